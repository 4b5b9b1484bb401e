"""What `prepare` builds: documents -> tokens (Ray Data) -> packed blocks -> a versioned parquet cache.

1. **tokenize**: `map_batches` with a callable class, so each Ray Data actor loads the
   tokenizer once; batched fast tokenization; every document ends with EOS.
2. **pack**: documents are concatenated and cut into `seq_len` blocks: no padding anywhere,
   the EOS marks document boundaries. Labels are the inputs (the model shifts them), so the
   target of each position is the next token of the same packed stream. Chat, instruction and
   preference examples are packed whole and padded (data.sft makes their tokens).
3. **cache**: blocks are written as parquet under `<cache_dir>/<key>/`, where the key hashes
   the source, the tokenizer and seq_len. Written to a temporary directory and renamed, so a
   cache is either whole or absent. `python -m raytrain_cpu.data prepare --config ...` fills
   it ahead of time; training fills it when missing. A mixture (data.mix) packs each source
   into a cache of its own; its own directory holds only their names and shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raytrain_cpu.checkpoint.files import fsync_dir, fsync_file, out_of_space
from raytrain_cpu.config.data import COMPRESSED, DataConfig, mix_counts, mix_entry_keys
from raytrain_cpu.config.schema import Config
from raytrain_cpu.data.sources import DataError, SourceSpec, arrow_filesystem, documents_batch, source_specs
from raytrain_cpu.data.stream import BLOCKS_PER_FILE, mix_pattern, read_meta
from raytrain_cpu.model.hub import download_tokenizer, is_hub_id
from raytrain_cpu.model.tokenizer import (
    load_tokenizer,
    resolve_tokenizer_path,
    save_tokenizer,
)

CACHE_FORMAT = 1


# ----------------------------------------------------------------------------- tokenize


class Tokenize:
    """Ray Data callable class: one tokenizer per actor, batched fast tokenization.

    Actors load the Rust `tokenizers` object straight from tokenizer.json (no transformers
    import: actors start in a second, not ten).
    """

    def __init__(self, tokenizer_json: str, eos_id: int, threads: int = 1, sft: dict | None = None):
        # The Rust tokenizer would start a thread pool per actor; with one CPU per actor that
        # oversubscribes the cores, so parallelism comes from actors, not threads.
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
        os.environ["RAYON_NUM_THREADS"] = str(max(1, threads))
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_json)
        self.eos = eos_id
        self.sft = None
        if sft is not None:  # chat/instruction: render with the run's template, label the responses
            from raytrain_cpu.model.chat import template_for_dir

            self.data = DataConfig(**sft)
            self.sft = template_for_dir(Path(tokenizer_json).parent, self.data)

    def __call__(self, batch: dict[str, np.ndarray]):
        import pyarrow as pa

        if self.sft is not None:
            return self._examples(batch)

        texts = [str(t) for t in batch["text"]]
        keep = [i for i, t in enumerate(texts) if t]
        # encode_batch_fast skips the character offsets, which packing never reads.
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        enc = dict(zip(keep, encode([texts[i] for i in keep], add_special_tokens=False) if keep else []))
        # One flat token array + offsets (EOS closes each document; an empty row stays empty):
        # building the Arrow list column from them is zero-copy, where converting a list of
        # per-document arrays cost a third of the tokenizing time.
        lengths = np.array([len(enc[i].ids) + 1 if i in enc else 0 for i in range(len(texts))], dtype=np.int64)
        offsets = np.zeros(len(texts) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.empty(int(offsets[-1]), dtype=np.int32)
        for i, e in enc.items():
            flat[offsets[i] : offsets[i + 1] - 1] = e.ids
            flat[offsets[i + 1] - 1] = self.eos
        ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
        return pa.table({"ids": ids, "skipped": pa.array(np.asarray(batch["skipped"], dtype=np.int64))})

    def _examples(self, batch: dict[str, np.ndarray]):
        """Examples -> (ids, labels) list columns; a row the template rejects or whose prompt
        alone fills data.seq_len fails naming its file and row, or is skipped and counted."""
        import pyarrow as pa

        from raytrain_cpu.data.sft import example_tokens
        from raytrain_cpu.model.chat import RowError

        d = self.data
        skipped = [int(x) for x in batch["skipped"]]
        payloads = [json.loads(str(t)) if str(t) else None for t in batch["text"]]
        # A preference row is two conversations (chosen, rejected) that share a block, so each
        # prompt must leave room in half of it.
        room = d.seq_len // 2 if d.format == "preference" else d.seq_len
        rendered: list[tuple[int, str, list]] = []
        for i, p in enumerate(payloads):
            if p is None:
                continue
            try:
                rendered += [(i, *self.sft.render(m)) for m in p.get("pair") or [p["messages"]]]
            except RowError as e:
                self._bad(p["ref"], str(e))
                skipped[i] += 1
        encodings = self.tok.encode_batch([t for _, t, _ in rendered], add_special_tokens=False) if rendered else []
        done: dict[int, list[tuple[list[int], list[int]]] | None] = {}  # None: refused
        for (i, _, spans), enc in zip(rendered, encodings):
            if i in done and done[i] is None:
                continue  # the pair's other side was refused
            ids, labels, prompt = example_tokens(enc, spans, d.train_on_prompt, self.eos)
            if prompt is None or prompt >= room:
                why = (
                    "no response token survives the template: nothing to train on"
                    if prompt is None
                    else f"its prompt alone takes {prompt} tokens, so data.seq_len={d.seq_len} leaves no room "
                    "for the response"
                    + (" (a preference pair shares a block)" if room < d.seq_len else "")
                    + "; raise data.seq_len or shorten the prompt"
                )
                self._bad(payloads[i]["ref"], why)
                skipped[i] += 1
                done[i] = None
                continue
            done.setdefault(i, []).append((ids, labels))
        examples = [done.get(i) or [] for i in range(len(payloads))]
        columns = {
            "ids": [np.asarray([t for ids, _ in ex for t in ids], dtype=np.int32) for ex in examples],
            "labels": [np.asarray([t for _, lab in ex for t in lab], dtype=np.int32) for ex in examples],
        }
        table = {name: pa.array(col, type=pa.list_(pa.int32())) for name, col in columns.items()}
        if d.format == "preference":  # where the rejected conversation starts in ids
            table["split"] = pa.array(np.asarray([len(ex[0][0]) if ex else 0 for ex in examples], dtype=np.int64))
        return pa.table(table | {"skipped": pa.array(np.asarray(skipped, dtype=np.int64))})

    def _bad(self, ref: str, why: str) -> None:
        if self.data.bad_rows != "skip":
            raise DataError(f"{ref}: {why}. Fix the row, or set data.bad_rows=skip to drop such rows.")


def _local_special_id(tokenizer_dir: Path, name: str) -> int | None:
    """Id of a special token (eos_token, pad_token) of a saved fast tokenizer, from its JSON files,
    or None when they don't say.

    Reading tokenizer_config.json and tokenizer.json directly skips transformers'
    AutoTokenizer machinery, whose first use costs seconds of imports, a large share of
    preparing a small corpus.
    """
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        f = tokenizer_dir / fname
        if not f.is_file():
            continue
        tok = json.loads(f.read_text()).get(name)
        tok = tok.get("content") if isinstance(tok, dict) else tok
        if isinstance(tok, str):
            tokenizer_json = tokenizer_dir / "tokenizer.json"
            return _token_id(str(tokenizer_json), tokenizer_json.stat().st_mtime_ns, tok)
    return None


@functools.lru_cache(maxsize=16)
def _token_id(tokenizer_json: str, mtime_ns: int, token: str) -> int | None:
    """A token's id in a tokenizer.json, parsed once per file version: the driver asks for its
    EOS when checking the tokenizer, preparing each source of a mixture and building the
    streams, and a large vocabulary's file (Llama-3's, 9 MB) takes a noticeable time to parse."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer_json).token_to_id(token)


