"""One SwiGLU activation alone: Hugging Face's Llama MLP against the fused one (raytrain_cpu.model.ops.mlp).

    python benchmarks/mlp.py [--shapes 50m,llama3-8b] [--tokens 2048] [--threads 1] [--repeats 3]

Forward and backward of silu(gate) * up on bf16 projections, as one worker runs it once per
decoder layer: at the ~50M bench model's intermediate size (1,408) and at Llama-3-8B's
(14,336); the projections themselves (GEMMs, the same in both) are left out. Each variant runs
in a fresh spawned process, interleaved `--repeats` times, and records the median step time
(after a warm-up step), the minor page faults per step and the bytes autograd keeps for the
backward (saved tensors, gate and up excluded: their projections' outputs). Writes
benchmarks/results/<machine>/mlp.json (and .md), or to --json.
"""

from __future__ import annotations

from typing import Any

from bench.kernels import (
    against_baseline,
    interleaved_runs,
    kernel_bench_parser,
    saved_bytes_columns,
    time_with_saved_bytes,
    write_kernel_bench,
)

SHAPES = {"50m": 1408, "llama3-8b": 14336}  # intermediate size
VARIANTS = ("hugging face", "fused")


def child(_: int, spec: dict[str, Any], out) -> None:
    import torch
    import torch.nn.functional as F

    from raytrain_cpu.model.ops import mlp

    torch.set_num_threads(spec["threads"])
    i = SHAPES[spec["shape"]]
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(spec["tokens"], i, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(2))
    grad = torch.randn(spec["tokens"], i, generator=gen).to(torch.bfloat16)

    def activation() -> torch.Tensor:
        return mlp.swiglu(gate, up) if spec["variant"] == "fused" else F.silu(gate) * up

    out.put((0, time_with_saved_bytes(lambda: activation().backward(grad), [gate, up], spec)))


def main() -> None:
    args = kernel_bench_parser(__doc__, list(SHAPES), steps=20, repeats=3).parse_args()
    rows = interleaved_runs(child, args, VARIANTS)
    table = [
        {
            "shape": f"{shape} (intermediate {SHAPES[shape]})",
            "variant": variant,
            **saved_bytes_columns(mine, speed),
        }
        for shape, variant, mine, speed in against_baseline(rows, "step_ms", "hugging face")
    ]
    notes = [
        "bf16 gate and up; 'hugging face' = silu(gate) * up under autograd, as LlamaMLP.forward computes it; "
        "'fused' = raytrain_cpu.model.ops.mlp.SwiGLUFunction (model.fused_mlp): the same output and gradient bits, "
        "silu(gate) recomputed in the backward.",
        "saved for backward: autograd's saved tensors other than gate and up.",
    ]
    write_kernel_bench(
        "mlp",
        rows,
        f"one SwiGLU activation, forward and backward, {args.tokens} tokens, {args.threads} thread(s)",
        table,
        notes,
        args.json,
    )


if __name__ == "__main__":
    main()
