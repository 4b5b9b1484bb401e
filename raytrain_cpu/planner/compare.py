"""Time and cost of a run on c7i/m7i/r7i nodes, and the comparison the recommendation reads:
flat ZeRO-3, ZeRO-3 with its gathers kept inside a node (hpZ), ZeRO-2, and LoRA, on each size.

A rank is one socket (the 48xlarge holds two), and a rank's threads are its socket share's
physical cores: more cores make a step faster, more nodes make it dearer, and the network sets
the pace where what crosses nodes outlasts the compute, which is what comparing sizes shows.
"""

from __future__ import annotations

import math
from typing import Any

from raytrain_cpu.model.shape import ModelShape
from raytrain_cpu.planner.recommend import fits_node, planned_peak, release_margin
from raytrain_cpu.planner.steptime import Rates, Topology, c7i_assumed_rates, step_time, with_network
from raytrain_cpu.planner.tables import (
    C7I_SIZES,
    GIB,
    SINGLE_FLOW_GBPS,
    instance_catalog,
    sockets_of,
)

STRIPES = 4  # trainer.collectives.DEFAULT_STRIPES (tests/unit/test_steptime.py checks)
LORA_RANK_COMPARED = 16  # the LoRA row of a full fine-tuning plan (configs/llama3-8b-lora-c7i.yaml's rank)


