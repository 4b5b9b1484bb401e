"""scaling: and deepspeed: settings: the workers, what each reserves, and the DeepSpeed engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from raytrain_cpu.config.checks import absolute, check_hpz_partition, choice, require

Allocator = Literal["auto", "jemalloc", "tcmalloc", "system"]
OmpWaitPolicy = Literal["default", "active", "passive"]

# The workers' default: glibc's dynamic threshold at its ceiling from the first step, with its
# trim threshold (twice it, as glibc's dynamic rule sets it). The dynamic pair trims the heap
# whenever its free top passes twice the largest block freed so far, so the next step faults
# those pages in again; this pair keeps them, at about the same peak memory
# (docs/performance.md has the timings).
GLIBC_HEAP_THRESHOLD = 32 << 20


# ----------------------------------------------------------------------------- scaling


@dataclass
class ScalingConfig:
    """How many Ray Train workers, and what each reserves."""

    num_workers: int = 0
    """Training workers (ranks); 0 derives it: one per node with CPUs, or 2 on a single
    machine with at least 2 CPUs; a resume keeps its checkpoint's. Another count resumes too,
    when micro batch x accumulation keep the checkpoint's global batch."""
    min_workers: int = 0
    """Elastic training when above 0 and below scaling.num_workers: the run starts with as many
    workers as the cluster holds in [min_workers, num_workers], goes on with fewer when nodes
    go (a spot node reclaimed for good) and grows back when nodes come, each time from the
    latest checkpoint. The global batch stays num_workers x micro_batch_size x
    grad_accum_steps: fewer workers accumulate more micro batches, so every worker count in
    the range must split it into micro batches. 0: always num_workers."""
    resize_check_s: float = 60.0
    """Elastic training: how often Ray Train looks for room for more workers. A resize restarts
    the workers from the latest checkpoint, so the steps since it are trained again."""
    cpus_per_worker: float = 0.0
    """Ray CPUs each worker reserves; 0 derives it from what Ray reports, leaving
    scaling.data_cpus free."""
    data_cpus: float = 0.0
    """CPUs per node the workers leave unreserved: room for Ray's own processes and each
    worker's data reader thread, which the torch threads (counted from the reserved CPUs' cores)
    then do not compete with; 0 derives it: 1 on machines with up to 16 CPUs, 2 above."""
    threads_per_worker: int = 0
    """torch intra-op threads per worker; 0 uses the physical cores behind the worker's CPUs."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources each worker needs, e.g. {c7i_worker: 1}, to land on given nodes."""
    instance_type: str = ""
    """The AWS node type the workers land on (e.g. c7i.48xlarge), for the planner
    (`python -m raytrain_cpu.plan --config`): it plans one rank per socket there, checks the fit
    and predicts the step on its network and price. The run itself places workers by
    scaling.resources_per_worker. Empty: the planner recommends a node."""
    node_wait_s: int = 1800
    """On a cluster that has no node for the workers yet (an autoscaler starts them on demand,
    as cluster/aws-c7i.yaml's worker types start at 0), how long the driver asks for them and
    waits before it stops; 0 stops at once. Needs scaling.num_workers."""
    check_memory: bool = True
    """Before data preparation, compare the planner's training peak per rank (times the ranks
    on a node) with the worker nodes' memory, and stop a run that cannot fit: Ray's memory
    monitor would kill its workers after loading, and again on every restart. false skips it."""
    pin_cores: bool = False
    """Pin each worker's threads to its own physical cores (split by local rank; one socket
    per rank on multi-socket nodes). Pays on a dedicated node; hurts on a shared one."""
    omp_wait_policy: OmpWaitPolicy = "default"
    """What a worker's idle OpenMP threads do between parallel regions (OMP_WAIT_POLICY):
    'default' leaves OpenMP's own (libgomp spins a while, then sleeps), 'active' keeps them
    spinning, 'passive' puts them to sleep at once. A ZeRO-3 rank runs Python between operators
    (its hooks) where plain PyTorch does not, and a thread that slept must be woken for the next
    region: on a 2-vCPU host 'active' raised a 2-thread rank 1.06-1.08x, to plain PyTorch's speed
    (docs/performance.md, threads per rank). Not the default until measured at 16-92 threads:
    a spinning thread takes its core from the data reader and Ray where the rank has none spare,
    and on a hyperthreaded node from its sibling."""
    allocator: Allocator = "auto"
    """malloc of the training workers: 'auto' preloads jemalloc (the system's, apt-get install
    libjemalloc2, else the one Ray's wheel ships), else tcmalloc; 'jemalloc', 'tcmalloc' or
    'system' (glibc)."""
    jemalloc_conf: str = ""
    """The workers' MALLOC_CONF when jemalloc is preloaded; '' is raytrain's (host.memory.JEMALLOC_CONF:
    freed pages stay for the next step and go back to the OS at phase ends). A MALLOC_CONF in
    the driver's environment (the cluster images') wins over both."""
    glibc_mmap_threshold: int = GLIBC_HEAP_THRESHOLD
    """With glibc malloc (no jemalloc/tcmalloc): allocations at least this many bytes get their
    own mapping, returned to the OS when freed and faulted in afresh when made again; smaller
    ones come from the heap, which keeps up to twice this free before trimming (glibc's own
    dynamic rule, at its 32 MiB ceiling by default), so a step reuses the last step's
    activations without page faults. 1048576 keeps RSS near live memory (the planner's
    calibration) at the cost of faults on every large tensor; 0 leaves both to glibc's dynamic
    thresholds, which trim the heap and fault every step (slower). The planner's estimate is for jemalloc (the cluster images preload it) or 1 MiB."""
    free_memory_growth_mib: int = 512
    """Hand malloc's free pages back to the OS when a worker's resident memory has grown this
    many MiB past its size after the first steps (or after the last such release): a bound on
    whatever an allocator keeps and does not reuse. Before host.memory.JEMALLOC_CONF let jemalloc reuse
    any kept extent, its kept pages grew every step in some runs (10-20 MiB a step on a
    16-layer model, to twice the live memory in 100 steps). The next step faults its pages in
    again. 0: never. The planner (`python -m raytrain_cpu.plan`) leaves this much free per rank
    in every fit."""

    def __post_init__(self) -> None:
        require(self.num_workers >= 0, "scaling.num_workers", "must be >= 0 (0 = auto).")
        require(self.min_workers >= 0, "scaling.min_workers", "must be >= 0 (0 = not elastic).")
        if self.min_workers:
            require(
                self.num_workers > 0,
                "scaling.min_workers",
                "elastic training needs scaling.num_workers, the most workers the run may have.",
            )
            require(
                self.min_workers <= self.num_workers,
                "scaling.min_workers",
                f"{self.min_workers} is above scaling.num_workers={self.num_workers}, the most workers.",
            )
        require(self.resize_check_s > 0, "scaling.resize_check_s", "must be > 0 seconds.")
        require(self.free_memory_growth_mib >= 0, "scaling.free_memory_growth_mib", "must be >= 0 (0 = never).")
        choice(self.allocator, "scaling.allocator", get_args(Allocator))
        choice(self.omp_wait_policy, "scaling.omp_wait_policy", get_args(OmpWaitPolicy))
        require(
            self.glibc_mmap_threshold >= 0, "scaling.glibc_mmap_threshold", "must be >= 0 (0 = glibc's dynamic one)."
        )
        require(self.cpus_per_worker >= 0, "scaling.cpus_per_worker", "must be >= 0 (0 = auto).")
        require(self.data_cpus >= 0, "scaling.data_cpus", "must be >= 0 (0 = auto).")
        require(self.threads_per_worker >= 0, "scaling.threads_per_worker", "must be >= 0 (0 = auto).")
        require(self.node_wait_s >= 0, "scaling.node_wait_s", "must be >= 0 (0 = don't wait).")
        for k, v in self.resources_per_worker.items():
            require(
                isinstance(v, (int, float)) and v > 0,
                f"scaling.resources_per_worker.{k}",
                "must be a positive number.",
            )


