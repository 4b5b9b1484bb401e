"""The three GEMMs of a linear layer's training step, at the bench model's shapes, one thread.

    python benchmarks/gemm_layouts.py [--size 50m] [--rounds 3] [--threads 1] [--json PATH]

A linear layer y = x W^T over T tokens runs three GEMMs a step: the forward (x @ W^T), the input
gradient (dy @ W) and the weight gradient (dy^T @ x, which autograd hands the BLAS as a
transposed view). The first two read their activation row by row along the GEMM's reduction;
the weight gradient reduces over the T tokens, so oneDNN must first transpose its activation
operand (dy) and repack both, every step. This measures that cost: each GEMM's rate, the weight
gradient also with dy^T already contiguous (its transpose untimed), and what that transpose
costs eagerly and compiled by inductor. Every round times every shape and layout in turn (the
best of --reps calls each); each figure is the median over --rounds, so a drifting host moves
all of them alike. bf16, one worker's micro batch (T = micro batch x seq_len).

Writes benchmarks/results/<machine>/gemm_layouts.json (and .md), or to --json.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from statistics import median

from raytrain_cpu.bench import SIZES, VOCAB, _portable_args, package_versions, write_results
from raytrain_cpu.cpu import cpu_features

GEMMS = ("forward x @ W^T", "input grad dy @ W", "weight grad dy^T @ x", "weight grad, dy^T contiguous")
TRANSPOSES = ("dy^T copy, eager", "dy^T copy, compiled")


def shapes(size: str) -> dict[str, tuple[int, int]]:
    """{name: (out, in)} of the model's linear layers."""
    m = SIZES[size]["model"]
    d, f = m["hidden_size"], m["intermediate_size"]
    kv = m["num_kv_heads"] * (d // m["num_heads"])
    attention = {f"q, k, v, o {d}x{d}": (d, d)} if kv == d else {f"q, o {d}x{d}": (d, d), f"k, v {kv}x{d}": (kv, d)}
    return {**attention, f"gate, up {f}x{d}": (f, d), f"down {d}x{f}": (d, f), f"output {VOCAB}x{d}": (VOCAB, d)}


def layouts(x, w, dy, dy_t, transpose) -> dict[str, Callable[[], object]]:
    """Each GEMM and transpose timed, by name (GEMMS, TRANSPOSES)."""
    import torch

    return {
        GEMMS[0]: lambda: torch.nn.functional.linear(x, w),
        GEMMS[1]: lambda: dy @ w,
        GEMMS[2]: lambda: dy.t() @ x,  # as autograd's linear backward calls it
        GEMMS[3]: lambda: dy_t @ x,
        TRANSPOSES[0]: lambda: dy.t().contiguous(),
        TRANSPOSES[1]: lambda: transpose(dy),
    }


def best_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="50m")
    ap.add_argument("--rounds", type=int, default=3, help="every shape and layout once a round")
    ap.add_argument("--reps", type=int, default=5, help="calls a timing (the best one counts)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads: one worker's share")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    tokens = SIZES[args.size]["micro_batch"] * SIZES[args.size]["seq_len"]
    transpose = torch.compile(lambda t: t.t().contiguous(), dynamic=False)
    gen = torch.Generator().manual_seed(0)
    data = {}
    for name, (out, inp) in shapes(args.size).items():
        x, w, dy = (torch.randn(*s, generator=gen).bfloat16() for s in ((tokens, inp), (out, inp), (tokens, out)))
        data[name] = (x, w, dy, dy.t().contiguous(), 2 * tokens * out * inp)

    runs: dict[str, dict[str, list[float]]] = {name: {k: [] for k in GEMMS + TRANSPOSES} for name in data}
    for r in range(args.rounds):
        for name, (x, w, dy, dy_t, flops) in data.items():
            for kind, fn in layouts(x, w, dy, dy_t, transpose).items():
                s = best_seconds(fn, args.reps)
                runs[name][kind].append(flops / s / 1e9 if kind in GEMMS else s * 1e3)
        print(f"[gemm_layouts] round {r + 1} of {args.rounds} done", flush=True)

    rows = []
    for name, got in runs.items():
        mid = {k: median(v) for k, v in got.items()}
        gflop = data[name][4] / 1e9
        rows.append(
            {
                "shape (out x in)": name,
                **{f"{k} GFLOP/s": mid[k] for k in GEMMS},
                "weight grad / forward": mid[GEMMS[2]] / mid[GEMMS[0]],
                "weight grad with dy^T contiguous / forward": mid[GEMMS[3]] / mid[GEMMS[0]],
                **{f"{k} ms": mid[k] for k in TRANSPOSES},
                "weight grad as autograd runs it, ms": 1e3 * gflop / mid[GEMMS[2]],
                "compiled dy^T copy + its GEMM, ms": mid[TRANSPOSES[1]] + 1e3 * gflop / mid[GEMMS[3]],
            }
        )
    result = {
        "command": "python benchmarks/gemm_layouts.py " + " ".join(_portable_args(None, args.json)),
        "machine": cpu_features().describe(),
        "versions": package_versions(),
        "runs": runs,
        "tables": {f"bf16, {tokens} tokens, {args.threads} thread(s), medians of {args.rounds} rounds": rows},
        "notes": [
            "GFLOP/s: 2 x tokens x out x in over the best of --reps calls; 'dy^T contiguous': the weight "
            "gradient's GEMM alone, its operand transposed beforehand (untimed).",
            "dy^T copy: what making that operand contiguous costs, eagerly and compiled by inductor; the last two "
            "columns: the weight gradient as autograd runs it against that copy (compiled) plus the contiguous GEMM.",
        ],
    }
    print(write_results("gemm_layouts", result, args.json).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
