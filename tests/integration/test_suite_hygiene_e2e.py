"""The suite's own clean-up: what the session's Ray leaves running after ray.shutdown() is
stopped by pid (tests/helpers.py), and nothing else is.
This module's in-process tests: tests/unit/test_suite_hygiene.py."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from helpers import _processes_of, _stop_what_ray_left


def test_only_the_raylets_own_leftovers_are_killed_and_named():
    fake_raylet = "999999999"  # no real pid: no process of any real Ray carries it
    theirs = subprocess.Popen(["sleep", "60"], env={**os.environ, "RAY_RAYLET_PID": fake_raylet})
    other = subprocess.Popen(["sleep", "60"], env={**os.environ, "RAY_RAYLET_PID": fake_raylet + "0"})
    try:
        assert set(_processes_of(fake_raylet)) == {theirs.pid}
        t0 = time.time()
        with pytest.warns(UserWarning, match=rf"left running 1 s after ray.shutdown\(\): sleep \(pid {theirs.pid}\)"):
            _stop_what_ray_left(fake_raylet, grace_s=1.0)
        assert time.time() - t0 < 5
        assert theirs.wait(timeout=5) == -9  # SIGKILL
        assert other.poll() is None  # another raylet's: untouched
    finally:
        for p in (theirs, other):
            p.kill()
            p.wait()
