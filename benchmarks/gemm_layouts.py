"""The three GEMMs of a linear layer's training step, at the bench model's shapes, one thread.

    python benchmarks/gemm_layouts.py [--size 50m] [--rounds 3] [--min-time 0.2] [--threads 1] [--json PATH]

A linear layer y = x W^T over T tokens runs three GEMMs a step: the forward (x @ W^T), the input
gradient (dy @ W) and the weight gradient (dy^T @ x, which autograd hands the BLAS as a
transposed view). The first two read their activation row by row along the GEMM's reduction;
the weight gradient reduces over the T tokens, so oneDNN must first transpose its activation
operand (dy) and repack both, every step. This measures that cost: each GEMM's rate, the weight
gradient also with dy^T already contiguous (its transpose untimed), and what that transpose
costs eagerly and compiled by inductor. Every round times every shape and layout in turn (the
project's GEMM probe: host_gemm.time_gemm, the best of timed batches over --min-time); each figure is
the median over --rounds, so a drifting host moves all of them alike. bf16, one worker's micro
batch (T = micro batch x seq_len).

Writes benchmarks/results/<machine>/gemm_layouts.json (and .md), or to --json.
"""

from __future__ import annotations

import argparse
from statistics import median

from bench.common import SIZES, VOCAB, report_script

from raytrain_cpu.host import gemm as host_gemm

GEMMS = ("forward x @ W^T", "input grad dy @ W", "weight grad dy^T @ x", "weight grad, dy^T contiguous")
TRANSPOSES = ("dy^T copy, eager", "dy^T copy, compiled")


def shapes(size: str) -> dict[str, tuple[int, int]]:
    """{name: (out, in)} of the model's linear layers (raytrain_cpu.model.shape.llama_gemms' shapes, by layer name)."""
    m = SIZES[size]["model"]
    d, f = m["hidden_size"], m["intermediate_size"]
    kv = m["num_kv_heads"] * (d // m["num_heads"])
    attention = {f"q, k, v, o {d}x{d}": (d, d)} if kv == d else {f"q, o {d}x{d}": (d, d), f"k, v {kv}x{d}": (kv, d)}
    return {**attention, f"gate, up {f}x{d}": (f, d), f"down {d}x{f}": (d, f), f"output {VOCAB}x{d}": (VOCAB, d)}


def layer_gemms(tokens: int, out: int, inp: int) -> dict[str, host_gemm.Gemm]:
    """A linear layer's GEMMs by GEMMS name, laid out by host_gemm.time_gemm as autograd has them
    (the weight gradient's dy as a transposed view); the last one's operands both contiguous."""
    return {
        GEMMS[0]: host_gemm.Gemm("fwd", tokens, inp, out),
        GEMMS[1]: host_gemm.Gemm("dgrad", tokens, out, inp),
        GEMMS[2]: host_gemm.Gemm("wgrad", out, tokens, inp),
        GEMMS[3]: host_gemm.Gemm("contiguous wgrad", out, tokens, inp),
    }


def transpose_ms(tokens: int, out: int, compiled, min_time_s: float) -> list[float]:
    """Milliseconds to make a (tokens, out) dy's transpose contiguous: eagerly, then by
    `compiled` (TRANSPOSES' order)."""
    import torch

    dy = torch.randn(tokens, out, dtype=torch.bfloat16)
    return [1e3 * host_gemm.best_seconds(fn, min_time_s) for fn in (lambda: dy.t().contiguous(), lambda: compiled(dy))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="50m")
    ap.add_argument("--rounds", type=int, default=3, help="every shape and layout once a round")
    ap.add_argument(
        "--min-time",
        type=float,
        default=0.2,
        help="seconds a timing takes at least (raytrain_cpu.host.gemm.best_seconds)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads: one worker's share")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    tokens = SIZES[args.size]["micro_batch"] * SIZES[args.size]["seq_len"]
    transpose = torch.compile(lambda t: t.t().contiguous(), dynamic=False)
    named = shapes(args.size)
    runs: dict[str, dict[str, list[float]]] = {name: {k: [] for k in GEMMS + TRANSPOSES} for name in named}
    for r in range(args.rounds):
        for name, (out, inp) in named.items():
            for kind, g in layer_gemms(tokens, out, inp).items():
                runs[name][kind].append(g.flops / host_gemm.time_gemm(g, torch.bfloat16, args.min_time)[0] / 1e9)
            for kind, ms in zip(TRANSPOSES, transpose_ms(tokens, out, transpose, args.min_time), strict=True):
                runs[name][kind].append(ms)
        print(f"[gemm_layouts] round {r + 1} of {args.rounds} done", flush=True)

    rows = []
    for name, got in runs.items():
        mid = {k: median(v) for k, v in got.items()}
        gflop = layer_gemms(tokens, *named[name])[GEMMS[0]].flops / 1e9
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
    report_script(
        "gemm_layouts",
        args.json,
        runs=runs,
        tables={f"bf16, {tokens} tokens, {args.threads} thread(s), medians of {args.rounds} rounds": rows},
        notes=[
            "GFLOP/s: 2 x tokens x out x in per call, the best of timed batches (raytrain_cpu.host.gemm.time_gemm); 'dy^T contiguous': the weight "
            "gradient's GEMM alone, its operand transposed beforehand (untimed).",
            "dy^T copy: what making that operand contiguous costs, eagerly and compiled by inductor; the last two "
            "columns: the weight gradient as autograd runs it against that copy (compiled) plus the contiguous GEMM.",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
