"""How many workers a Ray cluster's nodes hold: shared by the driver's sizing and the workers'
elastic checks (no Ray or torch import)."""

from __future__ import annotations

from typing import Any


def workers_that_fit(nodes: list[dict[str, Any]], bundle: dict[str, float]) -> int:
    """How many workers of `bundle` (each worker's Ray resources) the `nodes` (ray.nodes()) hold,
    counted on their whole resources as Ray Train's elastic scaling counts them."""
    return sum(min(int(n["Resources"].get(k, 0) // v) for k, v in bundle.items()) for n in nodes)
