"""Per-layer compile against the uncompiled layers, in one process, step by step.

    python benchmarks/compile_alternating.py [--size 50m] [--pairs 10] [--threads 1] [--json PATH]

What `model.compile=auto` turns on, measured where the host's drift cannot favour either side:
two copies of the bench model (bf16 weights, one worker's micro batch of random tokens, the
trainers' fused loss and causal blocks of 128 queries with their probabilities kept) train in
one process on one worker's threads, a step of one then a step of the other, the order
swapped every pair. The uncompiled copy runs the trainers' fused norms and rotary embeddings;
the compiled one Hugging Face's, which inductor fuses (worker_setup.compile_layers, as the trainers
compile). No DeepSpeed, no Ray: the compute of a step only. A shared machine's speed drifts by
minutes (the native AMX host's defaults ran 916-1,466 tokens/s from step to step of one run),
so separate runs of each, even interleaved, can't tell a 10% difference; adjacent steps can.

Writes benchmarks/results/<machine>/compile_alternating.json (and .md), or to --json.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from statistics import median

from bench.common import SIZES, VOCAB, bench_model_config, report_script


def build(size: str, cache_dir: str):
    """{'uncompiled': model, 'compiled': model}: the same weights, each set up as the trainers do."""
    import torch
    from transformers import LlamaForCausalLM

    from raytrain_cpu.model.ops import attention, norm, rotary
    from raytrain_cpu.model.ops import loss as fused_loss
    from raytrain_cpu.trainer import setup as worker_setup

    spec = SIZES[size]
    _, config = bench_model_config(spec["model"], spec["seq_len"])
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).to(torch.bfloat16).train()
    blocks = attention.register(128, keep_probs=True)
    models = {}
    for kind in ("uncompiled", "compiled"):
        m = copy.deepcopy(base)
        m.set_attn_implementation(blocks)
        fused_loss.install(m)
        if kind == "uncompiled":
            norm.install(m)
            rotary.install(m)
        else:
            worker_setup.compile_layers(m.model.layers, cache_dir)
        models[kind] = m
    return models


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="50m")
    ap.add_argument("--pairs", type=int, default=10, help="steps of each, alternating, after 2 warm-up steps")
    ap.add_argument("--threads", type=int, default=1, help="torch threads: one worker's share")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    spec = SIZES[args.size]
    batch, seq = spec["micro_batch"], spec["seq_len"]
    models = build(args.size, os.path.join(tempfile.gettempdir(), "compile_alternating_cache"))
    gen = torch.Generator().manual_seed(0)

    def step(model) -> float:
        ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    warmup = {}
    for kind, model in models.items():  # the compiled copy compiles its forward and backward here
        t0 = time.perf_counter()
        step(model)
        step(model)
        warmup[kind] = time.perf_counter() - t0
    times: dict[str, list[float]] = {kind: [] for kind in models}
    for i in range(args.pairs):
        for kind in list(models) if i % 2 == 0 else list(models)[::-1]:
            times[kind].append(step(models[kind]))
        print(
            f"[compile_alternating] pair {i}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True
        )
    ratios = [u / c for u, c in zip(times["uncompiled"], times["compiled"], strict=True)]
    row = {
        "size": args.size,
        "tokens per step": batch * seq,
        "threads": args.threads,
        "uncompiled s per step (median)": median(times["uncompiled"]),
        "compiled s per step (median)": median(times["compiled"]),
        "compiled speed-up (medians)": median(times["uncompiled"]) / median(times["compiled"]),
        "pairs the compiled step won": f"{sum(r > 1 for r in ratios)} of {len(ratios)}",
        "per-pair speed-ups": ", ".join(f"{r:.2f}" for r in ratios),
        "warm-up s (2 steps; compiled: the compile)": ", ".join(f"{k} {v:.1f}" for k, v in warmup.items()),
    }
    report_script(
        "compile_alternating",
        args.json,
        runs=times,
        tables={"per-layer compile against uncompiled, alternating steps in one process": [row]},
        notes=[
            "uncompiled: the trainers' fused norms and rotary embeddings (model.fused_norm, model.fused_rotary); "
            "compiled: Hugging Face's, which inductor fuses; both the fused loss and causal blocks of 128 queries.",
            "one process, no DeepSpeed or Ray: the compute of one worker's micro batch.",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
