"""Communication and compute per step: the bytes each rank moves and the model FLOPs."""

from __future__ import annotations

from raytrain_cpu.model.shape import (
    LORA_TARGETS,
    ModelShape,
)
from raytrain_cpu.planner.memory import bytes_per_param
from raytrain_cpu.planner.tables import DS_MAX_REUSE_DISTANCE, DS_PARAM_PERSISTENCE_THRESHOLD


def backward_regather_share(gathered_numel: float, reuse_distance: int = DS_MAX_REUSE_DISTANCE) -> float:
    """Share of ZeRO-3's parameters the backward gathers again after the forward released them.

    DeepSpeed keeps a gathered parameter when it runs again within stage3_max_reuse_distance
    elements of parameters (partitioned_param_coordinator's release). Between a layer's forward
    and its backward run the forward of every later layer and their backward: about twice the
    parameters after it. So the last layers (up to half the distance) stay gathered into the
    backward and the rest are gathered again: none in a model of up to half a billion gathered
    parameters, most of an 8B."""
    if gathered_numel <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - reuse_distance / (2.0 * gathered_numel)))


def comm_bytes_per_step(
    shape: ModelShape,
    world_size: int,
    zero_stage: int,
    grad_accum_steps: int = 1,
    dtype: str = "bf16",
    param_persistence_threshold: int = DS_PARAM_PERSISTENCE_THRESHOLD,
    lora_rank: int = 0,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    reference_forward: bool = False,
) -> float:
    """Bytes each rank sends (and receives) per optimizer step, ring algorithms.

    With LoRA the frozen base is gathered exactly as in full fine-tuning, but only the fp32
    adapters' gradients are reduced (and, at ZeRO-1/2, only they are re-gathered after the step).
    DPO's `reference_forward` (every micro batch: the base with the adapters off, or full
    fine-tuning's frozen copy of the starting model) gathers the model once more at ZeRO-3.

    ZeRO-3 all-gathers the (non-persistent) parameters in forward, again in backward those the
    forward released (backward_regather_share), and reduce-scatters the gradients, every micro
    batch: up to ~3x the model bytes. ZeRO-2 reduce-
    scatters gradients every micro batch and all-gathers the updated parameters once; ZeRO-1
    does both once per step: ~2x (an all-reduce).
    """
    W = world_size
    if W <= 1:
        return 0.0
    w_bytes = g_bytes = bytes_per_param(dtype)
    P = shape.num_params
    if lora_rank:  # gradients (and updated weights) only of the adapters, in fp32
        P, g_bytes = shape.lora_params(lora_rank, tuple(lora_targets)), 4
    ring = (W - 1) / W
    if zero_stage == 3:
        gathered = sum(n for n in shape.param_numels() if n >= param_persistence_threshold)
        gathers = 1 + backward_regather_share(gathered) + (1 if reference_forward else 0)
        per_micro = gathers * w_bytes * gathered * ring + g_bytes * P * ring
        return per_micro * grad_accum_steps
    if zero_stage == 2:
        return (g_bytes * P * grad_accum_steps + g_bytes * P) * ring
    return (g_bytes * P + g_bytes * P) * ring


def train_flops_per_step(
    shape: ModelShape, tokens: int, activation_checkpointing: bool, lora: bool = False, reference_forward: bool = False
) -> float:
    """Model FLOPs of forward + backward (6 per parameter per token, 8 when recomputing; LoRA
    computes no weight gradients for the frozen base: 4, or 6 when recomputing; DPO's reference
    forward adds 2)."""
    per_param = (4 if lora else 6) + (2 if activation_checkpointing else 0) + (2 if reference_forward else 0)
    return per_param * shape.num_params * tokens
