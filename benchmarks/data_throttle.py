"""Ray Data's scheduling loop in a training worker: spaced always, spaced unless a rank waits, unspaced.

    python benchmarks/data_throttle.py [--rounds 5] [--blocks 4096] [--seq-len 256]

A rank's streams run Ray Data's streaming executor as a thread of the training process
(`raytrain_cpu/datathrottle.py`). Three ways to run its loop, side by side in one process on a
local Ray with 2 CPUs, alternating rounds (this machine is shared and noisy: compare the ratios):

- `unspaced`: Ray's own loop;
- `spaced`: every step at least 100 ms after the last (raytrain's former throttle);
- `spaced_unless_waited`: spaced only while no consumer waits on the stream's output (now).

Measured per way, medians of the rounds:
- an evaluation as the tests' tiny runs make it: a new eval stream (`data.eval_stream`), 4
  batches of 4 blocks, time to the first batch and to the last;
- a whole eval split (`--blocks` blocks, batches of 8), as the default run evaluates;
- the idle loop's CPU: a training stream (`data.train_stream`) whose consumer took one batch
  and then sleeps 3 s (a long step), the process's CPU seconds per second of that sleep, the
  spinning the spacing exists to stop.
Writes benchmarks/results/<machine>/data_throttle.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from raytrain_cpu.data import throttle as datathrottle
from raytrain_cpu.data.prepare import _BlockWriter
from raytrain_cpu.data.stream import StreamPlan, eval_stream, train_stream
from raytrain_cpu.host.features import cpu_features

RESULTS = Path(__file__).parent / "results" / cpu_features().slug  # one folder per machine
WAYS = ("unspaced", "spaced", "spaced_unless_waited")
IDLE_S = 3.0


class AlwaysSpaced(datathrottle.ThrottleScheduling):
    """The throttle as it was: every step spaced, waited on or not."""

    def on_execution_step(self, executor) -> None:  # noqa: ANN001
        wait = datathrottle.MIN_STEP_INTERVAL_S - (time.perf_counter() - self._last)
        if wait > 0:
            time.sleep(wait)
        self._last = time.perf_counter()


CALLBACKS = {"unspaced": [], "spaced": [AlwaysSpaced], "spaced_unless_waited": [datathrottle.ThrottleScheduling]}


def write_split(path: Path, blocks: int, seq_len: int) -> None:
    rng = np.random.default_rng(0)
    writer = _BlockWriter(path, seq_len)
    for _ in range(blocks):
        writer.add(rng.integers(0, 32_000, seq_len, dtype=np.int32))
    writer.close()


def timed_iteration(ds, batch_size: int, batches: int | None) -> tuple[float, float]:
    """(seconds to the first batch, seconds to the last) of iterating `ds` afresh."""
    t0 = time.perf_counter()
    first = None
    it = iter(ds.iter_batches(batch_size=batch_size, batch_format="numpy"))
    for i, _ in enumerate(it):
        first = first if first is not None else time.perf_counter() - t0
        if batches is not None and i + 1 == batches:
            break
    elapsed = time.perf_counter() - t0
    it.close()
    return first, elapsed


def idle_cpu_per_s(cache: Path, blocks: int) -> float:
    """CPU seconds per second while a training stream's consumer sleeps after its first batch."""
    # Many epochs of positions: the stream cannot finish while the consumer sleeps, it backpressures.
    plan = StreamPlan((str(cache / "train"),), (blocks,), 0, 1024, 4, 1, 0, 0, 100 * blocks)
    it = iter(train_stream(plan).iter_batches(batch_size=4, batch_format="numpy"))
    next(it)
    time.sleep(1.0)  # the buffers fill and the stream backpressures
    c0 = time.process_time()
    time.sleep(IDLE_S)
    used = (time.process_time() - c0) / IDLE_S
    it.close()  # stops the stream's executor before the next measurement
    return used


def one_round(way: str, cache: Path, blocks: int) -> dict[str, float]:
    from ray.data import DataContext

    DataContext.get_current().custom_execution_callback_classes = list(CALLBACKS[way])
    tiny_first, tiny_all = timed_iteration(eval_stream(cache, 1, 0, blocks, 16), 4, 4)
    _, whole = timed_iteration(eval_stream(cache, 1, 0, blocks), 8, None)
    return {
        "eval_first_batch_s": tiny_first,
        "eval_4_batches_s": tiny_all,
        "eval_whole_split_s": whole,
        "idle_loop_cpu_per_s": idle_cpu_per_s(cache, blocks),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp)
            write_split(cache / "train", args.blocks, args.seq_len)
            write_split(cache / "eval", args.blocks, args.seq_len)
            one_round("unspaced", cache, args.blocks)  # warm-up: Ray's worker pool, the page cache
            rounds = {way: [] for way in WAYS}
            for r in range(args.rounds):
                for way in WAYS[r % 3 :] + WAYS[: r % 3]:  # each way goes first in turn
                    rounds[way].append(one_round(way, cache, args.blocks))
                    print(way, {k: round(v, 3) for k, v in rounds[way][-1].items()}, flush=True)
    finally:
        ray.shutdown()
    medians = {way: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for way, rs in rounds.items()}
    result = {
        "machine": cpu_features().describe(),
        "blocks": args.blocks,
        "seq_len": args.seq_len,
        "rounds": args.rounds,
        "medians": medians,
        "spaced_over_spaced_unless_waited": {
            k: medians["spaced"][k] / medians["spaced_unless_waited"][k] for k in medians["spaced"]
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "data_throttle.json").write_text(json.dumps(result, indent=2))
    metrics = list(medians["spaced"])
    lines = [
        f"Ray Data's scheduling loop, medians of {args.rounds} alternating rounds ({result['machine']}; "
        f"eval split {args.blocks} blocks of {args.seq_len} tokens)",
        "",
        "| way | " + " | ".join(metrics) + " |",
        "|---|" + "---:|" * len(metrics),
    ]
    lines += [f"| {way} | " + " | ".join(f"{medians[way][k]:.3f}" for k in metrics) + " |" for way in WAYS]
    table = "\n".join(lines)
    (RESULTS / "data_throttle.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
