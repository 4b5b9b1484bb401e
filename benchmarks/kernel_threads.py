"""Each kernel of our own against the ATen / Hugging Face path it replaces, at 1, 2, 4, ... threads.

    python benchmarks/kernel_threads.py [--shapes small,50m] [--threads 1,2,...] [--rounds 5]
                                        [--seconds 0.25] [--quick] [--json PATH]

A rank runs 16-92 ATen threads on the cluster configs, while the kernels' own figures were
taken at one thread; a kernel that wins there may lose at many (a serial loop, a task count
smaller than the threads, or oneDNN scaling better than it). Here, in one process, each
kernel's forward + backward (the weight gradient: the GEMM alone) and its reference's are timed
side by side at each thread count (torch.set_num_threads), at a small shape and at the ~50M
bench model's shapes (bench.common.SIZES):

- weight_grad: raytrain_cpu.model.ops.linear.weight_grad against dy^T @ x as autograd's linear backward
  runs it (oneDNN), one row per linear shape of the model, and their sum by count ('auto' times
  that sum at the run's threads: linear.choose);
- attention: the fused kernel (raytrain_cpu.model.ops.fused_attention) against SDPA, causal;
- norm: raytrain_cpu.model.ops.norm's RMSNorm against Hugging Face's LlamaRMSNorm;
- rotary: raytrain_cpu.model.ops.rotary against Hugging Face's apply_rotary_pos_emb, q and k;
- loss: raytrain_cpu.model.ops.loss's fused output layer + cross-entropy against logits then cross_entropy;
- mlp: raytrain_cpu.model.ops.mlp's SwiGLU activation against silu(gate) * up.

Rounds are interleaved (every thread count, case and variant in turn, each round), since a
shared host slows in spells: each round keeps each variant's fastest and median call over
--seconds; the table gives the best of the rounds' fastest and the median of their medians,
and 'ours / ref' speed-ups on both (above 1: ours is faster). `--threads` defaults to 1, 2, 4,
... up to os.cpu_count(), and the count itself. `--quick`: CI-sized shapes, one thread count
pair, short rounds. Writes benchmarks/results/<machine>/kernel_threads.json (and .md), or --json.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from statistics import median
from typing import Any

from bench.common import SIZES, VOCAB, report_script

from raytrain_cpu.model.ops import fused_attention

SHAPES: dict[str, dict[str, int]] = {
    # batch x seq tokens, hidden, heads (kv heads), intermediate, vocabulary
    "quick": {"batch": 2, "seq": 64, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 176, "vocab": 256},
    "small": {"batch": 2, "seq": 256, "hidden": 256, "heads": 4, "kv_heads": 4, "intermediate": 704, "vocab": VOCAB},
    "50m": {
        "batch": SIZES["50m"]["micro_batch"],
        "seq": SIZES["50m"]["seq_len"],
        "hidden": SIZES["50m"]["model"]["hidden_size"],
        "heads": SIZES["50m"]["model"]["num_heads"],
        "kv_heads": SIZES["50m"]["model"]["num_kv_heads"],
        "intermediate": SIZES["50m"]["model"]["intermediate_size"],
        "vocab": VOCAB,
    },
}
Call = Callable[[], object]


def thread_counts(cores: int) -> list[int]:
    """1, 2, 4, ... below `cores`, then `cores` itself."""
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return [*out, cores]


def linear_shapes(s: dict[str, int]) -> dict[tuple[int, int], int]:
    """{(out, in): layers a decoder stack of one layer has} (the output layer included)."""
    d, f, kv = s["hidden"], s["intermediate"], s["kv_heads"] * (s["hidden"] // s["heads"])
    shapes: dict[tuple[int, int], int] = {}
    for out, inp, n in ((d, d, 2), (kv, d, 2), (f, d, 2), (d, f, 1), (s["vocab"], d, 1)):
        shapes[(out, inp)] = shapes.get((out, inp), 0) + n
    return shapes


def _grad(outputs, inputs, grads) -> Call:
    import torch

    return lambda: torch.autograd.grad(outputs(), inputs, grads)


def cases(s: dict[str, int]) -> dict[str, tuple[Call, Call]]:
    """{case: (ours, reference)} at shape `s`, each a forward + backward (or the GEMM alone)."""
    import torch
    import torch.nn.functional as F
    from transformers.models.llama import modeling_llama

    from raytrain_cpu.model.ops import linear, loss, mlp, norm, rotary

    bf16, gen = torch.bfloat16, torch.Generator().manual_seed(0)

    def rand(*shape, grad=False):
        return torch.randn(*shape, generator=gen).to(bf16).requires_grad_(grad)

    b, t, d, h, hk, f = s["batch"], s["seq"], s["hidden"], s["heads"], s["kv_heads"], s["intermediate"]
    n, hd = b * t, d // h
    out: dict[str, tuple[Call, Call]] = {}
    if linear.kernel() is not None:
        for (o, i), _count in linear_shapes(s).items():
            dy, x = rand(n, o), rand(n, i)
            out[f"weight_grad {o}x{i}"] = (
                lambda dy=dy, x=x: linear.weight_grad(dy, x),
                lambda dy=dy, x=x: dy.t().mm(x),
            )
    if fused_attention.kernel() is not None:
        q, k, v = rand(b, h, t, hd, grad=True), rand(b, hk, t, hd, grad=True), rand(b, hk, t, hd, grad=True)
        g = rand(b, h, t, hd)
        out["attention (fused vs SDPA)"] = (
            _grad(lambda: fused_attention.fused_causal(q, k, v), (q, k, v), g),
            _grad(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != hk), (q, k, v), g),
        )
    xs, gx = rand(b, t, d, grad=True), rand(b, t, d)
    hf_norm = modeling_llama.LlamaRMSNorm(d, eps=1e-5).to(bf16)
    out["norm"] = (
        _grad(lambda: norm.rms_norm(xs, hf_norm.weight, hf_norm.variance_epsilon), (xs, hf_norm.weight), gx),
        _grad(lambda: hf_norm(xs), (xs, hf_norm.weight), gx),
    )
    # q and k as transformers hands them over: (B, H, S, D) views of the projections' (B, S, H, D)
    qr = rand(b, t, h, hd).transpose(1, 2).requires_grad_()
    kr = rand(b, t, hk, hd).transpose(1, 2).requires_grad_()
    cos, sin = rand(b, t, hd), rand(b, t, hd)
    gq, gk = rand(b, h, t, hd), rand(b, hk, t, hd)
    out["rotary"] = (
        _grad(lambda: rotary.apply_rotary_pos_emb(qr, kr, cos, sin), (qr, kr), (gq, gk)),
        _grad(lambda: modeling_llama.apply_rotary_pos_emb(qr, kr, cos, sin), (qr, kr), (gq, gk)),
    )
    hid, w_out = rand(n, d, grad=True), rand(s["vocab"], d, grad=True)
    targets = torch.randint(0, s["vocab"], (n,), generator=gen)
    rows = loss.chunk_rows(s["vocab"])
    out["loss"] = (
        _grad(lambda: loss.LinearCrossEntropy.apply(hid, w_out, targets, rows), (hid, w_out), None),
        _grad(lambda: F.cross_entropy(F.linear(hid, w_out).float(), targets), (hid, w_out), None),
    )
    gate, up, gm = rand(b, t, f, grad=True), rand(b, t, f, grad=True), rand(b, t, f)
    out["mlp"] = (
        _grad(lambda: mlp.swiglu(gate, up), (gate, up), gm),
        _grad(lambda: F.silu(gate) * up, (gate, up), gm),
    )
    return out


def timed_calls(fn: Call, seconds: float) -> tuple[float, float]:
    """(fastest, median) seconds of calls of `fn` over `seconds` (at least three calls)."""
    fn()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), median(times)


def measure(shapes: list[str], threads: list[int], rounds: int, seconds: float) -> dict[str, Any]:
    """{shape: {threads: {case: {"ours"|"ref": [(fastest, median) a round]}}}}, interleaved."""
    import torch

    built = {name: cases(SHAPES[name]) for name in shapes}
    raw: dict[str, Any] = {
        name: {str(n): {c: {"ours": [], "ref": []} for c in cs} for n in threads} for name, cs in built.items()
    }
    before = torch.get_num_threads()
    try:
        for r in range(rounds):
            for n in threads:
                torch.set_num_threads(n)
                for name, cs in built.items():
                    for case, (ours, ref) in cs.items():
                        for side, fn in (
                            (("ours", ours), ("ref", ref)) if r % 2 == 0 else (("ref", ref), ("ours", ours))
                        ):
                            raw[name][str(n)][case][side].append(timed_calls(fn, seconds))
            print(f"[kernel_threads] round {r + 1} of {rounds} done", flush=True)
    finally:
        torch.set_num_threads(before)
    return raw


def summed_weight_grads(got: dict[str, dict[str, list]], s: dict[str, int]) -> dict[str, list] | None:
    """The weight-gradient rows summed by layer count, round by round ('auto' times this sum)."""
    shapes = linear_shapes(s)
    keys = [(f"weight_grad {o}x{i}", c) for (o, i), c in shapes.items()]
    if not all(k in got for k, _ in keys):
        return None
    return {
        side: [
            tuple(sum(got[k][side][r][j] * c for k, c in keys) for j in range(2))
            for r in range(len(got[keys[0][0]][side]))
        ]
        for side in ("ours", "ref")
    }


def table(raw: dict[str, Any], amx: bool) -> list[dict[str, Any]]:
    from raytrain_cpu.model.ops import linear

    rows = []
    for name, by_threads in raw.items():
        for n, got in by_threads.items():
            summed = summed_weight_grads(got, SHAPES[name])
            items = list(got.items()) + ([("weight_grad, sum by layer count", summed)] if summed else [])
            for case, sides in items:
                best = {k: min(x[0] for x in v) for k, v in sides.items()}
                med = {k: median(x[1] for x in v) for k, v in sides.items()}
                row = {
                    "shape": name,
                    "threads": int(n),
                    "kernel": case,
                    "ours ms (best)": 1e3 * best["ours"],
                    "ref ms (best)": 1e3 * best["ref"],
                    "ours / ref speed (best)": best["ref"] / best["ours"],
                    "ours ms (median)": 1e3 * med["ours"],
                    "ref ms (median)": 1e3 * med["ref"],
                    "ours / ref speed (median)": med["ref"] / med["ours"],
                }
                if case.startswith("weight_grad, sum"):
                    wins = med["ours"] < med["ref"] * (1 - linear.WIN_MARGIN)
                    row["auto picks"] = ("kernel" if wins else "autograd") if amx else "autograd (no AMX)"
                rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="small,50m", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default 1, 2, 4, ... cores)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.25, help="per variant, case and thread count each round")
    ap.add_argument("--quick", action="store_true", help="CI-sized: the 'quick' shape, 1 and 2 threads, 2 short rounds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.rounds, args.seconds = "quick", 2, 0.02
        args.threads = args.threads or "1,2"
    shapes = [x for x in args.shapes.split(",") if x]
    unknown = [x for x in shapes if x not in SHAPES]
    if unknown:
        raise SystemExit(f"error: unknown --shapes {unknown}; choose from {', '.join(SHAPES)}")
    cores = os.cpu_count() or 1
    threads = [int(x) for x in args.threads.split(",")] if args.threads else thread_counts(cores)
    if any(n < 1 for n in threads):
        raise SystemExit("error: --threads must be positive counts, e.g. --threads 1,2,4")
    from raytrain_cpu.host import features as host_features
    from raytrain_cpu.model.ops import linear

    missing = [f"{k}: {why()}" for k, why in (("weight_grad", linear.why_unavailable),
               ("fused attention", fused_attention.why_unavailable)) if why()]  # fmt: skip
    load_before = os.getloadavg()
    raw = measure(shapes, threads, args.rounds, args.seconds)
    load = {"before": load_before, "after": os.getloadavg()}  # others' work on a shared host skews the medians
    amx = "amx_bf16" in host_features.cpu_flags()
    report_script(
        "kernel_threads",
        args.json,
        kernel_capability=fused_attention._capability()[0],
        cores=cores,
        load_average=load,
        threads=threads,
        shapes={k: SHAPES[k] for k in shapes},
        seconds=raw,
        tables={
            f"bf16 forward + backward, {args.rounds} interleaved rounds of {args.seconds} s a variant": table(raw, amx)
        },
        notes=[
            "'ours / ref speed': the reference's time over ours (above 1: ours is faster); best: the fastest call of all "
            "rounds, median: the median of each round's median call.",
            "weight_grad rows: the GEMM alone (our kernel against dy^T @ x, autograd's); the sum weights each shape by "
            "its layers in one decoder layer plus the output layer. 'auto picks': linear.choose's rule on the medians "
            f"(the kernel where faster by {linear.WIN_MARGIN:.0%}), behind its AMX gate.",
            f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load['before'])}, after "
            f"{', '.join(f'{x:.2f}' for x in load['after'])}, on {cores} cores: above the cores, busy threads lose "
            "time slices to others' processes, which the medians show and the best calls mostly do not.",
            *(f"not measured, unavailable here: {m}" for m in missing),
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