def rank_threads(instance: str, ranks_per_node: int, reserved_vcpus: float = 0) -> int:
    """Intra-op threads of a rank: its share of the node's physical cores (2 vCPUs a core) after
    the vCPUs the workers leave to Ray's processes and data (scaling.data_cpus)."""
    family = instance.partition(".")[0]
    return max(1, int((instance_catalog(family)[instance][0] - reserved_vcpus) // ranks_per_node // 2))


def node_rates(
    instance: str, ranks_per_node: int, rates: Rates | None, placement_group: str, threads: int = 0
) -> Rates:
    """`rates` (measured on a c7i-class host) on `instance`'s network, else c7i's assumed ones at
    `threads` a rank (0: its share of the node's cores)."""
    if placement_group not in SINGLE_FLOW_GBPS:
        raise ValueError(f"placement_group must be one of {sorted(SINGLE_FLOW_GBPS)}, got {placement_group!r}")
    nic = C7I_SIZES[f"c7i.{instance.partition('.')[2]}"][2]  # m7i and r7i have c7i's network at each size
    flow = SINGLE_FLOW_GBPS[placement_group]
    if rates is not None:
        return with_network(rates, nic, flow)
    return c7i_assumed_rates(threads or rank_threads(instance, ranks_per_node), nic, flow)


def step_on(
    shape: ModelShape,
    instance: str | None,
    world_size: int,
    ranks_per_node: int,
    hpz: int,
    shm: bool,
    run: dict[str, Any],
    rates: Rates | None,
    placement_group: str = "cluster",
    usd_per_hour: float | None = None,
    cross_node: str = "gloo",
    threads: int = 0,
) -> dict[str, Any]:
    """The predicted step of `run` (steptime.step_time's arguments) on `instance` nodes, or with
    `instance` None on this machine (every rank on it, `rates` measured here); `cross_node`
    is deepspeed.cross_node_collectives, `threads` a rank's (0: its share of the node)."""
    topo = Topology(world_size, ranks_per_node, hpz, shm, STRIPES if cross_node == "striped" else 1)
    if instance is None:
        if rates is None:
            raise ValueError("a step on this machine needs its measured rates (plan --measure)")
        return step_time(shape, topo, rates, **run)
    r = node_rates(instance, ranks_per_node, rates, placement_group, threads)
    out = step_time(shape, topo, r, instance=instance, **run)
    if usd_per_hour is not None:
        tokens = run["micro_batch"] * run["seq_len"] * run["grad_accum_steps"] * world_size
        out["usd_per_node_hour"] = usd_per_hour
        out["usd_per_million_tokens"] = usd_per_hour * topo.nodes * out["step_time_s"] / 3600 / tokens * 1e6
    return out


def _variants(run: dict[str, Any], ranks_per_node: int, nodes: int) -> dict[str, dict[str, Any]]:
    """The settings each compared variant changes; the in-node one only where a node holds
    several ranks and there are several nodes (else it is flat ZeRO-3), and each again with its
    collectives striped where there are several nodes."""
    lora = run["lora_rank"] > 0
    out: dict[str, dict[str, Any]] = {"zero3": {"zero_stage": 3, "hpz": 1}}
    if ranks_per_node > 1 and nodes > 1:
        out["zero3_in_node"] = {"zero_stage": 3, "hpz": ranks_per_node}
    out["zero2"] = {"zero_stage": 2, "hpz": 1}
    if not lora:
        out[f"lora_r{LORA_RANK_COMPARED}"] = {"zero_stage": 3, "hpz": 1, "lora_rank": LORA_RANK_COMPARED}
    if nodes > 1:
        out |= {f"{name}+striped": v | {"cross_node": "striped"} for name, v in out.items()}
    return out


def _settings(v: dict[str, Any], lora_rank: int) -> list[str]:
    """The config keys that make a compared variant, as dotted overrides."""
    out = [f"deepspeed.zero_stage={v['zero_stage']}"]
    if v["hpz"] > 1:
        out.append(f"deepspeed.hpz_partition_size={v['hpz']}")
    if v.get("cross_node"):
        out.append(f"deepspeed.cross_node_collectives={v['cross_node']}")
    if v.get("lora_rank"):
        out.append(f"lora.rank={lora_rank}")
    return out


def compare_variants(
    shape: ModelShape,
    world_size: int,
    mem_kwargs: dict[str, Any],
    run: dict[str, Any],
    rates: Rates | None,
    placement_group: str = "cluster",
    usd_per_hour: float | None = None,
    reserved_vcpus: float = 0,
) -> dict[str, Any]:
    """Every variant on every c7i/m7i/r7i size at `world_size` ranks, one a socket: whether it fits,
    its step, tokens/s and cost; and the fastest and the cheapest that fit and train what the
    plan trains (full fine-tuning or LoRA: the LoRA row of a full plan is there to compare).
    `reserved_vcpus`: what each node leaves to Ray and data (scaling.data_cpus), so a rank's
    threads are its share of the rest of the node's cores."""
    margin = release_margin(mem_kwargs)
    rows = []
    for family in ("c7i", "m7i", "r7i"):
        for instance, (_, gib, _) in instance_catalog(family).items():
            rpn = min(sockets_of(instance), world_size)
            nodes = math.ceil(world_size / rpn)
            for name, v in _variants(run, rpn, nodes).items():
                lora_rank = v.get("lora_rank", run["lora_rank"])
                mem = mem_kwargs | {
                    "zero_stage": v["zero_stage"],
                    "hpz_partition_size": v["hpz"],
                    "lora_rank": lora_rank,
                    "shm_ranks": world_size if nodes == 1 else 0,
                }
                peak = planned_peak(shape, world_size, mem)
                fits = fits_node(peak, rpn, gib, margin)
                variant_run = run | {"zero_stage": v["zero_stage"], "lora_rank": lora_rank}
                shm = mem_kwargs.get("shm_ranks", 0) > 0 or nodes == 1
                cross = v.get("cross_node", "gloo")
                args = (shape, instance, world_size, rpn, v["hpz"], shm, variant_run, rates, placement_group)
                s = step_on(*args, usd_per_hour, cross, rank_threads(instance, rpn, reserved_vcpus))
                rows.append(
                    {
                        "variant": name,
                        "settings": _settings(v, lora_rank),
                        "instance": instance,
                        "nodes": nodes,
                        "ranks_per_node": rpn,
                        "threads_per_rank": s["rates"]["threads"],
                        "fits": fits,
                        "peak_gib": peak / GIB,
                        "step_time_s": s["step_time_s"],
                        "tokens_per_s": s["tokens_per_s"],
                        "comm_exposed_s": s["comm_exposed_s"],
                        "network_gib_per_step": s["network_gib_per_step"],
                        "bound_by": s["bound_by"],
                        "usd_per_million_tokens": s["usd_per_million_tokens"],
                        "same_training": (lora_rank > 0) == (run["lora_rank"] > 0),
                    }
                )
    candidates = [r for r in rows if r["fits"] and r["same_training"]]
    return {
        "variants_compared": sorted(rows, key=lambda r: r["usd_per_million_tokens"]),
        "recommended_by_time": _simplest_near_best(candidates, "step_time_s"),
        "recommended_by_cost": _simplest_near_best(candidates, "usd_per_million_tokens"),
    }


# Within this share of the best, the variant with fewer settings wins (no stripes where they
# save nothing, flat ZeRO-3 over hpZ), then the one with fewer, larger nodes: the model is not
# that precise, and each setting is something more to run.
NEAR_BEST = 0.02


def _simplest_near_best(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    if not rows:
        return None
    best = min(r[key] for r in rows)
    near = [r for r in rows if r[key] <= best * (1 + NEAR_BEST)]
    return min(near, key=lambda r: (len(r["settings"]), r["nodes"], r[key]))
