"""Per-rank reads of a prepared cache: each rank's training stream (its own blocks, in a seeded
order, from the first block not yet consumed) and its share of the evaluation blocks.

A mixture (data.mix) interleaves its sources' caches by weight in the stream (`mix_pattern`,
`mix_positions`); each source goes through its own epochs.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCKS_PER_FILE = 8192  # blocks a cache file holds (the writer's, prepare._BlockWriter)


# ----------------------------------------------------------------------------- a prepared cache


def read_meta(cache: Path) -> dict:
    return json.loads((Path(cache) / "meta.json").read_text())


def mixture_sources(cache: Path, meta: dict) -> list[tuple[str, Path, dict]]:
    """(name, cache directory, meta) of each source a prepared cache holds: a mixture's, or
    ('', cache, meta) for a single source."""
    if "sources" not in meta:
        return [("", Path(cache), meta)]
    return [(s["name"], Path(s["cache"]), read_meta(Path(s["cache"]))) for s in meta["sources"]]


def mix_pattern(counts: list[int]) -> list[int]:
    """One period of a mixture: source i appears counts[i] times, spread evenly (slot k of source
    i at (k + 1/2) / counts[i] of the period), so any stretch of the stream holds each source near
    its share: counts 3 and 1 give [0, 0, 1, 0]."""
    slots = sorted(((k + 0.5) / c, i) for i, c in enumerate(counts) for k in range(c))
    return [i for _, i in slots]


# ----------------------------------------------------------------------------- training stream


@functools.lru_cache(maxsize=4)
def global_order(n_blocks: int, seed: int, epoch: int, window: int) -> np.ndarray:
    """Block ids in the order epoch `epoch` visits them.

    A two-level seeded shuffle: windows of `window` consecutive blocks (a few cache files) are
    visited in random order, and blocks are permuted within each window. A reader then needs
    only one window of files at a time, however large the corpus; when the data fit in one
    window (as wikitext-2 does) this is a plain global permutation.
    """
    rng = np.random.default_rng([seed, epoch])
    n_win = -(-n_blocks // window)
    parts = [rng.permutation(np.arange(w * window, min(n_blocks, (w + 1) * window))) for w in rng.permutation(n_win)]
    return np.concatenate(parts)


@functools.lru_cache(maxsize=16)
def _split_files(split_dir: str) -> tuple[tuple[str, ...], np.ndarray]:
    """A cache split's part files in order, and the block id each starts at (one more: the
    total), from the files' own row counts. Caches written by earlier versions hold more than
    BLOCKS_PER_FILE rows in some files; counted so, they read right too."""
    import pyarrow.parquet as pq

    files = sorted(Path(split_dir).glob("part-*.parquet"), key=lambda f: int(f.stem.removeprefix("part-")))
    rows = [pq.ParquetFile(f).metadata.num_rows for f in files]
    return tuple(map(str, files)), np.concatenate(([0], np.cumsum(rows, dtype=np.int64)))


class _DecodedColumns:
    """Cache files' columns as decoded arrays, for the `files` most recently read files.

    A reader goes through one shuffle window (data.shuffle_window blocks: 8 or 9 files) at a
    time in random order, so it needs every file of the window decoded at once: a column each
    for text, three for chat and DPO caches, and a window for each source of a mixture. Counted
    in columns (16), three columns of 8 files decoded a whole file for every third block read, many times
    slower than counted in files (benchmarks/decoded_columns.py). A plan keeps
    as many files as its windows span (`keep`), so a long run holds no more than that."""

    def __init__(self, files: int) -> None:
        self.files = files
        self.held: collections.OrderedDict[str, dict[str, np.ndarray]] = collections.OrderedDict()
        # A rank's training stream reads ahead on a thread while its evaluations (and DPO's
        # reference pass) read on the training thread: one reader at a time.
        self.lock = threading.Lock()

    def keep(self, files: int) -> None:
        """Holds at least `files` files from now on (a stream's windows, every source's)."""
        self.files = max(self.files, files)

    def __call__(self, path: str, column: str) -> np.ndarray:
        with self.lock:
            return self._read(path, column)

    def _read(self, path: str, column: str) -> np.ndarray:
        columns = self.held.setdefault(path, {})
        self.held.move_to_end(path)
        if column not in columns:
            import pyarrow.parquet as pq

            col = pq.read_table(path, columns=[column]).column(column).combine_chunks()
            columns[column] = col.values.to_numpy(zero_copy_only=False).reshape(len(col), -1)
        while len(self.held) > self.files:
            self.held.popitem(last=False)
        return columns[column]

    def clear(self) -> None:
        self.held.clear()


_decoded_columns = _DecodedColumns(files=16)  # a stream's plan asks for its windows' (StreamPlan.fetch)


@functools.lru_cache(maxsize=4)
def _pattern_counts(pattern: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A mixture's period as arrays: its sources, each source's count, and how many of each
    source come before each slot."""
    sources = np.asarray(pattern, dtype=np.int64)
    one_hot = np.eye(sources.max() + 1, dtype=np.int64)[sources]
    before = np.cumsum(one_hot, axis=0) - one_hot
    return sources, one_hot.sum(axis=0), before


