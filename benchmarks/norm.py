"""One RMSNorm alone: Hugging Face's Llama RMSNorm against the fused one (raytrain_cpu.model.ops.norm).

    python benchmarks/norm.py [--shapes 50m,llama3-8b] [--tokens 2048] [--threads 1] [--repeats 3]

Forward and backward of one norm on bf16 hidden states, as one worker runs it twice per decoder
layer: at the ~50M bench model's width (512) and at Llama-3-8B's (4,096). Each variant runs in
a fresh spawned process, interleaved `--repeats` times, and records the median step time (after
two warm-up steps), the minor page faults per step and the bytes autograd keeps for the
backward (saved tensors, the input excluded: the residual stream holds it). Writes
benchmarks/results/<machine>/norm.json (and .md), or to --json.
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

SHAPES = {"50m": 512, "llama3-8b": 4096}  # hidden size
VARIANTS = ("hugging face", "fused")


def child(_: int, spec: dict[str, Any], out) -> None:
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from raytrain_cpu.model.ops import norm

    torch.set_num_threads(spec["threads"])
    d = SHAPES[spec["shape"]]
    gen = torch.Generator().manual_seed(0)
    module = LlamaRMSNorm(d).to(torch.bfloat16)
    if spec["variant"] == "fused":
        norm.install(module)
    x = torch.randn(spec["tokens"], d, generator=gen).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(spec["tokens"], d, generator=gen).to(torch.bfloat16)

    out.put((0, time_with_saved_bytes(lambda: module(x).backward(grad), [x, module.weight], spec)))


def main() -> None:
    args = kernel_bench_parser(__doc__, list(SHAPES), steps=20, repeats=3).parse_args()
    rows = interleaved_runs(child, args, VARIANTS)
    table = [
        {
            "shape": f"{shape} (hidden {SHAPES[shape]})",
            "variant": variant,
            **saved_bytes_columns(mine, speed),
        }
        for shape, variant, mine, speed in against_baseline(rows, "step_ms", "hugging face")
    ]
    notes = [
        "bf16 input and weight; 'hugging face' = LlamaRMSNorm.forward under autograd; 'fused' = "
        "raytrain_cpu.model.ops.norm.RMSNormFunction (model.fused_norm): the same forward, a closed-form backward.",
        "saved for backward: autograd's saved tensors other than the input and the weight.",
    ]
    write_kernel_bench(
        "norm",
        rows,
        f"one RMSNorm, forward and backward, {args.tokens} tokens, {args.threads} thread(s)",
        table,
        notes,
        args.json,
    )


if __name__ == "__main__":
    main()
