"""Damaged checkpoints: a resume steps back past them to the newest one that verifies, and they
are renamed (nothing deleted) so neither a resume nor Ray Train takes them again."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint.files import fsync_dir
from raytrain_cpu.checkpoint.layout import (
    DAMAGE_NOTE,
    DAMAGED,
    MANIFEST,
    MOVED,
    CheckpointError,
    DamagedCheckpoint,
    checkpoint_dir_name,
    universal_ready,
)
from raytrain_cpu.checkpoint.ranks import all_gather
from raytrain_cpu.checkpoint.record import drop_from_record, reported_newest_first
from raytrain_cpu.checkpoint.verify import read_manifest, verify_checkpoint


def _damaged_copy(ckpt_dir: Path) -> Path | None:
    """Where a checkpoint renamed as damaged lies now, if it was."""
    return next(iter(sorted(ckpt_dir.parent.glob(f"{glob.escape(ckpt_dir.name)}{DAMAGED}*"))), None)


def resumable(run_dir: Path) -> list[str]:
    """reported_newest_first without the damaged checkpoints stepped past (gone or moved)."""
    return [n for n in reported_newest_first(run_dir) if (Path(run_dir) / n).is_dir() and not _moved(Path(run_dir) / n)]


def free_checkpoint_name(ckpt_root: Path, step: int) -> str:
    """The directory name of the checkpoint at `step`: checkpoint_dir_name(step), or that with -2,
    -3, ... when a damaged checkpoint had the name. Ray Train may still list the damaged one
    under it (after a restart inside the run), and deletes whatever lies there once it drops it."""
    base = name = checkpoint_dir_name(step)
    n = 1
    while _damaged_copy(Path(ckpt_root) / name) is not None:
        n += 1
        name = f"{base}-{n}"
    return name


def _moved(ckpt_dir: Path) -> bool:
    """Whether `ckpt_dir` is what mark_damaged leaves at a damaged checkpoint's old name."""
    return (ckpt_dir / MOVED).is_file() and not (ckpt_dir / MANIFEST).exists()


def _missing(ckpt_dir: Path) -> DamagedCheckpoint:
    copy = _damaged_copy(ckpt_dir)
    why = f"found damaged before, kept as {copy.name}" if copy else "the directory is gone"
    return DamagedCheckpoint(f"checkpoint {ckpt_dir} is missing ({why})", ckpt_dir, "missing")


def mark_damaged(error: DamagedCheckpoint) -> str:
    """Renames the damaged checkpoint `error` names to `<name>.damaged-<why>`, with every file
    kept and a note of what was found, so neither a resume nor Ray Train (which deletes the
    checkpoints it drops) takes it again, and leaves a directory holding only MOVED.txt at the old
    name for Ray Train to delete; returns what became of it, for the one line that says so."""
    path = error.path
    if not path.is_dir() or _moved(path):
        return str(error)
    target = path.with_name(f"{path.name}{DAMAGED}{error.why}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED}{error.why}-{n}")
    with contextlib.suppress(OSError):  # the note is a courtesy; the rename is what counts
        (path / DAMAGE_NOTE).write_text(f"{error}\n")
    os.rename(path, target)
    path.mkdir()
    (path / MOVED).write_text(f"{error}; kept as {target.name}\n")
    fsync_dir(path.parent)
    return f"{error}; kept as {target.name}"


def _none_verifies(run_dir: Path, errors: list[DamagedCheckpoint]) -> CheckpointError:
    return CheckpointError(
        f"none of run {Path(run_dir).name!r}'s checkpoints verifies: {'; '.join(map(str, errors))}. Restore their "
        "files (from a copy of the run directory), or start a new run.name (python -m raytrain_cpu.export turns a "
        "whole checkpoint into a model to start from); nothing was renamed or deleted"
    )


