"""Shared-memory collectives (raytrain_cpu.trainer.collectives): the same results as gloo, chunked and
whole, with DeepSpeed's own entry points; a missing rank ends in a clear error, not a hang.
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_collectives_e2e.py."""

from __future__ import annotations

import pytest


def test_slots_shrink_to_fit_dev_shm(monkeypatch):
    """Slots take at most a quarter of /dev/shm's free room (docker's default is 64 MiB),
    halving from 16 MiB; below 1 MiB a slot, gloo stays."""
    import os

    from raytrain_cpu.trainer import collectives

    def room(mib: int):
        return lambda path: os.statvfs_result((4096, 4096, 0, 0, mib * 256, 0, 0, 0, 0, 255))

    monkeypatch.setattr(os, "statvfs", room(64 * 1024))
    assert collectives._slot_bytes(2) == 16 << 20
    monkeypatch.setattr(os, "statvfs", room(64))  # 16 MiB usable over 2 sets of 2 ranks
    assert collectives._slot_bytes(2) == 4 << 20
    monkeypatch.setattr(os, "statvfs", room(8))
    assert collectives._slot_bytes(4) == 0


def test_the_segment_is_this_users_alone(tmp_path):
    """The segment in /dev/shm carries weights and gradients: 0600 whatever the umask, and never
    a file that already exists at its name."""
    import os
    import stat

    from raytrain_cpu.trainer import collectives

    path = tmp_path / "segment"
    before = os.umask(0)  # the widest: an open() that left the mode to the umask would make 0666
    try:
        collectives._create_segment(str(path), 4096, 12345)
    finally:
        os.umask(before)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == 4096 and int.from_bytes(path.read_bytes()[:8], "little") == 12345
    with pytest.raises(FileExistsError):
        collectives._create_segment(str(path), 4096, 1)
