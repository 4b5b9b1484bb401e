"""Causal self-attention alone: SDPA's CPU flash kernel against the causal blocks at each block size.

    python benchmarks/attention.py [--shapes 50m,llama3-8b] [--tokens 2048] [--threads 1] [--repeats 3]
                                   [--variants sdpa,fused,...] [--fused-source OTHER.cpp]

Forward and backward of one layer's attention on bf16 q, k, v and the output's gradient laid out
as Hugging Face's Llama hands them over (transposed views of the projections' output), as one
worker runs it once per decoder layer: the ~50M bench model's heads (8 x 64, seq 512) and Llama-3-8B's (32 query and 8
key/value heads of 128, seq 1024). `model.attention=auto` times SDPA against the causal blocks at
start-up, at each of raytrain_cpu.model.ops.attention.BLOCKS queries a block; this bench says what the
block size, keeping the probabilities for the backward (model.attention_probs) and the host
change. Each variant runs in a fresh spawned process, interleaved `--repeats` times; the
median step time after a warm-up, and the useful rate: the causal half's GEMM FLOPs
(6·b·h·s²·d for forward and backward) per second, to set against the bench's GEMM peak. Writes
benchmarks/results/<machine>/attention.json (and .md), or to --json. `--fused-source` adds the
variant "fused <file>": the fused kernel built from another source (say an earlier revision's,
`git show REV:raytrain_cpu/csrc/fused_attention.cpp > old.cpp`), side by side with this one.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any

from bench.kernels import (
    against_baseline,
    attention_inputs,
    attention_shape_label,
    interleaved_runs,
    kernel_bench_parser,
    time_kernel_steps,
    write_kernel_bench,
)

SHAPES = {"50m": (8, 8, 512, 64), "llama3-8b": (32, 8, 1024, 128)}  # heads, kv heads, seq, head dim
BLOCKS = (32, 64, 128, 256)
KEPT = (64, 128)  # model.attention_probs=keep at auto's block sizes
VARIANTS = ("sdpa", *(f"causal blocks {b}" for b in BLOCKS), *(f"causal blocks {b} kept" for b in KEPT), "fused")


def child(_: int, spec: dict[str, Any], out) -> None:
    import torch

    from raytrain_cpu.model.ops import attention

    torch.set_num_threads(spec["threads"])
    h, hk, s, d = SHAPES[spec["shape"]]
    b = max(1, spec["tokens"] // s)
    q, k, v, grad = attention_inputs(b, h, hk, s, d)
    if spec["variant"] == "sdpa":

        def attend() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != hk)
    elif spec["variant"].startswith("fused"):
        from raytrain_cpu.model.ops import fused_attention

        if spec["variant"] != "fused":  # --fused-source: the kernel() this process builds and loads
            fused_attention.SOURCE = Path(spec["fused_source"])

        def attend() -> torch.Tensor:
            return fused_attention.fused_causal(q, k, v)
    else:
        block, keep = int(spec["variant"].split()[2]), spec["variant"].endswith(" kept")

        def attend() -> torch.Tensor:
            return attention.causal_blocks(q, k, v, block=block, keep_probs=keep)

    timing = time_kernel_steps(lambda: attend().backward(grad), [q, k, v], spec["steps"])
    timing["gflops_per_s"] = 6 * b * h * s * s * d / timing["step_ms"] / 1e6
    out.put((0, timing))


def main() -> None:
    ap = kernel_bench_parser(__doc__, list(SHAPES), steps=10, repeats=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (sdpa first)")
    ap.add_argument("--fused-source", type=Path, help="another fused_attention.cpp to run as a variant")
    args = ap.parse_args()
    variants = tuple(args.variants.split(","))
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or variants[0] != "sdpa":
        ap.error(f"--variants: {', '.join(unknown) or variants[0]}: give a subset of {', '.join(VARIANTS)}, sdpa first")
    if args.fused_source:
        if not args.fused_source.is_file():
            ap.error(f"--fused-source {args.fused_source}: no such file")
        args.fused_source = str(args.fused_source.resolve())
        variants += (f"fused {Path(args.fused_source).name}",)
    rows = interleaved_runs(child, args, variants, {"fused_source": args.fused_source})
    table = [
        {
            "shape": attention_shape_label(shape, h, hk, s, d, args.tokens),
            "variant": variant,
            "ms per forward + backward, each run": ", ".join(f"{r['step_ms']:.1f}" for r in mine),
            "speed vs sdpa (medians)": speed,
            "useful GFLOP/s (median)": median(r["gflops_per_s"] for r in mine),
        }
        for shape, variant, mine, speed in against_baseline(rows, "step_ms", "sdpa")
        for h, hk, s, d in [SHAPES[shape]]
    ]
    notes = [
        "bf16 q, k, v as transposed views of (batch, seq, heads, head dim), as Hugging Face's Llama passes them; "
        "'sdpa' = torch's scaled_dot_product_attention (is_causal, its CPU flash kernel); 'causal blocks N' = "
        "raytrain_cpu.model.ops.attention.causal_blocks with N queries a block (model.attention=causal_blocks), recomputing "
        "the probabilities in the backward; '... kept': keeping them from the forward (model.attention_probs=keep); "
        "'fused': raytrain_cpu.model.ops.fused_attention (model.attention=fused).",
        "useful GFLOP/s: 6·b·h·s²·d (the causal half of QKᵀ and PV, forward, and their four backward GEMMs) "
        "over the time: what the same work would take at the GEMM peak.",
    ]
    write_kernel_bench(
        "attention",
        rows,
        f"one layer's causal attention, forward and backward, {args.tokens} tokens, {args.threads} thread(s)",
        table,
        notes,
        args.json,
    )


if __name__ == "__main__":
    main()
