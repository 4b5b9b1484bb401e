"""Fixtures and hooks for both tiers (tests/unit, tests/integration): one local Ray for the
session, the session's shared runs, a tiny-run config factory, the bundled tokenizer, and each
test's tier marker.
Plain helpers live in tests/helpers.py (`from helpers import ...`): a module named conftest is
ambiguous once tests/unit has its own conftest.py."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    CLI_OVERRIDES,
    _stop_what_ray_left,
    child_env,
    die_with_parent,
    fast_overrides,
    run_losses,
    straight_overrides,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
# Inductor compiles in this process, not in a pool of its own subprocesses (each importing torch
# again): the same code on a 2-core host, without the pool's start-up in every compiling worker.
# Set here, it reaches the session Ray's workers and the CLI runs the tests start.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Ray Train's PreemptionWatcher (an actor per run, watching for node drains) only in the test that
# drains a node (the elastic scenario in tests/integration/test_fault_tolerance_e2e.py turns it
# back on): each run's driver hands this to its controller, and every actor a run starts costs
# a process and its imports, a sizeable share of a tiny run on 2 cores.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

TESTS = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- the tiers
# A test's folder is its tier: `-m unit` or `-m integration` picks one (as does its path).
# `slow` keeps its own meaning (starts Ray and trains) on top.


def pytest_configure(config):
    config.addinivalue_line("markers", "unit: tests/unit (no Ray, no child processes, no process groups)")
    config.addinivalue_line("markers", "integration: tests/integration (Ray, subprocesses, 2-rank groups, training)")
    config.addinivalue_line(
        "markers", "late: runs after the rest of its tier (it reads a scenario a session fixture started earlier)"
    )


def _tier(item) -> str | None:
    path = Path(item.path).resolve()
    return path.relative_to(TESTS).parts[0] if TESTS in path.parents else None


def pytest_collection_modifyitems(config, items):
    """Marks each test with its tier, and runs the unit tier first: a failure there shows at once,
    and its pytest keeps one core of two busy, leaving the other to the CLI run (cli_run) started
    meanwhile. Each module stays whole (a tier holds whole modules), but for the tests marked
    `late`, which go to the end of their tier: each waits on a scenario a session fixture started
    in the background, which then runs beside the tests in between rather than being waited for."""
    for item in items:
        if _tier(item) in ("unit", "integration"):
            item.add_marker(_tier(item))
    items.sort(key=lambda item: (_tier(item) != "unit", item.get_closest_marker("late") is not None))


@pytest.fixture
def one_vcpu():
    """This thread narrowed to one vCPU, as under `taskset -c N`; the full mask comes back after."""
    everything = os.sched_getaffinity(0)
    if len(everything) < 2 or len(everything) < (os.cpu_count() or 0):
        pytest.skip("needs a process that may use every vCPU of a machine with at least 2")
    os.sched_setaffinity(0, {min(everything)})
    yield everything
    os.sched_setaffinity(0, everything)


@pytest.fixture(autouse=True)
def log_streams_outlive_capture():
    """A logging handler made during a test that captures sys.stderr (capsys) writes to pytest's
    capture stream, which closes with the test: Ray Data sets its loggers up on its first run in a
    process. Each later record through it printed "--- Logging error ---" and a traceback, which a
    later test checking the console (tests/unit/test_data.py) saw or not by the order tests ran in."""
    import logging

    yield
    loggers = [
        logging.getLogger(),
        *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for handler in (h for logger in loggers for h in logger.handlers):
        if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
            handler.stream = sys.__stderr__  # fd 2, which pytest's capture reads (setStream flushes the closed one)


# ----------------------------------------------------------------------------- where the suite's time goes
# The suite is CPU-bound on 2 cores (80% of their time busy): what a test costs is the CPU it
# spends, mostly in the Ray processes it starts, which are not its children. With
# RAYTRAIN_TEST_CPU_LOG=<file>, each test appends {test, wall, busy, total}: its seconds
# (set-up, call and teardown) and the machine's busy and total core-seconds meanwhile (/proc/stat).


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log = os.environ.get("RAYTRAIN_TEST_CPU_LOG")
    if not log:
        yield
        return
    from raytrain_cpu.host.features import machine_cpu_seconds

    (busy, total), t0 = machine_cpu_seconds(), time.time()
    yield
    busy_end, total_end = machine_cpu_seconds()
    row = {"test": item.nodeid, "wall": time.time() - t0, "busy": busy_end - busy, "total": total_end - total}
    with open(log, "a") as f:
        f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray started once (starting Ray costs ~10 s here); run() reuses it."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # never join another cluster on the machine (a stale or foreign head)
            num_cpus=2,
            include_dashboard=False,
            runtime_env={
                "env_vars": {
                    "TOKENIZERS_PARALLELISM": "false",
                    "DS_ACCELERATOR": "cpu",
                    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
                    # Ray Train's controller waits this long for a worker group's process groups to
                    # shut down before killing it (30 s by default): a hung peer's restart waits it out.
                    "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": "5",
                    # model.dtype=auto's pick forced for the whole suite (cpu.FORCE_AUTO_DTYPE): the
                    # workers read it, so it goes to them however Ray starts them.
                    **{k: os.environ[k] for k in ("RAYTRAIN_DTYPE_AUTO",) if k in os.environ},
                }
            },
            logging_level="WARNING",
        )
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address

    def raylet_pid() -> str:  # local: pickled by value (workers cannot import conftest)
        return os.environ["RAY_RAYLET_PID"]  # Ray sets it in every process its raylet starts

    raylet = ray.get(ray.remote(num_cpus=0)(raylet_pid).remote())
    yield ray
    ray.shutdown()
    _stop_what_ray_left(raylet)


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory):
    """One data cache for the session: packing the bundled text once saves ~20 s a test."""
    return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture(scope="module")
def tok():
    """The bundled tokenizer, as the `tokenizers` library loads it (the chat data tests' tokens)."""
    from tokenizers import Tokenizer

    from raytrain_cpu.model.tokenizer import BUNDLED_TOKENIZER

    return Tokenizer.from_file(str(BUNDLED_TOKENIZER / "tokenizer.json"))


@pytest.fixture(scope="module")
def eos_id(tok):
    from raytrain_cpu.model.tokenizer import EOS

    return tok.token_to_id(EOS)


@pytest.fixture
def make_config(tmp_path, shared_cache):
    """make_config(*overrides) -> Config of a fast tiny run in a fresh storage dir."""
    from raytrain_cpu.config.schema import load_config

    def make(*overrides: str, storage: str | None = None):
        return load_config(None, fast_overrides(storage or tmp_path / "runs", shared_cache, *overrides))

    return make


@pytest.fixture(scope="session")
def straight(ray_session, tmp_path_factory, shared_cache):
    """STEPS steps on 2 workers without faults, exporting at the end."""
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.launch.driver import run

    storage = tmp_path_factory.mktemp("straight")
    cfg = load_config(None, straight_overrides("straight", storage, shared_cache, "run.export_on_finish=true"))
    summary = run(cfg)
    return {"cfg": cfg, "summary": summary, "run_dir": cfg.run.run_dir, "losses": run_losses(cfg.run.run_dir)}


# The CLI run starts as soon as the tests are collected, when any of them reads it, so that it runs
# beside the unit tier rather than after it. It has its own data cache: the integration tests may
# write the shared one meanwhile. A run still going at the session's end is interrupted as a user
# would (a kill would leave its own Ray running), then killed.
_CLI_RUN: dict = {}


def _start_cli_run(root: Path) -> dict:
    import subprocess

    args = [f"run.storage_path={root / 'runs'}", f"data.cache_dir={root / 'data_cache'}", *CLI_OVERRIDES]
    out, err = (open(root / f"console.{k}", "w") for k in ("out", "err"))  # noqa: SIM115 - closed by cli_run
    p = subprocess.Popen(
        [sys.executable, "-m", "raytrain_cpu.main", *args],
        cwd=TESTS.parent,
        env=child_env(),
        stdout=out,
        stderr=err,
        preexec_fn=die_with_parent,
    )
    return {"p": p, "files": (out, err), "args": args, "t0": time.time()}


def pytest_collection_finish(session):
    if session.config.option.collectonly or not any("cli_run" in getattr(i, "fixturenames", ()) for i in session.items):
        return
    _CLI_RUN.update(_start_cli_run(session.config._tmp_path_factory.mktemp("cli_run")))


def pytest_sessionfinish(session, exitstatus):
    import contextlib
    import signal
    import subprocess

    p = _CLI_RUN.get("p")
    if p is not None and p.poll() is None:
        p.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=60)
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture(scope="session")
def cli_run(tmp_path_factory) -> dict:
    """The CLI_OVERRIDES run: its exit code, console (stdout, stderr), seconds and run directory."""
    from raytrain_cpu.config.schema import load_config

    started = _CLI_RUN or _start_cli_run(tmp_path_factory.mktemp("cli_run"))
    started["p"].wait(timeout=600)
    for f in started["files"]:
        f.close()
    out, err = (Path(f.name).read_text() for f in started["files"])
    return {
        "returncode": started["p"].returncode,
        "stdout": out,
        "stderr": err,
        "seconds": time.time() - started["t0"],
        "run_dir": Path(load_config(None, started["args"]).run.run_dir),
    }
