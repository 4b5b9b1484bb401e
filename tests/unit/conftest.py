"""The unit tier's rule, enforced: no Ray, no child processes, no torch.distributed process
group. Each is refused with a message naming the way out (tests/integration). Hook wrappers, not an
autouse fixture, put the patches in force: through every phase of a unit test, so a module- or
session-scoped fixture that a unit test asks for is held to the rule as well."""

from __future__ import annotations

import multiprocessing.process
import subprocess
import traceback

import pytest

# Fixtures that start Ray or a whole run (tests/conftest.py): asking for one is enough.
INTEGRATION_FIXTURES = ("ray_session", "straight", "cli_run")

# Children started from these build something once (then cached), not a second process the test
# talks to: torch's C++ extension loader and inductor's compile workers, and matplotlib's font
# list (`fc-list`, on the first import of a machine without the cache: a fresh CI host).
BUILDERS = ("torch/utils/cpp_extension.py", "torch/_inductor/", "matplotlib/font_manager.py")


def _refusal(what: str) -> RuntimeError:
    return RuntimeError(f"unit tests must not {what}; move this test to tests/integration")


def _refused(what: str):
    def refused(*args, **kwargs):
        raise _refusal(what)

    return refused


def _refused_unless_building(what: str, original):
    def guarded(*args, **kwargs):
        if any(b in frame.filename for frame in traceback.extract_stack() for b in BUILDERS):
            return original(*args, **kwargs)
        raise _refusal(what)

    return guarded


def _forbid(mp: pytest.MonkeyPatch) -> None:
    import ray
    import torch.distributed as dist

    mp.setattr(ray, "init", _refused("start or join Ray (ray.init)"))
    for module in (dist, dist.distributed_c10d):
        mp.setattr(module, "init_process_group", _refused("start a torch.distributed process group"))
    mp.setattr(
        subprocess.Popen,
        "_execute_child",
        _refused_unless_building("start a subprocess", subprocess.Popen._execute_child),
    )
    start = multiprocessing.process.BaseProcess.start
    mp.setattr(
        multiprocessing.process.BaseProcess, "start", _refused_unless_building("start a multiprocessing process", start)
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Set-up included: fixtures of a wider scope are made in the first test's set-up, before any
    function-scoped autouse fixture could patch anything."""
    asked = [f for f in INTEGRATION_FIXTURES if f in item.fixturenames]
    if asked:
        raise _refusal(f"use the {', '.join(asked)} fixture (Ray, a whole run)")
    with pytest.MonkeyPatch.context() as mp:
        _forbid(mp)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with pytest.MonkeyPatch.context() as mp:
        _forbid(mp)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with pytest.MonkeyPatch.context() as mp:
        _forbid(mp)
        yield
