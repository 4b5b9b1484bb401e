"""A quiet console (issue 13, point 5): raytrain's own lines by default, Ray's with run.verbose=true.

Fast tests check the parts (the line marker, Ray's filter knobs, the stderr filter, the one-line
failure reason); the slow ones run the real entry point and a real Ray: the default console of
`python -m raytrain_cpu.main` holds raytrain's lines only, while run.verbose=true (and a Ray the
caller imported first, as in a notebook) gets the lines Ray forwards as before. Ctrl-C ends the
run with one line saying where it resumes.
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_console_e2e.py."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from raytrain_cpu.obs.console import RAY_CONSOLE_FILTER, _pass_stderr, failure_reason
from raytrain_cpu.obs.metrics import CONSOLE_LINE, console

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

    from raytrain_cpu.launch import signals as raytrain_main

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
