"""`python -m raytrain_cpu.main [--config FILE] [key=value ...]`: the whole job, from the driver.

validate (before Ray) -> already finished? -> fetch hub files -> hold the run directory ->
ray.init -> size the workers -> prepare data -> write the model -> TorchTrainer(gloo) -> summary.
Re-running the same command with the same run.name resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import importlib.util
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from raytrain_cpu.config.checks import ConfigError, is_url
from raytrain_cpu.config.help import options_help
from raytrain_cpu.config.schema import Config, load_config
from raytrain_cpu.model.hub import download_model, is_hub_id
from raytrain_cpu.obs.console import (
    failure_reason,
    hide_core_log_lines,
    quiet_ray_console,
    quiet_ray_loggers,
    ray_log_file,
    restart_notice,
)
from raytrain_cpu.planner.sizing import workers_that_fit

# ----------------------------------------------------------------------------- validation


def check_storage(path: Path, key: str = "run.storage_path") -> None:
    """Fails if the directory `path` (set by config key `key`) can't be created and written;
    leaves nothing behind."""
    from raytrain_cpu.checkpoint.files import cannot_write, existing_folder

    probe_dir = existing_folder(path)
    if probe_dir == Path(path.anchor) and probe_dir != path:
        # A missing top-level directory is a mount that isn't there (/fsx on a node without
        # FSx): creating it would put the run on this node's root disk, where no other node sees it.
        raise ConfigError(
            f"{key}: {Path(path.anchor, path.parts[1])} does not exist. On a cluster it is the shared storage's "
            "mount point: mount it on every node (cluster/README.md); on one machine choose a directory such as "
            "./runs (top-level directories are never created)."
        )
    if not probe_dir.is_dir():
        raise ConfigError(
            f"{key}: {probe_dir} is a file, so {path} can't be created. Choose a directory path for {key}."
        )
    if why := cannot_write(probe_dir):
        raise ConfigError(
            f"{key}: cannot write under {probe_dir} ({why}). "
            f"Point {key} at a writable directory (on a cluster: the shared /fsx mount)."
        )


CHECKPOINT_BYTES_PER_PARAM = 12  # a ZeRO checkpoint: fp32 master weights and Adam's two moments


def check_checkpoint_room(cfg: Config, model_dir: str) -> None:
    """The run's storage must hold its checkpoints: with too little room the first save fails
    after all the steps before it. Stops when not even one fits; warns below run.num_to_keep + 1
    (the one being written beside those kept). LoRA checkpoints hold the adapters only: small."""
    if cfg.lora.rank:
        return
    if cfg.model.is_tiny:  # not written yet: counted from its shape
        from raytrain_cpu.planner.plan import inputs_from_config

        n_params = inputs_from_config(cfg)["model_shape"].num_params
    else:
        from raytrain_cpu.model.loading import count_parameters

        n_params = count_parameters(model_dir)["total"]
    from raytrain_cpu.checkpoint.layout import STAGING

    one = CHECKPOINT_BYTES_PER_PARAM * n_params
    # A save that failed (the storage full) leaves its staged files, which the next save removes
    # before it writes: room it has.
    staged = sum(f.stat().st_size for f in (cfg.run.run_dir / STAGING).rglob("*") if f.is_file())
    free = shutil.disk_usage(cfg.run.run_dir).free + staged
    kept = cfg.run.num_to_keep + bool(cfg.run.best_metric)  # ranked: the newest may be kept beside the best
    which = f"{kept} (the best and the newest)" if cfg.run.best_metric else "that many"
    needed = one * (kept + 1)
    what = (
        f"a checkpoint of this model takes about {_size(one)} ({n_params:,} parameters x "
        f"{CHECKPOINT_BYTES_PER_PARAM} bytes: fp32 master weights and Adam's two moments)"
    )
    if free < one:
        raise ConfigError(
            f"run.storage_path: {cfg.run.run_dir} has {_size(free)} free, and {what}: the next save would fail. "
            "Free space there, or choose a storage path with room."
        )
    if free < needed:
        print(
            f"[raytrain] storage: {_size(free)} free in {cfg.run.run_dir}, and {what}; run.num_to_keep="
            f"{cfg.run.num_to_keep} keeps {which} beside the one being written: {_size(needed)}. Free space, or "
            "lower run.num_to_keep.",
            flush=True,
        )


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_installed(cfg: Config) -> None:
    """What a setting asks for explicitly must be installed, else the workers quietly run without it."""
    from raytrain_cpu.host.features import cpp_compiler, cpp_compiler_name
    from raytrain_cpu.host.memory import find_allocator

    allocator = cfg.scaling.allocator
    if allocator in ("jemalloc", "tcmalloc") and find_allocator(allocator)[0] == "system":
        raise ConfigError(
            f"scaling.allocator: {allocator} is not installed here (apt-get install "
            f"{'libtcmalloc-minimal4' if allocator == 'tcmalloc' else 'libjemalloc2'}); the workers would "
            "run on glibc's malloc. Install it, or use auto (jemalloc, else tcmalloc, else glibc) or system."
        )
    if cfg.model.compile is True and not cpp_compiler():
        raise ConfigError(
            "model.compile: true, and inductor builds C++ on every worker, but this machine has no C++ compiler "
            f"({cpp_compiler_name()} is not on PATH): install one (apt-get install g++; the cluster "
            "images have it), or set model.compile=false (or auto, which compiles only where one is found)."
        )
    if cfg.metrics.mlflow_tracking_uri and importlib.util.find_spec("mlflow") is None:
        raise ConfigError(
            "metrics.mlflow_tracking_uri: set, but mlflow is not installed: pip install -e '.[mlflow]' (on a cluster, "
            "in the nodes' image too), or leave it out."
        )


def check_not_in_job_copy(cfg: Config) -> None:
    """Under `ray job submit --working-dir`, the driver runs in Ray's unpacked copy of that
    directory (<session>/runtime_resources/working_dir_files/...), which Ray deletes: a relative
    storage path would put the run's checkpoints there, to be lost with it."""
    cwd = Path.cwd()
    if "working_dir_files" not in cwd.parts:
        return
    for key, where in (("run.storage_path", cfg.run.storage_path), ("data.cache_dir", cfg.data.cache_dir)):
        if where and not Path(where).expanduser().is_absolute():
            raise ConfigError(
                f"{key}: {where!r} is relative, and this job runs in Ray's copy of its --working-dir ({cwd}), "
                f"which Ray deletes: what the run writes there would go with it. Give {key} an absolute path on "
                "storage every node shares (e.g. /fsx/runs; on one machine $PWD/runs)."
            )


