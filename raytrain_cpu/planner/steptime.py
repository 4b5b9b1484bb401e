"""How long a step takes and what it costs: compute from a rank's GEMM rate, communication by
where each collective travels (shared memory, a node's loopback, the network between nodes), and
what of it hides behind compute.

The model is deliberately small enough to check by hand:

    step = compute + optimizer + exposed communication
    compute = model FLOPs per rank / GEMM rate / (1 - non-GEMM share)
    a ring collective over g ranks moves (g-1)/g of its payload over every link of the ring
    (twice for an all-reduce), and takes as long as its slowest link: between nodes that is one
    TCP flow per link (gloo opens one connection between two ranks), capped by AWS at
    `flow_bytes_per_s`, not the node's whole network.

The rates come from `Rates`: measured on this machine (`plan --measure`, planner.measure) or,
for c7i nodes the planner cannot time, assumed (`C7I_ASSUMED`), with their source named in every
report so a prediction never passes for a measurement.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from raytrain_cpu.model.shape import LORA_TARGETS, ModelShape
from raytrain_cpu.planner.comm import backward_regather_share
from raytrain_cpu.planner.memory import bytes_per_param
from raytrain_cpu.planner.tables import DS_PARAM_PERSISTENCE_THRESHOLD, on_demand_usd_per_hour

GBIT = 1e9 / 8  # bytes per second in a Gbit/s


# torch's gloo reduce_scatter_tensor reduces the whole tensor on every rank, as an all-reduce
# does, and sends as many bytes: twice a ring reduce-scatter's
# (benchmarks/results/amd-epyc-avx512_bf16/two_nodes_gloo.md). The shared-memory one does not.
GLOO_REDUCE_SCATTER_LINK_FACTOR = 2.0


# What gloo's ring collectives reach of a shaped link between two network namespaces, 4 ranks
# (two_nodes_gloo.md: 0.83-0.95 of the rate); the planner applies it to AWS's flow and node rates.
NETWORK_EFFICIENCY = 0.9


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Rates:
    """A rank's rates at its thread count: what a step's time is made of."""

    source: str
    """Where these figures come from: 'measured on <host>' or 'assumed: ...'."""
    threads: int
    """Intra-op threads per rank the compute rates hold for."""
    gemm_flops_per_s: float
    """One rank's GEMM rate over the model's own matrix shapes (forward, input and weight grads)."""
    non_gemm_share: float
    """Share of forward + backward time spent outside GEMMs (attention's softmax, norms, the
    loss, ZeRO-3's hooks): measured on a real decoder layer against its GEMMs' time."""
    optimizer_s_per_param: float
    """AdamW (fp32 master, moments) and clipping, seconds per parameter of the rank's partition."""
    shm_bytes_per_s: float
    """Payload bytes per second a rank's collective moves over shared memory (all ranks on one
    machine, deepspeed.shm_collectives)."""
    loopback_bytes_per_s: float
    """Gloo between two ranks of one node (TCP over loopback): in-node links of a collective that
    also spans nodes, or every link where shared memory is off."""
    flow_bytes_per_s: float
    """One TCP flow between two nodes: AWS caps a single flow (10 Gbit/s inside a cluster
    placement group, 5 outside), below the node's network on large sizes."""
    nic_bytes_per_s: float
    """A node's network bandwidth (all flows of a node together)."""
    gather_overlap: float = 0.0
    """Share of ZeRO-3's gloo gathers that prefetch hides behind compute (shared-memory
    collectives run synchronously in the training thread, and hide nothing)."""

    def link_bytes_per_s(self, crosses_nodes: bool, shm: bool, flows: int = 1) -> float:
        """The slowest link of a ring: between nodes one capped flow per link (`flows` where a
        collective is striped over several groups), else shared memory or loopback."""
        if crosses_nodes:
            return min(self.loopback_bytes_per_s, flows * self.flow_bytes_per_s, self.nic_bytes_per_s)
        return self.shm_bytes_per_s if shm else self.loopback_bytes_per_s


@dataclass(frozen=True)
class Topology:
    """Where the ranks are: `ranks_per_node` consecutive ranks a node (Ray Train numbers a
    node's workers together), and whether ZeRO-3 keeps its gathers inside groups of `hpz`."""

    world_size: int
    ranks_per_node: int = 1
    hpz: int = 1
    """deepspeed.hpz_partition_size: ranks that share a secondary bf16 copy (1: flat ZeRO-3)."""
    shm: bool = True
    """deepspeed.shm_collectives: used only where every rank shares one machine."""
    stripes: int = 1
    """Gloo groups each all-gather and reduce-scatter among all ranks is cut over
    (deepspeed.cross_node_collectives="striped": trainer.collectives.DEFAULT_STRIPES), so as
    many TCP flows cross each node boundary; 1: gloo's own."""

    @property
    def nodes(self) -> int:
        return math.ceil(self.world_size / self.ranks_per_node)

    def spans_nodes(self, group: int) -> bool:
        """A group of `group` consecutive ranks crosses a node boundary."""
        return group > min(self.ranks_per_node, self.world_size)

    @property
    def shm_usable(self) -> bool:
        return self.shm and self.nodes == 1


# ----------------------------------------------------------------------------- traffic


@dataclass(frozen=True)
class Collective:
    """`count` ring collectives a step over `group` ranks, each of `payload` bytes (the whole
    gathered or reduced tensor); `kind` 'gather' (ZeRO-3's parameter all-gathers, which prefetch
    may overlap), 'reduce' (gradient reduce-scatters) or 'update' (ZeRO-1/2's once-a-step)."""

    kind: str
    group: int
    payload: float
    count: float
    all_reduce: bool = False

    def link_bytes(self) -> float:
        """Bytes over each link of the ring, all `count` calls together."""
        if self.group <= 1:
            return 0.0
        return (2 if self.all_reduce else 1) * (self.group - 1) / self.group * self.payload * self.count


def step_collectives(
    shape: ModelShape,
    topo: Topology,
    zero_stage: int,
    grad_accum_steps: int = 1,
    dtype: str = "bf16",
    lora_rank: int = 0,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    reference_forward: bool = False,
    param_persistence_threshold: int = DS_PARAM_PERSISTENCE_THRESHOLD,
) -> list[Collective]:
    """The collectives of one optimizer step (steady state), as planner.comm counts their bytes.

    ZeRO-3 gathers each parameter in every micro batch's forward, and again in its backward where
    the forward released it (comm.backward_regather_share).

    hpZ (DeepSpeed's ZeRO++ secondary partition): a parameter's first gather after the optimizer
    step goes over every rank and leaves a bf16 copy partitioned inside its group; every later
    gather (backward, later micro batches) reads the group's copy. A frozen parameter's copy never
    expires, so a LoRA base crosses nodes only once, not every step.
    """
    W, a = topo.world_size, grad_accum_steps
    if W <= 1:
        return []
    w_bytes = bytes_per_param(dtype)
    gathered = float(sum(n for n in shape.param_numels() if n >= param_persistence_threshold))
    trainable = float(shape.lora_params(lora_rank, tuple(lora_targets)) if lora_rank else shape.num_params)
    g_bytes = 4 if lora_rank else w_bytes  # LoRA's adapters keep fp32 gradients
    frozen = gathered - trainable if lora_rank else 0.0
    trained_gathered = gathered - frozen
    if zero_stage == 3:
        # forward, the backward's re-gathers (and the reference's forward), each micro batch
        gathers = (1 + backward_regather_share(gathered) + (1 if reference_forward else 0)) * a
        out = [Collective("reduce", W, g_bytes * trainable, a)]
        h = topo.hpz if 1 < topo.hpz < W else 1
        if h == 1:
            return [Collective("gather", W, w_bytes * gathered, gathers), *out]
        split = [
            Collective("gather", W, w_bytes * trained_gathered, 1),  # the first after the step
            Collective("gather", h, w_bytes * trained_gathered, gathers - 1),
            Collective("gather", h, w_bytes * frozen, gathers),
        ]
        return [c for c in split if c.payload and c.count] + out
    if zero_stage == 2:
        return [Collective("reduce", W, g_bytes * trainable, a), Collective("update", W, w_bytes * trainable, 1)]
    return [Collective("reduce", W, g_bytes * trainable, 1, all_reduce=True)]


def collective_seconds(c: Collective, topo: Topology, rates: Rates) -> float:
    crosses = topo.spans_nodes(c.group)
    shm = topo.shm_usable and c.group == topo.world_size
    factor = GLOO_REDUCE_SCATTER_LINK_FACTOR if c.kind == "reduce" and not shm and not c.all_reduce else 1.0
    flows = topo.stripes if c.group == topo.world_size and not c.all_reduce else 1
    return factor * c.link_bytes() / rates.link_bytes_per_s(crosses, shm, flows)


def cross_node_bytes(collectives: list[Collective], topo: Topology) -> float:
    """Bytes each node sends to the next over the network per step (one ring link leaves a node)."""
    return sum(
        c.link_bytes() * (GLOO_REDUCE_SCATTER_LINK_FACTOR if c.kind == "reduce" and not c.all_reduce else 1.0)
        for c in collectives
        if topo.spans_nodes(c.group)
    )


# ----------------------------------------------------------------------------- compute


def attention_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Causal attention's score and value products, forward and backward (3x forward): 2 GEMMs of
    2 * seq * q_dim FLOPs a token a layer, halved by the causal mask."""
    return 3 * 2 * 2 * shape.num_layers * shape.q_dim * seq_len / 2


def gemm_flops_per_rank(
    shape: ModelShape,
    tokens: int,
    activation_checkpointing: bool,
    lora: bool = False,
    reference_forward: bool = False,
) -> float:
    """Weight-GEMM FLOPs of one rank's tokens in a step: 2 per GEMM weight a pass (forward,
    backward's input gradients, and weight gradients unless frozen; a recomputed forward under
    activation checkpointing; DPO's reference forward). The input embedding is a lookup, not a
    GEMM; attention's own products are in the non-GEMM share, as measured."""
    passes = (2 if lora else 3) + (1 if activation_checkpointing else 0) + (1 if reference_forward else 0)
    return 2.0 * passes * shape.parameter_counts()["non_embedding"] * tokens


# ----------------------------------------------------------------------------- the step


def step_time(
    shape: ModelShape,
    topo: Topology,
    rates: Rates,
    zero_stage: int = 3,
    micro_batch: int = 1,
    seq_len: int = 1024,
    grad_accum_steps: int = 1,
    activation_checkpointing: bool = False,
    dtype: str = "bf16",
    lora_rank: int = 0,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    reference_forward: bool = False,
    instance: str | None = None,
) -> dict[str, Any]:
    """The predicted step: its parts in seconds, tokens/s, and (with `instance`) the cost of a
    million tokens at that node's on-demand price."""
    tokens_rank = micro_batch * seq_len * grad_accum_steps
    flops = gemm_flops_per_rank(shape, tokens_rank, activation_checkpointing, lora_rank > 0, reference_forward)
    gemm_s = flops / rates.gemm_flops_per_s
    compute_s = gemm_s / (1.0 - rates.non_gemm_share)
    trainable = shape.lora_params(lora_rank, tuple(lora_targets)) if lora_rank else shape.num_params
    optimizer_s = trainable / topo.world_size * rates.optimizer_s_per_param
    colls = step_collectives(
        shape, topo, zero_stage, grad_accum_steps, dtype, lora_rank, lora_targets, reference_forward
    )
    by_kind = {k: 0.0 for k in ("gather", "reduce", "update")}
    in_node = network = 0.0
    for c in colls:
        seconds = collective_seconds(c, topo, rates)
        by_kind[c.kind] += seconds
        if topo.spans_nodes(c.group):
            network += seconds
        else:
            in_node += seconds
    overlap = 0.0 if topo.shm_usable else rates.gather_overlap
    hidden = min(by_kind["gather"] * overlap, compute_s)
    comm_s = sum(by_kind.values())
    exposed = comm_s - hidden
    step_s = compute_s + optimizer_s + exposed
    global_tokens = tokens_rank * topo.world_size
    out: dict[str, Any] = {
        "step_time_s": step_s,
        "tokens_per_s": global_tokens / step_s,
        "compute_s": compute_s,
        "gemm_s": gemm_s,
        "optimizer_s": optimizer_s,
        "comm_s": comm_s,
        "comm_in_node_s": in_node,
        "comm_network_s": network,
        "comm_exposed_s": exposed,
        "comm_by_kind_s": by_kind,
        "network_gib_per_step": cross_node_bytes(colls, topo) / 2**30,
        "bound_by": "network" if network > compute_s else "compute",
        "gemm_tflop_per_rank": flops / 1e12,
        "attention_tflop_per_rank": attention_flops_per_token(shape, seq_len) * tokens_rank / 1e12,
        "nodes": topo.nodes,
        "rates": asdict(rates),
    }
    if instance:
        usd_h = on_demand_usd_per_hour(instance)
        out["usd_per_node_hour"] = usd_h
        out["usd_per_million_tokens"] = usd_h * topo.nodes * step_s / 3600 / global_tokens * 1e6
    return out


# ----------------------------------------------------------------------------- c7i, assumed


# What a c7i rank computes and sends where the planner cannot time one (plan --measure on a c7i
# node replaces it). A rank is one socket of Sapphire Rapids: its AMX GEMM rate per core, the
# share of its thread count it keeps, and the non-GEMM share are the intel-xeon-amx_bf16 host's
# (benchmarks/results/intel-xeon-amx_bf16/gemm.md: 0.64-0.98 TFLOP/s a core at one thread on the
# 50M bench's small shapes; an 8B's are larger), rounded down for many threads sharing a socket's
# memory. The network is AWS's documented figures (planner.tables.C7I_SIZES, SINGLE_FLOW_GBPS).
C7I_CORE_GEMM_FLOPS = 0.6e12
C7I_THREAD_EFFICIENCY = 0.75
C7I_NON_GEMM_SHARE = 0.30
C7I_OPTIMIZER_S_PER_PARAM = 2e-9  # fused AdamW over fp32 states at a socket's memory bandwidth
C7I_SHM_BYTES_PER_S = 8e9
C7I_LOOPBACK_BYTES_PER_S = 2e9


def c7i_assumed_rates(threads: int, nic_gbps: float, single_flow_gbps: float) -> Rates:
    return Rates(
        source="assumed: c7i (Sapphire Rapids, AMX) per-core GEMM rate and shares from the project's AMX host; "
        "AWS's documented network; replace with `plan --measure` on a c7i node",
        threads=threads,
        gemm_flops_per_s=C7I_CORE_GEMM_FLOPS * threads * C7I_THREAD_EFFICIENCY,
        non_gemm_share=C7I_NON_GEMM_SHARE,
        optimizer_s_per_param=C7I_OPTIMIZER_S_PER_PARAM,
        shm_bytes_per_s=C7I_SHM_BYTES_PER_S,
        loopback_bytes_per_s=C7I_LOOPBACK_BYTES_PER_S,
        flow_bytes_per_s=single_flow_gbps * GBIT * NETWORK_EFFICIENCY,
        nic_bytes_per_s=nic_gbps * GBIT * NETWORK_EFFICIENCY,
    )


def with_network(rates: Rates, nic_gbps: float, single_flow_gbps: float) -> Rates:
    """`rates` (measured here) on a c7i node's network."""
    return replace(
        rates,
        flow_bytes_per_s=single_flow_gbps * GBIT * NETWORK_EFFICIENCY,
        nic_bytes_per_s=nic_gbps * GBIT * NETWORK_EFFICIENCY,
    )
