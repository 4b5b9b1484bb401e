"""`gemm`: bf16 and fp32 GEMM FLOP/s at the model's own training shapes, one process per worker
at once: the peak MFU is measured against."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrain_cpu.host import features as host_features
from raytrain_cpu.host import gemm as host_gemm
from raytrain_cpu.model import shape as model_shape

from .common import VOCAB, run_procs

if TYPE_CHECKING:
    from .runs import Runner  # the suites' argument; runs imports gemm


def _gemm_worker(rank: int, threads: int, gemms: list[host_gemm.Gemm], rounds: int, min_time_s: float, out) -> None:
    import torch

    torch.set_num_threads(threads)
    best: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):  # dtypes alternate, so drift on a shared machine hits both alike
        for dtype in (torch.bfloat16, torch.float32):
            r = host_gemm.gemm_probe(gemms, dtype, min_time_s)
            if r["flops_per_s"] > best.get(r["dtype"], {}).get("flops_per_s", 0.0):
                best[r["dtype"]] = r
    out.put((rank, best))


def gemm_peak(
    shape: dict[str, int], tokens: int, workers: int, threads: int, rounds: int = 2, min_time_s: float = 0.2
) -> dict[str, Any]:
    """GEMM FLOP/s of one worker's threads at the model's training GEMM shapes, all workers at once.

    One process per worker runs concurrently, as the training workers do (they share the
    memory bandwidth and, here, the last-level cache). Returns the per-worker mean per dtype.
    """
    gemms = model_shape.llama_gemms(
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_heads"],
        shape["num_kv_heads"],
        VOCAB,
        shape["num_layers"],
        tokens,
    )
    results = run_procs(_gemm_worker, workers, (threads, gemms, rounds, min_time_s))
    out: dict[str, Any] = {"workers": workers, "threads_per_worker": threads, "tokens": tokens}
    for dtype in ("bfloat16", "float32"):
        per = [r[dtype] for r in results]
        out[dtype] = {
            "flops_per_s_per_worker": sum(p["flops_per_s"] for p in per) / len(per),
            "best_shape_flops_per_s_per_worker": sum(p["best_flops_per_s"] for p in per) / len(per),
            "per_worker": [p["flops_per_s"] for p in per],
            "shapes": per[0]["shapes"],
        }
    out["bf16_over_fp32"] = out["bfloat16"]["flops_per_s_per_worker"] / out["float32"]["flops_per_s_per_worker"]
    return out


def gemm_threads(workers: int) -> int:
    """Each GEMM process's threads: its share of the cores this process may use."""
    return max(1, host_features.cpu_features().usable_cores // workers)


def gemm_rows(g: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for dtype in ("bfloat16", "float32"):
        d = g[dtype]
        rows.append(
            {
                "dtype": dtype,
                "workers x threads": f"{g['workers']} x {g['threads_per_worker']}",
                "GFLOP/s per worker (model GEMM mix)": d["flops_per_s_per_worker"] / 1e9,
                "GFLOP/s per worker (best shape)": d["best_shape_flops_per_s_per_worker"] / 1e9,
            }
        )
    return rows


def suite_gemm(r: Runner, args) -> dict[str, Any]:
    spec = r.spec
    tokens = spec["micro_batch"] * spec["seq_len"]
    g = gemm_peak(
        spec["model"],
        tokens,
        args.workers,
        gemm_threads(args.workers),
        rounds=3,
        min_time_s=spec.get("gemm_min_time_s", 0.2),
    )
    return {
        "gemm": g,
        "tables": {
            "GEMM peak": gemm_rows(g),
            "per shape (bf16, worker 0)": g["bfloat16"]["shapes"],
            "per shape (fp32, worker 0)": g["float32"]["shapes"],
        },
    }