def validate_before_ray(cfg: Config) -> None:
    from raytrain_cpu.data.prepare import cache_root
    from raytrain_cpu.data.sources import DataError, check_sources
    from raytrain_cpu.model.loading import check_causal_lm, check_context_length, check_model_path

    if not cfg.model.is_tiny:
        check_model_path(cfg.model.name_or_path)
        local = Path(cfg.model.name_or_path).expanduser()
        if local.is_dir():  # a hub id is checked once downloaded
            check_causal_lm(str(local))
            check_context_length(str(local), cfg.data.seq_len)
    if cfg.model.tokenizer not in ("bundled", ""):
        p = Path(cfg.model.tokenizer).expanduser()
        if cfg.model.tokenizer.startswith((".", "/", "~")) and not p.is_dir():
            raise ConfigError(
                f"model.tokenizer: {cfg.model.tokenizer!r} does not exist; use 'bundled', '' or a tokenizer directory."
            )
    check_installed(cfg)
    check_not_in_job_copy(cfg)
    check_storage(cfg.run.run_dir)
    if cfg.data.cache_dir:  # else it lies under run.storage_path, just checked
        check_storage(cache_root(cfg), "data.cache_dir")
    if cfg.model.compile_cache_dir:  # made absolute when the config loaded
        check_storage(Path(cfg.model.compile_cache_dir), "model.compile_cache_dir")
    try:
        check_sources(cfg.data)  # a hub dataset's file list: the hub answers before Ray starts
    except DataError as e:
        raise ConfigError(str(e)) from None
    check_resume(cfg)
    check_ranking(cfg)