def _local_eos_id(tokenizer_dir: Path) -> int | None:
    """EOS id of a saved fast tokenizer read from its JSON files, or None when they don't say."""
    return _local_special_id(tokenizer_dir, "eos_token")


def materialize_tokenizer(path: str, cfg: Config) -> tuple[str, int]:
    """(tokenizer.json path, EOS id); a hub tokenizer is saved once under the data cache."""
    p = Path(path)
    if not (p.is_dir() and (p / "tokenizer.json").is_file()):
        p = cache_root(cfg) / "tokenizers" / re.sub(r"[^A-Za-z0-9_.-]", "_", path)
        if not (p / "tokenizer.json").is_file():
            source = download_tokenizer(path, cfg.run.hub_cache) if is_hub_id(path) else path
            save_tokenizer(load_tokenizer(source), p)
        if not (p / "tokenizer.json").is_file():
            raise DataError(f"model.tokenizer: {path!r} has no fast tokenizer (tokenizer.json); use one that does.")
    eos = _local_eos_id(p)
    if eos is None:
        eos = int(load_tokenizer(str(p)).eos_token_id)  # names the problem when there is no EOS token
    return str(p / "tokenizer.json"), eos


def documents_eos(cfg: Config) -> int | None:
    """data.attention_span=document: the EOS id that ends each text document, which the streams
    count positions from (read_blocks); None where attention spans the block."""
    if cfg.data.attention_span != "document":
        return None
    return materialize_tokenizer(resolve_tokenizer_path(cfg.model.tokenizer, cfg.model.name_or_path), cfg)[1]


