"""Compiler and attention levers on the ~50M bench model's shapes, one process, no DeepSpeed.

    python benchmarks/compile_levers.py [--layers 4] [--threads 1] [--steps 8] [--repeats 2]

What `model.compile=true` (per-layer inductor) could add, each in a fresh spawned process so
inductor's settings and caches don't leak between variants, interleaved `--repeats` times (this
machine is shared and noisy: compare the ratios):

- per-layer compile with inductor's defaults (what the project runs);
- + `max_autotune` with the C++ GEMM template (inductor's AMX / AVX-512 micro-GEMMs) offered
  next to ATen's oneDNN GEMMs; the row says how many kernels the template generated;
- + compiled autograd (the whole backward traced, across layers);
- attention alone, forward and backward at the model's shape: SDPA's CPU flash kernel, SDPA's
  math path, and the same math written out, eager and compiled.

Forward and backward of a causal-LM loss on random tokens with bf16 weights, like one worker's
micro batch (micro batch 4 x 512). Writes benchmarks/results/<machine>/compile_levers.json and .md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from bench.common import SIZES, VOCAB, bench_model_config, package_versions, run_procs, write_results

from raytrain_cpu.host.features import cpu_features

LAYER_VARIANTS = {
    "eager": {},
    "compile per layer": {"compile": True},
    "compile + max_autotune (C++ GEMM template)": {"compile": True, "max_autotune": True},
    "compile + compiled autograd": {"compile": True, "compiled_autograd": True},
}


# ----------------------------------------------------------------------------- one variant (a child process)


def layer_child(i: int, spec: dict[str, Any], out) -> None:
    """Steps of forward + backward under one variant; puts (i, the median step after two warm-ups)."""
    import torch

    torch.set_num_threads(spec["threads"])
    import torch._dynamo  # before building the model, as the workers do
    import torch._inductor.config as inductor_config
    from transformers import LlamaForCausalLM

    # The bench runs' model, as `bench reference` builds it, with fewer layers.
    s = SIZES["50m"]
    _, cfg = bench_model_config(s["model"] | {"num_layers": spec["layers"]}, s["seq_len"])
    cfg.use_cache = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    v = spec["variant"]
    if v.get("max_autotune"):
        inductor_config.max_autotune = True
        inductor_config.max_autotune_gemm_backends = "CPP,ATEN"
    if v.get("compile"):
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward, backend="inductor")
    ids = torch.randint(0, VOCAB, (s["micro_batch"], s["seq_len"]))
    times = []
    for _ in range(spec["steps"]):
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        if v.get("compiled_autograd"):
            with torch._dynamo.compiled_autograd._enable(torch.compile(backend="inductor")):
                loss.backward()
        else:
            loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    generated = list(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.py"))
    template = sum("micro_gemm" in p.read_text(errors="replace") for p in generated)
    out.put(
        (
            i,
            {
                "first_step_s": times[0],
                "step_s": median(times[2:]),
                "loss": loss.detach().item(),
                "gemm_template_kernels": template,
            },
        )
    )


def attention_rows(threads: int, steps: int) -> list[dict[str, Any]]:
    """Causal attention forward + backward at the bench model's shape, per backend."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(threads)
    s = SIZES["50m"]
    b, h, n = s["micro_batch"], s["model"]["num_heads"], s["seq_len"]
    d = s["model"]["hidden_size"] // h
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    causal = torch.ones(n, n, dtype=torch.bool).tril()

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def written_out(q, k, v):  # what SDPA's math path does, in fp32 softmax
        scores = (q @ k.transpose(-1, -2) * d**-0.5).masked_fill(~causal, float("-inf"))
        return torch.softmax(scores.float(), -1).to(q.dtype) @ v

    def timed(fn, backends) -> float:
        times = []
        with sdpa_kernel(backends):
            for _ in range(steps):
                t = time.perf_counter()
                fn(q, k, v).sum().backward()
                times.append(time.perf_counter() - t)
                q.grad = k.grad = v.grad = None
        return median(times[2:])

    flops = 3.5 * 2 * 2 * b * h * n * n * d / 2  # QK^T and PV, causal half; backward ~2.5x forward
    cases = {
        "SDPA, CPU flash kernel (the default)": (sdpa, [SDPBackend.FLASH_ATTENTION]),
        "SDPA, math path": (sdpa, [SDPBackend.MATH]),
        "written out, eager": (written_out, [SDPBackend.MATH]),
        "written out, compiled": (torch.compile(written_out), [SDPBackend.MATH]),
        "SDPA flash, compiled": (torch.compile(sdpa), [SDPBackend.FLASH_ATTENTION]),
    }
    rows = [{"attention": name, "fwd+bwd ms": 1e3 * timed(fn, be)} for name, (fn, be) in cases.items()]
    for r in rows:
        r["GFLOP/s"] = flops / (r["fwd+bwd ms"] / 1e3) / 1e9
        r["vs flash"] = rows[0]["fwd+bwd ms"] / r["fwd+bwd ms"]
    return rows