def check_resume(cfg: Config, world: int | None = None, damaged: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A run.name that already has a checkpoint resumes from it: its model/data settings and
    global batch must match, else the workers would fail on it after start-up. The worker count
    may change (`world`, else an explicit scaling.num_workers; auto keeps the checkpoint's,
    resume_world) when micro batch x accumulation keep the global batch. Returns that checkpoint
    (newest_checkpoint), None for a new run. Reads only files (Ray's checkpoint snapshot, the
    manifest, config.yaml), so it runs before Ray."""
    from raytrain_cpu.checkpoint.identity import batch_conflict, resume_conflict

    latest = newest_checkpoint(cfg.run.run_dir, damaged)
    if latest is None:
        return None
    conflict = resume_conflict(latest, latest["path"], cfg.to_dict())
    if conflict:
        raise ConfigError(f"run.name: {conflict}")
    world = world or cfg.scaling.num_workers or latest["world_size"]
    conflict = batch_conflict(latest, latest["path"], cfg.to_dict(), world)
    if conflict:
        key = "scaling.num_workers" if world != latest["world_size"] else "train.micro_batch_size"
        raise ConfigError(f"{key}: {conflict}")
    return latest


def check_model_unchanged(cfg: Config, model_dir: str, latest: dict[str, Any] | None) -> dict[str, Any] | None:
    """The model the run starts from (checkpoint.model_identity: a hub model's commit, the
    directory's fingerprint), which each manifest records; a resumed run's must be the one its
    checkpoint recorded, else a ConfigError names what changed. None for the tiny model, built
    from model.tiny (which the config hash covers) on every start."""
    from raytrain_cpu.checkpoint.identity import model_conflict, model_identity
    from raytrain_cpu.model.hub import snapshot_revision

    if cfg.model.is_tiny:
        return None
    name = cfg.model.name_or_path
    identity = model_identity(name, model_dir, snapshot_revision(model_dir) if is_hub_id(name) else None)
    if latest and (conflict := model_conflict(latest, latest["path"], model_dir, identity)):
        raise ConfigError(conflict)
    return identity


def check_ranking(cfg: Config) -> None:
    """Under run.best_metric Ray Train ranks the run's checkpoints by the score each was reported
    with: one scored by another metric, or by none (Ray Train puts those first), would keep its
    place over better ones, and a better one (the best, which export --best reads) could be the
    one deleted. So a resume may rank only by the metric its checkpoints were scored with."""
    from raytrain_cpu.checkpoint.record import rank_unscored_last, scored_metrics

    if not cfg.run.best_metric:
        return  # Ray Train keeps the newest: no score read
    if unscored := rank_unscored_last(cfg.run.run_dir):
        print(
            f"[raytrain] {', '.join(unscored)}: saved at a step without an evaluation, so with no score in Ray "
            "Train's record; ranked last now",
            flush=True,
        )
    others = {name: m for name, m in scored_metrics(cfg.run.run_dir).items() if m != cfg.watched_metric}
    if not others:
        return
    scored_by = sorted({m for m in others.values() if m})
    how = " and ".join(
        ([f"scored by {', '.join(scored_by)}"] if scored_by else [])
        + (["saved without a score (before checkpoints carried one)"] if None in others.values() else [])
    )
    fixes = (
        [f"set run.best_metric={scored_by[0]} (theirs)"] if len(scored_by) == 1 and None not in others.values() else []
    )
    fixes += [
        "leave run.best_metric out (the newest are kept)",
        "export this run and rank in a new one (another run.name)",
    ]
    fix = "; or ".join(fixes)
    raise ConfigError(
        f"run.best_metric: run {cfg.run.name!r}'s checkpoints {', '.join(sorted(others))} were {how}, not by "
        f"{cfg.watched_metric}: ranked against it, Ray Train would keep them over better ones and could delete the "
        f"best. {fix[0].upper()}{fix[1:]}."
    )


def verify_resume(cfg: Config, latest: dict[str, Any] | None, world: int) -> dict[str, Any] | None:
    """The checkpoint the run resumes from, every shard hashed before the driver plans the data
    stream from its step (the workers could not go back to an older one in this driver run): in
    parallel Ray tasks (hash_checkpoint), or by the conversion a resume on another worker count
    needs (convert_checkpoint). A damaged one is stepped past as newest_checkpoint does (renamed,
    one line, dropped from Ray Train's record) and the next one verified. None for a new run."""
    from raytrain_cpu.checkpoint.layout import DamagedCheckpoint

    damaged: dict[str, DamagedCheckpoint] = {}
    while latest:
        try:
            if latest["world_size"] != world and not cfg.elastic:  # elastic: the workers convert it
                convert_checkpoint(latest, world)
            else:
                hash_checkpoint(latest)
            return latest
        except DamagedCheckpoint as e:
            damaged[Path(latest["path"]).name] = e
            latest = check_resume(cfg, world, damaged)
    return latest


# Checkpoints up to this size are hashed in the driver itself: a Ray task's process start-up
# costs more than reading them, while an 8B model's shards want the nodes' parallel reads.
HASH_IN_DRIVER_BYTES = 1 << 30


def hash_checkpoint(latest: dict[str, Any]) -> None:
    """Every saved rank's files hashed against the manifest, one Ray task each (on a cluster,
    spread over the nodes, which read the shared storage in parallel) or, for a small checkpoint,
    here; raises DamagedCheckpoint."""
    import ray

    from raytrain_cpu.checkpoint.verify import read_manifest, shard_bytes, verify_checkpoint

    if shard_bytes(read_manifest(latest["path"])) <= HASH_IN_DRIVER_BYTES:
        verify_checkpoint(latest["path"], hash_ranks=True)
        return
    check = ray.remote(num_cpus=1, max_retries=0)(verify_checkpoint)
    tasks = [check.remote(latest["path"], hash_ranks=[r]) for r in range(latest["world_size"])]
    try:
        ray.get(tasks)
    except ray.exceptions.RayTaskError as e:
        raise e.cause from None


def convert_checkpoint(latest: dict[str, Any], world: int) -> None:
    """to_universal as a Ray task with one CPU: on a cluster that is a worker node, which has the
    memory for a shard and the shared storage, while the head may have neither to spare."""
    import ray

    from raytrain_cpu.checkpoint.layout import CheckpointError, DamagedCheckpoint, universal_ready, workers
    from raytrain_cpu.checkpoint.universal import to_universal

    saved = f"{Path(latest['path']).name} holds ZeRO shards for {workers(latest['world_size'])}; this run has {world}"
    if universal_ready(latest["path"]):
        print(f"[raytrain] {saved}: it resumes from the universal form an earlier run made", flush=True)
        return
    print(f"[raytrain] {saved}: converting it to DeepSpeed's universal checkpoint format (once)", flush=True)
    try:
        done = ray.get(ray.remote(num_cpus=1, max_retries=0)(to_universal).remote(latest["path"]))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DamagedCheckpoint):  # rescale_checkpoint steps back past it
            raise e.cause from None
        if isinstance(e.cause, CheckpointError):  # a full filesystem: named, nothing lost
            raise ConfigError(f"run.name: {e.cause}") from None
        raise
    print(f"[raytrain] universal checkpoint: {done}", flush=True)


def finished_run(cfg: Config) -> dict[str, Any] | None:
    """The summary of a run whose latest checkpoint already reached train.max_steps (or where
    train.early_stop_patience stopped it), else None.

    Re-running a finished job (the same command, a resubmitted `ray job submit`) then succeeds
    without starting Ray and leaves the run as it was: training on would rewrite config.yaml
    and summary.json with an attempt that trains no step.
    """
    from raytrain_cpu.trainer.evaluation import EvalWatch

    latest = newest_checkpoint(cfg.run.run_dir)
    if latest is None:
        return None
    if latest["step"] >= cfg.train.max_steps:
        length = "train.epochs" if cfg.train.epochs else "train.max_steps"
        steps = (
            f"={cfg.train.epochs:g} ({cfg.train.max_steps} steps)" if cfg.train.epochs else f"={cfg.train.max_steps}"
        )
        why = f"{length}{steps}: nothing to train. Raise {length} to train on"
    elif EvalWatch.for_run(cfg, latest).stop_reason:  # its evaluations used up train.early_stop_patience
        why = (
            f"where it stopped early (train.early_stop_patience={cfg.train.early_stop_patience}): nothing to train. "
            "Raise train.early_stop_patience (or set it to 0) to train on"
        )
    else:
        return None
    export = f"{cfg.run.run_dir} <dir> --best" if cfg.run.best_metric else f"{latest['path']} <dir>"
    print(
        f"[raytrain] run {cfg.run.name!r} is already at step {latest['step']} ({latest['path']}), {why}, or "
        f"export it: python -m raytrain_cpu.export {export}",
        flush=True,
    )
    summary_file = cfg.run.run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    if summary.get("steps") != latest["step"]:  # no summary of that step (a run stopped after its checkpoint)
        summary = {"steps": latest["step"], "world_size": latest["world_size"], "run_dir": str(cfg.run.run_dir)}
    return {**summary, "checkpoint_path": latest["path"]}


def check_lora_before_ray(cfg: Config, model_dir: str | None = None) -> dict[str, int] | None:
    """LoRA targets that match nothing, or layers peft can't wrap, fail here (a meta-device model:
    no weights, no memory), not minutes later on every worker. A hub model is checked once run()
    has fetched it (`model_dir`), still before Ray starts."""
    if not cfg.lora.enabled:
        return None
    from raytrain_cpu.model.lora import check_lora

    local = Path(model_dir or cfg.model.name_or_path).expanduser()
    if cfg.model.is_tiny:
        from raytrain_cpu.model.loading import tiny_llama_config

        model_config = tiny_llama_config(cfg, vocab_size=2048, eos_token_id=0)
    elif local.is_dir():
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(str(local))
    else:
        return None
    return check_lora(model_config, cfg.lora, cfg.model.name_or_path)


# ----------------------------------------------------------------------------- scaling


def local_ray_cpus() -> int | None:
    """CPUs a local Ray offers: the vCPUs this process may run on when a mask narrows them
    (taskset, a cpuset; Ray itself counts the machine's), and never fewer than 2. Ray Data
    needs a whole CPU beside the workers' reservations (see derive_scaling); on one vCPU the
    workers and Ray Data then share it. None: Ray's own count."""
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


def check_data_cpus(cluster_cpus: float, workers: int, cpus_per_worker: float) -> None:
    """Below one CPU left beside the workers Ray Data never schedules its reads, and the
    workers wait for their first batch forever (seen with 1 CPU and 1 or 2 workers)."""
    left = cluster_cpus - workers * cpus_per_worker
    if left < 1:
        raise ConfigError(
            f"scaling: {workers} workers x {cpus_per_worker:g} CPUs leave {left:g} of the cluster's "
            f"{cluster_cpus:g} CPUs to Ray Data, which needs at least 1 to feed them; lower "
            "scaling.num_workers or scaling.cpus_per_worker, or give Ray more CPUs."
        )


def worker_nodes(cfg: Config) -> list[dict[str, Any]]:
    """The alive nodes a training worker can run on: CPUs and scaling.resources_per_worker.

    A cluster may have none yet: an autoscaler starts worker nodes on demand (the AWS config's
    head has no CPUs and its worker types start at 0). Then the driver asks the autoscaler for
    the workers' bundles and waits until they fit, up to scaling.node_wait_s. A local Ray never
    grows: there, and without scaling.num_workers to size the request, it stops at once.
    """
    import ray
    from ray.autoscaler.sdk import request_resources

    s = cfg.scaling
    bundle = {"CPU": s.cpus_per_worker or 1, **s.resources_per_worker}
    least = s.min_workers if cfg.elastic else s.num_workers  # an elastic run starts with what fits

    def usable() -> list[dict[str, Any]]:
        return [
            n
            for n in ray.nodes()
            if n.get("Alive") and n["Resources"].get("CPU", 0) > 0
            and all(n["Resources"].get(k, 0) >= v for k, v in s.resources_per_worker.items())
        ]  # fmt: skip

    def fits(nodes: list[dict[str, Any]]) -> bool:  # room for every worker (the CPUs when they are given)
        need = dict(s.resources_per_worker) | ({"CPU": s.cpus_per_worker} if s.cpus_per_worker else {})
        if not need:
            return bool(nodes)
        return workers_that_fit(nodes, need) >= (least or len(nodes) or 1)

    nodes = usable()
    if fits(nodes):
        return nodes

    def have() -> list[str]:  # the resources the cluster's nodes offer, by name
        return sorted({k for n in ray.nodes() if n.get("Alive") for k in n["Resources"] if not k.startswith("node:")})

    # A Ray this process started (a local run, a notebook's, the tests') has no autoscaler; a
    # cluster joined (`ray job submit`) may have one: only the cluster knows, so it is asked.
    from raytrain_cpu.compat.ray import started_own_head

    if started_own_head():
        why = "this process's own Ray has no autoscaler to start more"
    elif not s.num_workers:
        why = "set scaling.num_workers, so the autoscaler knows how many to start"
    elif not s.node_wait_s:
        why = "scaling.node_wait_s=0 does not wait for more"
    else:
        why = ""
    if why:
        raise ConfigError(
            f"scaling: no node offers {least or 1} workers {bundle} (the cluster's nodes have {have()}); "
            f"{why}. On one machine drop scaling.resources_per_worker and let the CPUs be derived."
        )
    request_resources(bundles=[bundle] * s.num_workers)
    print(
        f"[raytrain] waiting for nodes to hold {least} workers {bundle}: the cluster's autoscaler starts "
        f"them (up to {s.node_wait_s}s, scaling.node_wait_s)",
        flush=True,
    )
    deadline = time.monotonic() + s.node_wait_s
    try:
        while not fits(nodes := usable()):
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"scaling: after {s.node_wait_s}s the cluster still has no room for {least} workers "
                    f"{bundle} (its nodes have {have()}). Check the autoscaler (ray status, its monitor log) and "
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
    import ray

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
    check_data_cpus(sum(n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")), workers, cpus)
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
    per node); placement then comes from scaling.pin_cores instead.
    """
    from raytrain_cpu.host.memory import preload_env

    env = preload_env(cfg.scaling.allocator, cfg.scaling.glibc_mmap_threshold, cfg.scaling.jemalloc_conf)
    if workers_per_node > 1:
        env["OMP_PROC_BIND"] = "false"
    return env


# ----------------------------------------------------------------------------- checkpoints on disk


def newest_checkpoint(run_dir: Path, damaged: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The manifest (+ "path") of the checkpoint the run resumes from: the newest in Ray Train's
    record that verifies (checkpoint.newest_verified: a damaged one is renamed, named in one line
    and dropped from the record, so Ray Train hands the workers this one; `damaged` adds those
    other checks found so).

    Only Ray's snapshot counts: a checkpoint directory it does not list was never reported (a
    crash between writing and reporting) and is not resumed from. When none of its checkpoints
    verifies, or the snapshot is missing beside finished checkpoints, this fails loudly instead
    of starting over.
    """
    from raytrain_cpu.checkpoint.damaged import newest_verified
    from raytrain_cpu.checkpoint.layout import DAMAGED, MANIFEST, CheckpointError
    from raytrain_cpu.checkpoint.record import latest_reported
    from raytrain_cpu.compat.ray import SNAPSHOT

    try:
        path = latest_reported(run_dir)
        if path is None:
            # Without Ray's record Ray Train starts the run over and overwrites what is there: a
            # run copied without that file once lost its checkpoints so, silently.
            found = sorted(
                p.name for p in Path(run_dir).glob("checkpoint_*") if (p / MANIFEST).is_file() and DAMAGED not in p.name
            )
            if found:
                raise ConfigError(
                    f"run.name: {run_dir} holds {', '.join(found)} but not Ray Train's record of them ({SNAPSHOT}), "
                    f"so Ray Train would start run {run_dir.name!r} over and overwrite them. Restore that file (copy "
                    "the whole run directory), or start a new run.name from the newest as a model (python -m "
                    f"raytrain_cpu.export {Path(run_dir) / found[-1]} OUT, then model.name_or_path=OUT). Only a run "
                    f"that stopped while saving its first checkpoint has none recorded: remove {found[-1]} to start over."
                )
            return None
        return newest_verified(run_dir, lambda line: print(line, flush=True), damaged)
    except CheckpointError as e:
        raise ConfigError(f"run.name: {e}.") from None


def resume_world(cfg: Config) -> Config:
    """scaling.num_workers=0 (auto) on a run that has a checkpoint takes the checkpoint's worker
    count: its ZeRO shards are laid out for it, and a cluster's node count (which auto follows)
    may have changed since the run started: an autoscaler still starting nodes, a lost one."""
    latest = None if cfg.scaling.num_workers else newest_checkpoint(cfg.run.run_dir)
    if latest is None:
        return cfg
    return dataclasses.replace(cfg, scaling=dataclasses.replace(cfg.scaling, num_workers=latest["world_size"]))


# ----------------------------------------------------------------------------- console (raytrain_cpu.obs.console)

# ----------------------------------------------------------------------------- run


def quiet_worker_logs() -> None:
    """Runs at the start of every Ray worker process of a local run (worker_process_setup_hook).

    A local run starts Ray without the dashboard (a process that 2 cores cannot spare), and
    Ray Train's placement-group cleaner, which asks the dashboard's state API every second
    whether the controller is still alive, then logs a warning each time: ~100 lines a run.
    Its job (freeing the placement group when the controller dies) ends with the local Ray
    anyway, so only its warnings are dropped. It asks the cluster named by RAY_ADDRESS, else the
    one it finds on the machine, and stops with a traceback where it finds several.
    """
    import ray

    from raytrain_cpu.compat.ray import PLACEMENT_GROUP_CLEANER_LOGGER

    logging.getLogger(PLACEMENT_GROUP_CLEANER_LOGGER).setLevel(logging.ERROR)
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)


def build_datasets(
    meta: dict, sources: list[tuple[str, Path, dict]], cfg: Config, worlds: list[int], start: int
) -> dict[str, Any]:
    """Each rank's stream for each worker count the run may have (one, unless elastic), named
    train_w{W}_rank{r} / eval_w{W}_rank{r} (a mixture: one eval stream per source, ..._{name}):
    all lazy, a worker iterates only its own. `sources`: data.mixture_sources of the cache's meta."""
    from ray.data import DataContext

    from raytrain_cpu.data import throttle as datathrottle
    from raytrain_cpu.data.prepare import documents_eos
    from raytrain_cpu.data.stream import StreamPlan, eval_dataset, eval_stream, train_stream

    # These streams' scheduling loops run inside the training workers: keep them from spinning.
    datathrottle.install(DataContext.get_current())
    eos = documents_eos(cfg)  # data.attention_span=document: the blocks carry each token's place in its document

    end = cfg.train.max_steps * cfg.train.derive_global_batch(worlds[-1])
    eval_blocks = cfg.train.eval_batches * cfg.train.micro_batch_size  # 0: the whole split
    # Chat/instruction blocks carry labels (-100 where no loss); a mixture's text blocks then too.
    labelled = tuple(source_meta.get("data_format", "text") != "text" for _, _, source_meta in sources)
    out = {}
    for w, r in [(world, rank) for world in worlds for rank in range(world)]:
        plan = StreamPlan(
            tuple(str(source_cache / "train") for _, source_cache, _ in sources),
            tuple(source_meta["blocks"] for _, _, source_meta in sources),
            cfg.train.seed,
            cfg.data.shuffle_window,
            cfg.train.micro_batch_size,
            w,
            r,
            start,
            end,
            pattern=tuple(meta.get("pattern", (0,))),
            source_labels=labelled,
            documents_eos=eos,
        )
        out[f"train_w{w}_rank{r}"] = train_stream(plan)
        for (name, source_cache, source_meta), has_labels in zip(sources, labelled):
            n_eval = source_meta["eval_blocks"]
            if n_eval >= w:
                out[eval_dataset(w, r, name)] = eval_stream(source_cache, w, r, n_eval, eval_blocks, has_labels, eos)
    return out


def no_evaluation(meta: dict[str, Any], world: int, source: str = "") -> str:
    """Why a run with these packed blocks (a cache's meta.json) evaluates nothing (of mixture
    source `source`), and the fix."""
    held_out = meta["eval_source"]
    fix = (
        f"{held_out.capitalize()} of {meta['documents']}; raise data.eval_fraction or set "
        f"{'an eval_path in its data.mix entry' if source else 'data.eval_path'}"
        if isinstance(held_out, str)  # held out from the training text
        else "Give more evaluation text or lower data.seq_len"
    )
    return (
        f"no evaluation{f' of {source}' if source else ''}: the eval data makes {meta['eval_blocks']} blocks of "
        f"{meta['seq_len']} tokens, fewer than one per worker ({world}). {fix}."
    )


def steps_of_epochs(cfg: Config, meta: dict[str, Any], global_batch: int) -> Config:
    """The config with train.max_steps derived from train.epochs, now that the blocks are counted
    (unchanged without train.epochs). Workers, config.yaml and the checkpoints see the steps."""
    t = cfg.train
    if not t.epochs:
        return cfg
    steps = t.epoch_steps(meta["blocks"], global_batch)
    print(
        f"[raytrain] train.epochs={t.epochs:g}: {meta['blocks']:,} training blocks, {global_batch} a step: "
        f"{steps} steps",
        flush=True,
    )
    if t.profile_step > steps:
        raise ConfigError(
            f"train.profile_step: {t.profile_step} is past the {steps} steps of train.epochs={t.epochs:g}; "
            f"pick a step in 1..{steps}, or 0 for none."
        )
    return dataclasses.replace(cfg, train=dataclasses.replace(t, max_steps=steps))


def note_epochs(meta: dict[str, Any], needed: int) -> None:
    """Says when the run reads its data (a mixture: a source) more than once."""
    if "sources" not in meta:
        if needed > meta["blocks"]:
            print(
                f"[raytrain] {needed} blocks needed, {meta['blocks']} in the data: {needed / meta['blocks']:.1f} epochs",
                flush=True,
            )
        return
    epochs = [f"{s['name']} {needed * s['share'] / s['blocks']:.2f}" for s in meta["sources"] if s["share"]]
    print(f"[raytrain] {needed} blocks needed; epochs of each source: {', '.join(epochs)}", flush=True)


def run(cfg: Config) -> dict[str, Any]:
    """Runs (or resumes) the job; returns the summary written to summary.json.

    A Ray it starts prints raytrain's lines only, unless run.verbose (see "console" above); a
    Ray the caller started keeps the caller's console.
    """
    done = None if cfg.train.epochs else finished_run(cfg)  # train.epochs: the steps are known once packed
    if done is not None:
        return done
    t0 = time.perf_counter()
    model_dir = fetch_from_hub(cfg)
    check_tokenizer_fits(cfg, model_dir)
    with hold_run_dir(cfg.run.run_dir), sigterm_kept():
        return run_on_ray(cfg, model_dir, t0)


def fetch_from_hub(cfg: Config) -> str:
    """What comes from the hub, before Ray starts: a hub this machine can't reach (or a token
    that may not read the model) stops the job before anything else runs. Returns the model's
    local directory ('tiny' for the tiny model, written later)."""
    from raytrain_cpu.checkpoint.identity import pinned_revision
    from raytrain_cpu.data.prepare import materialize_tokenizer
    from raytrain_cpu.model.loading import check_causal_lm, check_context_length
    from raytrain_cpu.model.tokenizer import resolve_tokenizer_path

    model_dir = cfg.model.name_or_path
    if is_hub_id(model_dir):
        # A resumed run, and every restart in it, loads the commit its start resolved, not the newest.
        latest = newest_checkpoint(cfg.run.run_dir)
        revision = pinned_revision(latest, model_dir)
        at = f" at commit {revision} (that {Path(latest['path']).name} trained from)" if revision else ""
        print(
            f"[raytrain] fetching {model_dir}{at} from the hub into {cfg.run.hub_cache} (kept for later runs)",
            flush=True,
        )
        model_dir = download_model(model_dir, cfg.run.hub_cache, revision)
        # What validate_before_ray checks of a local model, now that this one is local too.
        check_causal_lm(model_dir)
        check_context_length(model_dir, cfg.data.seq_len)
        check_lora_before_ray(cfg, model_dir)
    tokenizer = resolve_tokenizer_path(cfg.model.tokenizer, cfg.model.name_or_path)
    if is_hub_id(tokenizer):  # saved once under the data cache, where prepare and the workers read it
        materialize_tokenizer(tokenizer, cfg)
    return model_dir


def check_tokenizer_fits(cfg: Config, model_dir: str) -> None:
    """The tokenizer must load, and its ids must fit a given model's embedding (the tiny model is
    built for its tokenizer)."""
    from raytrain_cpu.data.prepare import materialize_tokenizer
    from raytrain_cpu.data.sources import DataError
    from raytrain_cpu.model.loading import check_vocab
    from raytrain_cpu.model.tokenizer import resolve_tokenizer_path

    tokenizer = resolve_tokenizer_path(cfg.model.tokenizer, model_dir)
    fix = "Set model.tokenizer to a tokenizer directory or hub id, or 'bundled'."
    files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if Path(tokenizer).is_dir() and not any((Path(tokenizer) / f).is_file() for f in files):
        raise ConfigError(f"model.tokenizer: {tokenizer} holds no tokenizer ({', '.join(files)}). {fix}")
    try:
        tokenizer_json, _ = materialize_tokenizer(tokenizer, cfg)
    except DataError as e:
        raise ConfigError(str(e)) from None
    except (OSError, ValueError) as e:  # files transformers cannot make a fast tokenizer of
        raise ConfigError(f"model.tokenizer: {tokenizer}: {str(e).strip().splitlines()[0]} {fix}") from None
    if not cfg.model.is_tiny:
        check_vocab(model_dir, tokenizer_json, cfg.model.tokenizer)


RUN_LOCK = ".raytrain.lock"  # in the run directory: "pid N on HOST, since T" of the job that holds it


@contextlib.contextmanager
def hold_run_dir(run_dir: Path) -> Iterator[None]:
    """Holds the run directory for this job: a second job with the same run.name and storage
    while this one runs (a job submitted again by mistake) stops with a ConfigError instead of
    writing its checkpoints into the same directory. An flock, which the kernel drops when the
    process ends, so a killed driver leaves nothing to clean up; on storage without flock (a
    Lustre mount without the flock option) nothing is held. A run directory it made and the job
    left empty (it stopped before writing anything) goes again."""
    made = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # innermost first
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise ConfigError(
                f"run.name: run {run_dir.name!r} is running already ({holder}). Wait for it to end or stop it, "
                "or choose another run.name."
            ) from None
        except OSError:
            pass  # this filesystem has no flock
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}".encode(), 0)
        yield
    finally:
        os.close(fd)  # and with it the lock
        if made and [p.name for p in run_dir.iterdir()] == [RUN_LOCK]:
            (run_dir / RUN_LOCK).unlink()
            with contextlib.suppress(OSError):  # a directory something else wrote into stays
                for d in made:
                    d.rmdir()


def ray_train_env(cfg: Config) -> dict[str, str]:
    """The Ray Train settings that only environment variables carry."""
    env = {
        # A dead or hung peer ends the attempt within run.gloo_timeout_s wherever the others wait
        # for it: in a gloo collective (the TorchConfig), in Ray Train's own barriers (report,
        # preemption checks) or in the controller's health check of a worker that stopped answering.
        "RAY_TRAIN_COLLECTIVE_TIMEOUT_S": str(cfg.run.gloo_timeout_s),
        "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": str(cfg.run.gloo_timeout_s),
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(cfg.run.poll_interval_s),
    }
    if cfg.elastic:
        # After a node loss Ray Train's view of the cluster lags up to 20 s (Ray Data's
        # AutoscalingCoordinator refreshes it), so its first restart may still ask for the lost
        # node's worker: it waits this long for it before taking the size that fits (Ray: 60 s).
        env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "30")
    return env


