"""A quiet console (issue 13, point 5): raytrain's own lines by default, Ray's with run.verbose=true.

Fast tests check the parts (the line marker, Ray's filter knobs, the stderr filter, the one-line
failure reason); the slow ones run the real entry point and a real Ray: the default console of
`python -m raytrain_cpu.main` holds raytrain's lines only, while run.verbose=true (and a Ray the
caller imported first, as in a notebook) gets the lines Ray forwards as before. Ctrl-C ends the
run with one line saying where it resumes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import CLI_STEPS, child_env

from raytrain_cpu.obs.console import RAY_CONSOLE_FILTER, _pass_stderr, failure_reason
from raytrain_cpu.obs.metrics import CONSOLE_LINE, console

ROOT = Path(__file__).resolve().parents[1]

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


# ----------------------------------------------------------------------------- fast: the parts


def test_console_lines_carry_the_marker(capsys):
    console("[rank 0] step 1/2 | loss 7.6")
    console("[rank 3] two\nlines")
    console("no prefix")
    out = capsys.readouterr().out.splitlines()
    assert out == ["[rank 0] step 1/2 | loss 7.6", "[rank 3] two", "[rank 3] lines", "[raytrain] no prefix"]
    assert all(CONSOLE_LINE.match(line) for line in out)


def test_ray_filter_knobs_pass_only_raytrain_lines():
    """Ray's own deduplicator, set up with the knobs quiet_ray_console sets, on the lines of a run."""
    from ray._private.ray_logging import LogDeduplicator

    ours = [
        "[rank 0] step 10/40 (25%) | loss 6.7121 | lr 2.82e-03",
        "[rank 1] cpu: AMD EPYC (avx2, 2 cores / 2 vCPUs)",
        "[raytrain] worker group failed (rank 1 on node 10.0.0.5: ActorDiedError: ...); restarting",
    ]
    theirs = [
        "Actor with class name: 'PreemptionWatcher' has constructor arguments in the object store and max_restarts > 0.",
        "  self.exclude_resources = exclude_resources",
        "WARNING: 8 PYTHON worker processes have been started on node: abc with address: 10.0.0.5",
        "Reporting training result 1: TrainingReport(checkpoint=Checkpoint(filesystem=local, path=/x))",
        "✔️  Dataset train_rank0 execution finished in 3.79 seconds",
        "Traceback (most recent call last):",
        "",
    ]
    dedup = LogDeduplicator(5, *RAY_CONSOLE_FILTER)
    printed = []
    for pid, line in enumerate(ours + theirs + ours):  # ours twice, from other processes: never merged
        for batch in dedup.deduplicate({"ip": "10.0.0.5", "pid": pid, "lines": [line]}):
            printed += batch["lines"]
    assert printed == ours + ours


def test_stderr_filter_drops_ray_core_lines_only():
    read, write = os.pipe()
    out_read, out_write = os.pipe()
    pump = threading.Thread(target=_pass_stderr, args=(read, os.fdopen(out_write, "wb")))
    pump.start()
    core = b"[2026-11-24 10:26:06,453 E 14559 14559] core_worker.cc:2465: Actor with class name: 'MapWorker' has "
    pieces = [
        b"error: data.path: /x does not exist\n",
        core + b"constructor arguments in the object store and max_restarts > 0.\n",
        b"\rdownloading 10%",  # a progress bar's partial line goes out before its newline
        b"\rdownloading 100%\n",
        core[:30],  # one of Ray's lines, split across writes
        core[30:] + b"...\n",
        b"[2026-11-24 10:26:06,453 F 1 2] logging.cc:1: a fatal line stays\n",
        b"Traceback (most recent call last):\n",
        b"no newline at the end",
    ]
    for piece in pieces:
        os.write(write, piece)
        time.sleep(0.01)
    os.close(write)
    pump.join(timeout=10)
    got = os.read(out_read, 1 << 16)
    assert got == (
        b"error: data.path: /x does not exist\n\rdownloading 10%\rdownloading 100%\n"
        b"[2026-11-24 10:26:06,453 F 1 2] logging.cc:1: a fatal line stays\n"
        b"Traceback (most recent call last):\nno newline at the end"
    )