# ----------------------------------------------------------------------------- the driver


def run_variant(name: str, args, cache_root: Path, rep: int) -> dict[str, Any]:
    spec = {"variant": LAYER_VARIANTS[name], "layers": args.layers, "threads": args.threads, "steps": args.steps}
    # A fresh cache per variant and repeat: every first step pays its own compile.
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache_root / f"{rep}-{list(LAYER_VARIANTS).index(name)}")}
    (res,) = run_procs(layer_child, 1, (spec,), env, timeout_s=1800)
    print(f"[levers] {name} (run {rep + 1}): step {res['step_s']:.3f}s, first {res['first_step_s']:.1f}s", flush=True)
    return {"variant": name, "rep": rep, **res}


def layer_table(rows: list[dict[str, Any]], tokens: int) -> list[dict[str, Any]]:
    base = median(r["step_s"] for r in rows if r["variant"] == "eager")
    out = []
    for name in LAYER_VARIANTS:
        mine = [r for r in rows if r["variant"] == name]
        step = median(r["step_s"] for r in mine)
        out.append(
            {
                "variant": name,
                "runs": len(mine),
                "step s (median)": step,
                "step s each": ", ".join(f"{r['step_s']:.3f}" for r in mine),
                "vs eager": base / step,
                "tokens/s": tokens / step,
                "first step s": max(r["first_step_s"] for r in mine),
                "C++ GEMM template kernels": mine[0]["gemm_template_kernels"],
                "loss": mine[0]["loss"],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (the bench model has 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads: one worker's share")
    ap.add_argument("--steps", type=int, default=8, help="steps per run; the first two are warm-up")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs of each variant")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="raytrain_levers_") as tmp:
        rows = [run_variant(n, args, Path(tmp), rep) for rep in range(args.repeats) for n in LAYER_VARIANTS]
    attention = attention_rows(args.threads, max(args.steps, 6))
    s = SIZES["50m"]
    feats = cpu_features()
    result = {
        "command": "python benchmarks/compile_levers.py " + " ".join(sys.argv[1:]),
        "machine": feats.describe(),
        "versions": package_versions(),
        "runs": rows,
        "tables": {
            f"per-layer compile variants ({args.layers} layers, {args.threads} thread(s))": layer_table(
                rows, s["micro_batch"] * s["seq_len"]
            ),
            "attention, forward + backward": attention,
        },
        "notes": [
            f"~50M bench model's layer shapes (hidden {s['model']['hidden_size']}, {s['model']['num_heads']} heads, "
            f"MLP {s['model']['intermediate_size']}), {args.layers} layers, bf16 weights, micro batch "
            f"{s['micro_batch']} x {s['seq_len']} random tokens, one process, no DeepSpeed; median step after two "
            "warm-ups; 'first step s' includes the compile (a fresh inductor cache per run).",
            "C++ GEMM template kernels: generated kernels that use inductor's micro-GEMMs. torch 2.13 offered the "
            "template only for constant weights (use_cpp_gemm_template needs a module buffer: inference with "
            "freezing); in training the weights are graph inputs, so GEMMs stay on ATen (oneDNN) and the count is 0.",
            "attention GFLOP/s count QK^T and PV over the causal half, backward as 2.5x the forward.",
        ],
    }
    path = write_results("compile_levers", result, None)
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
