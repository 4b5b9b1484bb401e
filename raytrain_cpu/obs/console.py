"""The driver's console: which of Ray's lines reach the terminal, and the one-line reasons for
a failed attempt. Used by the driver and by one-process commands (prepare, evaluate) that start a
local Ray."""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_cpu.obs.metrics import CONSOLE_LINE, ray_console_handlers

if TYPE_CHECKING:
    from raytrain_cpu.config.schema import Config

# The default console keeps raytrain's own lines: the driver's ([raytrain], [data], the
# summary), the workers' (metrics.console: "[rank N] ..." progress, [load], eval, resume) and
# one line per failed attempt. Everything else Ray prints stays complete in its log
# directory: the workers' and actors' stdout/stderr files, the core workers' logs, and this
# driver's Ray log records (raytrain-driver.log). run.verbose=true prints it all here, as before.


RAY_CONSOLE_FILTER = (CONSOLE_LINE.pattern, "^")
"""(RAY_DEDUP_LOGS_ALLOW_REGEX, RAY_DEDUP_LOGS_SKIP_REGEX) of the quiet console: of the lines Ray
forwards to the driver, raytrain's are always printed and every other one never."""


def quiet_ray_console(cfg: Config) -> bool:
    """Whether run()'s console is quiet: a Ray it starts (not the caller's) and run.verbose off.
    Then, of what Ray forwards to this driver (worker and actor output, raylet notices), only
    raytrain's lines are printed (metrics.CONSOLE_LINE), without Ray's "(RayTrainWorker pid=...)".

    Ray's documented log-deduplication knobs do it: a line matching RAY_DEDUP_LOGS_ALLOW_REGEX is
    always printed, one matching RAY_DEDUP_LOGS_SKIP_REGEX never. Autoscaler events (a request
    the cluster can't place) bypass them and still show. Ray reads the knobs when it is imported,
    so this runs before `import ray`; where Ray was imported already (a notebook), the same values
    go onto the objects Ray built from them, and a Ray without those objects prints everything.
    """
    ray = sys.modules.get("ray")
    if cfg.run.verbose or (ray is not None and ray.is_initialized()):
        return False
    knobs = {
        "RAY_DEDUP_LOGS_ALLOW_REGEX": RAY_CONSOLE_FILTER[0],
        "RAY_DEDUP_LOGS_SKIP_REGEX": RAY_CONSOLE_FILTER[1],
        "RAY_DISABLE_WORKER_LOG_PREFIX": "1",
    }
    for key, value in knobs.items():
        os.environ.setdefault(key, value)  # a value the user set wins
    if ray is not None:
        from raytrain_cpu.compat.ray import console_dedup

        env = os.environ
        console_dedup(
            env["RAY_DEDUP_LOGS_ALLOW_REGEX"],
            env["RAY_DEDUP_LOGS_SKIP_REGEX"],
            env["RAY_DISABLE_WORKER_LOG_PREFIX"] == "1",
        )
    return True


def quiet_ray_loggers() -> logging.Handler:
    """Ray's Python loggers in this process ("ray", and "ray.data" with its own console handler)
    print ERROR and above only. The rest is kept by the returned handler, which buffers it until
    ray_log_file() writes it to Ray's log directory (ray.data writes its own ray-data.log there)."""
    import logging.handlers

    ray_console_errors_only()
    buffer = logging.handlers.MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1)
    logging.getLogger("ray").addHandler(buffer)
    return buffer


def ray_log_file(buffer: logging.Handler, logs_dir: Path) -> None:
    """Moves quiet_ray_loggers' buffer (what Ray logged during ray.init) into raytrain-driver.log."""
    handler = logging.FileHandler(logs_dir / "raytrain-driver.log")
    handler.setFormatter(
        logging.Formatter("%(asctime)s\t%(levelname)s %(name)s %(filename)s:%(lineno)s -- %(message)s")
    )
    ray_logger = logging.getLogger("ray")
    buffer.setTarget(handler)
    buffer.flush()
    ray_logger.removeHandler(buffer)
    ray_logger.addHandler(handler)


