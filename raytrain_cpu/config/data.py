"""data: settings: where the text comes from (one source or a weighted mixture) and how it is packed."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from raytrain_cpu.config.checks import ConfigError, absolute, choice, is_glob, is_url, require, require_filesystem

OneSource = Literal["auto", "bundled", "text", "parquet", "jsonl", "hub"]
Source = Literal[OneSource, "mix"]  # "mix": data.mix lists the sources
Format = Literal["text", "chat", "instruction", "preference"]
BadRows = Literal["error", "skip"]
AttentionSpan = Literal["auto", "document", "block"]

# ----------------------------------------------------------------------------- data


# The files each data.source reads, by suffix. Text and JSON lines may come compressed, as corpora
# ship: Ray Data's reader (pyarrow) decompresses these by their suffix; parquet compresses inside.
DATA_SUFFIXES = {"text": (".txt", ".raw", ".tokens"), "jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
COMPRESSED = (".gz", ".bz2", ".zst")


def data_suffixes(kind: str) -> tuple[str, ...]:
    plain = DATA_SUFFIXES[kind]
    return plain if kind == "parquet" else plain + tuple(s + z for s in plain for z in COMPRESSED)


def source_kinds(path: str) -> tuple[set[str], list[str]]:
    """The data.source kinds a path's file names say, and the names: a file, a glob or a URL by
    its own, a local directory by the first thousand files it holds."""
    p = Path(path).expanduser()
    local_dir = not is_url(path) and not is_glob(path) and p.is_dir()
    files = (f.name for f in p.rglob("*") if f.is_file()) if local_dir else iter([path])
    names = list(itertools.islice(files, 1000))
    return {kind for kind in DATA_SUFFIXES for name in names if name.endswith(data_suffixes(kind))}, names


def source_of(path: str) -> str | None:
    """The data.source a path names by its files' suffixes; None unless exactly one kind."""
    kinds, _ = source_kinds(path)
    return kinds.pop() if len(kinds) == 1 else None


def unknown_source(path: str) -> str:
    """Why data.source=auto cannot tell what `path` holds, and what to do: an error's text."""
    kinds, names = source_kinds(path)
    if not names:
        return f"data.path: {path!r} is an empty directory; point it at your text, jsonl or parquet files."
    suffixes = ", ".join(s for kind in DATA_SUFFIXES for s in DATA_SUFFIXES[kind])
    known = f"{suffixes} (or those with {', '.join(COMPRESSED)} added)"
    if kinds:  # more than one
        found = f"it holds {' and '.join(sorted(kinds))} files"
        fix = "set data.source to the kind to read, or give each kind its own data.mix entry"
    elif names == [path]:  # one file, a glob or a URL: read as whatever data.source names
        found, fix = f"its name ends in none of {known}", "set data.source=text, jsonl or parquet"
    else:  # a directory: its files are read by their suffixes
        found = f"none of its files' names ends in {known}"
        fix = "a directory's files are read by their suffixes: rename them (notes.md -> notes.txt)"
    return f"data.source: cannot tell from data.path={path!r} what it holds: {found}; {fix}."


# What a data.mix entry may set. Where its text is (SOURCE_KEYS) is its own: data.source, path
# and eval_path are refused beside data.mix. How to read it (INHERITED_KEYS) the entry takes from
# data: unless it sets its own. The rest of data: applies to every source.
SOURCE_KEYS = ("source", "path", "eval_path")
INHERITED_KEYS = (
    "hub_id",
    "hub_config",
    "train_split",
    "eval_split",
    "text_column",
    "format",
    "messages_column",
    "prompt_column",
    "response_column",
    "system_column",
)
MIX_RESOLUTION = 1000  # mixture shares are kept to 1/1000 of the blocks


@dataclass
class MixSource:
    """One source of a data mixture (an entry of data.mix) and its share of the training blocks."""

    weight: float = math.nan  # NaN: not given, which the check names (a weight is required)
    """Its share of the training blocks, relative to the other entries' (3 and 1: 75% and 25%);
    0 evaluates it without training on it (general text watched while fine-tuning on another)."""
    name: str = ""
    """Its label in logs and in eval metrics (eval_loss/<name>); '' takes the path's or hub id's last
    part, or 'bundled'."""
    source: str = "auto"
    """As data.source, for this source."""
    path: str = ""
    """As data.path, for this source."""
    eval_path: str = ""
    """As data.eval_path, for this source ('' holds out data.eval_fraction of its documents)."""
    hub_id: str = ""
    """As data.hub_id, for this source ('' takes data.hub_id; so do the keys below)."""
    hub_config: str = ""
    """As data.hub_config, for this source."""
    train_split: str = ""
    """As data.train_split, for this source."""
    eval_split: str = ""
    """As data.eval_split, for this source."""
    text_column: str = ""
    """As data.text_column, for this source."""
    format: str = ""
    """As data.format, for this source. A 'text' source in a chat or instruction mixture
    (pre-training text kept in a fine-tuning run) trains on every token."""
    messages_column: str = ""
    """As data.messages_column, for this source."""
    prompt_column: str = ""
    """As data.prompt_column, for this source."""
    response_column: str = ""
    """As data.response_column, for this source."""
    system_column: str = ""
    """As data.system_column, for this source."""

    def default_name(self, hub_id: str) -> str:
        """The name of an entry without one: its path's or hub id's last part, or 'bundled'."""
        if self.source == "bundled":
            return "bundled"
        where = hub_id if self.source == "hub" else self.path
        if is_glob(where):
            where = where[: min(where.index(ch) for ch in "*?[" if ch in where)]
        last = Path(where.rstrip("/").split("://")[-1]).name.split(".")[0]
        return re.sub(r"[^\w.-]", "_", last) or "source"


