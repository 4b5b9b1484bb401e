"""Time GEMMs on this CPU: the dtype probe (bf16 or fp32) and MFU's denominator.

Flags say what the CPU can do, not what oneDNN/MKL make of it in this VM at these shapes, so the
dtype decision is measured (`choose_dtype`) at the model's own GEMM shapes
(raytrain_cpu.model.shape.gemms_for_model).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# ----------------------------------------------------------------------------- GEMMs


@dataclass(frozen=True)
class Gemm:
    """One matrix product C[m,n] = A[m,k] @ B[k,n] the model runs `count` times per micro batch."""

    name: str
    m: int
    k: int
    n: int
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


# ----------------------------------------------------------------------------- GEMM probe


def _operands(g: Gemm, dtype):
    """Operands laid out as autograd has them: Wᵀ for forward, a transposed gradient for wgrad."""
    import torch

    if g.name.startswith("fwd"):
        return torch.randn(g.m, g.k, dtype=dtype), torch.randn(g.n, g.k, dtype=dtype).t()
    if g.name.startswith("wgrad"):
        return torch.randn(g.k, g.m, dtype=dtype).t(), torch.randn(g.k, g.n, dtype=dtype)
    return torch.randn(g.m, g.k, dtype=dtype), torch.randn(g.k, g.n, dtype=dtype)


def time_calls(fn: Callable[[], object], min_time_s: float = 0.2, warmup: int = 2) -> tuple[float, float]:
    """(best, mean) seconds per call of `fn` over timed batches of ~50 ms for at least
    `min_time_s`, after `warmup` calls: the best batch (noise only ever adds time) and every
    timed call's mean (the rate the host gave over those seconds)."""
    for _ in range(warmup):
        fn()
    best, spent, reps, calls = float("inf"), 0.0, 1, 0
    while spent < min_time_s:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        dt = time.perf_counter() - t0
        best, spent, calls = min(best, dt / reps), spent + dt, calls + reps
        reps = max(1, min(reps * 2, int(0.05 / max(best, 1e-9))))  # batches of ~50 ms
    return best, spent / calls


def best_seconds(fn: Callable[[], object], min_time_s: float = 0.2, warmup: int = 2) -> float:
    """Seconds per call of `fn`: the best of timed batches (time_calls)."""
    return time_calls(fn, min_time_s, warmup)[0]


def time_gemm(
    g: Gemm, dtype, min_time_s: float = 0.2, warmup: int = 2, weight_grad: Callable | None = None
) -> tuple[float, float]:
    """(best, mean) seconds per call of one GEMM (time_calls), its operands laid out as autograd
    has them; a weight gradient by `weight_grad(dy, x)` instead where the model runs one
    (model.weight_grad_kernel: raytrain_cpu.model.ops.linear.weight_grad)."""
    import torch

    if weight_grad is not None and g.name.startswith("wgrad"):
        dy, x = torch.randn(g.k, g.m, dtype=dtype), torch.randn(g.k, g.n, dtype=dtype)
        return time_calls(lambda: weight_grad(dy, x), min_time_s, warmup)
    a, b = _operands(g, dtype)
    return time_calls(lambda: torch.mm(a, b), min_time_s, warmup)


def gemm_probe(
    gemms: Sequence[Gemm], dtype, min_time_s: float = 0.2, weight_grad: Callable | None = None
) -> dict[str, Any]:
    """FLOP/s of a GEMM mix on this process's threads.

    `flops_per_s` weights each shape by how often the model runs it (total FLOPs over
    total time): the rate a step made only of these GEMMs would reach, which is the
    denominator MFU needs. `best_flops_per_s` is the fastest single shape. Both from each
    shape's best batch; `mean_flops_per_s` is the mix's rate from every timed call instead.
    """
    rows, total_flops, total_time, total_mean = [], 0.0, 0.0, 0.0
    for g in gemms:
        t, mean = time_gemm(g, dtype, min_time_s, weight_grad=weight_grad)
        rows.append({"name": g.name, "m": g.m, "k": g.k, "n": g.n, "count": g.count, "gflops": g.flops / t / 1e9})
        total_flops += g.flops * g.count
        total_time += t * g.count
        total_mean += mean * g.count
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "flops_per_s": total_flops / total_time if total_time else 0.0,
        "mean_flops_per_s": total_flops / total_mean if total_mean else 0.0,
        "best_flops_per_s": max((r["gflops"] for r in rows), default=0.0) * 1e9,
        "shapes": rows,
    }


PROBE_MAX_BYTES = 512e6  # a probed GEMM's fp32 operands at most (an 8B model's vocabulary head would take GBs)


def fp32_operand_bytes(m: int, k: int, n: int) -> float:
    return 4.0 * (m * k + k * n + m * n)


def probe_gemms(gemms: Sequence[Gemm], max_tokens: int = 1024, max_bytes: float = PROBE_MAX_BYTES) -> list[Gemm]:
    """A cheap subset for the start-up dtype probe: forward shapes, token dimension capped, and
    none whose fp32 operands exceed `max_bytes` (an 8B model's vocabulary head would take GBs)."""
    out = []
    for g in gemms:
        m = min(g.m, max_tokens)
        if g.name.startswith("fwd") and fp32_operand_bytes(m, g.k, g.n) <= max_bytes:
            out.append(Gemm(g.name, m, g.k, g.n, g.count))
    return out


