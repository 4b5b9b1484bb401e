"""Ray Train's record of a run's reported checkpoints: which one a resume gets, and in what order
the others follow. The record's format is Ray's: raytrain_cpu.compat.ray reads and writes it."""

from __future__ import annotations

import json
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint.layout import MANIFEST, CheckpointError
from raytrain_cpu.compat import ray as ray_compat


def _record(run_dir: Path) -> dict[str, Any]:
    """Ray Train's record of the run's reported checkpoints ({} before the first); read again a
    few times while Ray rewrites it, then a CheckpointError naming it."""
    try:
        return ray_compat.read_record(run_dir)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{Path(run_dir) / ray_compat.SNAPSHOT} is unreadable ({e}); Ray Train can't tell which checkpoint to "
            "resume from"
        ) from e


def latest_reported(run_dir: Path) -> Path | None:
    """The checkpoint Ray Train will hand back on resume: the latest one in its record."""
    latest = ray_compat.latest_name(_record(run_dir))
    return Path(run_dir) / latest if latest else None


def reported_newest_first(run_dir: Path) -> list[str]:
    """The checkpoints Ray Train's record lists, the one it hands back first, then newest
    reported first (under run.best_metric its list is ordered by score)."""
    return ray_compat.names_newest_first(_record(run_dir))


def drop_from_record(run_dir: Path, names: Collection[str], latest: str) -> None:
    """Removes the checkpoints `names` from Ray Train's record of the run and makes `latest` the
    one it hands back. Before Ray starts, when nothing else writes the file: Ray Train refuses to
    start on a record that lists a directory no longer there."""
    ray_compat.write_record(run_dir, ray_compat.drop_names(_record(run_dir), names, latest))


UNSCORED = sys.float_info.max
"""The `checkpoint_score` of a checkpoint with no evaluation at its step: ranked last. Finite, as
Ray Train writes its record with pydantic, which turns inf into null."""


def rank_unscored_last(run_dir: Path) -> list[str]:
    """Rewrites the null scores in Ray Train's record of the run (checkpoints saved without an
    evaluation by earlier versions, reported with inf) as UNSCORED, which Ray can rank: a resume
    with run.best_metric failed on them ('float' * 'NoneType') at every retry. Before Ray starts,
    when nothing else writes the file. Returns the checkpoints rewritten."""
    record = _record(run_dir)
    fixed = ray_compat.score_nulls(record, UNSCORED)
    if fixed:
        ray_compat.write_record(run_dir, record)
    return sorted(set(fixed))


def scored_metrics(run_dir: Path) -> dict[str, str | None]:
    """{checkpoint name: the eval metric its `checkpoint_score` is of} for every checkpoint Ray
    Train still lists for the run; None where it was reported without a score (saved before
    checkpoints carried one), which Ray Train's ranking would put first."""
    out = {}
    for name, metrics in ray_compat.checkpoint_metrics(_record(run_dir)).items():
        manifest = Path(run_dir) / name / MANIFEST
        watch = (json.loads(manifest.read_text()).get("eval_watch") or {}) if manifest.is_file() else {}
        out[name] = watch.get("metric", "eval_loss") if "checkpoint_score" in metrics else None
    return out
