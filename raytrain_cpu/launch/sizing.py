"""Sizing the workers from what Ray reports: the nodes they may run on, their count, CPUs and
threads, the room they leave, the memory they need, and their environment."""

from __future__ import annotations

import os
import time
from typing import Any

from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.scaling import ScalingConfig
from raytrain_cpu.config.schema import Config
from raytrain_cpu.planner.sizing import workers_that_fit


def local_ray_cpus() -> int | None:
    """CPUs a local Ray offers: the vCPUs this process may run on when a mask narrows them
    (taskset, a cpuset; Ray itself counts the machine's), and never fewer than 2: two workers
    and Ray Data's tokenizers share one vCPU rather than refuse to start. None: Ray's own count."""
    from raytrain_cpu.host.threads import affinity_cpus

    cpus = affinity_cpus()
    if cpus is None and (os.cpu_count() or 1) >= 2:
        return None
    return max(2, cpus or 1)


def worker_node_cpu(nodes: list[dict[str, Any]]):
    """CpuFeatures of the nodes the workers land on (assumed alike): this machine's when it is
    the only node with CPUs, else read on the first such node by a zero-CPU Ray task (the head
    node often is another instance type)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raytrain_cpu.host.features import cpu_features

    here = ray.get_runtime_context().get_node_id()
    if len(nodes) == 1 and nodes[0]["NodeID"] == here:
        return cpu_features()
    probe = ray.remote(num_cpus=0)(cpu_features).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[0]["NodeID"], soft=False)
    )
    try:
        return ray.get(probe.remote(), timeout=120)
    except (ray.exceptions.RayError, TimeoutError):
        return cpu_features()  # a guess from the driver's node beats failing the run


def worker_nodes(cfg: Config) -> list[dict[str, Any]]:
    """The alive nodes a training worker can run on: CPUs and scaling.resources_per_worker.

    A cluster may have none yet: an autoscaler starts worker nodes on demand (the AWS config's
    head has no CPUs and its worker types start at 0). Then the driver asks the autoscaler for
    the workers' bundles and waits until they fit, up to scaling.node_wait_s. A local Ray never
    grows: there, and without scaling.num_workers to size the request, it stops at once.
    """
    s = cfg.scaling
    bundle = {"CPU": s.cpus_per_worker or 1, **s.resources_per_worker}
    least = s.min_workers if cfg.elastic else s.num_workers  # an elastic run starts with what fits
    nodes = usable_nodes(s)
    if room_for_workers(nodes, s, least):
        return nodes
    if why := why_not_wait(s):
        raise ConfigError(
            f"scaling: no node offers {least or 1} workers {bundle} (the cluster's nodes have {offered_resources()}); "
            f"{why}. On one machine drop scaling.resources_per_worker and let the CPUs be derived."
        )
    return wait_for_nodes(s, bundle, least)


def usable_nodes(s: ScalingConfig) -> list[dict[str, Any]]:
    """The alive nodes with CPUs and every resource of scaling.resources_per_worker."""
    import ray

    return [
        n
        for n in ray.nodes()
        if n.get("Alive") and n["Resources"].get("CPU", 0) > 0
        and all(n["Resources"].get(k, 0) >= v for k, v in s.resources_per_worker.items())
    ]  # fmt: skip


def room_for_workers(nodes: list[dict[str, Any]], s: ScalingConfig, least: int) -> bool:
    """Room for every worker (the CPUs when they are given)."""
    need = dict(s.resources_per_worker) | ({"CPU": s.cpus_per_worker} if s.cpus_per_worker else {})
    if not need:
        return bool(nodes)
    return workers_that_fit(nodes, need) >= (least or len(nodes) or 1)


def offered_resources() -> list[str]:
    """The resources the cluster's nodes offer, by name."""
    import ray

    return sorted({k for n in ray.nodes() if n.get("Alive") for k in n["Resources"] if not k.startswith("node:")})


def why_not_wait(s: ScalingConfig) -> str:
    """Why the driver can't wait for an autoscaler to start nodes ('' when it can)."""
    # A Ray this process started (a local run, a notebook's, the tests') has no autoscaler; a
    # cluster joined (`ray job submit`) may have one: only the cluster knows, so it is asked.
    from raytrain_cpu.compat.ray import started_own_head

    if started_own_head():
        return "this process's own Ray has no autoscaler to start more"
    if not s.num_workers:
        return "set scaling.num_workers, so the autoscaler knows how many to start"
    if not s.node_wait_s:
        return "scaling.node_wait_s=0 does not wait for more"
    return ""


