"""A quiet console (issue 13, point 5): raytrain's own lines by default, Ray's with run.verbose=true.

Fast tests check the parts (the line marker, Ray's filter knobs, the stderr filter, the one-line
failure reason); the slow ones run the real entry point and a real Ray: the default console of
`python -m raytrain_cpu.main` holds raytrain's lines only, while run.verbose=true (and a Ray the
caller imported first, as in a notebook) gets the lines Ray forwards as before. Ctrl-C ends the
run with one line saying where it resumes.
This module's in-process tests: tests/unit/test_console.py."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import CLI_STEPS, child_env

ROOT = Path(__file__).resolve().parents[2]


# What the default console used to show (issue 13), none of which it may show now.
RAY_NOISE = [
    "has constructor arguments in the object store",
    "exclude_resources",
    "PYTHON worker processes have been started",
    "registers for logging while another dataset",
    "Progress bars disabled",
    "execution finished",
    "Reporting training result",
    "TrainingReport(",
    "Setting up process group",
    "Started training worker group",
    "(RayTrainWorker pid=",
    "(TrainController pid=",
    "(raylet)",
    "Traceback",
    "Token authentication",
    "Writing model shards",
]


def test_prepare_cli_prints_its_own_lines_and_a_one_line_error(ray_session, tmp_path):
    """`python -m raytrain_cpu.data prepare` (here joining the session's Ray, as under `ray job
    submit`, rather than starting one): its console held Ray's progress logs and a core-worker
    notice before the error, and overrides after --config were refused."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo."}]}\n{"x": 1}\n'
    )
    args = [f"data.path={bad}", "--config", "configs/sft-local.yaml", f"run.storage_path={tmp_path / 'runs'}"]
    p = subprocess.run(
        [sys.executable, "-m", "raytrain_cpu.data", "prepare", *args],
        cwd=ROOT, env=child_env(join_session=True), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert [line.split(" ", 1)[0] for line in p.stdout.splitlines()] == ["[data]", "[data]"], p.stdout
    assert p.stderr.splitlines() == [
        f"error: {bad}, line 2: no 'messages' field (has ['x']); set data.messages_column (ShareGPT's 'conversations'"
        " is recognised as it is). Fix the row, or set data.bad_rows=skip to drop such rows."
    ]


# ----------------------------------------------------------------------------- slow: the real thing


@pytest.mark.slow
def test_default_console_is_raytrain_lines_only(cli_run, record_property):
    """The entry point as a user runs it (conftest's `cli_run`, guards firing on injected faults
    included): its console holds raytrain's lines, every one of them."""
    console_lines = (cli_run["stdout"] + cli_run["stderr"]).splitlines()
    record_property("console_lines", len(console_lines))
    shown = "\n".join(console_lines)
    print(f"\n[console] {len(console_lines)} lines in {cli_run['seconds']:.0f}s:\n{shown}")
    assert cli_run["returncode"] == 0, cli_run["stderr"][-3000:]
    for noise in RAY_NOISE:
        assert not any(noise in line for line in console_lines), noise
    ours = re.compile(r"^(\[(?:raytrain|data|rank \d+)\] |== raytrain_cpu summary ==$|[a-z][a-z/ ]+ {2,}\S|$)")
    assert [line for line in console_lines if not ours.match(line)] == []
    assert f"[rank 0] step 2/{CLI_STEPS} " in shown and f"[rank 0] step {CLI_STEPS}/{CLI_STEPS} " in shown
    assert f"[rank 0] step {CLI_STEPS} eval loss" in shown
    assert "[rank 0] guard: step 12: loss " in shown and "[rank 0] guard: step 16: " in shown  # the injected faults
    assert "== raytrain_cpu summary ==" in shown and f"\nsteps            {CLI_STEPS}\n" in shown
    logs = re.search(r"^\[raytrain\] Ray's own logs: (\S+) ", shown, re.M)
    assert logs and (Path(logs.group(1)) / "raytrain-driver.log").is_file()  # Ray's lines went there


CHILD = """
import os
import sys
from raytrain_cpu.config.schema import load_config
from raytrain_cpu.obs.console import quiet_ray_console

if sys.argv[2] == "import-first":  # as a notebook does: `import ray` before run()
    import ray
print("quiet", quiet_ray_console(load_config(None, [f"run.verbose={sys.argv[1]}"])), flush=True)
import ray

ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True, logging_level="WARNING")  # the session's Ray

@ray.remote(num_cpus=0)
def noisy():
    print("Progress bars disabled. To enable, set ...", flush=True)
    print("[rank 0] done", flush=True)

ray.get(noisy.remote())
sys.stdin.readline()  # the test saw the last line
ray.shutdown()
"""


VERBOSE_CASES = [("true", "import-after"), ("false", "import-first")]


@pytest.fixture(scope="module")
def ray_children(ray_session):
    """Both CHILD processes, started at once, each a driver of the session's Ray (what Ray forwards
    to a driver is the same whether it started that Ray or joined it); each waits on its stdin once
    it has printed its lines, and is killed at teardown if its test did not finish it."""
    children = {
        case: subprocess.Popen(
            [sys.executable, "-c", CHILD, *case],
            cwd=ROOT,
            env=child_env(join_session=True),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for case in VERBOSE_CASES
    }
    yield children
    for p in children.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
@pytest.mark.parametrize(("verbose", "order"), VERBOSE_CASES)
def test_verbose_shows_ray_lines(verbose, order, ray_children):
    """run.verbose=true keeps what Ray forwards (its own lines, with their process prefix); quiet also
    works where Ray was imported before (a notebook). Ray lines of one worker arrive in order, so
    once "[rank 0] done" is here, the line before it is too, or was dropped."""
    p = ray_children[(verbose, order)]
    watchdog = threading.Timer(180, p.kill)
    watchdog.start()
    lines = []
    for line in p.stdout:
        lines.append(line.rstrip("\n"))
        if line.rstrip().endswith("[rank 0] done"):
            break
    p.stdin.write("\n")
    p.stdin.flush()
    p.communicate(timeout=120)
    watchdog.cancel()
    assert lines[0] == f"quiet {verbose == 'false'}", lines
    forwarded = [line for line in lines if "Progress bars disabled" in line or "[rank 0] done" in line]
    if verbose == "true":
        assert re.match(r"^\S*\(noisy pid=\d+\)\S* Progress bars disabled", forwarded[0]), lines
        assert re.match(r"^\S*\(noisy pid=\d+\)\S* \[rank 0\] done$", forwarded[1]), lines
    else:
        assert forwarded == ["[rank 0] done"], lines


def _broken_model(root: Path) -> Path:
    """The tiny model with an activation transformers does not have in its config.json: it passes
    the driver's checks and fails on the workers."""
    import json

    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.model.loading import write_tiny_model
    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path

    model = root / "model"
    write_tiny_model(load_config(None, []), load_tokenizer(resolve_tokenizer_path("bundled", "tiny")), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"hidden_act": "no_such_activation"}))
    return model


@pytest.fixture(scope="module")
def cli_children(ray_session, tmp_path_factory, shared_cache):
    """The two CLI runs below, started at once: each is mostly Ray starting and workers loading, so
    side by side they take about the longer one's time. The one Ctrl-C stops starts a Ray of its
    own, as the command does on a laptop; the failing one joins the session's (RAY_ADDRESS, as
    under `ray job submit`), which saves a Ray's start-up. Their consoles go to files (a pipe
    nobody reads could fill); a run a test left is interrupted at teardown as a user would (a
    kill would leave its Ray running), then killed."""
    import signal

    root = tmp_path_factory.mktemp("cli_children")
    common = [f"run.storage_path={root}", f"data.cache_dir={shared_cache}", "data.tokenize_actors=1"]
    common.append("scaling.num_workers=1")  # what the console says does not depend on the workers' number
    common.append("run.poll_interval_s=0.25")  # Ray registers the checkpoints Ctrl-C waits for sooner
    runs = {
        # Trains "forever", checkpointing every 4 steps: Ctrl-C stops it.
        "stopped": [*common, "run.name=stopped", "train.max_steps=100000", "train.checkpoint_every=4"]
        + ["train.eval_every=0", "data.seq_len=64", "train.micro_batch_size=4"],
        # Fails on its workers past run.max_failures (0).
        "broken": [*common, "run.name=broken", f"model.name_or_path={_broken_model(root)}", "train.max_steps=2"],
    }
    children = {}
    for name, args in runs.items():
        out, err = (open(root / f"{name}.{k}", "w") for k in ("out", "err"))  # noqa: SIM115 - closed below
        p = subprocess.Popen(
            [sys.executable, "-m", "raytrain_cpu.main", *args],
            cwd=ROOT,
            env=child_env(join_session=name == "broken"),
            stdout=out,
            stderr=err,
        )
        children[name] = {"p": p, "run_dir": root / name, "files": (out, err), "err": root / f"{name}.err"}
    yield children
    for child in children.values():
        p = child["p"]
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in child["files"]:
            f.close()


@pytest.mark.slow
def test_ctrl_c_stops_the_run_and_says_where_it_can_resume(cli_children):
    """Ray Train turns Ctrl-C into an abort and exits the driver with SystemExit(1), logging only to
    the files the quiet console keeps. The CLI says what stopped and where the run resumes, exit 130."""
    import signal

    from raytrain_cpu.checkpoint.record import latest_reported
    from raytrain_cpu.checkpoint.verify import verify_checkpoint

    child = cli_children["stopped"]
    p, run_dir = child["p"], child["run_dir"]
    deadline = time.time() + 300
    while latest_reported(run_dir) is None and p.poll() is None and time.time() < deadline:
        time.sleep(1)
    assert p.poll() is None, child["err"].read_text()[-3000:]
    p.send_signal(signal.SIGINT)
    p.wait(timeout=120)
    err = child["err"].read_text()
    assert p.returncode == 130, err[-3000:]
    latest = latest_reported(run_dir)
    assert f"[raytrain] interrupted: run 'stopped' stopped before step 100000; its latest checkpoint is {latest}" in err
    assert verify_checkpoint(latest)["step"] % 4 == 0  # whole, as Ray Train recorded it: a resume starts there


@pytest.mark.slow
def test_a_failed_run_ends_with_its_cause_in_one_line(cli_children):
    """Workers that fail past run.max_failures (here: a model config.json that passes the driver's
    checks, with an activation transformers does not have) end the CLI with exit 1 and one line:
    the failed rank's error and where the run resumes, not Ray's WorkerGroupError traceback."""
    child = cli_children["broken"]
    child["p"].wait(timeout=300)
    err = child["err"].read_text()
    assert child["p"].returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: run 'broken' failed (rank "), err[-3000:]
    assert "no_such_activation" in last and "it had saved no checkpoint yet" in last
    assert "Traceback" not in err and "WorkerGroupError" not in err