def mix_positions(pos: np.ndarray, pattern: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(source, position in that source's own order) of global stream positions: the pattern
    (`mix_pattern`) repeats, so position p is slot p % P of period p // P. Each source's positions
    run 0, 1, 2, ... without gaps, whatever range of the stream is asked for: a resumed run (or
    one on another worker count) continues every source where it stopped."""
    sources, counts, before = _pattern_counts(tuple(pattern))
    period, slot = np.divmod(pos, len(sources))
    src = sources[slot]
    return src, period * counts[src] + before[slot, src]


@dataclass(frozen=True)
class StreamPlan:
    """Which blocks rank `rank` trains on, in which order.

    The global stream visits every block once per epoch (`global_order`); the run (or the
    resumed part of it) consumes positions [start, end) in steps of G = micro x accum x W;
    within a step, micro batch k of rank r holds positions (k*W + r)*m ... + m past the
    step's first. So rank r's i-th block sits at start + ((i // m) * W + r) * m + i % m: a
    resumed run continues with the first block not yet consumed, none repeated, none skipped,
    even when the number of workers changed.

    A mixture (several train_dirs) shares the positions out by `pattern` (`mix_positions`), and
    each source goes through its own epochs: a small source repeats sooner than a large one. Its
    block ids count on from the sources before it (source 1's block 0 is n_blocks[0]).
    """

    train_dirs: tuple[str, ...]
    n_blocks: tuple[int, ...]
    seed: int
    window: int
    micro: int
    world_size: int
    rank: int
    start: int  # global positions already consumed (a multiple of the global batch)
    end: int  # global positions the whole run consumes
    pattern: tuple[int, ...] = (0,)  # a mixture's period (mix_pattern); one source: (0,)
    # Which sources' caches carry labels (chat/instruction: -100 where no loss); () none. Where
    # any does, a text source's labels are its inputs: every token a target.
    source_labels: tuple[bool, ...] = ()
    # data.attention_span=document: the EOS id that ends each text document, and the rows carry
    # position_ids (read_blocks); None: they don't.
    documents_eos: int | None = None

    @property
    def has_labels(self) -> bool:
        return any(self.source_labels)

    @property
    def local_range(self) -> tuple[int, int]:
        return 0, (self.end - self.start) // self.world_size

    def positions(self, local: np.ndarray) -> np.ndarray:
        m, w = self.micro, self.world_size
        return self.start + ((local // m) * w + self.rank) * m + local % m

    def files_in_windows(self) -> int:
        """Cache files a reader of this plan needs decoded at once: each source's window and the
        file a window's edge may cut (caches written by earlier versions have uneven files), or
        every file of the source where that is fewer."""
        per_window = -(-self.window // BLOCKS_PER_FILE) + 1
        return sum(min(-(-n // BLOCKS_PER_FILE) + 1, per_window) for n in self.n_blocks)

    def fetch(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        _decoded_columns.keep(self.files_in_windows())
        pos = self.positions(batch["id"].astype(np.int64))
        src, src_pos = mix_positions(pos, self.pattern)
        first_id = np.cumsum((0, *self.n_blocks))
        block_id = np.empty_like(pos)
        rows: dict[str, np.ndarray] = {}
        for s, sel, ids in source_block_ids(src, src_pos, self.n_blocks, self.seed, self.window):
            block_id[sel] = first_id[s] + ids
            labelled = self.has_labels and self.source_labels[s]
            part = read_blocks(self.train_dirs[s], ids, labelled, self.documents_eos)
            if self.has_labels and not labelled:
                part["labels"] = part["input_ids"]
            for column, values in part.items():
                rows.setdefault(column, np.empty((len(pos), values.shape[1]), values.dtype))[sel] = values
        if len(self.n_blocks) > 1:  # a mixture: each row's source, for the training loss by source
            rows["source"] = src
        return {"pos": pos, "block_id": block_id, **rows}


def source_block_ids(
    src: np.ndarray,
    src_pos: np.ndarray,
    n_blocks: tuple[int, ...],
    seed: int,
    window: int,
    order: Callable[[int, int, int, int], np.ndarray] | None = None,
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(source, its rows' mask, their block ids within it) for each source of a batch's rows
    (mix_positions' `src`, `src_pos`): each source's positions through seeded epochs of its own.
    One rule for the stream's reads and the checkpoint's record of them (trainer.batches.stream_block_ids,
    which passes global_order's uncached function as `order`)."""
    order = order or global_order
    for s in np.unique(src):
        sel = src == s
        epoch, within = np.divmod(src_pos[sel], n_blocks[s])
        ids = np.empty_like(within)
        for e in np.unique(epoch):
            ids[epoch == e] = order(n_blocks[s], seed, int(e), window)[within[epoch == e]]
        yield int(s), sel, ids


def read_blocks(
    split_dir: str, block_ids: np.ndarray, has_labels: bool, documents_eos: int | None = None
) -> dict[str, np.ndarray]:
    """Rows `block_ids` of a cache split (its parquet files in block order), stacked per column:
    input_ids, labels where the cache has them (chat/instruction) and, given `documents_eos`,
    position_ids: the cache's own where it has labels (examples' bounds), else counted from the
    EOS that ends each text document (document_positions)."""
    columns = ("input_ids", "labels") if has_labels else ("input_ids",)
    if has_labels and documents_eos is not None:
        columns += ("position_ids",)
    files, starts = _split_files(split_dir)
    ids = np.asarray(block_ids, dtype=np.int64)
    if len(ids) and not 0 <= ids.min() <= ids.max() < starts[-1]:
        raise IndexError(f"block ids {ids.min()}..{ids.max()} outside the {starts[-1]} blocks of {split_dir}")
    rows: dict[str, list[np.ndarray]] = {c: [] for c in columns}
    for b, f in zip(ids, np.searchsorted(starts, ids, side="right") - 1, strict=True):
        for c in columns:
            rows[c].append(_decoded_columns(files[f], c)[b - starts[f]])
    out = {c: np.stack(v) for c, v in rows.items()}
    if documents_eos is not None and not has_labels:
        out["position_ids"] = document_positions(out["input_ids"], documents_eos)
    return out


def document_positions(ids: np.ndarray, eos_id: int) -> np.ndarray:
    """Each token's position in its document for (N, S) text blocks: 0 after every EOS (which
    ends the document before it) and at each block's start (where a document cut by the block
    before goes on); int32."""
    n, s = ids.shape
    column = np.broadcast_to(np.arange(s, dtype=np.int32), (n, s))
    starts = np.zeros((n, s), dtype=np.int32)
    starts[:, 1:] = np.where(ids[:, :-1] == eos_id, column[:, 1:], 0)
    return column - np.maximum.accumulate(starts, axis=1)


def rank_batches(
    fetch: Callable[[np.ndarray], dict[str, np.ndarray]], rows: int, micro: int, first: int = 0, prefetch: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """fetch(ids) for this rank's rows [first, rows) in slices of `micro`, in order, read on a
    thread `prefetch` batches ahead of the consumer (0: when asked).

    Read in the training process itself: a batch is a few blocks found by arithmetic (no shuffle
    stage, no data to move between processes), so a pipeline of reading tasks would add only its
    own start-up (seconds at every evaluation) and a scheduling loop that competes with the
    training thread for the GIL. pyarrow decodes a cache file without the GIL.
    """
    slices = (np.arange(lo, min(lo + micro, rows), dtype=np.int64) for lo in range(first, rows, micro))
    if not prefetch:
        yield from map(fetch, slices)
        return
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytrain-data")
    ahead: collections.deque = collections.deque()
    try:
        for ids in slices:
            ahead.append(pool.submit(fetch, ids))
            if len(ahead) > prefetch:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()
    finally:  # also when the consumer stops early (an early stop, an error): what was read ahead is dropped
        pool.shutdown(wait=True, cancel_futures=True)


def train_batches(plan: StreamPlan, skip: int = 0, prefetch: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Rank `plan.rank`'s micro batches in global order, after its first `skip` (a restart
    inside the driver's run goes on from a later checkpoint than the plan's start)."""
    lo, hi = plan.local_range
    return rank_batches(lambda ids: plan.fetch({"id": ids}), hi - lo, plan.micro, skip * plan.micro, prefetch)


def eval_blocks_per_rank(n_eval: int, world_size: int, max_blocks: int = 0) -> int:
    """Eval rows each rank reads (eval_stream): ceil(n_eval / W), every rank the same count (ZeRO-3
    needs every rank in every forward), at most `max_blocks` (0: no limit)."""
    per_rank = -(-n_eval // world_size)
    return min(per_rank, max_blocks) if max_blocks else per_rank


def read_eval_blocks(
    split_dir: str,
    block_ids: np.ndarray,
    n_eval: int,
    has_labels: bool,
    documents_eos: int | None = None,
    labelled: bool = False,
) -> dict[str, np.ndarray]:
    """Eval rows `block_ids` (a rank's r, r+W, ...: eval_stream) as read_blocks reads them, with
    block_id; an id past the split's `n_eval` blocks is padding: block n_eval-1's row in its place,
    every label -100 (no target) and block_id -1. A text split's rows carry labels too (their
    inputs; the padding's -100) where some are padding or `labelled` asks: every batch of a
    stream that may hold padding needs them."""
    ids = np.asarray(block_ids, dtype=np.int64)
    padding = ids >= n_eval
    rows = read_blocks(split_dir, np.where(padding, n_eval - 1, ids), has_labels, documents_eos)
    if (labelled or padding.any()) and not has_labels:
        rows["labels"] = rows["input_ids"].copy()
    if padding.any():
        rows["labels"][padding] = -100  # read_blocks stacks new arrays: the cache's rows are untouched
    return {"block_id": np.where(padding, -1, ids), **rows}


@dataclass(frozen=True)
class EvalStream:
    """Rank r evaluates eval blocks r, r+W, ... (its first `max_blocks`; 0: all), so the ranks
    together evaluate every block once, whatever W (`python -m raytrain_cpu.evaluate` on one
    process measures the same targets). Every rank gets the same count, ceil(n_eval / W)
    (eval_blocks_per_rank; ZeRO-3 needs every rank in every forward): where W does not divide
    n_eval, the last row of the ranks past the split's end is padding (read_eval_blocks: a real
    block's tokens, no target, block_id -1). Columns as in read_blocks, and block_id; a text
    split's stream that holds padding carries labels for all its rows (their inputs where real),
    so that every batch of the stream has the same columns.

    Read by index like the training stream: an evaluation reads the blocks it evaluates, not the
    whole split.
    """

    cache: str
    world_size: int
    rank: int
    n_eval: int
    max_blocks: int = 0
    has_labels: bool = False
    documents_eos: int | None = None

    @functools.cached_property
    def rows(self) -> int:
        return eval_blocks_per_rank(self.n_eval, self.world_size, self.max_blocks)

    @functools.cached_property
    def padded(self) -> bool:
        """Whether this rank's last row is padding."""
        return self.rows > 0 and (self.rows - 1) * self.world_size + self.rank >= self.n_eval

    def fetch(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        block_id = ids.astype(np.int64) * self.world_size + self.rank
        split_dir = str(Path(self.cache) / "eval")
        return read_eval_blocks(split_dir, block_id, self.n_eval, self.has_labels, self.documents_eos, self.padded)

    def batches(self, micro: int) -> Iterator[dict[str, np.ndarray]]:
        """This rank's eval rows in batches of `micro`, read when asked."""
        return rank_batches(self.fetch, self.rows, micro)


# ----------------------------------------------------------------------------- a rank's streams from the driver's spec


def rank_streams(spec: dict, world_size: int, rank: int) -> tuple[StreamPlan, dict[str, EvalStream]]:
    """Rank `rank` of `world_size`'s training plan and eval streams (by source name; '' for a
    single source) from the driver's plain dict (launch.datasets.stream_spec). A source with
    fewer eval blocks than workers is not evaluated."""
    t = spec["train"]
    plan = StreamPlan(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in t.items()}, world_size=world_size, rank=rank
    )
    evals = {
        name: EvalStream(
            e["cache"], world_size, rank, e["n_eval"], spec["eval_blocks"], e["has_labels"], t["documents_eos"]
        )
        for name, e in spec["eval"].items()
        if e["n_eval"] >= world_size
    }
    return plan, evals