@contextlib.contextmanager
def _console_errors_held() -> Iterator[list]:
    """Holds back the ERROR records Ray Data's loggers would print on the console while blocks are
    read, and prints them at the end unless the caller clears the list. A DataError in a tokenizer
    task (bad input) reaches the user as one line naming the file and the fix; Ray Data also logs
    it with the task's whole stack, three times (~150 lines), calling it an internal error. Its own
    log file (ray-data.log) keeps every record either way."""
    from raytrain_cpu.obs.metrics import ray_console_handlers

    held: list[tuple[logging.Handler, logging.LogRecord]] = []

    def hold(handler: logging.Handler, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        held.append((handler, record))
        return False

    filters = [(h, functools.partial(hold, h)) for h in ray_console_handlers()]
    for h, f in filters:
        h.addFilter(f)
    try:
        yield held
    finally:
        for h, f in filters:
            h.removeFilter(f)
        for h, record in held:
            h.handle(record)


def _damaged_file(spec: SourceSpec) -> DataError | None:
    """The first compressed local file of `spec` that does not decompress whole (a download cut
    short), named; else None. Asked only once a read has failed: the reader's own error (pyarrow's
    "Truncated compressed stream") names no file."""
    import pyarrow as pa

    if spec.filesystem != "local":
        return None
    for path in (p for p in spec.paths if p.endswith(COMPRESSED)):
        try:
            with pa.input_stream(path, compression="detect") as f:
                while f.read(1 << 24):
                    pass
        except OSError as e:
            return DataError(f"{path}: cannot decompress it ({e}). Replace the file, or remove it from data.path.")
    return None


def _unwrap(e: BaseException) -> DataError | None:
    """The DataError inside a Ray task failure, so the user sees our message, not a traceback."""
    chain: list[BaseException] = []
    while e is not None and all(e is not c for c in chain):
        if isinstance(e, DataError):
            # Only our one-line message, no object of the chain: Ray's dual-class error may hold
            # the original (and append its retry hint to the text), and the original's traceback
            # holds the execution and its tokenizer actors (see _pack).
            msg = e.args[0] if e.args else str(e)
            while isinstance(msg, BaseException):
                msg = msg.args[0] if msg.args else str(msg)
            return DataError(str(msg).strip().splitlines()[0])
        chain.append(e)
        e = getattr(e, "cause", None) or e.__cause__
    # Ray Data may hand back only the remote traceback's text (the chained DataError object does
    # not survive pickling): take our one-line message from it.
    marker = "DataError: "
    for c in chain:
        text = str(c)
        if marker in text:
            return DataError(text[text.rindex(marker) + len(marker) :].splitlines()[0].strip())
    return None


# ----------------------------------------------------------------------------- pack + cache


def _file_fingerprints(spec: SourceSpec) -> list[str]:
    """Each file's name and version: a file changed in place gets a new cache, not the old blocks."""
    if spec.filesystem == "local":
        return [f"{p}:{(st := os.stat(p)).st_size}:{int(st.st_mtime)}" for p in spec.paths]
    return [f"{p}:{v}" for p, v in zip(spec.paths, spec.versions, strict=True)]


def _tokenizer_fingerprint(path: str) -> str:
    p = Path(path)
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return hashlib.sha256((p / "tokenizer.json").read_bytes()).hexdigest()[:16]
    return path


def cache_key(
    cfg: Config, train: SourceSpec, evals: SourceSpec | None, tokenizer_path: str, eval_only: bool = False
) -> str:
    d = cfg.data
    payload = {
        "format": CACHE_FORMAT,
        "train": _file_fingerprints(train) + [train.text_column, train.wikitext],
        "eval": (_file_fingerprints(evals) + [evals.text_column]) if evals else d.eval_fraction,
        "tokenizer": _tokenizer_fingerprint(tokenizer_path),
        "seq_len": d.seq_len,
        "bad_rows": d.bad_rows,
    }
    if eval_only:  # no training blocks: a cache of its own, never taken for one that trains
        payload["eval_only"] = True
    if d.format != "text":  # text caches keep their old keys
        from raytrain_cpu.model.chat import template_fingerprint

        payload["sft"] = {
            "format": d.format,
            "template": template_fingerprint(tokenizer_path, d),
            "train_on_prompt": d.train_on_prompt,
            "columns": [d.messages_column, d.prompt_column, d.response_column, d.system_column],
            # How examples share blocks (_ExampleWriter); "+positions": the blocks carry each
            # token's position in its example (data.attention_span=document reads them).
            "packing": f"first-fit-{PACK_WINDOW}+positions",
        }
        if d.format == "preference":  # a pair's two sides share a block, chosen first
            payload["sft"]["columns"] += [d.chosen_column, d.rejected_column]
            payload["sft"]["packing"] += "+pairs"
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def cache_root(cfg: Config) -> Path:
    return (
        Path(cfg.data.cache_dir).expanduser().absolute()
        if cfg.data.cache_dir
        else cfg.run.run_dir.parent / "data_cache"
    )


# ----------------------------------------------------------------------------- cache versions
# A key's cache is built in a temporary directory beside the others, renamed to a version of its
# own (<key>.v-<id>, never written again) and published by pointing the symlink <key>.current at
# it, which one rename swaps: a reader sees the old version or the new one, whole, never a
# directory being replaced. A run reads the version prepare() resolved for it, so a --force
# rebuild (or another job's) never moves its files; an earlier version is never deleted here, as
# this process cannot know that no run on another node still reads it. A cache written before
# versions (a plain <key> directory) is read as it is and never replaced: a rebuild publishes a
# version beside it.


def _pointer(root: Path, key: str) -> Path:
    return root / f"{key}.current"


def _pointed(root: Path, key: str) -> str | None:
    """The version name <key>.current names, None where there is none."""
    try:
        return os.readlink(_pointer(root, key))
    except OSError:  # none (or not a symlink): nothing published
        return None


def published_cache(root: Path, key: str) -> Path | None:
    """The directory of key's whole cache: the published version, else a cache written before
    versions; None where neither holds a meta.json (written last, so its presence means whole)."""
    name = _pointed(root, key)
    if name and (root / name / "meta.json").is_file():
        return root / name
    legacy = root / key
    return legacy if not legacy.is_symlink() and (legacy / "meta.json").is_file() else None


def _fsync_tree(top: Path) -> None:
    """Every file and directory under `top` on disk before the rename that publishes it: after a
    crash (or on another node of a shared filesystem) a published version is whole, not a name
    over blocks still in a writer's page cache."""
    for folder, _, files in os.walk(top, topdown=False):
        for name in files:
            fsync_file(Path(folder, name))
        fsync_dir(Path(folder))


def _publish(root: Path, key: str, tmp: Path, *, replace: bool, seen: str | None, log) -> Path:
    """Makes the whole cache in `tmp` key's published version; returns the version to read.

    Two jobs preparing one key at once end with one cache: without --force (`replace`) the first
    to publish wins (creating the symlink fails for the second, which drops its own copy, never
    read, and takes the winner's). A --force rebuild replaces the version it found at its start
    (`seen`); one another job published meanwhile is as new as its own, so it takes that one."""
    _fsync_tree(tmp)
    version = root / f"{key}.v-{uuid.uuid4().hex[:12]}"
    os.rename(tmp, version)
    fsync_dir(root)
    pointer = _pointer(root, key)
    if not replace:
        try:
            os.symlink(version.name, pointer)
            fsync_dir(root)
            return version
        except FileExistsError:
            winner = published_cache(root, key)
            if winner is not None and winner.name != key:  # a whole version: it is the key's cache
                shutil.rmtree(version, ignore_errors=True)
                log(f"[data] another job published {winner} first; using it")
                return winner
    elif _pointed(root, key) not in (seen, None) and published_cache(root, key) is not None:
        winner = published_cache(root, key)
        shutil.rmtree(version, ignore_errors=True)
        log(f"[data] another job rebuilt {winner} meanwhile; using it")
        return winner
    link = root / f".{key}.link-{uuid.uuid4().hex[:8]}"
    os.symlink(version.name, link)
    try:
        os.replace(link, pointer)  # atomic: readers resolve the old version or this one
    finally:
        if link.is_symlink():
            link.unlink()
    fsync_dir(root)
    earlier = root / seen if seen else root / key
    if earlier != version and (earlier / "meta.json").is_file():
        log(f"[data] the earlier cache {earlier} is left in place for any run still reading it; remove it once none is")
    return version


class _BlockWriter:
    """Cuts a token stream into seq_len blocks and writes them as parquet files."""

    def __init__(self, out: Path, seq_len: int):
        self.out, self.seq_len = out, seq_len
        out.mkdir(parents=True)
        self.buf: list[np.ndarray] = []
        self.pending = 0
        self.blocks: list[np.ndarray] = []
        self.n_blocks = 0
        self.files = 0

    def add(self, ids: np.ndarray) -> None:
        self.buf.append(ids)
        self.pending += len(ids)
        if self.pending >= self.seq_len:
            flat = np.concatenate(self.buf)
            n = len(flat) // self.seq_len
            self.blocks.extend(flat[: n * self.seq_len].reshape(n, self.seq_len))
            rest = flat[n * self.seq_len :]
            self.buf, self.pending = [rest], len(rest)
            # Whole files only: one long document's blocks may cross a file's end (they once
            # went all into that file, up to 9,795 rows).
            while len(self.blocks) >= BLOCKS_PER_FILE:
                self._flush(BLOCKS_PER_FILE)

    def _flush(self, n: int | None = None) -> None:
        """Writes the first `n` blocks held (all by default) as the next part file."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.blocks:
            return
        arr = np.stack(self.blocks[:n])
        ids = pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1)), self.seq_len)
        block_id = pa.array(np.arange(self.n_blocks, self.n_blocks + len(arr), dtype=np.int64))
        pq.write_table(pa.table({"block_id": block_id, "input_ids": ids}), self.out / f"part-{self.files:05d}.parquet")
        self.n_blocks += len(arr)
        self.files += 1
        self.blocks = self.blocks[len(arr) :]

    def close(self) -> int:
        """Writes the last full blocks; returns the tokens of the final partial block (dropped)."""
        self._flush()
        return self.pending


PACK_WINDOW = 16  # blocks the example packer keeps open at once


@dataclass
class _OpenBlock:
    """A block being filled: the examples' pieces so far and the tokens they take."""

    ids: list[np.ndarray] = dataclasses.field(default_factory=list)
    labels: list[np.ndarray] = dataclasses.field(default_factory=list)
    positions: list[np.ndarray] = dataclasses.field(default_factory=list)
    used: int = 0


class _ExampleWriter(_BlockWriter):
    """Packs whole examples into seq_len blocks, padded: several per block, none split.

    First fit over a bounded window: an example goes into the oldest of the PACK_WINDOW open
    blocks with room for it, else opens a new block; when more than PACK_WINDOW are open, or
    the oldest is full, the oldest closes (its room left is padding, label -100), so blocks
    are written in the order they opened. Measured on the bundled chat examples at seq_len 256: 22% padding
    in order (a window of 1), 10% with 4, 9.5% with 16, 8.8% with 64; so a small window takes
    most of the gain while keeping the cache close to the data's order, its memory bounded
    and the result deterministic. An example longer than seq_len is truncated to it (its
    prompt fits, the tokenizer checked) and counted. Beside input_ids and labels, position_ids
    holds each token's position in its example (the padding counts as one more), which is
    where data.attention_span=document takes the examples' bounds from: a multi-turn example
    holds several EOS tokens, so they cannot tell them.
    """

    def __init__(self, out: Path, seq_len: int, pad_id: int, window: int = PACK_WINDOW):
        super().__init__(out, seq_len)
        self.pad_id, self.window = pad_id, window
        self.open: list[_OpenBlock] = []  # oldest first
        self.labels: list[np.ndarray] = []
        self.positions: list[np.ndarray] = []
        self.truncated = self.padding = self.loss_tokens = 0

    def add_example(self, ids: np.ndarray, labels: np.ndarray) -> None:
        if len(ids) > self.seq_len:
            ids, labels = ids[: self.seq_len], labels[: self.seq_len]
            self.truncated += 1
        self._place([(ids, labels)])

    def add_pair(self, ids: np.ndarray, labels: np.ndarray, split: int) -> None:
        """A preference pair (chosen = ids[:split], then rejected) into one block, side by side:
        the trainer tells them apart by their order. A pair longer than seq_len has its longer
        side(s) cut to fit (each keeps at least half a block, where its prompt fits)."""
        sides = [(ids[:split], labels[:split]), (ids[split:], labels[split:])]
        if len(ids) > self.seq_len:
            half = self.seq_len // 2
            short = min(len(sides[0][0]), len(sides[1][0]))
            cap = self.seq_len - short if short <= half else half
            sides = [(i[:cap], lab[:cap]) for i, lab in sides]
            self.truncated += 1
        self._place(sides)

    def _place(self, pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Puts pieces (an example, or a pair's two sides) into one block, first fit."""
        size = sum(len(ids) for ids, _ in pieces)
        block = next((b for b in self.open if b.used + size <= self.seq_len), None)
        if block is None:
            block = _OpenBlock()
            self.open.append(block)
        for ids, labels in pieces:
            block.ids.append(ids)
            block.labels.append(labels)
            block.positions.append(np.arange(len(ids), dtype=np.int32))
        block.used += size
        # Blocks are written in the order they opened: the oldest closes when full or pushed out.
        while self.open and (self.open[0].used == self.seq_len or len(self.open) > self.window):
            self._close_block()

    def _close_block(self) -> None:
        block = self.open.pop(0)
        pad = self.seq_len - block.used
        ids = np.concatenate([*block.ids, np.full(pad, self.pad_id, dtype=np.int32)])
        labels = np.concatenate([*block.labels, np.full(pad, -100, dtype=np.int32)])
        self.padding += pad
        self.loss_tokens += int((labels[1:] != -100).sum())  # targets after the model's shift
        self.blocks.append(ids)
        self.labels.append(labels)
        self.positions.append(np.concatenate([*block.positions, np.arange(pad, dtype=np.int32)]))
        if len(self.blocks) >= BLOCKS_PER_FILE:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.blocks:
            return
        columns = {"input_ids": self.blocks, "labels": self.labels, "position_ids": self.positions}
        block_id = pa.array(np.arange(self.n_blocks, self.n_blocks + len(self.blocks), dtype=np.int64))
        table = pa.table(
            {"block_id": block_id}
            | {
                name: pa.FixedSizeListArray.from_arrays(pa.array(np.stack(rows).reshape(-1)), self.seq_len)
                for name, rows in columns.items()
            }
        )
        pq.write_table(table, self.out / f"part-{self.files:05d}.parquet")
        self.n_blocks += len(self.blocks)
        self.files += 1
        self.blocks, self.labels, self.positions = [], [], []

    def close(self) -> int:
        while self.open:
            self._close_block()
        self._flush()
        return 0

    def stats(self) -> dict[str, Any]:
        total = self.n_blocks * self.seq_len
        return {
            "truncated_examples": self.truncated,
            "padding_tokens": self.padding,
            "padding_frac": self.padding / total if total else 0.0,
            "loss_tokens": self.loss_tokens,
        }


def _read_documents(spec: SourceSpec, cfg: DataConfig, tokenizer: tuple[str, int], actors: int):
    import ray

    # A file is one unit of work: more actors than files would only start idle processes.
    actors = max(1, min(actors, len(spec.paths)))
    cpus = ray.cluster_resources().get("CPU", 1)
    # One CPU of the cluster stays unreserved for whatever else runs (the driver's packing, a
    # read that could not be fused): an actor pool holding every CPU can starve a task (a
    # deadlock seen on 2 CPUs). The actors still run one process each, so every core works.
    actor_cpus = max(0.1, min(1.0, (cpus - 1) / actors))
    # Read, split and tokenize carry the same resources and a task -> actor chain, so Ray Data
    # fuses them into one actor operator: a file is read, cut into documents and tokenized
    # inside one tokenizer actor: separate read/split tasks each started Python workers of
    # their own and handed every file across processes twice, which took longer.
    ds = ray.data.read_binary_files(
        list(spec.paths),
        include_paths=True,
        filesystem=arrow_filesystem(spec.filesystem),
        num_cpus=actor_cpus,
        override_num_blocks=min(len(spec.paths), 64 * actors),  # files per block >= 1: no split to unfuse
    )
    sft = dataclasses.asdict(cfg) if spec.format != "text" else None  # plain dicts cross the Ray boundary
    docs = ds.map_batches(
        documents_batch,
        fn_kwargs={"spec": spec, "max_docs": cfg.tokenize_batch_size, "data": sft},
        batch_size=None,
        num_cpus=actor_cpus,
    )
    return docs.map_batches(
        Tokenize,
        fn_constructor_kwargs={"tokenizer_json": tokenizer[0], "eos_id": tokenizer[1], "sft": sft},
        batch_size=None,  # one chunk per call, as documents_batch cut them
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=actor_cpus,
    )


def _kill_tokenizer_actors() -> None:
    """Ends the tokenizer actors of a failed execution in this process.

    Ray Data shuts a failed execution down without killing its actors, leaving them to reference
    counting, but a task-done callback of the failed task keeps a handle (Ray 2.60), and so do
    tracebacks kept in log records. Each actor holds a CPU: in a process that trains next (a
    notebook, the tests) the training workers would wait for those CPUs forever.
    """
    import ray
    from ray.actor import ActorHandle

    gc.collect()
    with warnings.catch_warnings():  # isinstance on every object touches deprecated module proxies (torch's reduce_op)
        warnings.simplefilter("ignore")
        handles = [obj for obj in gc.get_objects() if isinstance(obj, ActorHandle)]
    for obj in handles:
        descriptor = obj.__dict__.get("_ray_actor_creation_function_descriptor")  # no __getattr__
        if descriptor is not None and "MapBatches(Tokenize)" in descriptor.class_name:
            ray.kill(obj)


def held_out_every(eval_fraction: float) -> int:
    """The period of the documents a source without evaluation text of its own holds out
    (whole documents: every round(1 / data.eval_fraction)-th, so 0.4 holds out every 2nd);
    0: none held out."""
    return round(1 / eval_fraction) if eval_fraction else 0


def held_out(eval_fraction: float) -> str:
    """Which documents a source holds out, for the run's summary (`held_out_every`)."""
    every = held_out_every(eval_fraction)
    return f"held out: every {every}th document" if every else "none held out"


def _pack(
    spec: SourceSpec,
    cfg: DataConfig,
    tokenizer: tuple[str, int],
    actors: int,
    out: Path,
    holdout: Path | None,
    pad_id: int | None = None,
) -> dict:
    """Tokenizes in Ray Data, then packs in document order on the driver (a sequential concat)."""
    import pyarrow as pa
    import pyarrow.compute  # noqa: F401 - pa.compute
    import ray

    # Packing order = file order = document order. Before the dataset is built: it keeps a copy
    # of the context it was built with (set after, `prepare` and `evaluate` packed in whatever
    # order the tasks finished: other blocks and another held-out split under the same key).
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ds = _read_documents(spec, cfg, tokenizer, actors)
    sft = spec.format != "text"
    make = (lambda d: _ExampleWriter(d, cfg.seq_len, pad_id)) if sft else (lambda d: _BlockWriter(d, cfg.seq_len))
    writer = make(out)
    eval_writer = make(holdout) if holdout else None
    every = held_out_every(cfg.eval_fraction) if holdout else 0
    docs = skipped = tokens = 0
    failure = None
    with _console_errors_held() as held:
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                skipped += int(pa.compute.sum(batch.column("skipped")).as_py() or 0)
                docs, added = _write_batch(batch, spec.format, writer, eval_writer, every, docs)
                tokens += added
        except Exception as e:
            failure = _unwrap(e) or _damaged_file(spec) or e  # ours as one line; anything else as it came
        if isinstance(failure, DataError):
            held.clear()  # ours: the one line it raises says it all (Ray Data's log file keeps the rest)
    if failure is not None:
        _kill_tokenizer_actors()
        raise failure  # outside the handler: no link to Ray's exception when it is ours
    dropped = writer.close() + (eval_writer.close() if eval_writer else 0)
    if docs == 0:
        raise DataError(
            f"the source {', '.join(spec.paths[:3])}{' ...' if len(spec.paths) > 3 else ''} holds no text "
            f"({skipped} rows skipped). Point data.path at non-empty text."
        )
    stats = {
        "documents": docs,
        "tokens": tokens,
        "skipped_rows": skipped,
        "dropped_tail_tokens": dropped,
        "blocks": writer.n_blocks,
        "eval_blocks": eval_writer.n_blocks if eval_writer else 0,
    }
    if sft and eval_writer:  # the held-out examples cut to seq_len, counted apart from the training ones
        stats["eval_truncated_examples"] = eval_writer.truncated
    return stats | (writer.stats() if sft else {})


def _write_batch(batch, data_format: str, writer, eval_writer, every: int, docs: int) -> tuple[int, int]:
    """Writes one tokenized batch's documents (or examples, or pairs) in order, every `every`-th
    document of the run to eval_writer; returns the documents so far and the tokens written."""
    col = batch.column("ids").combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy()
    sft = data_format != "text"
    labels = batch.column("labels").combine_chunks().values.to_numpy() if sft else None
    splits = batch.column("split").to_numpy() if data_format == "preference" else None
    tokens = 0
    for i in range(len(col)):
        ids = values[offsets[i] : offsets[i + 1]]
        if len(ids) == 0:
            continue
        docs += 1
        tokens += len(ids)
        # Hold-out goes by document, so no article is split between train and eval.
        w = eval_writer if every and docs % every == 0 else writer
        if splits is not None:
            w.add_pair(ids, labels[offsets[i] : offsets[i + 1]], int(splits[i]))
        elif sft:
            w.add_example(ids, labels[offsets[i] : offsets[i + 1]])
        else:
            w.add(ids)
    return docs, tokens


def _log_named(log, name: str, message: str) -> None:
    """A mixture entry's console line with its name after "[data] ", once: a line that already
    starts with it (an entry named for its format, "chat") is not named twice."""
    if not message.startswith(f"[data] {name}: "):
        message = message.replace("[data] ", f"[data] {name}: ", 1)
    log(message)


def prepare(cfg: Config, *, force: bool = False, log=print) -> Path:
    """Builds (or finds) the packed-block cache for this config; returns its directory.

    A mixture's sources are packed one by one, each into the cache it would have alone (a later
    run of that source alone, or of another mixture holding it, finds it there); the mixture's
    own directory holds only meta.json, naming them and their shares.
    """
    if not cfg.data.mix:
        return _prepare_source(cfg, force=force, log=log)
    caches = []
    for i, (entry, part) in enumerate(zip(cfg.data.mix, cfg.data.parts())):
        named = functools.partial(_log_named, log, entry.name)
        part_cfg = dataclasses.replace(cfg, data=part)
        try:
            caches.append(_prepare_source(part_cfg, force=force, log=named, eval_only=entry.weight == 0))
        except DataError as e:  # which entry: "the training text gives 127 tokens" named none
            message = mix_entry_keys(str(e), i)
            raise DataError(
                message if f"data.mix[{i}]" in message else f"data.mix[{i}] ({entry.name}): {message}"
            ) from None
    return _write_mixture(cfg, caches, log)


def prepare_evaluation(cfg: Config, *, log=print) -> Path:
    """The cache of cfg's evaluation blocks for a command that only evaluates (launch.evaluate): the
    one training made (or would make) where it is there, or where the evaluation is held out of
    the training text; else one of the evaluation text alone, packed without the training text."""
    if cfg.data.mix:
        return prepare(cfg, log=log)
    train, evals = source_specs(cfg.data)
    key = cache_key(cfg, train, evals, resolve_tokenizer_path(cfg.model.tokenizer, cfg.model.name_or_path))
    trained = published_cache(cache_root(cfg), key) is not None
    eval_only = evals is not None and not trained
    return _prepare_source(cfg, force=False, log=log, eval_only=eval_only, specs=(train, evals))


def _write_mixture(cfg: Config, caches: list[Path], log) -> Path:
    metas = [read_meta(c) for c in caches]
    formats = [m.get("data_format", "text") for m in metas]
    counts = mix_counts([e.weight for e in cfg.data.mix])
    # The names too: a run reads them back from this meta.json, which a mixture of the same
    # sources under other names must not overwrite meanwhile.
    mixture = {"sources": [m["key"] for m in metas], "names": [e.name for e in cfg.data.mix], "counts": counts}
    key = hashlib.sha256(json.dumps({"format": CACHE_FORMAT, **mixture}).encode()).hexdigest()[:16]
    period = sum(counts)
    total = lambda k: sum(m.get(k, 0) for m in metas)  # noqa: E731
    meta = {
        "format": CACHE_FORMAT,
        "key": key,
        "seq_len": cfg.data.seq_len,
        "tokenizer": metas[0]["tokenizer"],
        # Labelled blocks (-100 where no loss) if any source has them: the others' labels are their inputs.
        "data_format": formats[0] if len(set(formats)) == 1 else "mixed",
        "sources": [
            {
                "name": e.name,
                "weight": e.weight,
                "share": c / period,
                "cache": str(cache),
                **{k: m[k] for k in ("key", "blocks", "eval_blocks", "documents", "tokens")},
                "data_format": m.get("data_format", "text"),
            }
            for e, c, cache, m in zip(cfg.data.mix, counts, caches, metas)
        ],
        "pattern": mix_pattern(counts),
        **{k: total(k) for k in ("blocks", "eval_blocks", "documents", "tokens", "skipped_rows", "padding_tokens")},
        "truncated_examples": total("truncated_examples"),
        "eval_truncated_examples": total("eval_truncated_examples"),
    }
    meta["padding_frac"] = meta["padding_tokens"] / max(1, meta["blocks"] * cfg.data.seq_len)
    out = cache_root(cfg) / f"mix-{key}"
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".meta.json.tmp-{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out / "meta.json")
    shares = ", ".join(
        f"{s['name']} {s['share']:.1%} ({s['blocks']:,} blocks)" if s["share"] else f"{s['name']} evaluated only"
        for s in meta["sources"]
    )
    log(f"[data] a mixture of {len(caches)} sources: {shares}")
    return out


def _pack_training_text(
    train: SourceSpec, evals: SourceSpec | None, cfg: DataConfig, tokenizer, actors: int, tmp: Path, pad_id, log
) -> dict:
    """Packs the training text into tmp/train (and the held-out documents into tmp/eval when the
    source has no evaluation text of its own); returns the stats."""
    t0 = time.perf_counter()
    log(f"[data] 1/{2 if evals else 1} tokenizing the training text with up to {actors} actors (one a file) ...")
    stats = _pack(train, cfg, tokenizer, actors, tmp / "train", None if evals else tmp / "eval", pad_id)
    log(
        f"[data] tokenized {stats['documents']:,} docs, {stats['tokens']:,} tokens -> {stats['blocks']:,} "
        f"blocks in {time.perf_counter() - t0:.1f}s"
    )
    if stats["blocks"] == 0:
        raise DataError(
            f"the training text gives {stats['tokens']} tokens, less than one block of data.seq_len="
            f"{cfg.seq_len}; lower data.seq_len or add text."
        )
    return stats


def _log_examples_packed(data: DataConfig, stats: dict[str, Any], eval_only: bool, log) -> None:
    """The console line of packed chat/instruction/preference examples: the response tokens, the
    padding and the examples cut to data.seq_len, the eval text's among them."""
    pairs = data.format == "preference"
    limit = f"data.seq_len={data.seq_len}"
    n_cut = stats.get("eval_truncated_examples", 0)
    eval_cut = f"{n_cut} eval {'pair' if pairs else 'example'}{'' if n_cut == 1 else 's'}"
    if not eval_only:
        log(
            f"[data] {data.format}: {stats['loss_tokens']:,} response tokens carry the loss; padding "
            f"{stats['padding_frac']:.1%} of the blocks; {stats['truncated_examples']} "
            f"{'pairs cut to share a block of' if pairs else 'examples truncated to'} {limit}"
            + (f" (and {eval_cut})" if n_cut else "")
        )
    elif n_cut:
        log(f"[data] {data.format}: {eval_cut} {'cut to share a block of' if pairs else 'truncated to'} {limit}")


def _pad_id(tokenizer: tuple[str, int]) -> int:
    """Padding of chat/instruction blocks: the tokenizer's pad token, else EOS (its labels are -100 either way)."""
    pad_id = _local_special_id(Path(tokenizer[0]).parent, "pad_token")
    return tokenizer[1] if pad_id is None else pad_id


def _pack_evaluation_text(
    evals: SourceSpec, cfg: DataConfig, tokenizer, actors: int, tmp: Path, pad_id: int, stats: dict, log
) -> None:
    """Packs the source's own evaluation text into tmp/eval and adds its figures to `stats`."""
    estats = _pack(evals, cfg, tokenizer, actors, tmp / "eval", None, pad_id)
    log(f"[data] tokenized {estats['documents']:,} eval docs -> {estats['blocks']:,} blocks")
    stats["eval_blocks"] = estats["blocks"]
    stats["eval_tokens"] = estats["tokens"]
    stats["skipped_rows"] += estats["skipped_rows"]
    stats["eval_truncated_examples"] = estats.get("truncated_examples", 0)


def _source_meta(
    data: DataConfig,
    key: str,
    tokenizer_path: str,
    specs: tuple[SourceSpec, SourceSpec | None],
    stats: dict,
    wall: float,
) -> dict:
    """A source cache's meta.json: what it was packed from, and its figures."""
    train, evals = specs
    return {
        "format": CACHE_FORMAT,
        "key": key,
        "seq_len": data.seq_len,
        "tokenizer": tokenizer_path,
        "train_source": train.describe(),
        "eval_source": evals.describe() if evals else held_out(data.eval_fraction),
        "padding_tokens": 0,
        "padding_frac": 0.0,
        "truncated_examples": 0,
        "eval_truncated_examples": 0,
        "data_format": data.format,
        **stats,
        "prepare_wall_s": round(wall, 3),
        "tokens_per_s": round(stats["tokens"] / wall, 1),
    }


def _prepare_source(
    cfg: Config, *, force: bool, log, eval_only: bool = False, specs: tuple[SourceSpec, SourceSpec | None] = ()
) -> Path:
    """One source's cache; `eval_only` (a mixture's weight-0 source) packs only its evaluation
    text, where it has one of its own (a held-out evaluation needs the training text). `specs`:
    source_specs(cfg.data) where the caller has them (a hub source's file listing is a request)."""
    import ray

    tokenizer_path = resolve_tokenizer_path(cfg.model.tokenizer, cfg.model.name_or_path)
    train, evals = specs or source_specs(cfg.data)
    eval_only = eval_only and evals is not None
    key = cache_key(cfg, train, evals, tokenizer_path, eval_only)
    root = cache_root(cfg)
    final, seen = _pointer(root, key), _pointed(root, key)  # seen: the version a --force rebuild replaces
    found = published_cache(root, key)
    if found is not None and not force:
        log(f"[data] using the cached blocks in {found}")
        return found
    t0 = time.perf_counter()
    if not ray.is_initialized():  # a one-process command (evaluate) whose data are not packed yet
        ray.init(address="local", log_to_driver=False, include_dashboard=False)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    actors = cfg.data.tokenize_actors or max(1, cpus)
    tmp = final.parent / f".{key}.tmp-{uuid.uuid4().hex[:8]}"
    tokenizer = materialize_tokenizer(tokenizer_path, cfg)
    pad_id = _pad_id(tokenizer)
    try:
        if eval_only:
            log(f"[data] evaluated only: packing its evaluation text, not its training text -> {final}")
            stats = dict.fromkeys(("documents", "tokens", "skipped_rows", "dropped_tail_tokens", "blocks"), 0)
        else:
            log(f"[data] preparing {train.kind} source ({len(train.paths)} files) -> {final}")
            stats = _pack_training_text(train, evals, cfg.data, tokenizer, actors, tmp, pad_id, log)
        if evals:
            log(f"[data] {'1/1' if eval_only else '2/2'} tokenizing the evaluation text ...")
            _pack_evaluation_text(evals, cfg.data, tokenizer, actors, tmp, pad_id, stats, log)
        if cfg.data.format != "text":  # after the eval text: its cut examples are counted on the same line
            _log_examples_packed(cfg.data, stats, eval_only, log)
        wall = time.perf_counter() - t0
        meta = _source_meta(cfg.data, key, tokenizer_path, (train, evals), stats, wall)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        final = _publish(root, key, tmp, replace=force, seen=seen, log=log)  # whole or not at all
    except OSError as e:
        if not out_of_space(e):
            raise
        raise DataError(
            f"data.cache_dir: no space left in {final.parent} for the packed blocks ({e.strerror or e}); nothing was "
            "kept. Free space there, or set data.cache_dir to a filesystem with room (about 4 bytes a token)."
        ) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(
        f"[data] {stats['blocks']} train / {stats['eval_blocks']} eval blocks of {cfg.data.seq_len} tokens in {wall:.1f}s"
    )
    return final
