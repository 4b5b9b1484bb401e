"""MFU's denominator: the GEMM rate of this worker at the model's shapes, timed once every rank
is set up, and again every train.mfu_probe_every steps."""

from __future__ import annotations

from typing import Any

from raytrain_cpu.trainer.engine import rank_mean
from raytrain_cpu.trainer.state import Worker


def time_mfu_peak(w: Worker, cpu_setup: dict[str, Any]) -> None:
    """The faster of the start-up probe and a second timing now that every rank is set up and
    Ray's start-up is over (host_gemm.time_peak_flops).

    Whatever else runs on the cores only slows a timing, so the faster one is nearer the peak.
    Each alone can read far below it on a small shared host: the start-up probe beside Ray's
    start-up (the logged MFU then read over 100%), and the second timing while the host runs
    slower for a while."""
    from raytrain_cpu.host import gemm as host_gemm

    d = cpu_setup["dtype"]
    d["start_probe_flops_per_s"] = d["peak_flops_per_s"]
    d["retimed_flops_per_s"] = host_gemm.time_peak_flops(model_gemms(w), d["dtype"], agree=rank_mean(w))
    d["peak_flops_per_s"] = max(d["start_probe_flops_per_s"], d["retimed_flops_per_s"])
    w.loop_config["peak_flops"] = d["peak_flops_per_s"]
    w.log(
        f"[engine] MFU against {d['dtype']} GEMMs at {d['peak_flops_per_s'] / 1e9:.1f} GFLOP/s per worker at the "
        f"model's shapes (the faster of two timings: {d['start_probe_flops_per_s'] / 1e9:.1f} at start-up, "
        f"{d['retimed_flops_per_s'] / 1e9:.1f} once set up)"
    )


def retime_mfu_peak(w: Worker, dtype: str, clock) -> None:
    """train.mfu_probe_every: the GEMM rate again, right after a step and outside its clock and
    the console's tokens/s, so MFU reads against the host's rate at the time (the console's from
    this step's line on; the step-time breakdown's weighs each timed step by the timing after
    it). The whole training mix, timed as `bench train`'s peak is; the summary keeps its mean
    rate too (host_gemm.time_training_mix says why)."""
    from raytrain_cpu.host import gemm as host_gemm

    kernel = None
    if w.weight_grad_kernel:  # the mix as the model runs it
        from raytrain_cpu.model.ops.linear import weight_grad as kernel
    peak, mean = host_gemm.time_training_mix(model_gemms(w), dtype, agree=rank_mean(w), weight_grad=kernel)
    w.loop_config["peak_flops"] = peak
    clock.peak(peak, mean)


def model_gemms(w: Worker) -> list:
    """The model's GEMMs at one micro batch's tokens (model_shape.gemms_for_model)."""
    from raytrain_cpu.model import shape as model_shape

    return model_shape.gemms_for_model(w.loop_config["model_dir"], w.cfg.train.micro_batch_size * w.cfg.data.seq_len)
