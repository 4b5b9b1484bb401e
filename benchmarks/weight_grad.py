"""A weight-gradient kernel of our own against oneDNN's, at the bench model's linear shapes.

    python benchmarks/weight_grad.py [--size 50m] [--rounds 3] [--seconds 0.6] [--json PATH]

A linear layer's weight gradient dW = dy^T x reduces over the tokens, which both operands keep
as their slow dimension; autograd passes oneDNN dy^T as a transposed view and it ran at about
half the forward's rate on AMX (`gemm_layouts.py`), about half of a step's GEMM time.
model.weight_grad_kernel's kernel (raytrain_cpu/csrc/weight_grad.cpp) prepares each chunk of
512 tokens once and runs oneDNN's micro-kernels on it; this times it beside the forward
x @ W^T and autograd's weight gradient, all bf16, one thread, one worker's micro batch. Each
figure is the fastest single call over --seconds, in every round in turn (a shared host slows
in spells: `host_spells.py`; the fastest call is the like-for-like rate of each), then the best
round. The kernel's output is checked against fp32.

Writes benchmarks/results/<machine>/weight_grad.json (and .md), or to --json.
"""

from __future__ import annotations

import argparse
import time

from bench.common import SIZES, report_script

from raytrain_cpu.model.ops import fused_attention

KINDS = ["forward x @ W^T", "weight grad, autograd (oneDNN)", "weight grad, kernel"]


def fastest_call(fn, seconds: float) -> float:
    fn()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def variants(dy, x, w) -> list:
    """The timed calls, in KINDS' order."""
    import torch

    from raytrain_cpu.model.ops.linear import weight_grad

    return [lambda: torch.mm(x, w.t()), lambda: torch.mm(dy.t(), x), lambda: weight_grad(dy, x)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="50m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.6, help="per variant and shape in each round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    from gemm_layouts import shapes  # this script's own folder: first on sys.path

    from raytrain_cpu.model.ops import linear

    if linear.kernel() is None:
        raise SystemExit(f"error: the weight-gradient kernel is unavailable: {linear.why_unavailable()}")
    torch.set_num_threads(1)
    tokens = SIZES[args.size]["micro_batch"] * SIZES[args.size]["seq_len"]
    ms = {name: {k: [] for k in KINDS} for name in shapes(args.size)}
    errors: dict[str, float] = {}
    for r in range(args.rounds):
        for name, (out, inp) in shapes(args.size).items():
            dy = torch.randn(tokens, out, dtype=torch.bfloat16)
            x = torch.randn(tokens, inp, dtype=torch.bfloat16)
            w = torch.randn(out, inp, dtype=torch.bfloat16)
            fns = variants(dy, x, w)
            if r == 0:
                ref = dy.float().t() @ x.float()
                errors[name] = float((linear.weight_grad(dy, x).float() - ref).abs().max() / ref.abs().max())
            for kind, fn in zip(KINDS, fns, strict=True):
                ms[name][kind].append(1e3 * fastest_call(fn, args.seconds))
        print(f"[weight_grad] round {r + 1} of {args.rounds} done", flush=True)
    rows = []
    for name, got in ms.items():
        best = {k: min(v) for k, v in got.items()}
        fwd = best[KINDS[0]]
        rows.append(
            {
                "shape (out x in)": name,
                **{f"{k} ms": v for k, v in best.items()},
                **{f"{k} / forward rate": fwd / best[k] for k in KINDS[1:]},
                "kernel / autograd": best[KINDS[1]] / best[KINDS[2]],
                "kernel max error / max |dW|": errors[name],
            }
        )
    report_script(
        "weight_grad",
        args.json,
        kernel_capability=fused_attention._capability()[0],
        ms=ms,
        tables={f"bf16, {tokens} tokens, one thread, fastest call of each round's best": rows},
        notes=[
            "'/ forward rate': the forward's time over the variant's, the same FLOPs (1.0 = the forward's rate).",
            "errors: the kernel's against fp32, bf16 rounding included.",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