# A line of Ray's C++ logging: "[2026-11-24 10:26:06,453 E 14559 14559] core_worker.cc:2465: ..."
CORE_LOG_LINE = re.compile(rb"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [IWE] \d+ \d+\] \S+:\d+: ")


def ray_console_errors_only() -> None:
    """Ray's Python loggers ("ray", and "ray.data" with its own handler) print ERROR and above on
    the console; their log files keep everything."""
    import ray.data  # noqa: F401  (sets up ray.data's handlers, to quiet them here)

    for handler in ray_console_handlers():
        handler.setLevel(logging.ERROR)


def quiet_local_console() -> None:
    """For a one-process command (prepare, evaluate) that starts a local Ray to pack data: Ray's
    loggers print errors only (Ray Data's records stay in ray-data.log) and the core worker's
    notices are dropped (`hide_core_log_lines`), so the console holds the command's own lines
    and its one-line error."""
    ray_console_errors_only()
    hide_core_log_lines()


def hide_core_log_lines() -> Callable[[], None]:
    """Ray's C++ core worker in this process writes its warnings and errors to fd 2 besides its log
    file (python-core-driver-*.log in Ray's log directory), e.g. "Actor ... has constructor
    arguments in the object store" each time Ray Data starts its tokenizer actors. A pipe in
    front of fd 2 drops those lines and passes everything else straight through (fatal errors
    included). Returns what puts fd 2 back; it also runs at exit, after a last traceback."""
    try:
        sys.stderr.flush()
        terminal = os.fdopen(os.dup(2), "wb")
        read, write = os.pipe()
    except (OSError, ValueError):  # no usable fd 2
        return lambda: None
    os.dup2(write, 2)
    os.close(write)
    pump = threading.Thread(target=_pass_stderr, args=(read, terminal), name="raytrain-stderr", daemon=True)
    pump.start()

    def restore() -> None:
        if pump.is_alive():
            sys.stderr.flush()
            os.dup2(terminal.fileno(), 2)  # the pipe's last write end goes: the pump drains it and ends
            pump.join(timeout=5)

    atexit.register(restore)
    return restore


def _pass_stderr(read: int, out: Any) -> None:
    """Copies the pipe to the terminal as it comes (a progress bar's partial line too), holding
    back only the start of a line that may turn out to be one of Ray's C++ log lines."""
    held, mode = b"", "undecided"  # what happens to the current line: undecided (held), pass, drop
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while chunk := pipe.read(1 << 16):
            for piece in filter(None, re.split(rb"(?<=\n)", chunk)):
                if mode == "undecided":
                    held += piece
                    if not (held.endswith(b"\n") or not held.startswith(b"[") or len(held) > 80):
                        continue
                    mode = "drop" if CORE_LOG_LINE.match(held) else "pass"
                    piece, held = held, b""
                if mode == "pass":
                    out.write(piece)
                if piece.endswith(b"\n"):
                    mode = "undecided"
            out.flush()
    if held and not CORE_LOG_LINE.match(held):
        out.write(held)
    out.flush()


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours a task's name in its errors
EXCEPTION_LINE = re.compile(r"^(?:\w+\.)*[A-Z]\w*(?:Error|Exception)(?::|$)")  # "IndexError: index 7 is ..."
MODULE_PREFIX = re.compile(r"^(?:\w+\.)+(?=\w+:)")  # "ray.exceptions." of "ray.exceptions.RayError: ..."


