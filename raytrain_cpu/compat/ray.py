"""Ray internals the project reaches into, each where Ray offers no public route.

Ray is imported inside the functions: the driver's CLI checks run before Ray starts, and the
checkpoint code reads Ray Train's record without starting Ray.

Ray Train's record of a run (`SNAPSHOT`): `ray.train.Result.from_path` is the public reader, but
it does not do the job here. It raises when a checkpoint the record lists is gone (the case a
resume past a damaged checkpoint must handle), and on a record another Ray version wrote; it
does not give the report order that a resume steps back through under run.best_metric; and it
imports pandas and pyarrow into CLIs that need neither. Dropping a damaged checkpoint from the
record has no public route at all. So the record's JSON is read and written here.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from raytrain_cpu.compat import written_for

written_for(__name__, "ray", "2.60")

# ----------------------------------------------------------------------------- Ray Train's record

SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of a run's reported checkpoints


def read_record(run_dir: Path, tries: int = 5, wait_s: float = 0.2) -> dict[str, Any]:
    """Ray Train's record of the run ({} before the first checkpoint): its checkpoint manager's
    snapshot, the JSON file Ray Train v2 keeps in the run directory.

    Ray Train rewrites it in place (truncate, then write) at every report, so a reader polling a
    live run can catch it empty or half written: read again a few times; raises the last
    OSError or ValueError when it stays unreadable."""
    path = Path(run_dir) / SNAPSHOT
    for attempt in range(tries):
        if attempt:
            time.sleep(wait_s)
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            error = e
    raise error


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    """Replaces Ray Train's record of the run (a new file renamed over it). Only before Ray
    starts, when nothing else writes it."""
    path = Path(run_dir) / SNAPSHOT
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def latest_name(record: dict[str, Any]) -> str | None:
    """The checkpoint Ray Train hands back on resume (the record's latest_checkpoint_result)."""
    latest = record.get("latest_checkpoint_result")
    return latest["checkpoint_dir_name"] if latest else None


def names_newest_first(record: dict[str, Any]) -> list[str]:
    """The checkpoints the record lists, the one Ray Train hands back first, then newest reported
    first: under a checkpoint score its checkpoint_results are ordered by score, and its
    checkpoint_report_indices say when each was reported."""
    results = record.get("checkpoint_results") or []
    indices = record.get("checkpoint_report_indices") or list(range(len(results)))
    names = [r["checkpoint_dir_name"] for _, r in sorted(zip(indices, results, strict=True), key=lambda x: -x[0])]
    latest = (record.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
    return list(dict.fromkeys(([latest] if latest else []) + names))


def checkpoint_metrics(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{checkpoint name: the metrics it was reported with} for every checkpoint the record lists."""
    return {r["checkpoint_dir_name"]: r.get("metrics") or {} for r in record.get("checkpoint_results") or []}


def score_nulls(record: dict[str, Any], value: float) -> list[str]:
    """Sets each null `checkpoint_score` metric in the record (its checkpoint_results and its
    latest_checkpoint_result) to `value`; returns the names of the checkpoints changed."""
    fixed = []
    for result in [*(record.get("checkpoint_results") or []), record.get("latest_checkpoint_result") or {}]:
        metrics = result.get("metrics") or {}
        if "checkpoint_score" in metrics and metrics["checkpoint_score"] is None:
            metrics["checkpoint_score"] = value
            fixed.append(result["checkpoint_dir_name"])
    return fixed


def drop_names(record: dict[str, Any], names: Collection[str], latest: str) -> dict[str, Any]:
    """The record without the checkpoints `names` (in its results, report indices, pending
    validations and every *_checkpoint_dir_names list), `latest` the one it hands back."""
    results = record.get("checkpoint_results") or []
    indices = record.get("checkpoint_report_indices") or list(range(len(results)))
    kept = [(i, r) for i, r in zip(indices, results, strict=True) if r["checkpoint_dir_name"] not in names]
    record["checkpoint_results"] = [r for _, r in kept]
    record["checkpoint_report_indices"] = [i for i, _ in kept]
    record["latest_checkpoint_result"] = next(
        (r for _, r in kept if r["checkpoint_dir_name"] == latest), {"checkpoint_dir_name": latest, "metrics": {}}
    )
    pending = zip(record.get("pending_training_results") or [], record.get("pending_validation_specs") or [])
    pending = [(r, v) for r, v in pending if r["checkpoint_dir_name"] not in names]
    if "pending_training_results" in record:
        record["pending_training_results"] = [r for r, _ in pending]
        record["pending_validation_specs"] = [v for _, v in pending]
    for key in [k for k in record if k.endswith("_checkpoint_dir_names")]:
        record[key] = [n for n in record[key] if n not in names]
    return record


# ----------------------------------------------------------------------------- the driver's Ray


def started_own_head() -> bool:
    """Whether this process started its own Ray (a head node, so no autoscaler), rather than
    joined a cluster. Reads `ray._private.worker._global_node`, set only when ray.init started
    the node here: the public runtime context does not tell the two apart."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    return bool(getattr(node, "head", False))


@contextlib.contextmanager
def sigterm_handler_kept() -> Iterator[None]:
    """While inside, ray.init leaves the process's SIGTERM handler alone: it installs its own
    through `ray._private.utils.set_sigterm_handler`, which is made a no-op meanwhile."""
    from ray._private import utils as ray_utils

    set_handler = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = set_handler


PLACEMENT_GROUP_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
"""The logger of Ray Train v2's placement-group cleaner (an internal module's name)."""


def console_dedup(allow: str, skip: str, disable_worker_prefix: bool) -> None:
    """Applies the RAY_DEDUP_LOGS_ALLOW/SKIP_REGEX and RAY_DISABLE_WORKER_LOG_PREFIX settings to
    a Ray already imported in this process (it reads them at import): `ray._private.ray_logging`'s
    deduplicators and `ray._private.ray_constants`. Does nothing where this Ray lacks them."""
    import re

    try:
        from ray._private import ray_constants, ray_logging

        for dedup in (ray_logging.stdout_deduplicator, ray_logging.stderr_deduplicator):
            dedup.allow_re = re.compile(allow)
            dedup.skip_re = re.compile(skip)
        ray_constants.RAY_DISABLE_WORKER_LOG_PREFIX = disable_worker_prefix
    except (ImportError, AttributeError):
        pass


# ----------------------------------------------------------------------------- draining a node


def gcs_client(address: str | None):
    """A client of the cluster's GCS at `address` (None: the one this machine runs), and the
    address it resolved: `ray._raylet.GcsClient` with
    `ray._private.services.canonicalize_bootstrap_address_or_die`. Ray's only route to a drain
    for preemption is the GCS's DrainNode call; `ray drain-node` (hidden, outside Ray's API
    guarantees) calls the same with the same client."""
    import ray._private.services as services
    from ray._raylet import GcsClient

    return GcsClient(address=services.canonicalize_bootstrap_address_or_die(address))


def drain_for_preemption(gcs, node_id: str, message: str, deadline_ms: int) -> tuple[bool, str]:
    """Asks the GCS to drain node `node_id` for preemption by `deadline_ms` (epoch ms):
    GcsClient.drain_node with DRAIN_NODE_REASON_PREEMPTION. Returns (accepted, why not)."""
    from ray.core.generated import autoscaler_pb2

    return gcs.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), message, deadline_ms
    )