def test_failure_reason_names_the_worker_that_died():
    """With Ray's own error types: the dead worker first, then a hung one, then the others."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.train.v2._internal.exceptions import (
        UserExceptionWithTraceback,
        WorkerHealthCheckFailedError,
        WorkerHealthCheckTimeoutError,
    )

    died = RayActorError(
        "a1",
        "The actor died unexpectedly before finishing this task.\n\tclass_name: RayTrainWorker\n\tpid: 29446\n"
        "\tip: 10.0.0.5\nThe actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY "
        "Worker exit detail: Task was killed due to the node running low on memory. Memory on the node was 61 GB.",
    )
    dead = WorkerHealthCheckFailedError("A worker health check failed.\nWorker info: Worker(node_ip='10.0.0.5')", died)
    peer = UserExceptionWithTraceback(
        RuntimeError("x"),
        'Traceback (most recent call last):\n  File "train.py", line 116\n    dist.all_reduce(t)\n'
        "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer\n",
    )
    data = UserExceptionWithTraceback(
        ValueError("x"),
        'Traceback (most recent call last):\n  File "data.py"\nraytrain_cpu.data.DataError: bad row 7\n',
    )
    hung = WorkerHealthCheckTimeoutError(
        "A worker health check has been hanging for 21.04 seconds. Marking the worker as dead.\n"
        "Worker info: Worker(node_ip='10.0.0.7', pid=31)"
    )
    assert failure_reason({0: peer, 1: dead}) == (
        "rank 1, pid 29446 on node 10.0.0.5: RayActorError: Task was killed due to the node running low on "
        "memory. (NODE_OUT_OF_MEMORY); rank 0 failed too",
        False,
    )
    reason, _ = failure_reason({0: peer, 3: hung})
    assert reason.startswith("rank 3, pid 31 on node 10.0.0.7: WorkerHealthCheckTimeoutError: A worker health check")
    assert failure_reason({2: data}) == ("rank 2: DataError: bad row 7", False)
    # A Ray Data task's error in the workers' data reads: the cause, not the task's coloured name.
    task = RayTaskError(
        "MapBatches(StreamPlan.fetch)",
        'Traceback (most recent call last):\n  File "data.py", line 1329, in read_blocks\n    rows[c].append(x[r])\n'
        "IndexError: index 7919 is out of bounds for axis 0 with size 5501\n",
        IndexError("index 7919 is out of bounds for axis 0 with size 5501"),
        proctitle="ray::MapBatches(StreamPlan.fetch)",
        pid=7566,
        ip="192.0.2.2",
    ).as_instanceof_cause()
    assert failure_reason({1: task}) == (
        "rank 1, pid 7566 on node 192.0.2.2: IndexError: index 7919 is out of bounds for axis 0 with size 5501 "
        "(in ray::MapBatches)",
        False,
    )


def test_a_worker_lost_with_a_preempted_node_is_told_once(capsys):
    """Ray Train reports the errors on each poll: a preempted node's lost worker again on every one
    until the drain runs out. One line for it; a later error that ends the attempt counts."""
    from ray.exceptions import RayActorError

    from raytrain_cpu.obs.console import restart_notice

    said = "The actor died unexpectedly before finishing this task.\n\tpid: 25142\n\tip: 10.0.0.5"
    notice = restart_notice(1, "checkpoint_000016")
    for _ in range(3):
        notice.after_exception(None, {1: RayActorError("a1", said, False, True)})
    notice.after_exception(None, {1: RayActorError("a1", said, False, False)})  # Ray's view changed
    lost = "worker group failed (rank 1, pid 25142 on node 10.0.0.5: RayActorError: The actor died unexpectedly"
    assert capsys.readouterr().out.splitlines() == [
        f"[raytrain] {lost} before finishing this task.); restarting from checkpoint_000016 once the node's drain "
        "ends (a preempted node: not counted in run.max_failures)",
        f"[raytrain] {lost} before finishing this task.); restarting from checkpoint_000016 (attempt 2 of 2)",
    ]


def test_a_sigterm_while_ray_starts_is_held_then_stops_the_run():
    """ray.init sets Ray's SIGTERM handler (sys.exit mid-call) as it starts: a SIGTERM then was lost
    in a logging lock and the run trained on, or ended as by Ctrl-C (130). It is held while Ray
    starts, then stops the run as a SIGTERM does later (128 + SIGTERM), the caller's handler back."""
    import signal

    from ray._private import utils as ray_utils

    from raytrain_cpu.launch import driver as raytrain_main

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), raytrain_main.sigterm_held_while_ray_starts():
        ray_utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))  # as ray.init does: kept out
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs between bytecodes: this process goes on
    assert raytrain_main.STOP_SIGNAL[0] == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is before
    raytrain_main.STOP_SIGNAL[0] = signal.SIGINT
    with raytrain_main.sigterm_held_while_ray_starts():  # none came: nothing happens
        pass
    assert ray_utils.set_sigterm_handler.__module__ == "ray._private.utils"


def test_prepare_cli_prints_its_own_lines_and_a_one_line_error(tmp_path):
    """`python -m raytrain_cpu.data prepare` starts a Ray of its own: its console held Ray's progress
    logs and a core-worker notice before the error, and overrides after --config were refused."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo."}]}\n{"x": 1}\n'
    )
    args = [f"data.path={bad}", "--config", "configs/sft-local.yaml", f"run.storage_path={tmp_path / 'runs'}"]
    p = subprocess.run(
        [sys.executable, "-m", "raytrain_cpu.data", "prepare", *args],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
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
import sys
from raytrain_cpu.config.schema import load_config
from raytrain_cpu.obs.console import quiet_ray_console

if sys.argv[2] == "import-first":  # as a notebook does: `import ray` before run()
    import ray
print("quiet", quiet_ray_console(load_config(None, [f"run.verbose={sys.argv[1]}"])), flush=True)
import ray

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=True, logging_level="WARNING")

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
def ray_children():
    """Both CHILD processes, started at once (each is mostly Ray starting up); each waits on its
    stdin once it has printed its lines, and is killed at teardown if its test did not finish it."""
    children = {
        case: subprocess.Popen(
            [sys.executable, "-c", CHILD, *case],
            cwd=ROOT,
            env=child_env(),
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
def cli_children(tmp_path_factory, shared_cache):
    """The two CLI runs below, started at once: each is mostly Ray starting and workers loading, so
    side by side they take about the longer one's time (one after the other: 39 s + 28 s here).
    Their consoles go to files (a pipe nobody reads could fill); a run a test left is interrupted
    at teardown as a user would (a kill would leave its Ray running), then killed."""
    import signal

    root = tmp_path_factory.mktemp("cli_children")
    common = [f"run.storage_path={root}", f"data.cache_dir={shared_cache}", "data.tokenize_actors=1"]
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
            [sys.executable, "-m", "raytrain_cpu.main", *args], cwd=ROOT, env=child_env(), stdout=out, stderr=err
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

    from raytrain_cpu.checkpoint.store import latest_reported, verify_checkpoint

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