def run_on_ray(cfg: Config, model_dir: str, t0: float) -> dict[str, Any]:
    """The job once its files are here: Ray, the data, the model, the TorchTrainer, the summary."""
    from raytrain_cpu.data.prepare import prepare
    from raytrain_cpu.data.stream import mixture_sources, read_meta
    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path

    run_dir = cfg.run.run_dir
    quiet = quiet_ray_console(cfg)  # before `import ray`: Ray reads its console knobs on import
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_cpu.checkpoint.identity import config_hash
    from raytrain_cpu.checkpoint.layout import workers
    from raytrain_cpu.model.loading import count_parameters, write_tiny_model
    from raytrain_cpu.obs.metrics import count_events, read_choices, read_metrics, run_log_size
    from raytrain_cpu.trainer.loop import train_loop

    ray_env = {"TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
    os.environ.update(ray_env)
    restore_stderr = None
    if not ray.is_initialized():
        local = cfg.run.ray_init_address == "local"
        # Joining a running cluster (under `ray job submit` RAY_ADDRESS is its GCS): every process
        # of the job gets the address, so helpers that look the cluster up themselves (Ray Train's
        # placement-group cleaner) don't fail with "multiple active Ray instances" on a machine
        # that runs several Rays.
        joined = {} if local or is_url(cfg.run.ray_init_address) else {"RAY_ADDRESS": cfg.run.ray_init_address}
        ray_logs = quiet_ray_loggers() if quiet else None
        with sigterm_held_while_ray_starts():
            context = ray.init(
                address=cfg.run.ray_init_address,
                num_cpus=local_ray_cpus() if local else None,
                runtime_env={"env_vars": ray_env | joined}
                | ({"worker_process_setup_hook": "raytrain_cpu.launch.driver.quiet_worker_logs"} if local else {}),
                include_dashboard=False,
                log_to_driver=True,
                configure_logging=True,
                logging_level="WARNING",
            )
        logs_dir = Path(context.address_info["session_dir"]) / "logs"
        if ray_logs is not None:
            ray_log_file(ray_logs, logs_dir)
            restore_stderr = hide_core_log_lines()
        verbose_hint = "" if cfg.run.verbose else "; run.verbose=true prints them here too"
        print(f"[raytrain] Ray's own logs: {logs_dir} (on each node){verbose_hint}", flush=True)
    stop_on_sigterm()
    # Helper processes (e.g. Ray Train's placement-group cleaner) find this cluster, not another.
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    # One progress line from rank 0 instead of Ray Data's bars and per-operator logs (which it
    # writes every few seconds when stdout is not a terminal). Set before any dataset exists:
    # a dataset keeps a copy of the context it was built with, also on the workers.
    from ray.data import DataContext

    data_ctx = DataContext.get_current()
    data_ctx.enable_progress_bars = False
    data_ctx.print_on_execution_start = False
    data_ctx.execution_options.preserve_order = True  # each rank's blocks arrive in plan order
    cfg = resume_world(cfg)
    sizing = derive_scaling(cfg)
    world = sizing["num_workers"]
    global_batch = cfg.train.derive_global_batch(world)  # ConfigError names the fix
    if cfg.scaling.check_memory:
        check_memory(cfg, model_dir, sizing)
    check_checkpoint_room(cfg, model_dir)
    worlds = list(cfg.worker_counts) if cfg.elastic else [world]
    how_many = f"{worlds[0]} to {world} workers (elastic)" if cfg.elastic else workers(world)
    print(
        f"[raytrain] {how_many} x {sizing['cpus_per_worker']} CPUs ({sizing['threads_per_worker']} threads), "
        f"global batch {global_batch} blocks, run dir {run_dir}; nodes: {sizing['node_cpu']['model_name']} "
        f"({sizing['node_cpu']['best_isa']})",
        flush=True,
    )

    # ---- data
    cache = prepare(cfg, log=lambda m: print(m, flush=True))
    meta = read_meta(cache)
    sources = mixture_sources(cache, meta)
    cfg = steps_of_epochs(cfg, meta, global_batch)
    if cfg.train.epochs and (done := finished_run(cfg)) is not None:
        if restore_stderr is not None:
            restore_stderr()
        return done
    if not cfg.train.epochs or "sources" in meta:  # a mixture: how often each source is read
        note_epochs(meta, cfg.train.max_steps * global_batch)
    for name, _, source_meta in sources:
        if source_meta["eval_blocks"] < world:  # else the summary's eval perplexity is n/a without a word why
            print(f"[raytrain] {no_evaluation(source_meta, world, name)}", flush=True)
    check_watched_metric(cfg, sources, world)

    # ---- model
    if cfg.model.is_tiny:
        tok = load_tokenizer(resolve_tokenizer_path(cfg.model.tokenizer, "tiny"))
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        if quiet:
            hf_logging.disable_progress_bar()  # its "Writing model shards" bar, for one small shard
        model_dir = str(write_tiny_model(cfg, tok, run_dir / "base_model"))
        if quiet and bars:
            hf_logging.enable_progress_bar()
    n_params = count_parameters(model_dir)
    # Again for callers of run() (main() did it before Ray), now with the derived worker count,
    # before config.yaml is replaced.
    latest = verify_resume(cfg, check_resume(cfg, world), world)
    model = check_model_unchanged(cfg, model_dir, latest)

    # ---- resolved config and resume position
    cfg_dict = cfg.to_dict()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
    if cfg.train.record_block_ids:
        (run_dir / "block_ids").mkdir(exist_ok=True)
    start_step = latest["step"] if latest else 0
    start = start_step * global_batch
    if latest and latest.get("data_key", meta["key"]) != meta["key"]:  # its files changed since (more text?)
        print(
            f"[raytrain] the training data changed since {Path(latest['path']).name} (packed blocks "
            f"{latest['data_key']} then, {meta['key']} now): the run goes on at position {start:,} of the new "
            "blocks' own seeded order, not the old one's, so blocks trained before may come again this epoch "
            "and others not until the next",
            flush=True,
        )
    datasets = build_datasets(meta, sources, cfg, worlds, start)

    # ---- trainer
    loop_config = {
        "config": cfg_dict,
        "run_dir": str(run_dir),
        "model_dir": model_dir,
        "config_hash": config_hash(cfg_dict),
        "threads_per_worker": sizing["threads_per_worker"],
        # Each source's eval blocks: a worker count above them evaluates nothing of that source.
        "eval_sources": {name: source_meta["eval_blocks"] for name, _, source_meta in sources},
        "worker_bundle": {"CPU": sizing["cpus_per_worker"], **cfg.scaling.resources_per_worker},
        "start_position": start,
        "data_key": meta["key"],  # recorded in the checkpoints: a resume notices data that changed
        "data_cache": str(cache),  # train.dpo_precompute_reference reads the blocks it covers
        "train_blocks": meta["blocks"],  # the metrics rows' epoch counts passes over them
        "record_block_ids": cfg.train.record_block_ids,
        "n_params": n_params,
        "model": model,  # the manifests record it; every attempt checks model_dir still matches it
        "hashed_checkpoint": latest and Path(latest["path"]).name,  # the workers' first attempt checks only its sizes
    }
    os.environ.update(ray_train_env(cfg))  # the driver's: Ray Train hands them to its controller
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        # gloo: the CPU collective backend that ships with PyTorch; oneCCL bindings are retired.
        torch_config=TorchConfig(backend="gloo", timeout_s=cfg.run.gloo_timeout_s),
        scaling_config=ray.train.ScalingConfig(
            num_workers=(worlds[0], worlds[-1]) if cfg.elastic else world,
            elastic_resize_monitor_interval_s=cfg.scaling.resize_check_s,
            use_gpu=False,
            resources_per_worker=loop_config["worker_bundle"],
        ),
        run_config=ray.train.RunConfig(
            name=cfg.run.name,
            storage_path=str(run_dir.parent),
            checkpoint_config=checkpoint_config(cfg),
            # Restarts resume from the latest reported checkpoint; announced preemptions (spot
            # notices) have their own, unlimited budget.
            failure_config=ray.train.FailureConfig(max_failures=cfg.run.max_failures, max_preemption_failures=-1),
            worker_runtime_env={"env_vars": {**ray_env, **worker_env(cfg, sizing["workers_per_node"])}},
            callbacks=[restart_notice(cfg.run.max_failures, latest and Path(latest["path"]).name)],
        ),
        datasets=datasets,
        dataset_config=ray.train.DataConfig(datasets_to_split=[]),
    )
    choices_start = run_log_size(run_dir)  # this attempt's lines of run.log start here
    result = trainer.fit()
    if restore_stderr is not None:
        restore_stderr()

    # ---- summary
    worker_summary = json.loads((run_dir / ".worker_summary.json").read_text())
    summary = {
        **worker_summary,
        "wall_s": time.perf_counter() - t0,
        "checkpoint_path": result.checkpoint.path if result.checkpoint else None,
        "run_dir": str(run_dir),
        "data_cache": str(cache),
        **({"data_mix": meta["sources"]} if "sources" in meta else {}),
        "padding_tokens": meta["padding_tokens"],
        "padding_frac": meta.get("padding_frac", 0.0),
        "truncated_examples": meta.get("truncated_examples", 0),
        "eval_truncated_examples": meta.get("eval_truncated_examples", 0),
        "data_format": meta.get("data_format", "text"),
        "skipped_rows": meta["skipped_rows"],
        "scaling": sizing,
        # From metrics.jsonl rather than the worker: it spans every attempt of a resumed run.
        "guard_events": count_events(read_metrics(run_dir)),
        # Which kernel and path each choice took, as the workers wrote them to run.log.
        "choices": read_choices(run_dir, choices_start),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def checkpoint_config(cfg: Config):
    """Ray Train keeps run.num_to_keep checkpoints: the newest, or under run.best_metric those
    with the lowest `checkpoint_score` (the metric at their step; train.py), and always the newest
    beside them, which a resume loads."""
    import ray.train

    if not cfg.run.best_metric:
        return ray.train.CheckpointConfig(num_to_keep=cfg.run.num_to_keep)
    return ray.train.CheckpointConfig(
        num_to_keep=cfg.run.num_to_keep, checkpoint_score_attribute="checkpoint_score", checkpoint_score_order="min"
    )


def check_watched_metric(cfg: Config, sources: list[tuple[str, Any, dict[str, Any]]], world: int) -> None:
    """run.best_metric and train.early_stop_patience read an eval metric: the data must give every
    worker eval blocks of its source (of some source, for eval_loss), or it is never measured."""
    if not (cfg.run.best_metric or cfg.train.early_stop_patience):
        return
    metric = cfg.watched_metric
    whole = ("eval_loss", "eval_dpo_loss")  # over every source (a preference run has one)
    watched = [(name, m) for name, _, m in sources if metric in whole or metric == f"eval_loss/{name}"]
    if all(m["eval_blocks"] < world for _, m in watched):
        name, m = watched[0]
        key = "run.best_metric" if cfg.run.best_metric else "train.early_stop_patience"
        raise ConfigError(f"{key} watches {metric}, which this run never measures: {no_evaluation(m, world, name)}")


def print_summary(s: dict[str, Any]) -> None:
    from raytrain_cpu.checkpoint.layout import workers

    def num(key: str, spec: str) -> str:  # a finished run's summary may lack a figure
        return "n/a" if s.get(key) is None else format(s[key], spec)

    resumed = f" (resumed from step {s['resumed_from_step']})" if s.get("resumed_from_step") else ""
    print(
        "\n== raytrain_cpu summary ==\n"
        f"steps            {s['steps']}{resumed}\n"
        f"tokens seen      {num('tokens_seen', ',')}\n"
        f"final loss       {num('final_loss', '.4f')}{_by_source(s, 'final_loss', '.4f')}\n"
        f"eval perplexity  {num('eval_perplexity', '.2f')}{_by_source(s, 'eval_perplexity', '.2f')}\n"
        f"{_preference_line(s)}"
        f"tokens/s         {num('tokens_per_s', ',.0f')} on {workers(s['world_size'])}\n"
        f"wall time        {num('wall_s', '.0f')}s\n"
        f"checkpoint       {s['checkpoint_path']}\n"
        f"{_best_line(s)}"
        f"run directory    {s['run_dir']} (metrics.jsonl, summary.json; run.log: which kernel and path each choice took)\n"
        f"guards           {_guard_line(s)}\n"
        f"report           python -m raytrain_cpu.report {shlex.quote(str(s['run_dir']))}\n",
        flush=True,
    )
    if s.get("early_stop"):
        print(f"[raytrain] stopped early at step {s['steps']}: {s['early_stop']}", flush=True)
    if s.get("guard_stop"):
        print(f"error: the run stopped early at step {s['steps']}: {s['guard_stop']}", file=sys.stderr, flush=True)


def _preference_line(s: dict[str, Any]) -> str:
    """'eval DPO         loss 0.6687, reward accuracy 56.2%' for a preference run, else ''; a
    loss other than DPO's sigmoid is named: 'eval DPO         ipo loss 0.2482, ...'."""
    if s.get("eval_dpo_loss") is None:
        return ""
    kind = (s.get("dpo") or {}).get("loss", "sigmoid")
    name = "" if kind == "sigmoid" else f"{kind} "
    return f"eval DPO         {name}loss {s['eval_dpo_loss']:.4f}, reward accuracy {100 * s['eval_reward_accuracy']:.1f}%\n"


def _best_line(s: dict[str, Any]) -> str:
    """'best checkpoint  <path> (eval_loss 4.0123 at step 300)' under run.best_metric, else ''."""
    best = s.get("best_checkpoint")
    if not best:
        return ""
    return f"best checkpoint  {best['path']} ({best['metric']} {best['value']:.4f} at step {best['step']})\n"


def _by_source(s: dict[str, Any], metric: str, fmt: str) -> str:
    """' (wiki 62.10, notes 18.40)': a mixture's `metric` of each source (final_loss/<name>, ...)."""
    from raytrain_cpu.obs.metrics import by_source

    each = [f"{name} {v:{fmt}}" for name, v in by_source(s, metric).items()]
    return f" ({', '.join(each)})" if each else ""


STOP_SIGNAL = [signal.SIGINT]  # the signal that stopped the run: the exit code is 128 + it


def stop_on_sigterm() -> None:
    """SIGTERM (`ray job stop`, a Kubernetes pod stop, `timeout`) stops the run as Ctrl-C does:
    through Ray Train's SIGINT handler, a graceful abort of the workers. Ray's own handler, set by
    ray.init, exits mid-call instead: its crash handler prints a stack and the driver aborts (134)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum, frame) -> None:
        STOP_SIGNAL[0] = signal.SIGTERM
        on_sigint = signal.getsignal(signal.SIGINT)  # Ray Train's inside fit()
        if not callable(on_sigint):  # a job started with `&` ignores SIGINT: SIGTERM must still stop it
            raise KeyboardInterrupt
        on_sigint(signal.SIGINT, frame)

    signal.signal(signal.SIGTERM, on_sigterm)


@contextlib.contextmanager
def sigterm_held_while_ray_starts() -> Iterator[None]:
    """A SIGTERM while ray.init runs is held and acted on once Ray has started: the run stops as
    for Ctrl-C, with its line and exit code 143. ray.init sets Ray's own handlers as it starts
    (sys.exit mid-call): a SIGTERM then was lost inside a logging lock ("Exception ignored") and
    the run trained on, or ended as if by Ctrl-C (130). Ray's atexit hook still stops the
    processes it started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from raytrain_cpu.compat.ray import sigterm_handler_kept

    held: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
    try:
        with sigterm_handler_kept():  # ours stays while Ray starts
            yield
    finally:
        signal.signal(signal.SIGTERM, before)
    if held:
        STOP_SIGNAL[0] = signal.SIGTERM
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_kept() -> Iterator[None]:
    """The caller's SIGTERM handler again once the run is over: a notebook or a test process
    that goes on would otherwise keep stop_on_sigterm's (and ray.init's) for good."""
    before = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def where_it_resumes(cfg: Config, failed: bool = False) -> str:
    """What a stopped run left and how to go on: the checkpoints Ray Train recorded stay. A
    failed run fails again unless its cause was passing (a lost node), so that comes first."""
    from raytrain_cpu.checkpoint.damaged import resumable
    from raytrain_cpu.checkpoint.layout import CheckpointError

    try:  # a damaged one the workers stepped past was renamed: the newest still there is what a rerun takes
        there = resumable(cfg.run.run_dir)
    except CheckpointError as e:
        return f"{e}."
    latest = cfg.run.run_dir / there[0] if there else None
    again = "Once the cause is fixed (or if it was passing), run the same command" if failed else "Run the same command"
    if latest:
        return f"its latest checkpoint is {latest}. {again} again to resume from it."
    return f"it had saved no checkpoint yet. {again} again to start it."


def print_interrupted(cfg: Config) -> None:
    print(
        f"\n[raytrain] interrupted: run {cfg.run.name!r} stopped before "
        f"{f'the end of train.epochs={cfg.train.epochs:g}' if cfg.train.epochs else f'step {cfg.train.max_steps}'}; "
        f"{where_it_resumes(cfg)}",
        file=sys.stderr,
        flush=True,
    )


def print_failed(cfg: Config, error: Exception) -> None:
    """The end of a run whose workers failed past run.max_failures: the cause in one line (every
    rank's traceback stays in Ray's logs, or on the console with run.verbose) and where it resumes."""
    failures = getattr(error, "worker_failures", None)
    if failures:
        reason, _ = failure_reason(failures)
    else:  # the controller's own error
        reason = next((line for line in str(error).splitlines()[1:] if line.strip()), str(error)).strip()
    from raytrain_cpu.obs.metrics import FAILURE_FILE

    with contextlib.suppress(OSError):  # for the report, which otherwise sees a run still in progress
        (cfg.run.run_dir / FAILURE_FILE).write_text(json.dumps({"time": time.time(), "reason": reason}))
    print(
        f"\nerror: run {cfg.run.name!r} failed ({reason}); {where_it_resumes(cfg, failed=True)} Ray's logs (named at the top, "
        "on each node) hold every rank's traceback; run.verbose=true prints them here too.",
        file=sys.stderr,
        flush=True,
    )


def _guard_line(s: dict[str, Any]) -> str:
    g = s.get("guard_events") or {}
    if not any(g.values()):
        return "no loss spikes, gradient-norm spikes or non-finite losses"
    return ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in g.items()) + " (event rows in metrics.jsonl)"


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m raytrain_cpu.main",
        description=(
            "Train a causal LM on CPUs with Ray Train (gloo) + DeepSpeed ZeRO-3. With no arguments: "
            "a tiny Llama on the bundled wikitext-2, 2 workers on a local Ray."
        ),
        epilog=options_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", default=None, help="YAML config file (e.g. configs/local.yaml); defaults are built in")
    ap.add_argument(
        "overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=20 scaling.num_workers=1"
    )
    return ap.parse_intermixed_args(argv)  # overrides on both sides of --config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        validate_before_ray(cfg)
        check_lora_before_ray(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from raytrain_cpu.data.sources import DataError

    try:
        summary = run(cfg)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit):
        # Ray Train turns Ctrl-C into an abort of the run, then exits this process with
        # SystemExit(1) and only a log record (which the quiet console keeps in Ray's log files).
        print_interrupted(cfg)
        return 128 + STOP_SIGNAL[0]
    except Exception as e:
        import ray.train

        if cfg.run.verbose or not isinstance(e, ray.train.TrainingFailedError):
            raise
        print_failed(cfg, e)
        return 1
    print_summary(summary)
    return 3 if summary.get("guard_stop") else 0


if __name__ == "__main__":
    raise SystemExit(main())
