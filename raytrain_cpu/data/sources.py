"""Data sources: which files a source reads (local, /fsx, s3:// or a hub dataset), and each file's
documents (text) or examples (chat, instruction and preference rows), with bad rows named or skipped.

Sources are read as whole files, so a bad byte or a missing column is reported with its file and
line. Wikitext-style line sources are regrouped into articles (a ` = Title = ` heading starts
one); blank lines are dropped.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raytrain_cpu.config.checks import ConfigError, is_glob
from raytrain_cpu.config.data import DataConfig, data_suffixes, mix_entry_keys
from raytrain_cpu.model.hub import hub_errors
from raytrain_cpu.model.tokenizer import (
    BUNDLED_SFT,
    BUNDLED_WIKITEXT,
)

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
    format: str = "text"  # text: documents | chat / instruction: rows that become examples (data.sft)
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


def arrow_filesystem(name: str):
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
    from raytrain_cpu.data.sft import row_messages, row_pair
    from raytrain_cpu.model.chat import RowError

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


def documents_batch(batch: dict[str, np.ndarray], spec: SourceSpec, max_docs: int, data: dict | None = None):
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
