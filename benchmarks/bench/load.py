"""`load`: each rank's peak RSS during ZeRO-3's sharded load, against a naive full load."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_cpu.host import memory as host_memory

from .common import GB, VOCAB, model_overrides, n_params, run_procs

if TYPE_CHECKING:
    from .runs import Runner  # the suites' argument; runs imports gemm


def _load_worker(rank: int, world: int, port: int, model_dir: str, dtype_name: str, mode: str, out) -> None:
    """One rank: imports, then (after resetting the peak) a sharded or a naive load."""
    import torch

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    from transformers import AutoModelForCausalLM

    if mode == "sharded":
        import torch.distributed as dist

        from raytrain_cpu.config.schema import load_config
        from raytrain_cpu.model.loading import load_sharded
        from raytrain_cpu.trainer.engine import deepspeed_config, init_deepspeed, init_local_group

        init_local_group(rank, world, port)
        init_deepspeed()
        ds_config = deepspeed_config(
            load_config(None, ["model.dtype=" + ("bf16" if dtype == torch.bfloat16 else "fp32")]), world
        )

        def load():
            model, keep = load_sharded(model_dir, ds_config, dtype)
            dist.barrier()
            return model, keep
    else:

        def load():
            return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), None

    before = _rss()
    host_memory.reset_peak_rss()
    t0 = time.perf_counter()
    model, keep = load()
    seconds = time.perf_counter() - t0
    peak = host_memory.peak_rss_bytes()
    out.put((rank, {"rss_before_load": before, "peak_rss": peak, "load_s": seconds}))
    del model


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _spawn(world: int, target: Callable, *args) -> list[dict[str, Any]]:
    """target(rank, world, port, *args, queue) on `world` gloo ranks; their results by rank."""
    from raytrain_cpu.trainer.engine import free_port

    return run_procs(target, world, (world, free_port(), *args), timeout_s=1800)


def _write_model(shape: dict[str, int], out: Path) -> Path:
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.model.loading import write_tiny_model
    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path

    cfg = load_config(None, model_overrides(shape, 512))
    tok = load_tokenizer(resolve_tokenizer_path("bundled", "tiny"))
    return write_tiny_model(cfg, tok, out)


def load_compare(shape: dict[str, int], workdir: Path, world: int, dtype_name: str = "bfloat16") -> dict[str, Any]:
    model_dir = _write_model(shape, workdir / f"load_model_{shape['hidden_size']}x{shape['num_layers']}")
    params = n_params(shape)
    bytes_per = 2 if dtype_name == "bfloat16" else 4
    largest = VOCAB * shape["hidden_size"]
    largest = max(largest, shape["hidden_size"] * shape["intermediate_size"])
    bound = bytes_per * params["total"] / world + bytes_per * largest + 1.5e9
    sharded = _spawn(world, _load_worker, str(model_dir), dtype_name, "sharded")
    naive = _spawn(world, _load_worker, str(model_dir), dtype_name, "naive")
    rows = []
    for r in range(world):
        rows.append(
            {
                "rank": r,
                "sharded peak RSS (GB)": sharded[r]["peak_rss"] / GB,
                "naive peak RSS (GB)": naive[r]["peak_rss"] / GB,
                "sharded / naive": sharded[r]["peak_rss"] / naive[r]["peak_rss"],
                "sharded: load adds (GB)": (sharded[r]["peak_rss"] - sharded[r]["rss_before_load"]) / GB,
                "naive: load adds (GB)": (naive[r]["peak_rss"] - naive[r]["rss_before_load"]) / GB,
                "bound (GB)": bound / GB,
                "within bound": sharded[r]["peak_rss"] <= bound,
                "sharded load (s)": sharded[r]["load_s"],
                "naive load (s)": naive[r]["load_s"],
            }
        )
    return {
        "model": shape,
        "params": params["total"],
        "dtype": dtype_name,
        "world": world,
        "bound_bytes": bound,
        "sharded": sharded,
        "naive": naive,
        "rows": rows,
    }


def suite_load(r: Runner, args) -> dict[str, Any]:
    out = {"tables": {}}
    for label, shape in (("train model", r.spec["model"]), ("larger model", r.spec["load_model"])):
        if shape is None:
            continue
        res = load_compare(shape, r.workdir, args.workers)
        out[label] = res
        out["tables"][f"loading, {label}: {res['params'] / 1e6:.0f}M params, {res['dtype']}, {res['world']} ranks"] = (
            res["rows"]
        )
    return out
