"""What every config section's checks share: the error type and the small checks that raise it."""

from __future__ import annotations

import os


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
