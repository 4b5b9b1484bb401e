"""What a checkpoint is on the storage: its names, its format, and the errors about it."""

from __future__ import annotations

from pathlib import Path

DS_TAG = "ds"
UNIVERSAL = "universal"  # the same state in DeepSpeed's universal format, made for a resume on another world size
MANIFEST = "manifest.json"
STAGING = ".staging"
FORMAT = 2


class CheckpointError(RuntimeError):
    """A checkpoint that can't be written, or one that is incomplete or unreadable."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are not what its manifest vouches for (or which has none): a
    resume steps back past it. `why` is a short word for its new name (missing-file, size,
    sha256, manifest, missing)."""

    def __init__(self, message: str, path: str | Path = "", why: str = "damaged"):
        super().__init__(message)
        self.path, self.why = Path(path), why

    def __reduce__(self):  # whole across Ray (a to_universal task's failure)
        return type(self), (str(self), str(self.path), self.why)


DAMAGED = ".damaged-"  # a damaged checkpoint's new name: checkpoint_000100.damaged-sha256
DAMAGE_NOTE = "DAMAGED.txt"  # inside it: what was found, in full
# Left alone at a damaged checkpoint's old name: Ray Train may still list that name (a restart
# inside the run), and when it drops it, it deletes the directory there, or fails the whole run
# (FileNotFoundError in its controller) when there is none.
MOVED = "MOVED.txt"


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:06d}"


def workers(n: int) -> str:
    return f"{n} worker{'s' * (n != 1)}"


def rng_file(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / "rng" / f"rank{rank}.pt"


def universal_ready(ckpt_dir: str | Path) -> bool:
    """Whether `to_universal` has already converted this checkpoint (the directory exists only whole)."""
    return (Path(ckpt_dir) / UNIVERSAL / "zero" / "optimizer_state.pt").is_file()
