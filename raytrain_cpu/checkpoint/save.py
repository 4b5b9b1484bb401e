"""Saving a checkpoint: every rank writes to staging, rank 0 verifies, seals and renames it, then
every rank reports it to Ray Train."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint.damaged import free_checkpoint_name
from raytrain_cpu.checkpoint.files import describe_write_error, fsync_dir, fsync_file, sha256_of, write_json_durably
from raytrain_cpu.checkpoint.layout import DS_TAG, FORMAT, MANIFEST, STAGING, CheckpointError, rng_file
from raytrain_cpu.checkpoint.ranks import all_gather, broadcast
from raytrain_cpu.checkpoint.rng import rng_state, write_rng_state
from raytrain_cpu.compat.deepspeed import own_checkpoint_files


def _own_files(engine, staging: Path, rank: int) -> list[Path]:
    """The files this rank wrote: its DeepSpeed shards (by DeepSpeed's own naming) and RNG file."""
    return [rng_file(staging, rank), *own_checkpoint_files(engine, staging, DS_TAG)]


def _write_rank(engine, staging: Path, step: int, rank: int) -> dict[str, dict[str, Any]]:
    """Step 2: this rank's shard + RNG state; returns {relative path: {size, sha256, rank}}."""
    engine.save_checkpoint(str(staging), tag=DS_TAG, client_state={"step": step}, save_latest=False)
    rng = rng_file(staging, rank)
    rng.parent.mkdir(parents=True, exist_ok=True)
    write_rng_state(rng, rng_state())
    files = {}
    for p in _own_files(engine, staging, rank):
        if not p.is_file():
            raise CheckpointError(f"rank {rank}: DeepSpeed reported success but {p} was not written")
        fsync_file(p)  # on this node, which wrote it: another node's fsync does not flush this one's cache
        files[str(p.relative_to(staging))] = {"size": p.stat().st_size, "sha256": sha256_of(p), "rank": rank}
    return files


def _seal(staging: Path, files: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Step 3's writes (rank 0): fsyncs what DeepSpeed wrote besides the ranks' own files (its
    recovery script) and every directory, then writes the manifest last, so it only vouches for
    files already on the storage."""
    for p in sorted(staging.rglob("*")):
        if p.is_file() and str(p.relative_to(staging)) not in files:
            fsync_file(p)
    for d in sorted({p for p in staging.rglob("*") if p.is_dir()}, reverse=True):
        fsync_dir(d)
    write_json_durably(staging / MANIFEST, {**manifest, "format": FORMAT, "ds_tag": DS_TAG, "files": files})
    fsync_dir(staging)


def _check_staged(staging: Path, per_rank: list[dict[str, dict[str, Any]]], zero_stage: int) -> dict[str, Any]:
    """Step 3 (rank 0): every rank's shards are present with the size their writer saw."""
    files: dict[str, Any] = {}
    for rank, own in enumerate(per_rank):
        kinds = {k for rel in own for k in ("optim_states", "model_states", "rng/") if k in rel}
        needed = {"optim_states", "rng/"} | ({"model_states"} if zero_stage == 3 or rank == 0 else set())
        if needed - kinds:
            raise CheckpointError(f"rank {rank} wrote no {', '.join(sorted(needed - kinds))} file into {staging}")
        files.update(own)
    for rel, meta in files.items():
        p = staging / rel
        size = p.stat().st_size if p.is_file() else None
        if size != meta["size"]:
            raise CheckpointError(
                f"{p}: rank {meta['rank']} wrote {meta['size']} bytes but rank 0 sees "
                f"{'no file' if size is None else f'{size} bytes'}; is run.storage_path shared by all nodes?"
            )
    return files


def write_checkpoint(
    engine, ckpt_root: Path, step: int, manifest: dict[str, Any], rank: int, world: int, previous: Path | None = None
) -> Path:
    """Steps 1-3 of the save; returns the finished directory on every rank, or raises CheckpointError.

    `previous` (the checkpoint resumed from or last written) only names what stays intact in errors.
    """
    import torch.distributed as dist

    ckpt_root = Path(ckpt_root)
    name = free_checkpoint_name(ckpt_root, step)
    staging, final = ckpt_root / STAGING / name, ckpt_root / name
    intact = f"checkpoint {step} was not reported; {f'{previous} is intact and stays the latest' if previous else 'no earlier checkpoint exists'}"

    # 1. a clean staging directory (a crashed attempt may have left one behind)
    if rank == 0:
        try:
            shutil.rmtree(ckpt_root / STAGING, ignore_errors=True)
            staging.mkdir(parents=True)
        except OSError as e:
            raise CheckpointError(f"cannot create {staging}: {describe_write_error(e, staging)}; {intact}") from e
    dist.barrier()

    # 2. every rank writes and hashes its own files; a failure here ends the attempt from this rank
    try:
        own = _write_rank(engine, staging, step, rank)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"rank {rank} could not write checkpoint {step} to {staging}: {describe_write_error(e, staging)}; {intact}"
        ) from e
    per_rank = all_gather(own, world)

    # 3. rank 0 verifies, writes the manifest last and renames; everyone learns the outcome
    error = None
    if rank == 0:
        try:
            files = _check_staged(staging, per_rank, engine.zero_optimization_stage())
            _seal(staging, files, manifest)
            if final.exists():  # written by a crashed attempt but never reported: not Ray's latest
                shutil.rmtree(final)
            os.replace(staging, final)
            fsync_dir(ckpt_root)
        except Exception as e:
            error = f"checkpoint {step} failed verification: {e}; {intact}"
            if isinstance(e, OSError):
                error = f"checkpoint {step} could not be finished in {ckpt_root}: {describe_write_error(e, staging)}; {intact}"
            shutil.rmtree(staging, ignore_errors=True)
    error = broadcast(error)
    if error:
        raise CheckpointError(error)
    return final


def report_checkpoint(metrics: dict[str, Any], final: Path) -> None:
    """Step 4: every rank reports the finished directory to Ray Train, in place (no copy)."""
    import ray.train
    from ray.train import CheckpointUploadMode

    ray.train.report(
        metrics,
        checkpoint=ray.train.Checkpoint.from_directory(str(final)),
        checkpoint_dir_name=final.name,
        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
    )


def save_and_report(
    engine,
    ckpt_root: Path,
    step: int,
    manifest: dict[str, Any],
    metrics: dict[str, Any],
    rank: int,
    world: int,
    previous: Path | None = None,
) -> Path:
    """The whole save: write, verify, rename, report. Every rank must call it at the same steps."""
    final = write_checkpoint(engine, ckpt_root, step, manifest, rank, world, previous)
    report_checkpoint(metrics, final)
    return final
