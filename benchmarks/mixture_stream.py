"""Data mixtures: what interleaving sources costs a worker's stream, side by side with one source.

    python benchmarks/mixture_stream.py [--blocks 16384] [--seq-len 1024] [--rounds 5]

A rank's training stream maps global positions to cache rows (`data.StreamPlan.fetch`; this
times it at 256 positions a call, as Ray Data's map_batches called it until each rank read its
own blocks one micro batch at a time: benchmarks/stream_reads.py). This times that function on real parquet
caches written by the packer's own writer: one source of N blocks, against a 3:1 mixture of
two sources holding the same N blocks, alternating A/B rounds in one process (this machine is
shared and noisy: compare the ratio). Cold = a pass that reads the parquet files (from the page
cache: they were just written); warm = a second pass over the same positions (the files' columns
are kept, as in a long run). Medians of the rounds.
Writes benchmarks/results/<machine>/mixture_stream.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from raytrain_cpu.data import stream as data
from raytrain_cpu.data.prepare import _BlockWriter
from raytrain_cpu.data.stream import StreamPlan, mix_pattern
from raytrain_cpu.host.features import cpu_features

RESULTS = Path(__file__).parent / "results" / cpu_features().slug  # one folder per machine
BATCH = 256  # positions a call


def write_cache(path: Path, blocks: int, seq_len: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    writer = _BlockWriter(path, seq_len)
    for _ in range(blocks):
        writer.add(rng.integers(0, 128_000, seq_len, dtype=np.int32))
    writer.close()
    return str(path)


def blocks_per_s(plan: StreamPlan, n: int) -> float:
    t0 = time.perf_counter()
    for lo in range(0, n, BATCH):
        plan.fetch({"id": np.arange(lo, min(lo + BATCH, n))})
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n, seq = args.blocks, args.seq_len
    with tempfile.TemporaryDirectory() as tmp:
        one = write_cache(Path(tmp) / "one", n, seq, 0)
        big = write_cache(Path(tmp) / "big", n * 3 // 4, seq, 1)
        small = write_cache(Path(tmp) / "small", n // 4, seq, 2)
        plans = {
            "one source": StreamPlan((one,), (n,), 1234, 65536, 8, 1, 0, 0, n),
            "3:1 mixture": StreamPlan(
                (big, small), (n * 3 // 4, n // 4), 1234, 65536, 8, 1, 0, 0, n, pattern=tuple(mix_pattern([3, 1]))
            ),
        }
        blocks_per_s(plans["one source"], n)  # numpy's and pyarrow's first calls, timed by neither
        cold, warm = {k: [] for k in plans}, {k: [] for k in plans}
        for _ in range(args.rounds):
            for name, plan in plans.items():
                data._decoded_columns.clear()  # the files' columns read again (from the page cache)
                cold[name].append(blocks_per_s(plan, n))
                warm[name].append(blocks_per_s(plan, n))
    rows = {
        name: {"cold_blocks_per_s": statistics.median(cold[name]), "warm_blocks_per_s": statistics.median(warm[name])}
        for name in plans
    }
    ratio = {k: rows["3:1 mixture"][k] / rows["one source"][k] for k in ("cold_blocks_per_s", "warm_blocks_per_s")}
    features = cpu_features()
    result = {
        "host": {"cpu": features.model_name, "isa": features.best_isa},
        "blocks": n,
        "seq_len": seq,
        "batch": BATCH,
        "rounds": args.rounds,
        "rows": rows,
        "mixture_over_one_source": ratio,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mixture_stream.json").write_text(json.dumps(result, indent=2))
    table = [
        f"# Mixture stream ({features.model_name}, {features.best_isa})",
        "",
        f"`python benchmarks/mixture_stream.py --blocks {n} --seq-len {seq} --rounds {args.rounds}`: "
        f"StreamPlan.fetch over {n:,} blocks of {seq} tokens, {BATCH} positions a call; medians of "
        f"{args.rounds} alternating rounds.",
        "",
        "| stream | cold blocks/s | warm blocks/s | warm tokens/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        table.append(
            f"| {name} | {r['cold_blocks_per_s']:,.0f} | {r['warm_blocks_per_s']:,.0f} | "
            f"{r['warm_blocks_per_s'] * seq:,.0f} |"
        )
    table += [
        "",
        f"Mixture / one source: cold {ratio['cold_blocks_per_s']:.2f}x, warm {ratio['warm_blocks_per_s']:.2f}x.",
    ]
    (RESULTS / "mixture_stream.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