def failure_reason(errors: dict[int, BaseException]) -> tuple[str, bool]:
    """("rank 1 on node 10.0.0.5: ActorDiedError: ...", preempted) for one failed attempt.

    Names the error that most likely caused the others: a worker that died, then one that hung
    (its health check timed out), before the collective errors its peers raise in turn.
    """

    def cause(e: BaseException) -> BaseException:  # a failed health check wraps the actor's death
        return getattr(e, "health_check_failure", None) or e

    def likely_first(rank: int) -> tuple[int, int]:
        e = cause(errors[rank])
        dead = hasattr(e, "actor_init_failed")  # a RayActorError: the worker process is gone
        return (0 if dead else 1 if "Timeout" in type(e).__name__ else 2, rank)

    rank = min(errors, key=likely_first)
    e = cause(errors[rank])
    lines = [x.strip() for x in ANSI_ESCAPE.sub("", str(e)).strip().splitlines() if x.strip()] or [""]
    exit_detail = re.search(r"Worker exit type: (\w+) Worker exit detail: (.+?\.)(?:\s|$)", " ".join(lines))
    if exit_detail:  # a dead worker: Ray's account of how its process ended
        message = f"{type(e).__name__}: {exit_detail.group(2)} ({exit_detail.group(1)})"
    elif lines[0].startswith("Traceback"):  # an exception in the training loop: its last line
        message = MODULE_PREFIX.sub("", lines[-1])
    elif lines[0].startswith("ray::") and (raised := next(filter(EXCEPTION_LINE.match, lines[1:]), None)):
        # A Ray task's error (a Ray Data read or tokenizing task) names the task, then the
        # exception that caused it, before the one Ray raised from it: that first is the cause.
        message = f"{MODULE_PREFIX.sub('', raised)} (in {lines[0].split('(')[0]})"
    else:
        message = f"{type(e).__name__}: {lines[0]}"
    node = re.search(r"(?:\bip: |\bip=|node_ip=')([\w.:-]+)", str(errors[rank]))
    pid = re.search(r"\bpid(?:: |=)(\d+)", str(errors[rank]))
    where = f"rank {rank}" + (f", pid {pid.group(1)}" if pid else "") + (f" on node {node.group(1)}" if node else "")
    others = sorted(set(errors) - {rank})
    also = f"; rank {', '.join(map(str, others))} failed too" if others else ""
    preempted = any(getattr(cause(x), "preempted", False) for x in errors.values())
    message = message if len(message) <= 500 else message[:499] + "…"
    return f"{where}: {message}{also}", preempted


def restart_notice(max_failures: int, start_checkpoint: str | None) -> Any:
    """A Ray Train callback that prints one line per failed attempt on the console: the reason
    and what Ray Train does next (as its FailureConfig decides: run.max_failures, preemptions not
    counted). Ray's own report, every rank's traceback, stays in the controller's log.

    Defined here, not at module level, so that importing this module doesn't import Ray (its
    console knobs are read at import); the class travels to the controller by value.
    """
    import ray.train

    from raytrain_cpu.obs.metrics import console

    class RestartNotice(ray.train.UserCallback):
        def __init__(self) -> None:
            self.checkpoint, self.failures, self.preempted = start_checkpoint, 0, set()

        def after_report(self, run_context, metrics, checkpoint) -> None:
            if checkpoint is not None:
                self.checkpoint = Path(checkpoint.path).name

        def after_exception(self, run_context, worker_exceptions) -> None:
            # Ray Train calls this on every poll that finds errors. A worker lost with a preempted
            # node is found again on each poll until the node's drain runs out (then Ray restarts,
            # not counting it) or another error ends the attempt (then it counts, said below).
            reason, preempted = failure_reason(worker_exceptions)
            if preempted and reason in self.preempted:  # the same loss, found again
                return
            start = self.checkpoint or "step 0"
            self.failures += not preempted
            if preempted:
                self.preempted.add(reason)
                then = f"restarting from {start} once the node's drain ends (a preempted node: not counted in run.max_failures)"
            elif max_failures == -1 or self.failures <= max_failures:
                of = "" if max_failures == -1 else f" of {max_failures + 1}"
                then = f"restarting from {start} (attempt {self.failures + 1}{of})"
            else:
                then = f"no restarts left (run.max_failures={max_failures}), the run stops"
            console(f"[raytrain] worker group failed ({reason}); {then}")

    return RestartNotice()
