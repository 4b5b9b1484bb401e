"""Ctrl-C and SIGTERM: both stop a run through Ray Train's graceful abort, including a SIGTERM
that comes while Ray starts; the exit code is 128 + the signal (STOP_SIGNAL)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNAL = [signal.SIGINT]  # the signal that stopped the run: the exit code is 128 + it


def stop_on_sigterm() -> None:
    """SIGTERM (`ray job stop`, a Kubernetes pod stop, `timeout`) stops the run as Ctrl-C does:
    through Ray Train's SIGINT handler, a graceful abort of the workers. Ray's own handler, set by
    ray.init, exits mid-call instead: its crash handler prints a stack and the driver aborts (134)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum, frame) -> None:
        STOP_SIGNAL[0] = signal.SIGTERM
        on_sigint = signal.getsignal(signal.SIGINT)  # Ray Train's inside fit()
        if not callable(on_sigint):  # a job started with `&` ignores SIGINT: SIGTERM must still stop it
            raise KeyboardInterrupt
        on_sigint(signal.SIGINT, frame)

    signal.signal(signal.SIGTERM, on_sigterm)


@contextlib.contextmanager
def sigterm_held_while_ray_starts() -> Iterator[None]:
    """A SIGTERM while ray.init runs is held and acted on once Ray has started: the run stops as
    for Ctrl-C, with its line and exit code 143. ray.init sets Ray's own handlers as it starts
    (sys.exit mid-call): a SIGTERM then was lost inside a logging lock ("Exception ignored") and
    the run trained on, or ended as if by Ctrl-C (130). Ray's atexit hook still stops the
    processes it started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from raytrain_cpu.compat.ray import sigterm_handler_kept

    held: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
    try:
        with sigterm_handler_kept():  # ours stays while Ray starts
            yield
    finally:
        signal.signal(signal.SIGTERM, before)
    if held:
        STOP_SIGNAL[0] = signal.SIGTERM
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_kept() -> Iterator[None]:
    """The caller's SIGTERM handler again once the run is over: a notebook or a test process
    that goes on would otherwise keep stop_on_sigterm's (and ray.init's) for good."""
    before = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)
