"""What every config section's checks share: the error type and the small checks that raise it."""

from __future__ import annotations

import os
from collections.abc import Iterable


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the fix."""


def require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    require(value in choices, key, f"got {value!r}; choose one of {', '.join(choices)}.")


def absolute(path: str) -> str:
    """A local path made absolute against the directory the run was started in: Ray Train's
    workers run in directories of their own, and export and generate read the paths a
    checkpoint's manifest records from wherever they are started."""
    return os.path.abspath(os.path.expanduser(path))


def is_url(path: str) -> bool:
    return "://" in path


def is_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def require_filesystem(path: str, key: str) -> None:
    """Runs, caches and checkpoints live on a filesystem every node mounts: an s3:// (or other
    URL) would otherwise be taken as a relative directory named 's3:'."""
    require(
        not is_url(path),
        key,
        f"{path!r} is a URL; runs, caches and checkpoints go on a filesystem every node mounts (on AWS "
        "FSx for Lustre at /fsx, which can link an S3 bucket). Give a path such as /fsx/runs.",
    )


def check_hpz_partition(size: int, zero_stage: int, worker_counts: Iterable[int] = ()) -> None:
    """deepspeed.hpz_partition_size before Ray starts: ZeRO-3 only, and a divisor of every worker
    count the run may have (`worker_counts`: empty while scaling.num_workers is derived later).
    DeepSpeed would otherwise stop each worker with a bare assertion after loading the model."""
    require(size >= 0, "deepspeed.hpz_partition_size", "must be >= 0 (1 = flat ZeRO-3, 0 = the ranks of one node).")
    require(
        size == 1 or zero_stage == 3,
        "deepspeed.hpz_partition_size",
        f"{size} keeps a second partition of ZeRO-3's parameters, and deepspeed.zero_stage={zero_stage} does not "
        "partition parameters; set deepspeed.zero_stage=3 or deepspeed.hpz_partition_size=1.",
    )
    for n in worker_counts:
        require(
            size <= 1 or n % size == 0,
            "deepspeed.hpz_partition_size",
            f"{size} does not divide {n} workers (hpZ groups are that many consecutive ranks); set it to the "
            f"ranks of one node (0 does that) or to one of {', '.join(str(d) for d in range(1, n + 1) if n % d == 0)}.",
        )


def resolve_hpz_partition(size: int, world: int, local_world: int) -> int:
    """deepspeed.hpz_partition_size as the workers' DeepSpeed config takes it: 0 becomes the
    ranks on this worker's node (`local_world`), which must divide `world`, as any size must."""
    resolved = size or local_world
    require(
        resolved >= 1,
        "deepspeed.hpz_partition_size",
        "0 takes the ranks of one node from the worker's LOCAL_WORLD_SIZE (Ray Train sets it), which is not set "
        "here; give the size.",
    )
    if resolved > 1:
        require(
            world % resolved == 0,
            "deepspeed.hpz_partition_size",
            f"{resolved}{' (the ranks on this node)' if not size else ''} does not divide the {world} ranks; every "
            "node must run the same number of workers, or set a size that divides them.",
        )
    return resolved
