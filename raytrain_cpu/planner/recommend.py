"""Recommendation: the node that holds a run's ranks, the fewest workers per c7i size, and
the advice a plan adds (a lower ZeRO stage, a larger micro batch) where memory allows."""

from __future__ import annotations

import math
from typing import Any

from raytrain_cpu.model.shape import ModelShape
from raytrain_cpu.planner.memory import memory_breakdown, memory_stages
from raytrain_cpu.planner.tables import C7I_SIZES, FREE_MEMORY_GROWTH_MIB, GIB, instance_catalog, usable_bytes


def planned_stages(shape: ModelShape, world_size: int, mem_kwargs: dict[str, Any]) -> tuple[dict, dict]:
    """(memory_breakdown's parts, memory_stages) for plan()'s memory arguments."""
    kwargs = dict(mem_kwargs)
    kept_pages = kwargs.pop("kept_pages", True)
    kwargs.pop("free_memory_growth_mib", None)  # a margin of the fit (release_margin), not of the stages
    parts = memory_breakdown(shape, world_size, **kwargs)
    return parts, memory_stages(parts, lora=bool(kwargs.get("lora_rank")), kept_pages=kept_pages)


def planned_peak(shape: ModelShape, world_size: int, mem_kwargs: dict[str, Any]) -> float:
    return planned_stages(shape, world_size, mem_kwargs)[1]["peak"]


def release_margin(mem_kwargs: dict[str, Any]) -> float:
    """Bytes a rank may hold above its training peak before its kept pages go back (FREE_MEMORY_GROWTH_MIB)."""
    return mem_kwargs.get("free_memory_growth_mib", FREE_MEMORY_GROWTH_MIB) * 2**20


def fits_node(peak_bytes: float, ranks_per_node: int, instance_gib: float, margin_bytes: float) -> bool:
    return (peak_bytes + margin_bytes) * ranks_per_node <= usable_bytes(instance_gib)


def recommend(
    shape: ModelShape,
    world_size: int,
    ranks_per_node: int = 1,
    max_workers: int = 512,
    **mem_kwargs: Any,
) -> dict[str, Any]:
    """The smallest node that holds `world_size` ranks, and the fewest workers per c7i size.

    Memory decides the smallest node that works; a bigger c7i only adds cores (and network),
    which is what makes a step faster. c7i first (2 GiB/vCPU), then m7i (4) and r7i (8).
    """
    peak = planned_peak(shape, world_size, mem_kwargs)
    nodes = math.ceil(world_size / ranks_per_node)
    candidates = [(name, gib) for fam in ("c7i", "m7i", "r7i") for name, (_, gib, _) in instance_catalog(fam).items()]
    margin = release_margin(mem_kwargs)
    chosen = next((name for name, gib in candidates if fits_node(peak, ranks_per_node, gib, margin)), None)

    # ZeRO-3 shards with the world size, so more, smaller nodes can replace fewer, bigger ones.
    one_per_node = mem_kwargs | {"shm_ranks": 0}  # one rank per node: gloo
    min_workers = {
        name: next(
            (w for w in range(1, max_workers + 1) if fits_node(planned_peak(shape, w, one_per_node), 1, gib, margin)),
            None,
        )
        for name, (_, gib, _) in C7I_SIZES.items()
    }

    if chosen is None:
        need = min_workers["c7i.48xlarge"]
        note = (
            f"{world_size} ranks do not fit any c7i/m7i/r7i node; use at least {need} c7i.48xlarge workers."
            if need
            else "does not fit at any world size tried; use ZeRO-3, activation checkpointing or offload nvme."
        )
    elif chosen.startswith("c7i"):
        note = f"{nodes} x {chosen} ({ranks_per_node} rank(s) per node)."
        if chosen != "c7i.48xlarge":
            note += " Bigger c7i sizes add cores (speed), not needed memory."
    else:
        note = f"{nodes} x {chosen}: needs more memory per vCPU than c7i has (m7i: 4 GiB/vCPU, r7i: 8)."
    return {
        "instance": chosen,
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "min_workers_per_c7i_size": min_workers,
        "note": note,
    }


# What the advice quotes: `bench options` side by side, the ~50M bench model on 2 workers, ZeRO-2
# against ZeRO-3 (benchmarks/results/<machine>/options-zero*.md).
ZERO2_SPEEDUP_50M = "1.08-1.10x on an AVX-512 BF16 host, 0.90x in one noisy run on AMX"


def lower_stage_advice(
    zero_stage: int,
    offload: str,
    stages_compared: dict[str, dict[str, float]],
    node: str,
    ranks_per_node: int,
    node_gib: float,
    margin_bytes: float,
) -> str | None:
    """Where a ZeRO-3 run would fit `node` at ZeRO-2 too, the line that says so (else None).

    ZeRO-2 keeps the whole bf16 model on every rank, so forward and backward gather nothing:
    no per-layer hooks, and about 2/3 of ZeRO-3's traffic per step. Worth it only where
    memory allows, which is the planner's to say.
    """
    if zero_stage != 3 or offload != "none":
        return None
    z2, z3 = stages_compared["2"], stages_compared["3"]
    if not fits_node(z2["peak_gib"] * GIB, ranks_per_node, node_gib, margin_bytes):
        return None
    return (
        f"ZeRO-2 also fits {node} ({z2['peak_gib']:.1f} GiB per rank against {z3['peak_gib']:.1f}) and moves "
        f"{z2['comm_gib_per_step']:.3g} GiB per rank per step against {z3['comm_gib_per_step']:.3g}, with no "
        f"parameter gathers: deepspeed.zero_stage=2 (the ~50M bench model on 2 workers, against ZeRO-3: "
        f"{ZERO2_SPEEDUP_50M})."
    )


# What the advice quotes: `bench options --variants "micro batch 4"`, the ~50M bench model on 2
# workers (benchmarks/results/<machine>/options-mb8*.md); the gain is larger where the GEMMs are a
# smaller share of the step.
LARGER_MICRO_BATCH_SPEEDUP = "1.20x and 1.27x at micro batch 8 against 4 on AMX, 1.00x and 1.03x on AMD Zen 5"


def micro_batch_advice(
    shape: ModelShape,
    world_size: int,
    micro_batch: int,
    grad_accum_steps: int,
    mem_kwargs: dict[str, Any],
    node: str,
    ranks_per_node: int,
    node_gib: float,
) -> str | None:
    """With gradient accumulation at ZeRO-3, the largest micro batch that keeps the global batch
    (fewer accumulation steps) and still fits `node`; None where none does or none is asked.

    ZeRO-3 gathers the whole model and runs its hooks once per micro batch, so k times the micro
    batch at 1/k the accumulation makes the same optimizer steps with 1/k of those per token."""
    if mem_kwargs.get("zero_stage") != 3 or grad_accum_steps == 1:
        return None
    for k in sorted((k for k in range(2, grad_accum_steps + 1) if grad_accum_steps % k == 0), reverse=True):
        peak = planned_peak(shape, world_size, mem_kwargs | {"micro_batch": micro_batch * k})
        if fits_node(peak, ranks_per_node, node_gib, release_margin(mem_kwargs)):
            return (
                f"micro batch {micro_batch * k} x grad accum {grad_accum_steps // k} keeps the global batch and fits "
                f"{node} ({peak / GIB:.1f} GiB per rank): 1/{k} of ZeRO-3's gathers and hooks per token "
                f"(train.micro_batch_size={micro_batch * k} train.grad_accum_steps={grad_accum_steps // k}; the "
                f"~50M bench model: {LARGER_MICRO_BATCH_SPEEDUP})."
            )
    return None
