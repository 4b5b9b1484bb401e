"""Attention kept within packed documents (data.attention_span=document) against attention across them.

    python benchmarks/document_mask.py [--shapes 50m/chat,50m/text,llama3-8b/chat] [--tokens 2048] [--repeats 3]

Forward and backward of one layer's attention on bf16 q, k, v laid out as Hugging Face's Llama
hands them over (see benchmarks/attention.py), for blocks packed with documents: 'chat' draws
their lengths evenly from 64 to 256 tokens (instruction examples), 'text' from 1,024 to 8,192
(articles, most blocks holding one or two). The mask is the boolean (batch, 1, seq, seq) one
transformers builds from the blocks' position ids, causal within each document. Variants:
SDPA plainly causal (the baseline: across documents), SDPA under the mask (model.attention=sdpa),
and the causal blocks at 64 and 128 queries a block, plain and under the mask, where each block
also skips the keys before the first document any of its rows is in. The blocks plan a mask
once per forward for all layers (attention.mask_plan); here every step plans it again, as a
model of one layer would. Each variant runs in a
fresh spawned process, interleaved `--repeats` times; the median step time after a warm-up.
Writes benchmarks/results/<machine>/document_mask.json (and .md), or to --json.
"""

from __future__ import annotations

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

MODELS = {"50m": (8, 8, 512, 64), "llama3-8b": (32, 8, 1024, 128)}  # heads, kv heads, seq, head dim
DOCUMENTS = {"chat": (64, 256), "text": (1024, 8192)}  # document lengths, drawn evenly from [lo, hi]
SHAPES = ("50m/chat", "50m/text", "llama3-8b/chat")
VARIANTS = (
    "sdpa causal",
    "sdpa documents",
    "causal blocks 64",
    "causal blocks 64 documents",
    "causal blocks 128",
    "causal blocks 128 documents",
)


def document_mask(batch: int, seq: int, lengths: tuple[int, int], seed: int = 0):
    """(batch, 1, seq, seq) boolean, causal within documents of seeded lengths in `lengths`
    (each row starts inside a document, as a packed block does), and the documents a row holds."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    docs = torch.empty(batch, seq, dtype=torch.long)
    counts = []
    for r in range(batch):
        ids, pos, doc = [], -int(torch.randint(0, lengths[0], (1,), generator=gen)), 0
        while pos < seq:
            n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
            ids += [doc] * (min(pos + n, seq) - max(pos, 0))
            pos, doc = pos + n, doc + 1
        docs[r] = torch.tensor(ids)
        counts.append(doc)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None], counts


def child(_: int, spec: dict[str, Any], out) -> None:
    import torch

    from raytrain_cpu.model.ops import attention

    torch.set_num_threads(spec["threads"])
    model, docs = spec["shape"].split("/")
    h, hk, s, d = MODELS[model]
    b = max(1, spec["tokens"] // s)
    q, k, v, grad = attention_inputs(b, h, hk, s, d)
    variant = spec["variant"]
    mask, counts = document_mask(b, s, DOCUMENTS[docs]) if variant.endswith("documents") else (None, [])
    if variant.startswith("sdpa"):

        def attend() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=h != hk
            )
    else:
        block = int(variant.split()[2])

        def attend() -> torch.Tensor:
            attention._last_plan[0] = None  # each step plans its mask anew: a one-layer model's cost
            return attention.causal_blocks(q, k, v, block=block, mask=mask)

    timing = time_kernel_steps(lambda: attend().backward(grad), [q, k, v], spec["steps"])
    timing["documents_per_row"] = sum(counts) / len(counts) if counts else 1.0
    out.put((0, timing))


def main() -> None:
    args = kernel_bench_parser(__doc__, list(SHAPES), steps=10, repeats=3).parse_args()
    rows = interleaved_runs(child, args, VARIANTS)
    table = [
        {
            "shape": attention_shape_label(shape, h, hk, s, d, args.tokens),
            "variant": variant,
            "documents a row": median(r["documents_per_row"] for r in mine),
            "ms per forward + backward, each run": ", ".join(f"{r['step_ms']:.1f}" for r in mine),
            "speed vs sdpa causal (medians)": speed,
        }
        for shape, variant, mine, speed in against_baseline(rows, "step_ms", "sdpa causal")
        for h, hk, s, d in [MODELS[shape.split("/")[0]]]
    ]
    notes = [
        "bf16 q, k, v as transposed views of (batch, seq, heads, head dim), as Hugging Face's Llama passes them; "
        "'sdpa causal' = torch's scaled_dot_product_attention with is_causal (across documents); '... documents' = "
        "under the boolean mask causal within each document (data.attention_span=document); 'causal blocks N' = "
        "raytrain_cpu.model.ops.attention.causal_blocks with N queries a block, recomputing the probabilities in the backward.",
        "documents: 'chat' lengths drawn evenly from 64-256 tokens, 'text' from 1,024-8,192; each row starts inside "
        "a document, as a packed block does.",
    ]
    write_kernel_bench(
        "document_mask",
        rows,
        f"one layer's attention within packed documents, forward and backward, {args.tokens} tokens, "
        f"{args.threads} thread(s)",
        table,
        notes,
        args.json,
    )


if __name__ == "__main__":
    main()
