"""The output layer and loss alone: Hugging Face's against the fused one (raytrain_cpu.model.ops.loss).

    python benchmarks/loss_head.py [--shapes 50m,llama3-8b] [--tokens 2048] [--threads 1] [--repeats 2]

Forward and backward of `cross_entropy(hidden @ weight.T, targets)` with bf16 hidden states
and weight, as one worker's last layer runs it: at the ~50M bench model's shape (hidden 512,
2,048-entry vocabulary) and at Llama-3-8B's (hidden 4,096, 128,256 entries). Each variant runs
in a fresh spawned process, interleaved `--repeats` times, which records the step's time (the
median after a warm-up step) and its resident-memory high-water mark above the inputs (the
kernel's VmHWM, reset through /proc/self/clear_refs once the inputs exist, over the warm-up and
timed steps; the inputs and their gradients' size are not counted). No sampling thread: its
wake-ups take the GIL from the fused loss's Python loop and slowed it by a third at the 50M
shape. Writes benchmarks/results/<machine>/loss_head.json (and .md), or to --json.
"""

from __future__ import annotations

from typing import Any

from bench.kernels import against_baseline, interleaved_runs, kernel_bench_parser, time_kernel_steps, write_kernel_bench
from bench.load import _rss

from raytrain_cpu.host.memory import peak_rss_bytes, reset_peak_rss
from raytrain_cpu.model.ops import loss as fused

SHAPES = {"50m": (512, 2048), "llama3-8b": (4096, 128256)}  # hidden, vocabulary
VARIANTS = ("hugging face", "fused")


def child(_: int, spec: dict[str, Any], out) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    n, (d, v) = spec["tokens"], SHAPES[spec["shape"]]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=gen).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, d, generator=gen) * d**-0.5).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)

    def step() -> float:
        if spec["variant"] == "fused":
            loss = fused.LinearCrossEntropy.apply(hidden, weight, targets, fused.chunk_rows(v))
        else:
            loss = torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), targets)
        loss.backward()
        return float(loss.detach())

    # The inputs resident, plus what their gradients will hold: the rest of the peak is the loss's.
    reset_peak_rss()  # VmHWM := VmRSS now
    base = _rss() + hidden.nbytes + weight.nbytes
    losses = []  # the warm-up step's memory counts too: the first step is a step
    timing = time_kernel_steps(lambda: losses.append(step()), [hidden, weight], spec["steps"])
    peak = peak_rss_bytes()
    out.put((0, {"step_s": timing["step_ms"] / 1e3, "peak_over_inputs_gib": (peak - base) / 2**30, "loss": losses[-1]}))


def main() -> None:
    args = kernel_bench_parser(__doc__, list(SHAPES), steps=3, repeats=2).parse_args()
    rows = interleaved_runs(child, args, VARIANTS)
    table = [
        {
            "shape": f"{shape} (hidden {SHAPES[shape][0]}, vocab {SHAPES[shape][1]:,})",
            "variant": variant,
            "step s each": ", ".join(f"{r['step_s']:.3f}" for r in mine),
            "vs hugging face (time, medians)": speed,
            "peak over inputs GiB (max)": max(r["peak_over_inputs_gib"] for r in mine),
            "loss": mine[0]["loss"],
        }
        for shape, variant, mine, speed in against_baseline(rows, "step_s", "hugging face")
    ]
    notes = [
        "bf16 hidden states and weight; 'hugging face' = cross_entropy((hidden @ weight.T).float(), targets) as "
        "ForCausalLMLoss computes it; 'fused' = raytrain_cpu.model.ops.loss.LinearCrossEntropy (model.fused_loss).",
        "peak over inputs: the VmHWM high-water mark of all steps (reset once the inputs exist) above the "
        "inputs and their gradients' size.",
        f"chunk: raytrain_cpu.model.ops.loss.CHUNK_BYTES = {fused.CHUNK_BYTES >> 20} MiB of fp32 logits.",
    ]
    write_kernel_bench(
        "loss_head",
        rows,
        f"output layer + loss, forward and backward, {args.tokens} tokens, {args.threads} thread(s)",
        table,
        notes,
        args.json,
    )


if __name__ == "__main__":
    main()
