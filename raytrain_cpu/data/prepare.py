"""Data: text -> documents -> tokens (Ray Data) -> packed blocks (parquet cache) -> per-rank streams.

The flow, top to bottom:

1. **sources**: text files, JSONL, parquet (local, /fsx or s3://) or a hub dataset are read
   as whole files with Ray Data, so a bad byte or a missing column can be reported with its
   file and line. Wikitext-style line sources are regrouped into articles (a ` = Title = `
   heading starts one); blank lines are dropped.
2. **tokenize**: `map_batches` with a callable class, so each Ray Data actor loads the
   tokenizer once; batched fast tokenization; every document ends with EOS.
3. **pack**: documents are concatenated and cut into `seq_len` blocks: no padding anywhere,
   the EOS marks document boundaries. Labels are the inputs (the model shifts them), so the
   target of each position is the next token of the same packed stream.
4. **cache**: blocks are written as parquet under `<cache_dir>/<key>/`, where the key hashes
   the source, the tokenizer and seq_len. Written to a temporary directory and renamed, so a
   cache is either whole or absent. `python -m raytrain_cpu.data prepare --config ...` fills
   it ahead of time; training fills it when missing.
5. **stream**: each rank gets its own Ray Data pipeline over the cache holding exactly the
   blocks it will train on, in a seeded order, starting at the first block not yet consumed.
   A mixture (data.mix) packs each source into a cache of its own and interleaves them by
   weight in the stream (`mix_positions`).
"""

from __future__ import annotations

import codecs
import collections
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
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raytrain_cpu.checkpoint.store import fsync_dir, fsync_file, out_of_space
from raytrain_cpu.config.checks import ConfigError, is_glob
from raytrain_cpu.config.data import COMPRESSED, DataConfig, data_suffixes, mix_counts, mix_entry_keys
from raytrain_cpu.config.schema import Config, load_config
from raytrain_cpu.model.hub import download_tokenizer, hub_errors, is_hub_id
from raytrain_cpu.model.tokenizer import (
    BUNDLED_SFT,
    BUNDLED_WIKITEXT,
    load_tokenizer,
    resolve_tokenizer_path,
    save_tokenizer,
)

CACHE_FORMAT = 1
BLOCKS_PER_FILE = 8192
_HEADING = re.compile(r"^ ?= [^=].*[^=] = ?$")


class DataError(ValueError):
    """Unusable input data; the message names the file (and line or row) and the fix."""


# ----------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class SourceSpec:
    """One split of one source: which files, how to read them, how to cut documents."""

    kind: str  # text | jsonl | parquet
    paths: tuple[str, ...]
    text_column: str
    wikitext: bool  # regroup lines into articles at ` = Title = ` headings
    bad_rows: str
    filesystem: str = "local"  # local | s3 | hf
    format: str = "text"  # text: documents | chat / instruction: rows that become examples (sft.py)
    # A remote file's version from its listing, one per path (S3: size and modification time; the
    # hub: its git blob id), so an object rewritten under the same name is new data to the cache
    # key; () for local files, which are stat'ed when the key is made.
    versions: tuple[str, ...] = ()

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "paths": list(self.paths),
            "text_column": self.text_column,
            "wikitext": self.wikitext,
            "format": self.format,
        }


def _expand_local(path: str, kind: str, key: str) -> tuple[str, ...]:
    suffix = data_suffixes(kind)
    p = Path(path).expanduser()
    if is_glob(path):
        files = sorted(str(f) for f in Path(p.anchor or ".").glob(str(p.relative_to(p.anchor)) if p.anchor else path))
    elif p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.name.endswith(suffix))
    elif p.is_file():
        files = [str(p.absolute())]
    else:
        raise DataError(f"{key}: {path!r} does not exist. Point it at a {kind} file, a directory or a glob.")
    if not files:
        raise DataError(f"{key}: {path!r} holds no {'/'.join(suffix)} files; the source is empty.")
    return tuple(str(Path(f).absolute()) for f in files)