def decide_dtype(requested: str, bf16_flops: float, fp32_flops: float, margin: float = 1.05) -> tuple[str, str]:
    """(dtype, reason): 'auto' takes bf16 only when it measured at least `margin` x fp32.

    An explicit 'bf16' or 'fp32' is kept; when bf16 was asked for and measured slower the
    reason says so (the caller warns).
    """
    ratio = bf16_flops / fp32_flops if fp32_flops > 0 else float("inf")
    measured = f"bf16 GEMM {bf16_flops / 1e9:.1f} GFLOP/s vs fp32 {fp32_flops / 1e9:.1f} GFLOP/s ({ratio:.2f}x)"
    if requested != "auto":
        slow = requested == "bf16" and ratio < 1.0
        return requested, f"{requested} as configured; {measured}" + ("; bf16 is slower here" if slow else "")
    if ratio >= margin:
        return "bf16", f"auto: {measured}"
    return "fp32", f"auto: {measured}; bf16 is not faster on this CPU, training in fp32"


def choose_dtype(
    requested: str,
    gemms: Sequence[Gemm],
    agree: Callable[[list[float]], list[float]] | None = None,
    min_time_s: float = 0.02,
) -> dict[str, Any]:
    """Probes bf16 and fp32 at the model's GEMM shapes and picks per decide_dtype.

    `agree` averages the measurements over ranks (an all-reduce), so every rank takes the
    same decision: a split one would give the ranks different DeepSpeed configs. Both
    dtypes are probed even when one is configured (the log says when bf16 is the slower);
    MFU's denominator is timed again once the worker is set up (time_peak_flops), since this
    probe runs beside Ray's start-up. 20 ms a shape and dtype: time_gemm keeps the best of
    doubling batches, which reads the same rate as longer timings did, at a fraction of every
    worker's start-up.
    """
    import torch

    probe = probe_gemms(gemms)
    bf16 = gemm_probe(probe, torch.bfloat16, min_time_s)["flops_per_s"]
    fp32 = gemm_probe(probe, torch.float32, min_time_s)["flops_per_s"]
    if agree is not None:
        bf16, fp32 = agree([bf16, fp32])
    dtype, reason = decide_dtype(requested, bf16, fp32)
    if (dtype == "fp32" and requested == "auto") or "slower" in reason:
        warnings.warn(reason, stacklevel=2)
    return {
        "dtype": dtype,
        "requested": requested,
        "reason": reason,
        "bf16_flops_per_s": bf16,
        "fp32_flops_per_s": fp32,
        "peak_flops_per_s": bf16 if dtype == "bf16" else fp32,
    }


def time_peak_flops(
    gemms: Sequence[Gemm],
    dtype: str,
    agree: Callable[[list[float]], list[float]] | None = None,
) -> float:
    """The per-worker GEMM rate MFU is logged against, timed again once the worker is set up.

    The start-up probe (choose_dtype) runs while Ray still starts the data pipeline's processes
    beside the workers: on a small host it read about half the rate, and the logged MFU read
    over 100%. Its bf16/fp32 ratio, both timed in the same conditions, still decides the dtype; MFU's denominator is the faster of the two
    timings of the chosen dtype (train.time_mfu_peak). `agree` averages it over ranks, as
    choose_dtype's does."""
    import torch

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    rate = gemm_probe(probe_gemms(gemms), torch_dtype, min_time_s=0.02)["flops_per_s"]
    return agree([rate])[0] if agree is not None else rate


def time_training_mix(
    gemms: Sequence[Gemm],
    dtype: str,
    agree: Callable[[list[float]], list[float]] | None = None,
    weight_grad: Callable | None = None,
) -> tuple[float, float]:
    """(peak, mean) FLOP/s of the whole training mix, for train.mfu_probe_every, timed the way
    `bench train`'s peak is: forward, input and weight gradients at the micro batch's tokens (the
    weight gradients run at about half the forward's rate), 0.2 s a shape, two rounds (shapes
    whose operands exceed 512 MB left out, as in the start-up subset). At 0.02 s a shape the rate
    read lower and scattered, which would flatter MFU.

    `peak` is the better round, each shape at its best ~50 ms batch. `mean` is the rate over
    every timed call of both rounds: what the host gave on average. They differ where the host
    slows the cores in spells (a small VM ran one GEMM at twice its best time or more in spells
    of tens of milliseconds; benchmarks/host_spells.py), and the best batches time only the fast
    spells while a step runs through both. `agree` averages both
    over ranks. `weight_grad`: the weight gradients as the model runs them (time_gemm)."""
    import torch

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    mix = [g for g in gemms if fp32_operand_bytes(g.m, g.k, g.n) <= PROBE_MAX_BYTES]
    rounds = [gemm_probe(mix, torch_dtype, min_time_s=0.2, weight_grad=weight_grad) for _ in range(2)]
    peak = max(r["flops_per_s"] for r in rounds)
    mean = len(rounds) / sum(1.0 / r["mean_flops_per_s"] for r in rounds)  # equal FLOPs a round
    return tuple(agree([peak, mean])) if agree is not None else (peak, mean)