# ----------------------------------------------------------------------------- deepspeed


@dataclass
class DeepSpeedSettings:
    """DeepSpeed engine settings; a JSON file can add or override raw DeepSpeed keys."""

    zero_stage: int = 3
    """ZeRO stage: 3 shards parameters, gradients and optimizer states (and loads sharded);
    1 and 2 shard only optimizer states (and gradients)."""
    config_file: str = ""
    """Optional DeepSpeed JSON merged over the generated config (batch sizes, precision and
    optimizer are always set from this config; a ZeRO key or gradient_clipping that a
    deepspeed.* or train.* key also sets must agree with it, or be "auto")."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward (helps with real networks, not on one host)."""
    param_persistence_threshold: int = 10000
    """ZeRO-3: parameters smaller than this many elements stay whole on every rank."""
    max_live_parameters: int = 1_000_000_000
    """ZeRO-3: parameters kept gathered at once. Forward's gathers stay live for the backward up
    to this many; lower saves memory (1e8 instead of 1e9: 1.3 GiB per rank at 0.5B) but
    re-gathers in the backward (+16% step time there). `python -m raytrain_cpu.plan` shows
    both peaks."""
    shm_collectives: bool = True
    """DeepSpeed's all-gathers, reduce-scatters and all-reduces go through shared memory when
    every rank runs on one machine (raytrain_cpu.trainer.collectives): gloo sends each byte through
    the loopback TCP stack, several times slower at ZeRO-3's sizes. Ranks on several machines, or no
    room in /dev/shm, keep gloo; false always uses gloo."""
    cross_node_collectives: Literal["gloo", "striped"] = "gloo"
    """Ranks on several machines (where the shared-memory collectives do not apply): "striped"
    cuts each ZeRO-3 all-gather and reduce-scatter among all ranks into chunks on 4 extra gloo
    groups issued at once (raytrain_cpu.trainer.collectives.StripedCollectives). gloo crosses each
    node boundary on one TCP connection per direction, and clouds cap one flow below the node's
    rate (AWS: 10 of a c7i.48xlarge's 50 Gbit/s in a placement group); 4 stripes use 4 flows.
    Same bytes; all-gathers give gloo's bits, reduce-scatters' sums may round differently (gloo
    segments each chunk itself). Under a per-flow cap of a fifth of the node's rate it ran about
    4x gloo's speed, on an uncapped link about the same (benchmarks/flows.py). Costs 4 more gloo
    groups' connections and threads per rank. "gloo": torch's own collectives."""
    sub_group_size: int = 100_000_000
    """ZeRO-3: elements of this rank's partition the optimizer updates at a time (DeepSpeed's
    sub groups). One sub group's fp32 gradient exists at a time, so this bounds it: 0.49 GiB
    per rank for Llama-3-8B at 4 ranks (its largest sub group) instead of the whole fp32
    gradient's 7.5 GiB. Checkpoints hold one entry per sub group: resume with the value the
    run started with (DeepSpeed's default, 1e9, for runs made before raytrain_cpu set this);
    the manifest records it, and another value stops the run before Ray starts."""
    reuse_fp32_grad_buffer: bool = True
    """ZeRO-3: cast each sub group's gradients into one fp32 buffer kept between steps, instead
    of DeepSpeed's fresh flattened copy and fresh fp32 copy every step, whose new pages each
    cost a fault. The buffer
    is the size of the largest sub group and stays resident; the planner counts it."""
    reuse_reduce_buffer: bool = True
    """ZeRO-3: flatten each gradient bucket for its reduce-scatter into one buffer kept between
    buckets and steps, instead of DeepSpeed's new tensor per bucket (same bits; no fresh pages to
    fault in). Resident: one reduce bucket (5e7 elements)."""
    gather_whole_layers: bool = True
    """ZeRO-3: gather each decoder layer's parameters at once when the layer starts (DeepSpeed
    leaf modules), instead of each projection and norm as it runs: one hook pair and one
    all-gather per layer instead of about thirteen. ZeRO-3's per-step Python is what it saves
    (most on deep, narrow models), and LoRA, whose adapters each carry hooks otherwise, gains
    more. A gathered layer (plus the next, prefetched) is what the planner
    counts live anyway. model.compile (compile_scope 'layers') needs it: the gathers must stay
    outside the compiled layer."""
    hpz_partition_size: int = 1
    """ZeRO-3 (ZeRO++ hpZ): ranks that keep a second bf16 partition of the parameters among
    themselves, so ZeRO-3's parameter gathers stay within that group (set it to one node's
    ranks) instead of crossing the network to every rank. Each optimizer step's update makes
    the second partition stale, so a step's first forward still gathers from every rank (and
    refreshes it); the backward's re-gathers (layers beyond deepspeed.max_live_parameters) and
    every later micro batch of the step (train.grad_accum_steps) then stay in the node, as do
    all gathers of frozen weights (LoRA's base). Across nodes go the gradients' reduce-scatter
    and that first gather. Costs each rank 1/hpz of the bf16 model for the second partition
    (about 7.5 GiB per rank for an 8B model at 2 ranks a node). Groups are consecutive ranks,
    which Ray Train places node by node. 1: flat ZeRO-3; 0: the ranks of each node (Ray Train's
    local world size), which must be the same on every node. Must divide the workers."""

    def __post_init__(self) -> None:
        choice(str(self.zero_stage), "deepspeed.zero_stage", ("1", "2", "3"))
        choice(self.cross_node_collectives, "deepspeed.cross_node_collectives", ("gloo", "striped"))
        check_hpz_partition(self.hpz_partition_size, self.zero_stage)
        if self.config_file:
            require(
                Path(self.config_file).is_file(),
                "deepspeed.config_file",
                f"{self.config_file!r} does not exist; give the path of a DeepSpeed JSON file or ''.",
            )
            self.config_file = absolute(self.config_file)  # the workers read it
        require(self.param_persistence_threshold >= 0, "deepspeed.param_persistence_threshold", "must be >= 0.")
        require(
            self.max_live_parameters > 0, "deepspeed.max_live_parameters", "must be > 0 (DeepSpeed's default is 1e9)."
        )
        require(self.sub_group_size > 0, "deepspeed.sub_group_size", "must be > 0 (raytrain_cpu's default is 1e8).")
