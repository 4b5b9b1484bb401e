"""A rank's reads of a prepared cache, in its own process: how fast, and what an evaluation costs.

    python benchmarks/stream_reads.py [--blocks 16384] [--seq-len 1024] [--micro 8] [--rounds 5]

Each training worker reads its blocks itself (`data.stream.train_batches`: `StreamPlan.fetch`
one micro batch at a time, `data.prefetch_batches` ahead on a thread). This times that on a real
parquet cache written by the packer's own writer: the first batch of a stream (the files of its
window opened and decoded), the rate over the whole stream read ahead or not, and two
evaluations (`data.stream.EvalStream`): a tests-sized one (4 batches of 4 blocks) and a whole
4,096-block eval split. Medians of alternating rounds in one process; each round starts with the
files' columns dropped (read again from the page cache).
Writes benchmarks/results/<machine>/stream_reads.json and .md (bench.common.report_script).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import report_script  # benchmarks/ is this script's path
from mixture_stream import write_cache

from raytrain_cpu.data import stream as data
from raytrain_cpu.data.stream import EvalStream, StreamPlan, train_batches


def read_stream(plan: StreamPlan, prefetch: int) -> tuple[float, float]:
    """(seconds to the first batch, blocks/s over the whole stream)."""
    data._decoded_columns.clear()
    t0 = time.perf_counter()
    batches = train_batches(plan, prefetch=prefetch)
    n = len(next(batches)["pos"])
    first = time.perf_counter() - t0
    n += sum(len(b["pos"]) for b in batches)
    return first, n / (time.perf_counter() - t0)


def evaluation_s(stream: EvalStream, micro: int, batches: int | None) -> float:
    data._decoded_columns.clear()
    t0 = time.perf_counter()
    for i, _ in enumerate(stream.batches(micro)):
        if batches and i + 1 >= batches:
            break
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n, seq, micro = args.blocks, args.seq_len, args.micro
    ways = {"prefetch 0": 0, "prefetch 4": 4}
    first, rate = {k: [] for k in ways}, {k: [] for k in ways}
    tiny_eval, whole_eval = [], []
    with tempfile.TemporaryDirectory() as tmp:
        write_cache(Path(tmp) / "train", n, seq, 0)
        write_cache(Path(tmp) / "eval", 4096, seq, 1)
        plan = StreamPlan((str(Path(tmp) / "train"),), (n,), 1234, 65536, micro, 1, 0, 0, n)
        read_stream(plan, 0)  # numpy's and pyarrow's first calls, timed by neither
        for _ in range(args.rounds):
            for name, prefetch in ways.items():
                f, r = read_stream(plan, prefetch)
                first[name].append(f)
                rate[name].append(r)
            tiny_eval.append(evaluation_s(EvalStream(tmp, 1, 0, 4096, 16), 4, 4))
            whole_eval.append(evaluation_s(EvalStream(tmp, 1, 0, 4096), 8, None))
    table = [
        {
            "training stream": name,
            "first batch s": statistics.median(first[name]),
            "blocks/s": statistics.median(rate[name]),
            "tokens/s": statistics.median(rate[name]) * seq,
        }
        for name in ways
    ]
    evaluation = [
        {"evaluation": "4 batches of 4 blocks", "s": statistics.median(tiny_eval)},
        {"evaluation": "a whole 4,096-block split, batches of 8", "s": statistics.median(whole_eval)},
    ]
    note = f"{n:,} blocks of {seq} tokens, micro batches of {micro}; medians of {args.rounds} rounds"
    report_script(
        "stream_reads",
        None,
        tables={"A rank's training stream": table, "An evaluation's reads": evaluation},
        notes=[note],
    )


if __name__ == "__main__":
    main()
