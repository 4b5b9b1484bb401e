"""Ray Train's per-worker entry: one attempt of one worker, run by a Trainer (trainer.py)."""

from __future__ import annotations

from typing import Any


def train_loop(loop_config: dict[str, Any]) -> None:
    """Ray Train runs this once per worker with a plain dict (launch.driver builds it)."""
    from raytrain_cpu.trainer.trainer import Trainer

    Trainer.from_ray(loop_config).fit()
