"""Keep Ray Data's scheduling loop from spinning inside the training workers.

Each rank iterates its own stream, so Ray Data's streaming executor runs as a thread in the
training process. When its operators are backpressured (the prefetch buffer is full and no
task is running) the loop has nothing to `ray.wait` on and goes round without sleeping
(Ray 2.60): a large share of a core while the consumer sleeps, and the GIL taken from the
training thread, whose ZeRO-3 hooks are Python, so training slowed until its stream had been
fully produced. Backpressured streaming tasks count as ready, so `ray.wait` does not block
either. This callback spaces the loop's steps 100 ms apart, which cuts the loop's CPU without
draining slower (benchmarks/data_throttle.py): a freed buffer slot is refilled within that,
far below a training step and covered by the batches the iterator prefetches. Only the
training streams get it, not the tokenizing pipeline.

It spaces only the steps nobody waits on. While a rank is blocked on its next batch (a stream
starting, at the first step and at every evaluation, which opens new streams), the loop is
doing the work that rank waits for, so it runs at Ray's own pace: spaced, each evaluation
would wait several times longer for its first batch. A wait past STALL_S is a stall, and
spaced again.

Kept in its own module because subclassing Ray Data's callback (which Ray exports nowhere
public: compat.ray) imports `ray.data`, which the CLI's validation (before Ray starts) should
not pay for.
"""

from __future__ import annotations

import time

from raytrain_cpu.compat import ray as ray_compat

# Ray Data's own ray.wait timeout: the cadence the loop was meant to have when nothing finishes.
MIN_STEP_INTERVAL_S = 0.1
# How often a spaced loop looks for a waiting consumer: Ray's own poll of an empty output queue.
WAKE_S = 0.01
# A consumer waiting longer than this is a stall, not a stream starting (a cold stream's first
# batch can take over a second): nothing may be launchable (no CPU left for the stream's tasks),
# and an unspaced loop would spin through it. Its steps are spaced again.
STALL_S = 2.0


class ThrottleScheduling(ray_compat.execution_callback_class()):
    """Spaces scheduling steps at least MIN_STEP_INTERVAL_S apart, unless a consumer waits."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._waiting_since: float | None = None

    def on_execution_step(self, executor) -> None:  # noqa: ANN001 - Ray's StreamingExecutor
        deadline = self._last + MIN_STEP_INTERVAL_S
        now = time.perf_counter()
        # Slept in slices: a consumer that starts waiting mid-interval ends the wait.
        while now < deadline and not self._served(executor, now):
            time.sleep(min(deadline - now, WAKE_S))
            now = time.perf_counter()
        self._last = now

    def _served(self, executor, now: float) -> bool:  # noqa: ANN001
        """Whether a consumer waits on the stream, for less than STALL_S so far."""
        if not consumer_waiting(executor):
            self._waiting_since = None
            return False
        if self._waiting_since is None:
            self._waiting_since = now
        return now - self._waiting_since < STALL_S


def consumer_waiting(executor) -> bool:  # noqa: ANN001 - Ray's StreamingExecutor
    """Whether a consumer is blocked on the stream's output; False where this Ray keeps no such
    count, so the loop stays spaced."""
    return ray_compat.waiting_consumers(executor) > 0


def install(ctx) -> None:  # noqa: ANN001 - ray.data.DataContext
    """Registers the throttle on `ctx`; datasets built afterwards carry it to where they run."""
    if ThrottleScheduling not in ctx.custom_execution_callback_classes:
        ctx.custom_execution_callback_classes.append(ThrottleScheduling)
