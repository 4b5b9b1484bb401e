"""The suite's own clean-up: what the session's Ray leaves running after ray.shutdown() is
stopped by pid (tests/conftest.py), and nothing else is."""

from __future__ import annotations

import time

from helpers import _stop_what_ray_left


def test_nothing_left_is_no_wait_and_no_warning(recwarn):
    t0 = time.time()
    _stop_what_ray_left("999999998", grace_s=10.0)
    assert time.time() - t0 < 2 and not recwarn.list
