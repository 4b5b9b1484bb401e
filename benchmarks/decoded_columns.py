"""Reading a shuffle window's blocks: decoded cache columns kept 16 columns (before) or by file,
as many files as the window spans (data._DecodedColumns, sized by StreamPlan), side by side.

A rank's stream reads its blocks through `data.read_blocks` in the seeded order of
`data.global_order`: one window of data.shuffle_window blocks (65,536 by default: 8 cache files)
at a time, in random order. Each read needs its file's columns decoded: one for text caches,
three for chat and DPO caches (input_ids, labels, position_ids). This writes one window of each
kind (8 files of 8,192 blocks), then reads `--blocks` of them in that order, 8 a call (a micro
batch), each way in turn, `--reps` times. Writes milliseconds per block (medians) and the ratio
to benchmarks/results/<machine>/decoded_columns.{json,md} (bench.common.write_results).

    python benchmarks/decoded_columns.py     # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from bench.common import write_results

from raytrain_cpu.data import stream as data
from raytrain_cpu.host.features import cpu_features
from raytrain_cpu.obs.metrics import markdown_table

FILES, SEQ, WINDOW = 8, 256, 65536
EOS = 2


def write_window(split: Path, columns: tuple[str, ...]) -> None:
    """FILES part files of BLOCKS_PER_FILE random blocks, in the caches' layout."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    split.mkdir(parents=True)
    rng, n = np.random.default_rng(0), data.BLOCKS_PER_FILE
    for f in range(FILES):
        table = {"block_id": pa.array(np.arange(f * n, (f + 1) * n, dtype=np.int64))}
        for c in columns:
            values = rng.integers(0, 32_000, n * SEQ, dtype=np.int32)
            table[c] = pa.FixedSizeListArray.from_arrays(pa.array(values), SEQ)
        pq.write_table(pa.table(table), split / f"part-{f:05d}.parquet")


def ms_per_block(split: Path, labelled: bool, blocks: int, decoded) -> float:
    data._decoded_columns = decoded  # what read_blocks calls
    order = data.global_order(FILES * data.BLOCKS_PER_FILE, 1234, 0, WINDOW)[:blocks]
    t0 = time.perf_counter()
    for lo in range(0, blocks, 8):
        data.read_blocks(str(split), order[lo : lo + 8], labelled, EOS if labelled else None)
    return (time.perf_counter() - t0) / blocks * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1024, help="blocks read each way (default 1024)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    plan = data.StreamPlan(("x",), (FILES * data.BLOCKS_PER_FILE,), 1234, WINDOW, 8, 1, 0, 0, args.blocks)
    ways = {
        # One entry a column and file, 16 of them: what the reader kept before.
        "16 columns (before)": lambda: functools.lru_cache(maxsize=16)(data._DecodedColumns(files=1)),
        "the window's files": lambda: data._DecodedColumns(files=plan.files_in_windows()),
    }
    kinds = {"text (1 column)": ("input_ids",), "chat/DPO (3 columns)": ("input_ids", "labels", "position_ids")}
    ms: dict[str, dict[str, list[float]]] = {k: {w: [] for w in ways} for k in kinds}
    with tempfile.TemporaryDirectory(prefix="decoded_columns_") as tmp:
        for kind, columns in kinds.items():
            split = Path(tmp) / kind.split()[0].replace("/", "_")
            write_window(split, columns)
            for rep in range(args.reps):
                for way in ways if rep % 2 == 0 else reversed(ways):  # neither way always first
                    ms[kind][way].append(ms_per_block(split, len(columns) > 1, args.blocks, ways[way]()))
    table = [
        {
            "cache": kind,
            **{f"{way} ms/block": statistics.median(ms[kind][way]) for way in ways},
            "files / columns": statistics.median(ms[kind]["the window's files"])
            / statistics.median(ms[kind]["16 columns (before)"]),
        }
        for kind in kinds
    ]
    note = (
        f"{args.blocks} blocks of {SEQ} tokens read 8 a call in a {WINDOW:,}-block window's seeded order "
        f"({FILES} files of {data.BLOCKS_PER_FILE:,}); medians of {args.reps} alternating reps"
    )
    print(markdown_table(table) + "\n\n" + note)
    if not args.no_write:
        result = {
            "command": f"python benchmarks/decoded_columns.py --blocks {args.blocks} --reps {args.reps}",
            "machine": cpu_features().describe(),
            "ms_per_block": ms,
            "tables": {"A window's blocks read through decoded columns: 16 columns kept, or the window's files": table},
            "notes": [note],
        }
        print(write_results("decoded_columns", result, None))


if __name__ == "__main__":
    main()
