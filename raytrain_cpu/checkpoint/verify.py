"""Finding a checkpoint and checking it against its manifest."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint.files import sha256_of
from raytrain_cpu.checkpoint.layout import DAMAGED, DS_TAG, FORMAT, MANIFEST, CheckpointError, DamagedCheckpoint
from raytrain_cpu.checkpoint.record import latest_reported


def checkpoint_of(path: str | Path) -> Path:
    """`path` when it is a checkpoint; for a run directory, its latest reported checkpoint (the
    one a resume loads); else `path` as given, for read_manifest to say what it lacks."""
    p = Path(path)
    if (p / MANIFEST).is_file() or not p.is_dir():
        return p
    return latest_reported(p) or p


BEST_HELP = "with a run directory: its best checkpoint (run.best_metric), not its latest"  # --best of the CLIs


def best_of(run_dir: str | Path) -> Path:
    """A run directory's best checkpoint under run.best_metric: the one its latest checkpoint's
    manifest names (train.EvalWatch), which Ray Train keeps while it ranks first."""
    run_dir = Path(run_dir)
    latest = latest_reported(run_dir) if run_dir.is_dir() else None
    if latest is None:
        raise CheckpointError(f"--best takes a run directory, and {run_dir} holds no reported checkpoint")
    best = (read_manifest(latest).get("eval_watch") or {}).get("best_checkpoint")
    if not best:
        raise CheckpointError(
            f"{run_dir} did not rank its checkpoints (run.best_metric was not set): drop --best for its latest "
            f"checkpoint, or pass one of them{_siblings(latest)}"
        )
    return run_dir / best["name"]


def _siblings(ckpt_dir: Path) -> str:
    """'; <run dir> holds checkpoint_000100, ...' for a mistyped checkpoint path, else ''."""
    run_dir = ckpt_dir.parent
    found = sorted(p.name for p in run_dir.glob("checkpoint_*") if (p / MANIFEST).is_file() and DAMAGED not in p.name)
    return f"; {run_dir} holds {', '.join(found)}" if found else ""


def shard_bytes(manifest: dict[str, Any]) -> int:
    """The size of a checkpoint's DeepSpeed shards (every rank's files under ds/), from its manifest."""
    return sum(meta["size"] for rel, meta in manifest["files"].items() if rel.startswith(f"{DS_TAG}/"))


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / MANIFEST
    if not path.is_file():
        if Path(ckpt_dir).is_dir():
            raise DamagedCheckpoint(
                f"checkpoint {ckpt_dir} has no {MANIFEST}: it is incomplete or not a raytrain_cpu checkpoint",
                ckpt_dir,
                "no-manifest",
            )
        raise CheckpointError(
            f"checkpoint {ckpt_dir} has no {MANIFEST}: it is incomplete or not a raytrain_cpu checkpoint"
            f" (the directory does not exist{_siblings(Path(ckpt_dir))})"
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise DamagedCheckpoint(f"{path} is unreadable: {e}", ckpt_dir, "manifest") from e
    if not isinstance(manifest, dict):
        raise DamagedCheckpoint(f"{path} holds no JSON object", ckpt_dir, "manifest")
    if manifest.get("format") != FORMAT or "files" not in manifest:
        raise CheckpointError(f"{path} has no file list (format {manifest.get('format')}, expected {FORMAT})")
    return manifest


def verify_checkpoint(ckpt_dir: str | Path, *, hash_ranks: Collection[int] | bool = ()) -> dict[str, Any]:
    """Checks a checkpoint against its manifest and returns the manifest.

    Every listed file must exist with its recorded size; the sha256 of the files of `hash_ranks`
    (True: all) is recomputed. Raises CheckpointError naming the first problem.
    """
    ckpt_dir = Path(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    for rel, meta in manifest["files"].items():
        p = ckpt_dir / rel
        if not p.is_file():
            raise DamagedCheckpoint(
                f"checkpoint {ckpt_dir} is incomplete: {rel} (rank {meta['rank']}) is missing", ckpt_dir, "missing-file"
            )
        if p.stat().st_size != meta["size"]:
            raise DamagedCheckpoint(
                f"checkpoint {ckpt_dir} is damaged: {rel} has {p.stat().st_size} bytes, the manifest says {meta['size']}",
                ckpt_dir,
                "size",
            )
        if (hash_ranks is True or meta["rank"] in (hash_ranks or ())) and sha256_of(p) != meta["sha256"]:
            raise DamagedCheckpoint(
                f"checkpoint {ckpt_dir} is damaged: {rel} does not match its sha256", ckpt_dir, "sha256"
            )
    return manifest
