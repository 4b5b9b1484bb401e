"""The suite's own clean-up: what the session's Ray leaves running after ray.shutdown() is
stopped by pid (tests/helpers.py), and nothing else is.
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_suite_hygiene_e2e.py."""

from __future__ import annotations

import time

from helpers import _stop_what_ray_left


def test_nothing_left_is_no_wait_and_no_warning(recwarn):
    t0 = time.time()
    _stop_what_ray_left("999999998", grace_s=10.0)
    assert time.time() - t0 < 2 and not recwarn.list
