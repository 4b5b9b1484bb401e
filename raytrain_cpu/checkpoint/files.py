"""File helpers: hashing, durable writes, and what a failed write says about the storage."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_json_durably(path: Path, obj: Any) -> None:
    """Writes, fsyncs and renames into place, so the file is whole or absent."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _storage_state(path: Path) -> str:
    """'read-only', 'N MiB free' or '' for the filesystem holding `path` (for error messages)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return ""
    if st.f_flag & os.ST_RDONLY:
        return "the filesystem is read-only"
    return f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free on that filesystem"


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind an exception, if any (torch.save wraps write failures in RuntimeError)."""
    for _ in range(10):
        if e is None or isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def existing_folder(path: Path) -> Path:
    """`path` or the nearest folder above it that exists: where a directory to be made at `path` goes."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def cannot_write(folder: Path) -> str | None:
    """Why no file can be made in the existing `folder` (the OS's reason), or None. A probe file,
    removed again: os.access says yes to root on a read-only file system, and /proc refuses new
    files whatever its mode bits say."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return e.strerror or str(e)


def out_of_space(e: BaseException) -> bool:
    """A full filesystem or quota, however wrapped: the errno of an OSError behind it (torch.save
    wraps one in RuntimeError), or its words inside safetensors' or pyarrow's own errors."""
    os_error = _os_error(e)
    return (os_error is not None and os_error.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
        words in str(e) for words in ("No space left on device", "Disk quota exceeded")
    )


def describe_write_error(e: BaseException, where: Path) -> str:
    os_error = _os_error(e)
    if out_of_space(e):
        what = "the storage is full (no space or quota left)"
    elif os_error is not None and os_error.errno == errno.EROFS:
        what = "the storage is read-only (EROFS)"
    else:
        what = f"{type(e).__name__}: {e}"
    state = _storage_state(where)
    return f"{what}{f'; {state}' if state else ''}"