def mix_entry_keys(message: str, i: int) -> str:
    """An error about one source (data.path, data.hub_id) as one about mixture entry i's keys."""
    return re.sub(rf"\bdata\.({'|'.join((*SOURCE_KEYS, *INHERITED_KEYS))})\b", rf"data.mix[{i}].\1", message)


def mix_counts(weights: list[float]) -> list[int]:
    """Blocks each source gets in one period of a mixture: whole weights as they are, others as
    their shares of MIX_RESOLUTION (largest remainders); divided by their common divisor (3 and 1,
    or 0.75 and 0.25, give 3 and 1: a period of 4 blocks)."""
    if all(float(w).is_integer() for w in weights) and sum(weights) <= MIX_RESOLUTION:
        divisor = math.gcd(*map(int, weights))  # whole weights are kept as they are: 1, 1, 1 is exact
        return [int(w) // divisor for w in weights]
    total = sum(weights)
    exact = [w / total * MIX_RESOLUTION for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: MIX_RESOLUTION - sum(counts)]:
        counts[i] += 1
    divisor = math.gcd(*counts)
    return [c // divisor for c in counts] if divisor else counts


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes packed training blocks."""

    source: Source = "auto"
    """'auto' ('bundled' without data.path, else what data.path's file names say: .txt -> text,
    .jsonl -> jsonl, .parquet -> parquet), 'bundled' (wikitext-2 shipped with the package:
    trains on its test split, evaluates on its validation split), 'text' (wikitext-style text
    files), 'parquet', 'jsonl' (local, /fsx/... or s3://...), or 'hub' (a dataset on the Hugging
    Face hub, cluster only)."""
    path: str = ""
    """Training data for source text/parquet/jsonl: a file, a directory or a glob."""
    eval_path: str = ""
    """Evaluation data for source text/parquet/jsonl; '' holds out data.eval_fraction of the
    training blocks instead."""
    hub_id: str = "wikitext"
    """Dataset id on the hub, for source 'hub'."""
    hub_config: str = "wikitext-2-raw-v1"
    """Dataset configuration (subset) name on the hub, for source 'hub'."""
    train_split: str = "train"
    """Split to train on, for source 'hub'."""
    eval_split: str = "validation"
    """Split to evaluate on, for source 'hub'."""
    text_column: str = "text"
    """Column holding the text, for parquet, jsonl and hub sources."""
    seq_len: int = 256
    """Tokens per packed training block."""
    eval_fraction: float = 0.02
    """Share of the documents held out for evaluation when there is no eval source: every
    round(1 / eval_fraction)-th document (0.02: every 50th; 0.4 rounds to every 2nd); 0 holds
    none out, and the run evaluates nothing."""
    cache_dir: str = ""
    """Where packed blocks are cached as parquet, keyed by source (each file's name and version) +
    tokenizer + seq_len; '' means <run.storage_path>/data_cache."""
    bad_rows: BadRows = "error"
    """'error' stops at the first undecodable or missing text (or, for chat/instruction data, a
    blank answer) naming the file and line; 'skip' drops such rows and counts them in summary.json."""
    tokenize_batch_size: int = 512
    """Rows per Ray Data batch in tokenization."""
    tokenize_actors: int = 0
    """Tokenizer actors in Ray Data; 0 uses every CPU Ray reports."""
    shuffle_window: int = 65536
    """Blocks shuffled together: training visits windows of this many blocks in a seeded
    random order and the blocks within each window in a seeded random order, so a reader
    holds one window at a time (data smaller than a window get a full permutation), decoded:
    4 x seq_len bytes a block and column (text 1 column, chat and DPO 3), 256 MiB for 65,536
    text blocks of 1,024 tokens, in each training worker."""
    prefetch_batches: int = 4
    """Micro batches each training worker reads ahead of its steps, on a thread of its own (0: each
    when the step asks for it)."""
    format: Format = "text"
    """'text' (documents packed back to back, every token trained), 'chat' (rows with a list of
    {role, content} messages) or 'instruction' (rows with prompt/response fields, or Alpaca's
    instruction/input/output): rendered with the chat template, loss only on the assistant's
    tokens, several examples packed per block and padded, none split. 'preference' (rows with
    a prompt and a chosen and a rejected response) trains with DPO (train.dpo_beta) against the
    model as it started: each pair shares a block, each response attending to its own prompt."""
    messages_column: str = "messages"
    """Field holding the messages, for format 'chat'."""
    prompt_column: str = "prompt"
    """Field holding the prompt, for formats 'instruction' and 'preference'."""
    response_column: str = "response"
    """Field holding the response, for format 'instruction'."""
    system_column: str = ""
    """Optional field holding a system message, for formats 'instruction' and 'preference'; ''
    for none."""
    chosen_column: str = "chosen"
    """Field holding the preferred response, for format 'preference': text, or a list of
    {role, content} messages whose last is the assistant's answer (the ones before it, where
    there are any, are the prompt; else data.prompt_column's field is)."""
    rejected_column: str = "rejected"
    """Field holding the dispreferred response, for format 'preference' (as data.chosen_column)."""
    chat_template: str = ""
    """'' renders with the tokenizer's own chat template, or the plain template when it has none
    (see raytrain_cpu.model.chat); else the path of a Jinja template file."""
    train_on_prompt: bool = False
    """Chat/instruction: also train on system, user and prompt tokens (padding never is)."""
    attention_span: AttentionSpan = "auto"
    """What a token attends to in a packed block: 'document' (the earlier tokens of its own
    document or example only, its positions counted from the document's start: as if each were
    a sequence of its own), 'block' (every earlier token of the block, across documents), or
    'auto': 'document' where any source is chat or instruction data (unrelated examples share
    blocks), else 'block' (text: what pre-training packing commonly does). Resolved at start-up
    and recorded with the checkpoints."""
    mix: list[MixSource] = field(default_factory=list)
    """A mixture: several sources, each a mapping of weight, name and where its text comes from
    (source, path, eval_path, hub_id, ...), e.g. [{path: notes/, weight: 3}, {source: bundled,
    weight: 1}]. Training blocks are drawn by weight, evenly interleaved (a small source repeats
    within the run, a large one is only partly read); each source is evaluated on its own. The
    other data settings apply to all; data.source/path/eval_path are left out. A weight of 0
    evaluates a source without training on it. [] trains on one source."""

    def __post_init__(self) -> None:
        # DataConfig(**asdict) (a checkpoint's data settings, read back by export and generate)
        # hands the entries over as mappings.
        self.mix = [MixSource(**e) if isinstance(e, dict) else e for e in self.mix]
        choice(self.attention_span, "data.attention_span", get_args(AttentionSpan))
        if self.attention_span == "auto":  # resolved here, so checkpoints record what the run computed
            formats = {e.format or self.format for e in self.mix} or {self.format}
            self.attention_span = "block" if formats == {"text"} else "document"
        if self.mix or self.source == "mix":
            self._check_mix()
            return
        self._resolve_source()
        self._check_format()
        if self.source in ("text", "parquet", "jsonl"):
            require(bool(self.path), "data.path", f"source {self.source!r} needs data.path=<file|dir|glob>.")
        require_filesystem(self.cache_dir, "data.cache_dir")
        require(self.seq_len >= 8, "data.seq_len", f"got {self.seq_len}; use at least 8 tokens.")
        require(0.0 <= self.eval_fraction < 0.5, "data.eval_fraction", "must be in [0, 0.5).")
        choice(self.bad_rows, "data.bad_rows", get_args(BadRows))
        require(self.tokenize_batch_size > 0, "data.tokenize_batch_size", "must be positive.")
        require(self.tokenize_actors >= 0, "data.tokenize_actors", "must be >= 0 (0 = auto).")
        require(self.shuffle_window > 0, "data.shuffle_window", "must be a positive number of blocks.")
        require(self.prefetch_batches >= 0, "data.prefetch_batches", "must be >= 0.")

    def _resolve_source(self) -> None:
        """data.source=auto as what data.path holds; paths the source would not read are refused."""
        choice(self.source, "data.source", get_args(OneSource))
        if self.source == "auto":  # resolved here, so checkpoints record what the run read
            self.source = source_of(self.path) if self.path else "bundled"
            require(
                self.source is not None
                or is_url(self.path)
                or is_glob(self.path)
                or Path(self.path).expanduser().exists(),
                "data.path",
                f"{self.path!r} does not exist. Point it at a text, jsonl or parquet file, a directory or a glob.",
            )
            if self.source is None:
                raise ConfigError(unknown_source(self.path))
        # Paths a source would not read are refused, not silently ignored.
        reads = {"bundled": "the bundled text and its validation split", "hub": "data.hub_id's splits"}
        for key, value in (("data.path", self.path), ("data.eval_path", self.eval_path)):
            require(
                not (self.source in reads and value),
                key,
                f"is set, but data.source={self.source} reads {reads.get(self.source)}: set data.source=auto (or "
                f"text, jsonl, parquet) to read {key}, or leave it out.",
            )

    def _check_format(self) -> None:
        """data.format against the source, and the chat template file it renders with."""
        choice(self.format, "data.format", get_args(Format))
        if self.format == "preference":
            self._check_preference()
        if self.format != "text":
            require(
                self.source != "text",
                "data.format",
                f"{self.format!r} needs rows with fields: use data.source jsonl, parquet, hub or bundled.",
            )
        if self.chat_template:
            require(
                Path(self.chat_template).expanduser().is_file(),
                "data.chat_template",
                f"{self.chat_template!r} does not exist; give a Jinja template file, or '' for the tokenizer's own.",
            )
            self.chat_template = absolute(self.chat_template)

    def _check_preference(self) -> None:
        require(
            self.attention_span == "document",
            "data.attention_span",
            "is 'block', and data.format=preference puts a pair's chosen and rejected responses in one block: each "
            "must see only its own prompt. Set data.attention_span=document (or auto).",
        )
        require(
            not self.train_on_prompt,
            "data.train_on_prompt",
            "DPO compares the responses' likelihoods; the prompt is the same in both and takes no part. Leave it false.",
        )

    def _check_mix(self) -> None:
        require(bool(self.mix), "data.source", "'mix' needs data.mix entries (a list of sources with weights).")
        require(
            "preference" not in {self.format, *(e.format for e in self.mix)},
            "data.format",
            "'preference' trains on one source, not a mixture (its DPO loss and a text source's loss are "
            "not one objective); train on one preference source, with data.mix left out.",
        )
        for key, value, default in (
            ("source", self.source, "mix"),
            ("path", self.path, ""),
            ("eval_path", self.eval_path, ""),
        ):
            require(
                value in (default, "auto"),
                f"data.{key}",
                f"is set, but data.mix lists the sources: move it into a data.mix entry (data.mix[0].{key}), "
                "or leave data.mix out.",
            )
        names: dict[str, int] = {}
        for i, entry in enumerate(self.mix):
            require(
                math.isfinite(entry.weight) and entry.weight >= 0,
                f"data.mix[{i}].weight",
                f"{'is missing' if math.isnan(entry.weight) else f'got {entry.weight}'}; give each source a "
                "weight, a number >= 0 (> 0 trains on it, 0 only evaluates it).",
            )
            part = self.mix_part(i)  # validates the entry as a source of its own
            entry.source, entry.path, entry.eval_path = part.source, part.path, part.eval_path  # as resolved
            entry.name = entry.name or entry.default_name(part.hub_id)
            require(
                re.fullmatch(r"[\w.-]+", entry.name) is not None,
                f"data.mix[{i}].name",
                f"{entry.name!r}: use letters, digits, '_', '-' and '.' (it names the source's eval metrics).",
            )
            require(
                entry.name not in names,
                f"data.mix[{i}].name",
                f"{entry.name!r} is data.mix[{names.get(entry.name)}]'s name too; give each source its own name.",
            )
            names[entry.name] = i
        require(
            any(e.weight > 0 for e in self.mix),
            "data.mix",
            "every source has weight 0 (evaluated only): give the ones to train on a weight > 0.",
        )
        for i, count in enumerate(mix_counts([e.weight for e in self.mix])):
            require(
                count > 0 or self.mix[i].weight == 0,
                f"data.mix[{i}].weight",
                f"{self.mix[i].weight} is under 1/{MIX_RESOLUTION} of all the weights; raise it or leave the source out.",
            )
        self.source = "mix"

    def mix_part(self, i: int) -> DataConfig:
        """Mixture entry i as a data config of one source: where its text is, the keys it sets, the
        rest from data:. Its errors name the entry's keys (data.mix[i].path)."""
        entry = self.mix[i]
        own = {k: getattr(entry, k) for k in SOURCE_KEYS} | {k: v for k in INHERITED_KEYS if (v := getattr(entry, k))}
        try:
            return dataclasses.replace(self, mix=[], **own)
        except ConfigError as e:
            raise ConfigError(mix_entry_keys(str(e), i)) from None

    def parts(self) -> list[DataConfig]:
        """The sources this trains on, each as a data config of its own: the mixture's, or itself."""
        return [self.mix_part(i) for i in range(len(self.mix))] if self.mix else [self]