def wait_for_nodes(s: ScalingConfig, bundle: dict[str, float], least: int) -> list[dict[str, Any]]:
    """Asks the autoscaler for the workers' bundles and waits, up to scaling.node_wait_s, until they fit."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[bundle] * s.num_workers)
    print(
        f"[raytrain] waiting for nodes to hold {least} workers {bundle}: the cluster's autoscaler starts "
        f"them (up to {s.node_wait_s}s, scaling.node_wait_s)",
        flush=True,
    )
    deadline = time.monotonic() + s.node_wait_s
    try:
        while not room_for_workers(nodes := usable_nodes(s), s, least):
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"scaling: after {s.node_wait_s}s the cluster still has no room for {least} workers "
                    f"{bundle} (its nodes have {offered_resources()}). Check the autoscaler (ray status, its monitor log) and "
                    "the node types' resources, or raise scaling.node_wait_s. A run with a checkpoint can go on "
                    "with fewer workers: a lower scaling.num_workers, with train.grad_accum_steps keeping its global batch."
                )
            time.sleep(2)
    finally:
        request_resources(bundles=[])  # a request outlives the job: it would keep the nodes up for good
    print(f"[raytrain] {len(nodes)} node(s) ready for the workers", flush=True)
    return nodes


def derive_scaling(cfg: Config) -> dict[str, Any]:
    """Worker count, CPUs and threads per worker from what Ray reports (config wins when set).

    Defaults: one rank per socket of each node (2 on a single-socket machine, for the demo);
    intra-op threads = the physical cores behind a worker's Ray CPUs (Ray counts vCPUs).
    """

    from raytrain_cpu.host.threads import default_workers_per_node, threads_per_worker

    nodes = worker_nodes(cfg)
    cpus_per_node = min(n["Resources"]["CPU"] for n in nodes)
    feats = worker_node_cpu(nodes)
    s = cfg.scaling
    data_cpus = s.data_cpus or (1.0 if cpus_per_node <= 16 else 2.0)
    per_socket = default_workers_per_node(feats.sockets)
    if s.num_workers:
        workers = s.num_workers
    elif len(nodes) > 1:
        workers = len(nodes) * per_socket
    else:
        workers = max(per_socket, 2 if cpus_per_node >= 2 else 1)
    workers_per_node = max(1, -(-workers // len(nodes)))
    free = cpus_per_node - data_cpus
    if s.cpus_per_worker:
        cpus = s.cpus_per_worker
    else:
        cpus = max(0.25, free / workers_per_node)
        cpus = int(cpus) if cpus >= 1 else round(cpus, 2)
    if cpus * workers_per_node > cpus_per_node:
        raise ConfigError(
            f"scaling.cpus_per_worker: {workers_per_node} workers x {cpus} CPUs don't fit a node with "
            f"{cpus_per_node:g} CPUs; lower scaling.cpus_per_worker or scaling.num_workers."
        )
    threads = s.threads_per_worker or threads_per_worker(
        cpus, feats.threads_per_core, feats.usable_cores, workers_per_node
    )
    return {
        "num_workers": workers,
        "cpus_per_worker": cpus,
        "threads_per_worker": threads,
        "workers_per_node": workers_per_node,
        "data_cpus": data_cpus,
        "nodes": len(nodes),
        "cpus_per_node": cpus_per_node,
        "node_cpu": feats.to_dict(),
    }


def check_memory(cfg: Config, model_dir: str, sizing: dict[str, Any]) -> None:
    """The planner's training peak per rank, times the ranks on a node, against the worker
    node's memory: a run that cannot fit is killed by Ray's memory monitor after its load, and
    again on every restart. Above the node's memory it stops; above what the planner leaves a
    node (Ray's 95% kill line, less what the node runs besides) it warns."""
    from raytrain_cpu.planner import tables
    from raytrain_cpu.planner.plan import inputs_from_config, plan

    node_bytes = sizing["node_cpu"].get("memory_bytes") or 0
    try:
        # An elastic run's fewest workers (the planner's default for it) hold the largest shards.
        inputs = inputs_from_config(cfg, model_dir, 0 if cfg.elastic else sizing["num_workers"])
    except (KeyError, ValueError, TypeError, OSError):  # a config.json the planner has no shape for
        return
    per_node = inputs["ranks_per_node"] = sizing["workers_per_node"]
    peak = plan(**inputs)["memory_gib"]["peak"]
    need, node_gib = peak * per_node, node_bytes / tables.GIB
    if not node_bytes or need <= tables.usable_bytes(node_gib) / tables.GIB:
        return
    ranks = f" x {per_node} ranks a node = {need:.1f} GiB" if per_node > 1 else ""
    fixes = ", ".join(
        [*(["model.activation_checkpointing=true"] if not cfg.model.activation_checkpointing else [])]
        + ["a lower train.micro_batch_size (a higher train.grad_accum_steps keeps the batch)", "more nodes"]
        + (["lora.rank=16"] if not cfg.lora.rank else [])
    )
    estimate = f"the planner estimates a training peak of {peak:.1f} GiB per rank{ranks}"
    if need > node_gib:
        raise ConfigError(
            f"scaling: {estimate}, more than a worker node's {node_gib:.1f} GiB: Ray would kill the workers once "
            f"the model is loaded, and again on each restart. Try {fixes}; `python -m raytrain_cpu.plan` compares "
            "them. scaling.check_memory=false starts it anyway."
        )
    print(
        f"[raytrain] memory is tight: {estimate} of a worker node's {node_gib:.1f} GiB, above the "
        f"{tables.NODE_USABLE_FRACTION:.0%} less {tables.NODE_RESERVE_BYTES / tables.GIB:.0f} GiB the planner leaves a node. "
        f"If Ray's memory monitor kills a worker: {fixes}.",
        flush=True,
    )


def worker_env(cfg: Config, workers_per_node: int) -> dict[str, str]:
    """Env vars the training workers must have at process start (set by Ray's runtime env).

    The allocator has to be preloaded (and glibc's tunables set) before the process starts.
    OMP_PROC_BIND is turned off when ranks share a node: libgomp binds at import time to the
    node's first cores, the same ones for every rank (the cluster images set it for one rank
    per node); placement then comes from scaling.pin_cores instead. scaling.omp_wait_policy
    too is read once, when OpenMP starts.
    """
    from raytrain_cpu.host.memory import preload_env

    env = preload_env(cfg.scaling.allocator, cfg.scaling.glibc_mmap_threshold, cfg.scaling.jemalloc_conf)
    if workers_per_node > 1:
        env["OMP_PROC_BIND"] = "false"
    if cfg.scaling.omp_wait_policy != "default":
        env["OMP_WAIT_POLICY"] = cfg.scaling.omp_wait_policy
    return env