def _expand_s3(path: str, kind: str, key: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(s3:// paths, their versions) of an object or of every object under a prefix."""
    import pyarrow.fs as pafs

    try:
        fs, root = pafs.FileSystem.from_uri(path)
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise DataError(f"{key}: {path!r} does not exist (or is not readable with these credentials).")
        if info.type == pafs.FileType.File:
            return (path,), (_object_version(info),)
        sel = pafs.FileSelector(root, recursive=True)
        # A prefix's objects of this kind only, as a local directory's files (_SUCCESS, README.md,
        # .crc files beside the data are no source).
        found = sorted(
            (f.path, f)
            for f in fs.get_file_info(sel)
            if f.type == pafs.FileType.File and f.base_name.endswith(data_suffixes(kind))
        )
    except OSError as e:  # S3 unreachable, an unknown bucket, credentials refused: AWS's words, one line
        raise DataError(
            f"{key}: cannot list {path!r} ({' '.join(str(e).split())}). Check the bucket's name, this machine's "
            "network and its AWS credentials (the instance role on the cluster; AWS_PROFILE or AWS_ACCESS_KEY_ID)."
        ) from None
    if not found:
        raise DataError(f"{key}: {path!r} holds no {'/'.join(data_suffixes(kind))} objects; the source is empty.")
    return tuple(f"s3://{p}" for p, _ in found), tuple(_object_version(f) for _, f in found)


def _object_version(info) -> str:
    """An S3 object's size and last-modified time, as its listing gives them (no request more)."""
    return f"{info.size}:{info.mtime_ns}"


def _hub_files(cfg: DataConfig, split: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(hf:// paths, their versions) of a hub dataset split's parquet files (the hub's own parquet
    conversion)."""
    from huggingface_hub import HfFileSystem

    fs = HfFileSystem()
    base = f"datasets/{cfg.hub_id}"
    candidates = [f"{base}/{cfg.hub_config}/{split}-*.parquet", f"{base}/{cfg.hub_config}/{split}/*.parquet"]
    for pattern in candidates:
        with hub_errors("data.hub_id", cfg.hub_id, "dataset"):
            found = sorted(fs.glob(pattern, detail=True).items())
        if found:
            # A file's git blob id (an LFS file's pointer: its content hash) names its version:
            # a dataset updated on the hub is new data.
            versions = tuple(str(info.get("blob_id") or info["size"]) for _, info in found)
            return tuple(f"hf://{f}" for f, _ in found), versions
    raise DataError(
        f"data.hub_id: no parquet files for {cfg.hub_id} / {cfg.hub_config} / split {split!r} on the hub "
        f"(looked for {candidates}). Check data.hub_config and data.train_split/eval_split."
    )


def source_specs(cfg: DataConfig) -> tuple[SourceSpec, SourceSpec | None]:
    """(train, eval) sources; eval is None when it is held out from train."""
    train, evals = _source_specs(cfg)
    # Rows become chat/instruction examples: never regrouped as wikitext lines.
    fmt = {"format": cfg.format, "wikitext": False} if cfg.format != "text" else {}
    return dataclasses.replace(train, **fmt), (dataclasses.replace(evals, **fmt) if evals else None)


def check_sources(cfg: DataConfig) -> None:
    """Lists every source's files (a mixture's each): a missing path, or a hub dataset's file
    list, answers before Ray starts."""
    for i, part in enumerate(cfg.parts()):
        try:
            source_specs(part)
        except (ConfigError, DataError) as e:  # a hub's answer, a missing file: named as the entry's
            if not cfg.mix:
                raise
            raise type(e)(mix_entry_keys(str(e), i)) from None


def _source_specs(cfg: DataConfig) -> tuple[SourceSpec, SourceSpec | None]:
    if cfg.source == "bundled" and cfg.format != "text":  # the examples made from the bundled wikitext

        def mk(split: str) -> SourceSpec:
            return SourceSpec("jsonl", (str(BUNDLED_SFT / f"{cfg.format}_{split}.jsonl"),), "", False, cfg.bad_rows)

        return mk("train"), mk("eval")
    if cfg.source == "bundled":
        mk = lambda f: SourceSpec("text", (str(BUNDLED_WIKITEXT / f),), "text", True, cfg.bad_rows)  # noqa: E731
        return mk("test.txt"), mk("valid.txt")
    if cfg.source == "hub":
        wikitext = "wikitext" in cfg.hub_id.lower()

        def hub(split: str) -> SourceSpec:
            paths, versions = _hub_files(cfg, split)
            return SourceSpec("parquet", paths, cfg.text_column, wikitext, cfg.bad_rows, "hf", versions=versions)

        return hub(cfg.train_split), (hub(cfg.eval_split) if cfg.eval_split else None)

    def files(path: str, key: str) -> SourceSpec:
        if path.startswith("s3://"):
            paths, versions = _expand_s3(path, cfg.source, key)
            fs = "s3"
        else:
            paths, versions, fs = _expand_local(path, cfg.source, key), (), "local"
        return SourceSpec(cfg.source, paths, cfg.text_column, cfg.source == "text", cfg.bad_rows, fs, versions=versions)

    return files(cfg.path, "data.path"), (files(cfg.eval_path, "data.eval_path") if cfg.eval_path else None)


def _filesystem(name: str):
    if name == "hf":
        from huggingface_hub import HfFileSystem
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        return PyFileSystem(FSSpecHandler(HfFileSystem()))
    return None


# ----------------------------------------------------------------------------- documents


def _decode_lines(raw: bytes, path: str, bad_rows: str) -> tuple[list[str], int]:
    """UTF-8 lines of a file; undecodable lines fail (naming file and line) or are skipped.
    Files saved on Windows read as the same lines: a leading byte-order mark and CRLF endings are
    dropped (a kept '\r' hides wikitext headings, and a BOM is not JSON)."""
    raw = raw.removeprefix(codecs.BOM_UTF8).replace(b"\r\n", b"\n")
    try:
        return raw.decode("utf-8").split("\n"), 0
    except UnicodeDecodeError as e:
        if bad_rows == "error":
            line = raw[: e.start].count(b"\n") + 1
            col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
            raise DataError(
                f"{path}, line {line}, column {col}: not valid UTF-8 (byte 0x{raw[e.start]:02x}). "
                "Re-encode the file as UTF-8, or set data.bad_rows=skip to drop such lines."
            ) from None
    lines, skipped = [], 0
    for chunk in raw.split(b"\n"):
        try:
            lines.append(chunk.decode("utf-8"))
        except UnicodeDecodeError:
            skipped += 1
    return lines, skipped


def _group_wikitext(lines: list[str]) -> list[str]:
    """Articles: a top-level ` = Title = ` heading starts one; blank lines are dropped."""
    docs: list[list[str]] = []
    for line in lines:
        if not line.strip():
            continue
        if _HEADING.match(line.rstrip("\n")) or not docs:
            docs.append([])
        docs[-1].append(line.strip())
    return ["\n".join(d) for d in docs]


def _records_text(
    records: list[Any], column: str, path: str, first_row: int, bad_rows: str, what: str
) -> tuple[list[str], int]:
    texts, skipped = [], 0
    for i, value in enumerate(records):
        if isinstance(value, str):
            texts.append(value)
            continue
        if bad_rows == "skip":
            skipped += 1
            continue
        raise DataError(
            f"{path}, {what} {first_row + i}: column {column!r} is {'missing' if value is None else type(value).__name__}, "
            "not text. Fix the row, or set data.bad_rows=skip to drop such rows."
        )
    return texts, skipped


def _jsonl_rows(raw: bytes, path: str, bad_rows: str) -> tuple[list[tuple[str, int, Any]], int]:
    """("line", number, parsed object) of every non-blank line; bad JSON fails or is skipped. A
    file holding one JSON array instead (as Alpaca's alpaca_data.json and many exports ship)
    gives ("item", index, object) of its items."""
    lines, skipped = _decode_lines(raw, path, bad_rows)
    if next((ln.lstrip()[:1] for ln in lines if ln.strip()), "") == "[":
        try:
            items = json.loads("\n".join(lines))
        except json.JSONDecodeError as e:  # one document: no row to skip
            raise DataError(f"{path}, line {e.lineno}: not valid JSON ({e.msg}). Fix it.") from None
        if isinstance(items, list):
            return [("item", i, obj) for i, obj in enumerate(items)], skipped
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(("line", n, json.loads(line)))
        except json.JSONDecodeError as e:
            if bad_rows == "skip":
                skipped += 1
                continue
            raise DataError(f"{path}, line {n}: not valid JSON ({e.msg}). Fix it, or set data.bad_rows=skip.") from None
    return rows, skipped


def file_examples(path: str, raw: bytes, spec: SourceSpec, data: DataConfig) -> tuple[list[str], int]:
    """Chat/instruction rows of one file as JSON payloads {ref, messages} for the tokenizer actors;
    a row without messages/prompt fails naming file and row, or is skipped and counted."""
    from raytrain_cpu.model.chat import RowError, row_messages, row_pair

    if spec.kind == "jsonl":
        rows, skipped = _jsonl_rows(raw, path, spec.bad_rows)
        refs = [f"{path}, {what} {n}" for what, n, _ in rows]
        objs = [o for _, _, o in rows]
    else:
        import io

        import pyarrow.parquet as pq

        objs, skipped = pq.read_table(io.BytesIO(raw)).to_pylist(), 0
        refs = [f"{path}, row {i}" for i in range(len(objs))]
    out = []
    for ref, obj in zip(refs, objs):
        try:
            if not isinstance(obj, dict):
                raise RowError(f"a {type(obj).__name__}, not an object with fields")
            if data.format == "preference":
                out.append(json.dumps({"ref": ref, "pair": row_pair(obj, data)}))
            else:
                out.append(json.dumps({"ref": ref, "messages": row_messages(obj, data)}))
        except (RowError, ValueError) as e:
            if spec.bad_rows == "skip":
                skipped += 1
                continue
            raise DataError(f"{ref}: {e}. Fix the row, or set data.bad_rows=skip to drop such rows.") from None
    return out, skipped


def file_documents(path: str, raw: bytes, spec: SourceSpec, data: DataConfig | None = None) -> tuple[list[str], int]:
    """(documents, skipped rows) of one whole file; for chat/instruction data, example payloads."""
    if spec.format != "text":
        return file_examples(path, raw, spec, data or DataConfig(format=spec.format, source="jsonl", path=path))
    if spec.kind == "text":
        lines, skipped = _decode_lines(raw, path, spec.bad_rows)
        docs = _group_wikitext(lines) if spec.wikitext else ["\n".join(ln for ln in lines if ln.strip())]
        return [d for d in docs if d.strip()], skipped
    if spec.kind == "jsonl":
        rows, skipped = _jsonl_rows(raw, path, spec.bad_rows)
        texts = []
        for what, n, obj in rows:
            if not isinstance(obj, dict) or spec.text_column not in obj:
                if spec.bad_rows == "skip":
                    skipped += 1
                    continue
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise DataError(
                    f"{path}, {what} {n}: no {spec.text_column!r} field (has {keys}). "
                    "Set data.text_column to the field holding the text."
                )
            t, s = _records_text([obj[spec.text_column]], spec.text_column, path, n, spec.bad_rows, what)
            texts += t
            skipped += s
        return _docs_from_texts(texts, spec), skipped
    # parquet
    import io

    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(raw))
    if spec.text_column not in table.column_names:
        raise DataError(
            f"{path}: no column {spec.text_column!r} (columns: {table.column_names}). "
            "Set data.text_column to the column holding the text."
        )
    texts, skipped = _records_text(
        table.column(spec.text_column).to_pylist(), spec.text_column, path, 0, spec.bad_rows, "row"
    )
    return _docs_from_texts(texts, spec), skipped


def _docs_from_texts(texts: list[str], spec: SourceSpec) -> list[str]:
    if spec.wikitext:  # line-per-row wikitext (the hub's layout): regroup into articles
        return _group_wikitext([t.rstrip("\n") for t in texts])
    return [t for t in texts if t.strip()]


TOKENIZE_CHUNK_BYTES = 1 << 19  # text per tokenizer call: ~0.1-0.3 s of work, whatever the document size


def _documents_batch(batch: dict[str, np.ndarray], spec: SourceSpec, max_docs: int, data: dict | None = None):
    """Files -> documents, yielded in order as chunks of <= max_docs documents and ~512 KiB.

    Runs fused with the read and the tokenizer inside one actor (see `_read_documents`): the
    tokenizer takes each chunk as one call (batch_size=None), so a large file is tokenized
    piece by piece with bounded memory, and work is spread over the actors file by file,
    never held back to fill a document-count batch.
    """
    docs, skipped, size = [], [], 0
    data_cfg = DataConfig(**data) if data else None
    for path, raw in zip(batch["path"], batch["bytes"]):
        d, s = file_documents(str(path), bytes(raw), spec, data_cfg)
        for i, doc in enumerate(d or [""]):  # a file whose every row was skipped still reports its count
            docs.append(doc)
            skipped.append(s if i == 0 else 0)
            size += len(doc)
            if len(docs) >= max_docs or size >= TOKENIZE_CHUNK_BYTES:
                yield {"text": docs, "skipped": np.asarray(skipped, dtype=np.int64)}
                docs, skipped, size = [], [], 0
    if docs:
        yield {"text": docs, "skipped": np.asarray(skipped, dtype=np.int64)}


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

        from raytrain_cpu.model.chat import RowError, example_tokens

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
    AutoTokenizer machinery, whose first use costs ~2 s of imports (measured here), a
    quarter of preparing 18 MB of text on 2 CPUs.
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
    # inside one tokenizer actor. Measured on 2 CPUs (8 wikitext files): 7.7 s against 12.9 s
    # for separate read/split tasks, which each started Python workers of their own and
    # handed every file across processes twice.
    ds = ray.data.read_binary_files(
        list(spec.paths),
        include_paths=True,
        filesystem=_filesystem(spec.filesystem),
        num_cpus=actor_cpus,
        override_num_blocks=min(len(spec.paths), 64 * actors),  # files per block >= 1: no split to unfuse
    )
    sft = dataclasses.asdict(cfg) if spec.format != "text" else None  # plain dicts cross the Ray boundary
    docs = ds.map_batches(
        _documents_batch,
        fn_kwargs={"spec": spec, "max_docs": cfg.tokenize_batch_size, "data": sft},
        batch_size=None,
        num_cpus=actor_cpus,
    )
    return docs.map_batches(
        Tokenize,
        fn_constructor_kwargs={"tokenizer_json": tokenizer[0], "eos_id": tokenizer[1], "sft": sft},
        batch_size=None,  # one chunk per call, as _documents_batch cut them
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
                col = batch.column("ids").combine_chunks()
                offsets = col.offsets.to_numpy()
                values = col.values.to_numpy()
                labels = batch.column("labels").combine_chunks().values.to_numpy() if sft else None
                splits = batch.column("split").to_numpy() if spec.format == "preference" else None
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
    """The cache of cfg's evaluation blocks for a command that only evaluates (evaluate.py): the
    one training made (or would make) where it is there, or where the evaluation is held out of
    the training text; else one of the evaluation text alone, packed without the training text."""
    if cfg.data.mix:
        return prepare(cfg, log=log)
    train, evals = source_specs(cfg.data)
    key = cache_key(cfg, train, evals, resolve_tokenizer_path(cfg.model.tokenizer, cfg.model.name_or_path))
    trained = published_cache(cache_root(cfg), key) is not None
    eval_only = evals is not None and not trained
    return _prepare_source(cfg, force=False, log=log, eval_only=eval_only, specs=(train, evals))


def mix_pattern(counts: list[int]) -> list[int]:
    """One period of a mixture: source i appears counts[i] times, spread evenly (slot k of source
    i at (k + 1/2) / counts[i] of the period), so any stretch of the stream holds each source near
    its share: counts 3 and 1 give [0, 0, 1, 0]."""
    slots = sorted(((k + 0.5) / c, i) for i, c in enumerate(counts) for k in range(c))
    return [i for _, i in slots]


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


def mixture_sources(cache: Path, meta: dict) -> list[tuple[str, Path, dict]]:
    """(name, cache directory, meta) of each source a prepared cache holds: a mixture's, or
    ('', cache, meta) for a single source."""
    if "sources" not in meta:
        return [("", Path(cache), meta)]
    return [(s["name"], Path(s["cache"]), read_meta(Path(s["cache"]))) for s in meta["sources"]]


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
    # Padding (chat/instruction blocks): the tokenizer's pad token, else EOS; its labels are -100 either way.
    pad_id = _local_special_id(Path(tokenizer[0]).parent, "pad_token")
    pad_id = tokenizer[1] if pad_id is None else pad_id
    try:
        if eval_only:
            log(f"[data] evaluated only: packing its evaluation text, not its training text -> {final}")
            stats = dict.fromkeys(("documents", "tokens", "skipped_rows", "dropped_tail_tokens", "blocks"), 0)
        else:
            log(f"[data] preparing {train.kind} source ({len(train.paths)} files) -> {final}")
            stats = _pack_training_text(train, evals, cfg.data, tokenizer, actors, tmp, pad_id, log)
        if evals:
            log(f"[data] {'1/1' if eval_only else '2/2'} tokenizing the evaluation text ...")
            estats = _pack(evals, cfg.data, tokenizer, actors, tmp / "eval", None, pad_id)
            log(f"[data] tokenized {estats['documents']:,} eval docs -> {estats['blocks']:,} blocks")
            stats["eval_blocks"] = estats["blocks"]
            stats["eval_tokens"] = estats["tokens"]
            stats["skipped_rows"] += estats["skipped_rows"]
            stats["eval_truncated_examples"] = estats.get("truncated_examples", 0)
        if cfg.data.format != "text":  # after the eval text: its cut examples are counted on the same line
            _log_examples_packed(cfg.data, stats, eval_only, log)
        wall = time.perf_counter() - t0
        meta = {
            "format": CACHE_FORMAT,
            "key": key,
            "seq_len": cfg.data.seq_len,
            "tokenizer": tokenizer_path,
            "train_source": train.describe(),
            "eval_source": evals.describe() if evals else held_out(cfg.data.eval_fraction),
            "padding_tokens": 0,
            "padding_frac": 0.0,
            "truncated_examples": 0,
            "eval_truncated_examples": 0,
            "data_format": cfg.data.format,
            **stats,
            "prepare_wall_s": round(wall, 3),
            "tokens_per_s": round(stats["tokens"] / wall, 1),
        }
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


def read_meta(cache: Path) -> dict:
    return json.loads((Path(cache) / "meta.json").read_text())


# ----------------------------------------------------------------------------- streams


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
    total), from the files' own row counts. Caches written before 2026-11-30 hold more than
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
    in columns (16), three columns of 8 files decoded a whole file for every third block read:
    18.1 ms a block against 0.43 counted in files (benchmarks/decoded_columns.py). A plan keeps
    as many files as its windows span (`keep`), so a long run holds no more than that."""

    def __init__(self, files: int) -> None:
        self.files = files
        self.held: collections.OrderedDict[str, dict[str, np.ndarray]] = collections.OrderedDict()

    def keep(self, files: int) -> None:
        """Holds at least `files` files from now on (a stream's windows, every source's)."""
        self.files = max(self.files, files)

    def __call__(self, path: str, column: str) -> np.ndarray:
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
        file a window's edge may cut (caches written before 2026-11-30 have uneven files), or
        every file of the source where that is fewer."""
        per_window = -(-self.window // BLOCKS_PER_FILE) + 1
        return sum(min(-(-n // BLOCKS_PER_FILE) + 1, per_window) for n in self.n_blocks)

    def fetch(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        _decoded_columns.keep(self.files_in_windows())  # in the reading process: Ray Data's task
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
    One rule for the stream's reads and the checkpoint's record of them (train.stream_block_ids,
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


def train_stream(plan: StreamPlan):
    """The Ray Dataset rank `plan.rank` iterates: its blocks in global order, lazily fetched.

    No shuffle stage: the order is arithmetic on a seeded permutation, so the dataset is a
    `range` mapped to cache rows, deterministic and cheap to restart at any position.
    """
    import ray

    lo, hi = plan.local_range
    return ray.data.range(hi - lo, override_num_blocks=max(1, min(64, (hi - lo) // 256))).map_batches(
        plan.fetch, batch_format="numpy", batch_size=256, num_cpus=0.25
    )


def eval_dataset(world_size: int, rank: int, source: str = "") -> str:
    """The name of a rank's eval stream (of a mixture's source) among the trainer's datasets."""
    return f"eval_w{world_size}_rank{rank}" + (f"_{source}" if source else "")


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


def eval_stream(
    cache: Path,
    world_size: int,
    rank: int,
    n_eval: int,
    max_blocks: int = 0,
    has_labels: bool = False,
    documents_eos: int | None = None,
):
    """Rank r evaluates eval blocks r, r+W, ... (its first `max_blocks`; 0: all), so the ranks
    together evaluate every block once, whatever W (`python -m raytrain_cpu.evaluate` on one
    process measures the same targets). Every rank gets the same count, ceil(n_eval / W)
    (eval_blocks_per_rank; ZeRO-3 needs every rank in every forward): where W does not divide
    n_eval, the last row of the ranks past the split's end is padding (read_eval_blocks: a real
    block's tokens, no target, block_id -1). Columns as in read_blocks, and block_id; a text
    split's stream that holds padding carries labels for all its rows (their inputs where real),
    so that every batch of the stream has the same columns.

    Fetched by index like the training stream: an evaluation reads the blocks it evaluates,
    not the whole split (reading and filtering the split cost seconds an evaluation).
    """
    import ray

    per_rank = eval_blocks_per_rank(n_eval, world_size, max_blocks)
    padded = per_rank > 0 and (per_rank - 1) * world_size + rank >= n_eval  # this rank's last row is padding
    split_dir = str(Path(cache) / "eval")

    def fetch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        block_id = batch["id"].astype(np.int64) * world_size + rank
        return read_eval_blocks(split_dir, block_id, n_eval, has_labels, documents_eos, labelled=padded)

    return ray.data.range(per_rank, override_num_blocks=max(1, min(64, per_rank // 256))).map_batches(
        fetch, batch_format="numpy", batch_size=256, num_cpus=0.25
    )


# ----------------------------------------------------------------------------- CLI


# What `python -m raytrain_cpu.data prepare` prints of a cache's meta.json, where it says them
# (a mixture's has no tokens_per_s, a text cache no padding; only a mixture lists its sources).
PREPARED_FIGURES = (
    "blocks",
    "eval_blocks",
    "tokens",
    "skipped_rows",
    "tokens_per_s",
    "truncated_examples",
    "eval_truncated_examples",
    "padding_frac",
    "loss_tokens",
    "sources",
)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m raytrain_cpu.data",
        description="Tokenize and pack a text source into the parquet block cache that training streams from.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the cache for a config (no-op when it exists)")
    p.add_argument("--config", default=None, help="YAML config (default: the embedded local default)")
    p.add_argument(
        "--force",
        action="store_true",
        help="rebuild even if the cache exists (a new version; the old one stays for runs reading it)",
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.seq_len=512")
    argv = sys.argv[1:] if argv is None else argv
    # Overrides on both sides of --config, as main takes them (argparse mixes positionals and
    # options only without subparsers, so the command's own parser reads the rest).
    args = p.parse_intermixed_args(argv[1:]) if argv[:1] == ["prepare"] else ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        check_sources(cfg.data)  # fail on missing paths before Ray starts
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    from raytrain_cpu.obs.console import quiet_local_console

    quiet_local_console()  # a Ray of its own; its progress and notices go to its log files
    ray.init(address=cfg.run.ray_init_address, log_to_driver=False, include_dashboard=False)
    try:
        cache = prepare(cfg, force=args.force)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = read_meta(cache)
    print(
        json.dumps(
            {
                "cache": str(cache),
                **{k: meta[k] for k in PREPARED_FIGURES if k in meta},
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "DataError",
    "StreamPlan",
    "cache_root",
    "check_sources",
    "eval_dataset",
    "eval_stream",
    "file_documents",
    "global_order",
    "mix_positions",
    "mixture_sources",
    "prepare",
    "read_meta",
    "source_specs",
    "train_stream",
]
