"""Checkpoints on disk: the one a run resumes from, its worker count, verifying (or converting)
it before the data stream is planned, a run already finished, and where a stopped run resumes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.schema import Config
from raytrain_cpu.model.hub import is_hub_id


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