def newest_verified(
    run_dir: Path, log: Callable[[str], None], damaged: dict[str, DamagedCheckpoint] | None = None
) -> dict[str, Any] | None:
    """The driver's choice: the manifest (+ "path") of the newest checkpoint in Ray Train's
    record whose files are all there with their sizes (the workers hash their own), skipping
    `damaged` (names found so by other checks: to_universal hashes every shard). Those it steps
    past are renamed (mark_damaged), one line each, and dropped from the record, so Ray Train
    hands the workers this one. None when the record lists none; CheckpointError when none verifies."""
    run_dir = Path(run_dir)
    errors: list[DamagedCheckpoint] = []
    for name in reported_newest_first(run_dir):
        path = run_dir / name
        try:
            if name in (damaged or {}):
                raise damaged[name]
            if not path.is_dir() or _moved(path):
                raise _missing(path)
            manifest = verify_checkpoint(path)
        except DamagedCheckpoint as e:
            errors.append(e)
            continue
        for e in errors:
            log(f"[raytrain] {mark_damaged(e)}; resuming from {name}")
        if errors:
            drop_from_record(run_dir, [e.path.name for e in errors], name)
            for e in errors:  # no longer in Ray Train's record: what stood in for them goes
                if _moved(e.path):
                    shutil.rmtree(e.path)
        return {**manifest, "path": str(path)}
    if errors:
        raise _none_verifies(run_dir, errors)
    return None


def _check_own(ckpt_dir: Path, rank: int, world: int) -> dict[str, Any]:
    """A worker's share of checking a checkpoint: every file's size, and the sha256 of the files
    this rank loads (saved for another worker count: of old ranks rank, rank + world, ..., unless
    its universal form, made from hashed shards, is what loads)."""
    if not ckpt_dir.is_dir() or _moved(ckpt_dir):
        raise _missing(ckpt_dir)
    saved = read_manifest(ckpt_dir)["world_size"]
    if saved == world:
        mine = [rank]
    else:
        mine = [] if universal_ready(ckpt_dir) else [r for r in range(saved) if r % world == rank]
    return verify_checkpoint(ckpt_dir, hash_ranks=mine)


def choose_checkpoint(
    handed: Path | None, rank: int, world: int, log: Callable[[str], None], hashed: str | None = None
) -> tuple[Path | None, dict[str, Any]]:
    """The workers' choice, on every attempt: the checkpoint Ray Train handed back (`handed`)
    when it verifies on every rank, else the newest older one in Ray Train's record that does.
    Every rank hashes its own files; one gather per checkpoint tried makes all ranks agree. Rank
    0 renames those stepped past (mark_damaged), one line each. `hashed`: the checkpoint the
    driver hashed whole before Ray Train started (hash_checkpoint), whose sizes alone are checked
    again (the first attempt reads no shard twice). Returns (path, manifest), or
    (None, {}) when Ray Train handed none; raises CheckpointError when none verifies, or when one
    fails in another way (a manifest of another format) that stepping back would not mend."""
    import torch.distributed as dist

    if handed is None:
        return None, {}
    run_dir = handed.parent
    errors: list[DamagedCheckpoint] = []
    for name in dict.fromkeys([handed.name, *reported_newest_first(run_dir)]):
        path = run_dir / name
        manifest: dict[str, Any] = {}
        try:
            manifest = verify_checkpoint(path) if name == hashed else _check_own(path, rank, world)
            verdict: tuple[str, Any] = ("ok", None)
        except DamagedCheckpoint as e:
            verdict = ("damaged", e)
        except CheckpointError as e:
            verdict = ("error", str(e))
        verdicts = all_gather(verdict, world)
        if fatal := next((v for kind, v in verdicts if kind == "error"), None):
            raise CheckpointError(fatal)
        if found := next((v for kind, v in verdicts if kind == "damaged"), None):
            errors.append(found)
            continue
        if rank == 0:
            for e in errors:
                log(f"[resume] {mark_damaged(e)}; resuming from {name}")
        if errors:
            dist.barrier()  # the renames are done before any rank names its next checkpoint (free_checkpoint_name)
        return path, manifest
    raise _none_verifies(run_dir, errors)
