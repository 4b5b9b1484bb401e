"""Run configuration: nested dataclasses, YAML files and dotted ``key=value`` overrides.

Every field has a docstring (the string literal under it); ``--help`` prints them.
Validation happens in ``__post_init__`` so a bad value fails on the driver, before Ray
starts. Only plain dicts (``Config.to_dict()``) cross the Ray boundary.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import inspect
import itertools
import json
import math
import os
import re
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the fix."""


# model.attention's causal blocks: 'causal_blocks' runs this many queries a block,
# 'causal_blocks_<N>' N (raytrain_cpu.model.ops.attention; parsed here, where nothing imports torch, for
# the config check, the attention module and the planner alike).
CAUSAL_BLOCKS_DEFAULT = 64
# model.attention's fused kernel (raytrain_cpu.model.ops.fused_attention)
FUSED = "fused"
# model.compile=auto compiles models of at least this many parameters: per-layer compile paid on
# the 53M bench model on every host measured, and lost on the embedded default's ~0.4M one; 20M
# lies between, where the compile's fixed tens of seconds are a small share of a real run.
COMPILE_AUTO_MIN_PARAMS = 20_000_000

# The workers' default: glibc's dynamic threshold at its ceiling from the first step, with its
# trim threshold (twice it, as glibc's dynamic rule sets it). The dynamic pair trims the heap
# whenever its free top passes twice the largest block freed so far, so the next step faults
# those pages in again: the embedded default ran at 19.9k and 27.5k tokens/s (fused loss)
# against 33.7k and 35.9k with this pair; with Hugging Face's loss 32.2k and 32.9k against
# 32.1k and 30.7k (the same perplexity). The 50M bench model: 1,344 and 1,323 against 1,307
# and 1,346, at 2.84 GB peak per rank against 2.87.
GLIBC_HEAP_THRESHOLD = 32 << 20


def causal_blocks_size(name: str | None) -> int | None:
    """Queries a block of a causal-blocks implementation name ('causal_blocks', 'causal_blocks_128',
    or transformers' 'raytrain_'-prefixed ones); None for anything else, SDPA's names included."""
    m = re.fullmatch(r"(?:raytrain_)?causal_blocks(?:_([1-9][0-9]*))?", name or "")
    return None if m is None else int(m.group(1) or CAUSAL_BLOCKS_DEFAULT)


def _require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, key, f"got {value!r}; choose one of {', '.join(choices)}.")


def _absolute(path: str) -> str:
    """A local path made absolute against the directory the run was started in: Ray Train's
    workers run in directories of their own, and export and generate read the paths a
    checkpoint's manifest records from wherever they are started."""
    return os.path.abspath(os.path.expanduser(path))


def is_url(path: str) -> bool:
    return "://" in path


def is_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _require_filesystem(path: str, key: str) -> None:
    """Runs, caches and checkpoints live on a filesystem every node mounts: an s3:// (or other
    URL) would otherwise be taken as a relative directory named 's3:'."""
    _require(
        not is_url(path),
        key,
        f"{path!r} is a URL; runs, caches and checkpoints go on a filesystem every node mounts (on AWS "
        "FSx for Lustre at /fsx, which can link an S3 bucket). Give a path such as /fsx/runs.",
    )


# ----------------------------------------------------------------------------- model


@dataclass
class TinyModelConfig:
    """Shape of the Llama-architecture model built from scratch when model.name_or_path is 'tiny'."""

    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Number of decoder layers."""
    num_heads: int = 4
    """Attention heads; must divide hidden_size."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: int = 176
    """Width of the SwiGLU MLP."""
    max_position_embeddings: int = 2048
    """Longest sequence the rotary embedding is set up for; must be >= data.seq_len."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output projection (Llama-3 does not)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            _require(getattr(self, name) > 0, f"model.tiny.{name}", "must be a positive integer.")
        _require(
            self.hidden_size % self.num_heads == 0,
            "model.tiny.num_heads",
            f"{self.num_heads} does not divide hidden_size {self.hidden_size}; pick a divisor.",
        )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "model.tiny.num_kv_heads",
            f"{self.num_kv_heads} does not divide num_heads {self.num_heads}; pick a divisor.",
        )


@dataclass
class ModelConfig:
    """Which model to train and how to hold it."""

    name_or_path: str = "tiny"
    """'tiny' builds a small Llama from model.tiny and writes it as safetensors (no download);
    otherwise a local directory with config.json + safetensors, or a hub id such as
    meta-llama/Meta-Llama-3-8B (cluster only: needs network and, for gated models, HF_TOKEN)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the 'tiny' model."""
    tokenizer: str = "auto"
    """'auto' (the tiny model: 'bundled'; any other model: its own), 'bundled' (a 2048-token BPE
    trained on wikitext, shipped with the package), '' (the model's own tokenizer), a local
    directory or a hub id."""
    dtype: str = "auto"
    """Training precision: 'bf16' (DeepSpeed bf16, fp32 master weights), 'fp32', or 'auto':
    the workers time bf16 and fp32 GEMMs at the model's shapes at start-up and take bf16 only
    where it is faster (AMX or AVX-512 BF16 CPUs), else fp32 with a warning. With 'bf16' the
    same probe warns when bf16 measures slower. A resumed run keeps its checkpoint's dtype."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory (costs ~1/3 more compute)."""
    attention: str = "auto"
    """Causal self-attention: 'causal_blocks' (raytrain_cpu.model.ops.attention: 64 queries at a time
    against their key prefix, as GEMMs; 2x the speed of SDPA's CPU flash kernel on an AVX-512
    host at seq 512), 'causal_blocks_<N>' (N queries at a time: 128 is faster on AMX), 'sdpa',
    'fused' (raytrain_cpu.model.ops.fused_attention: one C++ kernel on oneDNN's AMX micro-kernels, built at
    first use; bf16 only; keeps no probabilities), or 'auto': every rank times SDPA, the blocks
    at 64 and 128 queries and (in bf16, where it builds) the fused kernel at the run's shape at
    start-up and all take the fastest (one more than 3% faster than those before it); a resumed
    run keeps its checkpoint's pick, so its losses continue bit for bit. Padding-masked or cached attention always runs SDPA."""
    attention_probs: str = "auto"
    """What the causal blocks keep for the backward: 'keep' their probabilities (the backward
    reads them: one batched GEMM of seven and half the softmax work fewer, about 1.2x the
    attention's forward and backward, the same bits), 'recompute' them from q and k, or 'auto':
    keep while they add at most a quarter to the activations the run keeps (heads x ~seq/2
    elements a token a layer: kept for Llama-3-8B up to seq 1,024, or 2,048 with activation
    checkpointing; `python -m raytrain_cpu.plan` counts them). SDPA is not affected."""
    fused_loss: bool = True
    """Compute the output layer and the cross-entropy loss together, a chunk of tokens at a time,
    with their gradients in the forward (raytrain_cpu.model.ops.loss): no full-size logits, their fp32
    copy or their gradient (~14 bytes per token per vocabulary entry: 3.4 GiB per 2,048 tokens
    for Llama-3's vocabulary), the same gradients to the last bit. Llama, Mistral, Qwen2/3,
    Phi-3, OLMo-2 and Gemma heads; other models keep Hugging Face's loss."""
    fused_norm: bool = True
    """Run Llama-style RMSNorms as one autograd operation (raytrain_cpu.model.ops.norm): Hugging Face's
    forward, the same output bits, a closed-form fp32 backward; keeps 2 bytes per element where
    Hugging Face's keeps 6 (two norms per layer) and runs 2.2-2.6x faster alone, a chunk of rows
    at a time (benchmarks/norm.py, AMD Zen 4). OLMo-2 and
    Gemma norms, and compiled models (inductor fuses them itself), keep Hugging Face's."""
    fused_rotary: bool = True
    """Apply the rotary position embedding to q and k as one autograd operation a chunk of rows
    at a time (raytrain_cpu.model.ops.rotary): Hugging Face's products and sums in the same order (the same
    bits), about two passes over memory where its five operators and their backward make about
    a dozen; 1.9-2.0x Hugging Face's alone at the bench model's and Llama-3-8B's shapes (AMD Zen
    4). Llama's attention; other attention classes and compiled models keep Hugging Face's."""
    fused_mlp: bool = False
    """Run the SwiGLU MLP's silu(gate) * up as one autograd operation (raytrain_cpu.model.ops.mlp) that
    recomputes silu(gate) in the backward instead of keeping it: the same bits, 2 bytes per
    intermediate unit per token per layer less (7 GiB per rank for Llama-3-8B at 8,192 tokens
    a rank without activation checkpointing; `plan --fused-mlp` counts it). Off by default:
    it cost 0.97-0.98x on the 50M bench model and 0.89x on the embedded default (the recompute
    and a Python autograd call per layer); turn it on where activations limit an uncompiled
    run. Llama-style MLPs with SiLU; compiled models keep Hugging Face's."""
    weight_grad_kernel: bool | str = "auto"
    """Run each bf16 linear layer's weight gradient on a kernel of our own (raytrain_cpu.model.ops.linear,
    csrc/weight_grad.cpp): autograd's runs at about half the forward's rate on AMX, the kernel
    faster than it at the ~50M bench model's shapes (benchmarks/weight_grad.py,
    benchmarks/kernel_threads.py). true, false or 'auto': on AMX (oneDNN's AMX micro-kernels) for
    models of at least 20M parameters (COMPILE_AUTO_MIN_PARAMS: the first use builds the kernel,
    about 30 s on 2 cores, which a tiny model would not win back), and then only where it beats
    autograd's weight gradient timed at the model's linear shapes on the rank's own threads at
    start-up (linear.choose; all ranks take one pick): a speed-up measured at one thread says
    nothing about a 92-thread rank. It needs a C++ compiler and ninja; where it does not build
    the run keeps autograd's."""
    compile: bool | str = "auto"
    """torch.compile with inductor (model.compile_scope): true, false or 'auto', which compiles
    where it has paid: a model of at least 20M parameters (COMPILE_AUTO_MIN_PARAMS), trained in
    bf16 without document masks, on a machine with inductor's C++ compiler ($CXX, else g++). Per-layer
    compile trained the ~50M bench model faster on every host measured in bf16 (README,
    "Compilation"), but cost the embedded default's tiny model more than it saved (106 s against
    79) and lost in fp32 (0.89x, AMD AVX2). Document masks (chat and instruction data) stay
    uncompiled under auto: the causal blocks take no mask inside a compiled graph, and SDPA's
    attention costs more than compile saves. The first steps compile (tens of seconds at 50M on
    2 cores; seconds from the cache after that)."""
    compile_scope: str = "layers"
    """What model.compile compiles: 'layers' compiles each decoder layer's forward (one graph,
    reused by every layer; under ZeRO-3 the layers are gathered whole, so the gathers stay
    outside the graph), 'model' the whole model through DeepSpeed's engine.compile."""
    compile_cache_dir: str = ""
    """Persistent inductor cache shared by all workers and runs; '' means
    <run.storage_path>/inductor_cache."""

    def __post_init__(self) -> None:
        _require(bool(self.name_or_path), "model.name_or_path", "must not be empty; use 'tiny'.")
        _choice(self.dtype, "model.dtype", ("auto", "bf16", "fp32"))
        _choice(self.compile_scope, "model.compile_scope", ("layers", "model"))
        for key in ("compile", "weight_grad_kernel"):
            value = getattr(self, key)
            if isinstance(value, str) and value.lower() in ("true", "false"):
                setattr(self, key, value := value.lower() == "true")
            _require(
                isinstance(value, bool) or value == "auto",
                f"model.{key}",
                f"got {value!r}; choose true, false or auto.",
            )
        _require(
            self.attention in ("auto", "sdpa", FUSED)
            or (causal_blocks_size(self.attention) is not None and not self.attention.startswith("raytrain_")),
            "model.attention",
            f"got {self.attention!r}; choose one of auto, sdpa, fused, causal_blocks, causal_blocks_<queries a block>.",
        )
        _require(
            not (self.attention == FUSED and self.dtype == "fp32"),
            "model.attention",
            "fused computes in bf16 only; with model.dtype=fp32 choose auto, sdpa or causal_blocks.",
        )
        _choice(self.attention_probs, "model.attention_probs", ("auto", "keep", "recompute"))
        # A hub id stays as it is; a local directory (what model.check_model_path treats as one) goes absolute.
        if not self.is_tiny and Path(self.name_or_path).expanduser().exists():
            self.name_or_path = _absolute(self.name_or_path)
        if self.tokenizer == "auto":  # resolved here, so checkpoints record what the run used
            self.tokenizer = "bundled" if self.is_tiny else ""
        _require(
            not (self.is_tiny and self.tokenizer == ""),
            "model.tokenizer",
            "'' is the model's own tokenizer, and the tiny model has none: use auto or bundled, a tokenizer "
            "directory or a hub id.",
        )
        if self.tokenizer not in ("bundled", "") and Path(self.tokenizer).expanduser().exists():
            self.tokenizer = _absolute(self.tokenizer)
        if self.compile_cache_dir:
            _require_filesystem(self.compile_cache_dir, "model.compile_cache_dir")
            self.compile_cache_dir = _absolute(self.compile_cache_dir)

    @property
    def is_tiny(self) -> bool:
        return self.name_or_path == "tiny"


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

    source: str = "auto"
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
    bad_rows: str = "error"
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
    text blocks of 1,024 tokens, in each of Ray Data's reading processes."""
    prefetch_batches: int = 4
    """Batches each training worker prefetches from its Ray Data shard."""
    format: str = "text"
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
    (see raytrain_cpu/sft.py); else the path of a Jinja template file."""
    train_on_prompt: bool = False
    """Chat/instruction: also train on system, user and prompt tokens (padding never is)."""
    attention_span: str = "auto"
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
        _choice(self.attention_span, "data.attention_span", ("auto", "document", "block"))
        if self.attention_span == "auto":  # resolved here, so checkpoints record what the run computed
            formats = {e.format or self.format for e in self.mix} or {self.format}
            self.attention_span = "block" if formats == {"text"} else "document"
        if self.mix or self.source == "mix":
            self._check_mix()
            return
        _choice(self.source, "data.source", ("auto", "bundled", "text", "parquet", "jsonl", "hub"))
        if self.source == "auto":  # resolved here, so checkpoints record what the run read
            self.source = source_of(self.path) if self.path else "bundled"
            _require(
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
            _require(
                not (self.source in reads and value),
                key,
                f"is set, but data.source={self.source} reads {reads.get(self.source)}: set data.source=auto (or "
                f"text, jsonl, parquet) to read {key}, or leave it out.",
            )
        _choice(self.format, "data.format", ("text", "chat", "instruction", "preference"))
        if self.format == "preference":
            self._check_preference()
        if self.format != "text":
            _require(
                self.source != "text",
                "data.format",
                f"{self.format!r} needs rows with fields: use data.source jsonl, parquet, hub or bundled.",
            )
        if self.chat_template:
            _require(
                Path(self.chat_template).expanduser().is_file(),
                "data.chat_template",
                f"{self.chat_template!r} does not exist; give a Jinja template file, or '' for the tokenizer's own.",
            )
            self.chat_template = _absolute(self.chat_template)
        if self.source in ("text", "parquet", "jsonl"):
            _require(bool(self.path), "data.path", f"source {self.source!r} needs data.path=<file|dir|glob>.")
        _require_filesystem(self.cache_dir, "data.cache_dir")
        _require(self.seq_len >= 8, "data.seq_len", f"got {self.seq_len}; use at least 8 tokens.")
        _require(0.0 <= self.eval_fraction < 0.5, "data.eval_fraction", "must be in [0, 0.5).")
        _choice(self.bad_rows, "data.bad_rows", ("error", "skip"))
        _require(self.tokenize_batch_size > 0, "data.tokenize_batch_size", "must be positive.")
        _require(self.tokenize_actors >= 0, "data.tokenize_actors", "must be >= 0 (0 = auto).")
        _require(self.shuffle_window > 0, "data.shuffle_window", "must be a positive number of blocks.")
        _require(self.prefetch_batches >= 0, "data.prefetch_batches", "must be >= 0.")

    def _check_preference(self) -> None:
        _require(
            self.attention_span == "document",
            "data.attention_span",
            "is 'block', and data.format=preference puts a pair's chosen and rejected responses in one block: each "
            "must see only its own prompt. Set data.attention_span=document (or auto).",
        )
        _require(
            not self.train_on_prompt,
            "data.train_on_prompt",
            "DPO compares the responses' likelihoods; the prompt is the same in both and takes no part. Leave it false.",
        )

    def _check_mix(self) -> None:
        _require(bool(self.mix), "data.source", "'mix' needs data.mix entries (a list of sources with weights).")
        _require(
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
            _require(
                value in (default, "auto"),
                f"data.{key}",
                f"is set, but data.mix lists the sources: move it into a data.mix entry (data.mix[0].{key}), "
                "or leave data.mix out.",
            )
        names: dict[str, int] = {}
        for i, entry in enumerate(self.mix):
            _require(
                math.isfinite(entry.weight) and entry.weight >= 0,
                f"data.mix[{i}].weight",
                f"{'is missing' if math.isnan(entry.weight) else f'got {entry.weight}'}; give each source a "
                "weight, a number >= 0 (> 0 trains on it, 0 only evaluates it).",
            )
            part = self.mix_part(i)  # validates the entry as a source of its own
            entry.source, entry.path, entry.eval_path = part.source, part.path, part.eval_path  # as resolved
            entry.name = entry.name or entry.default_name(part.hub_id)
            _require(
                re.fullmatch(r"[\w.-]+", entry.name) is not None,
                f"data.mix[{i}].name",
                f"{entry.name!r}: use letters, digits, '_', '-' and '.' (it names the source's eval metrics).",
            )
            _require(
                entry.name not in names,
                f"data.mix[{i}].name",
                f"{entry.name!r} is data.mix[{names.get(entry.name)}]'s name too; give each source its own name.",
            )
            names[entry.name] = i
        _require(
            any(e.weight > 0 for e in self.mix),
            "data.mix",
            "every source has weight 0 (evaluated only): give the ones to train on a weight > 0.",
        )
        for i, count in enumerate(mix_counts([e.weight for e in self.mix])):
            _require(
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


# ----------------------------------------------------------------------------- training


REFERENCE_FREE_LOSSES = ("simpo",)  # train.dpo_loss values that compare no reference model


@dataclass
class TrainConfig:
    """The optimisation loop."""

    max_steps: int = 200
    """Optimizer steps to run in total (a resumed run counts from where it stopped). Derived
    instead when train.epochs is set."""
    epochs: float = 0.0
    """Passes over the training data, in place of train.max_steps: once the data are packed the
    run takes ceil(epochs x training blocks / global batch) steps, so every block is trained on
    at least once an epoch (the last step may take a few blocks of the next pass). A mixture
    counts the blocks of all its sources and draws them by weight: a source weighted above its
    share of the blocks is read more than once an epoch, one below it only in part (the console
    says how often each is read). Fractions work (0.5: half the data). 0 (default):
    train.max_steps says how long. Set one of the two: where the command line gives one and the
    --config file the other, the command line's wins."""
    micro_batch_size: int = 8
    """Blocks per worker per forward/backward pass."""
    grad_accum_steps: int = 1
    """Micro batches accumulated per optimizer step."""
    global_batch_size: int = 0
    """Blocks per optimizer step over all workers; 0 derives it as micro_batch_size x
    grad_accum_steps x world size; if set it must equal that product."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of train.lr."""
    warmup_steps: int = 20
    """Linear warm-up steps (capped at a tenth of train.max_steps for short runs)."""
    schedule: str = "cosine"
    """'cosine' (warm-up then cosine decay), 'wsd' (warm-up, stable, then linear decay over
    the last train.decay_fraction of steps) or 'constant' (warm-up then flat)."""
    decay_fraction: float = 0.2
    """Share of train.max_steps spent decaying, for schedule 'wsd'."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    fused_adamw: bool = True
    """Use PyTorch's fused AdamW kernel (`torch.optim.AdamW(fused=True)`): one pass over each
    parameter's state, with no temporaries. Measured on the fp32 partitions ZeRO updates:
    8-12x faster optimizer steps and 8 bytes per parameter less peak memory per rank than
    the per-tensor loop (false), whose sqrt and division make two partition-sized tensors."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 1234
    """Seeds model initialisation, data order and dropout."""
    log_every: int = 10
    """Write a metrics.jsonl line every this many steps."""
    eval_every: int = 100
    """Evaluate every this many steps (and always at the end); 0 evaluates only at the end."""
    eval_batches: int = 0
    """Micro batches per evaluation per worker; 0 evaluates the whole eval split."""
    eval_on_start: bool = False
    """Also evaluate before the first step (step 0 in metrics.jsonl): the starting model's loss,
    the baseline a fine-tuning run (and each source of a mixture) improves on. Not on a resume."""
    checkpoint_every: int = 100
    """Checkpoint every this many steps (and always at the end); 0 only at the end."""
    early_stop_patience: int = 0
    """Stop once the watched eval metric (run.best_metric, else eval_loss) has gone this many
    evaluations in a row without beating its best by more than train.early_stop_min_delta;
    0: never. The run then checkpoints and ends as finished, before train.max_steps."""
    early_stop_min_delta: float = 0.0
    """How much lower than its best the watched eval metric must be to count as an improvement."""
    sample_prompt: str = ""
    """A prompt the model completes greedily at each evaluation, to watch what a run learns: shown
    on the console, in <run dir>/samples.jsonl and TensorBoard. Chat and instruction runs render it
    as the user's message with the run's template, as `generate` does. Every rank takes part
    (ZeRO-3 gathers the weights for each new token). '': none."""
    sample_tokens: int = 32
    """New tokens of train.sample_prompt's completion, at most."""
    dpo_beta: float = 0.1
    """DPO's beta, for data.format=preference: the loss is -log sigmoid(beta x (how much more the
    model prefers the chosen response than the reference did, in log-likelihood)). A larger
    beta keeps the model closer to the reference; 0.1 is the DPO paper's and TRL's default."""
    dpo_loss: str = "sigmoid"
    """The preference loss of each pair's margin x (the log-likelihood gain of the chosen response
    over the rejected one, relative to the reference): 'sigmoid', DPO's -log sigmoid(beta x);
    'ipo', (x - 1/(2 beta))^2 on log-likelihoods averaged per response token (IPO: a pair the
    model already ranks right by that much is pushed no further; against overfitting small or
    near-deterministic preference sets); 'hinge', max(0, 1 - beta x) (SLiC); 'simpo',
    -log sigmoid(beta x - train.simpo_gamma) with x the chosen response's per-token
    log-likelihood over the rejected one's and no reference model at all (SimPO: no reference
    forward, no frozen copy; its beta is larger, e.g. train.dpo_beta=2.0)."""
    simpo_gamma: float = 0.5
    """For train.dpo_loss=simpo: the margin (in beta-scaled per-token log-likelihood) by which
    the chosen response should beat the rejected one; TRL's default 0.5 (the SimPO paper: about
    half of beta)."""
    dpo_sft_weight: float = 0.0
    """For data.format=preference: adds this weight times the chosen responses' per-token loss
    (SFT's) to the preference loss (RPO; TRL's rpo_alpha, e.g. 1.0). DPO alone may lower both
    responses' likelihoods as long as the rejected one falls faster; this holds the chosen one
    up. The train rows' loss is then the sum, with dpo_loss and chosen_loss beside it."""
    dpo_label_smoothing: float = 0.0
    """For train.dpo_loss=sigmoid: the probability that a pair's labels are swapped (conservative
    DPO): each pair's loss is (1 - e) x DPO's + e x DPO's on the pair reversed. 0: plain DPO;
    below 0.5 (at 0.5 chosen and rejected weigh the same)."""
    dpo_precompute_reference: bool = False
    """For data.format=preference: compute the reference model's log-likelihoods of every pair the
    run will train and evaluate on once, before the first step, and keep them in <run dir>/
    reference_logps/<the starting model's key>/ (4 bytes a token; another model gets its own), each computed in the micro batch that first holds its
    block, so the numbers are the reference forward's. Training then runs no reference forward
    (a DPO step costs about what an SFT step does) and full fine-tuning holds no frozen copy of
    the model (2 bytes a parameter over the ranks, saved). The pass costs one forward over
    those pairs: it pays off when pairs come round again (train.epochs > 1, repeated
    evaluations) or where the copy does not fit. A resume computes only pairs it has not kept
    (more steps, more data). TRL's precompute_ref_log_probs."""
    record_block_ids: bool = False
    """Append the id of every block each rank trains on to <run dir>/block_ids/rank<r>.txt
    (an audit trail of the data order; the resume tests count them)."""
    profile_breakdown: bool = False
    """Also time the collectives (all-gather, reduce-scatter, all-reduce) in the training thread,
    so summary.json's step-time breakdown shows communication; forward, backward, optimizer
    step and data wait are always timed."""
    profile_step: int = 0
    """Record this optimizer step with torch.profiler on every rank (0: none). The run
    directory gets profile/rank<r>.json (a trace for Perfetto or chrome://tracing) and
    profile/rank<r>.md (time by operator kind, then the top operators). The profiler slows
    that step, which the run's tokens/s then includes."""
    mfu_probe_every: int = 0
    """Time the model's training GEMMs (forward, input and weight gradients, as `bench train`'s
    peak, 0.2 s a shape: about 5 s on the ~50M model) after every this many optimizer steps
    (every rank at once, outside the step's clock and the logged tokens/s), and read MFU
    against the rate timed next to each step instead of at start-up. A shared host's GEMM
    rate drifts (2x within minutes on a 2-vCPU cloud VM), and MFU against a rate timed minutes
    away follows the host, not the run: the console's MFU reads the latest timing,
    summary.json's step-time breakdown the timed steps' rates weighted by their time, both the
    best batches' (`peak_flops_per_s`) and every timed call's mean (`mean_gemm_flops_per_s`:
    a host that slows in spells of ~100 ms gives the steps its average, not its best). `bench
    train` sets 1. 0: the start-up timings only."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "micro_batch_size", "grad_accum_steps", "log_every"):
            _require(getattr(self, name) > 0, f"train.{name}", "must be a positive integer.")
        for name in (
            "global_batch_size",
            "warmup_steps",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "early_stop_patience",
            "profile_step",
            "mfu_probe_every",
        ):
            _require(getattr(self, name) >= 0, f"train.{name}", "must be >= 0.")
        _require(self.lr > 0, "train.lr", f"got {self.lr}; must be > 0.")
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1].")
        _choice(self.schedule, "train.schedule", ("cosine", "wsd", "constant"))
        _require(0 < self.decay_fraction <= 1, "train.decay_fraction", "must be in (0, 1].")
        _require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "train.betas",
            "must be two numbers in [0, 1), e.g. [0.9, 0.95].",
        )
        _require(self.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping).")
        _require(self.weight_decay >= 0, "train.weight_decay", f"got {self.weight_decay}; must be >= 0 (0: none).")
        _require(self.early_stop_min_delta >= 0, "train.early_stop_min_delta", "must be >= 0.")
        _require(self.sample_tokens > 0, "train.sample_tokens", "must be a positive integer.")
        _require(self.dpo_beta > 0, "train.dpo_beta", f"got {self.dpo_beta}; must be > 0 (e.g. 0.1).")
        _choice(self.dpo_loss, "train.dpo_loss", ("sigmoid", "ipo", "hinge", "simpo"))
        _require(self.simpo_gamma >= 0, "train.simpo_gamma", f"got {self.simpo_gamma}; must be >= 0 (e.g. 0.5).")
        _require(
            self.dpo_sft_weight >= 0, "train.dpo_sft_weight", f"got {self.dpo_sft_weight}; must be >= 0 (0: none)."
        )
        _require(
            0 <= self.dpo_label_smoothing < 0.5,
            "train.dpo_label_smoothing",
            f"got {self.dpo_label_smoothing}; must be in [0, 0.5), e.g. 0.1 (0: plain DPO).",
        )
        _require(
            self.dpo_label_smoothing == 0 or self.dpo_loss == "sigmoid",
            "train.dpo_label_smoothing",
            f"smooths train.dpo_loss=sigmoid only, not {self.dpo_loss!r}; set it to 0 or train.dpo_loss=sigmoid.",
        )
        _require(self.eps > 0, "train.eps", f"got {self.eps}; must be > 0 (AdamW divides by sqrt(v) + eps), e.g. 1e-8.")
        _require(
            math.isfinite(self.epochs) and self.epochs >= 0,
            "train.epochs",
            f"got {self.epochs}; must be >= 0, e.g. 3 (0: train.max_steps says how long).",
        )
        _require(
            self.epochs > 0 or self.profile_step <= self.max_steps,  # epochs: known once the data are packed
            "train.profile_step",
            f"{self.profile_step} is past train.max_steps={self.max_steps}; pick a step in 1..max_steps, "
            "past the warm-up (the first two steps compile and allocate), or 0 for none.",
        )
        if self.global_batch_size:
            per_worker = self.micro_batch_size * self.grad_accum_steps
            _require(
                self.global_batch_size % per_worker == 0,
                "train.global_batch_size",
                f"{self.global_batch_size} is not a multiple of micro_batch_size x grad_accum_steps "
                f"= {per_worker}; set it to {per_worker} x <number of workers> or to 0 to derive it.",
            )

    @property
    def dpo_reference(self) -> bool:
        """Whether train.dpo_loss compares a reference model (every preference loss but SimPO's)."""
        return self.dpo_loss not in REFERENCE_FREE_LOSSES

    @property
    def reference_each_step(self) -> bool:
        """Whether the reference model runs beside training (a forward each micro batch; full
        fine-tuning: a frozen copy), not precomputed once (train.dpo_precompute_reference)."""
        return self.dpo_reference and not self.dpo_precompute_reference

    def epoch_steps(self, blocks: int, global_batch: int) -> int:
        """train.epochs as optimizer steps over `blocks` training blocks, `global_batch` a step."""
        return max(1, math.ceil(self.epochs * blocks / global_batch - 1e-9))  # 2 x 600 / 400 is 3, not 4

    def derive_global_batch(self, world_size: int) -> int:
        """Blocks per optimizer step; raises ConfigError when the batch can't split evenly."""
        derived = self.micro_batch_size * self.grad_accum_steps * world_size
        if self.global_batch_size and self.global_batch_size != derived:
            per_worker = self.micro_batch_size * self.grad_accum_steps
            raise ConfigError(
                f"train.global_batch_size: {self.global_batch_size} blocks do not divide evenly over "
                f"{world_size} workers with micro_batch_size x grad_accum_steps = {per_worker} "
                f"(that gives {derived}). Set train.global_batch_size={derived}, or 0 to derive it, "
                f"or change scaling.num_workers to {self.global_batch_size // per_worker}."
            )
        return derived


# ----------------------------------------------------------------------------- lora


LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraSettings:
    """LoRA adapters (peft) on a frozen, ZeRO-3-partitioned base model."""

    rank: int = 0
    """Adapter rank r; 0 trains every weight (full fine-tuning). With r > 0 the base weights
    stay frozen and partitioned, and only the adapters get gradients and optimizer state."""
    alpha: float = 16.0
    """Scaling numerator: the adapter's update is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    """Module names (suffixes, as peft matches them) that get adapters; the default covers the
    attention and MLP projections of Llama-class models (GPT-2 style models name theirs c_attn,
    c_proj, c_fc)."""

    def __post_init__(self) -> None:
        _require(self.rank >= 0, "lora.rank", f"got {self.rank}; use 0 (full fine-tuning) or a positive rank.")
        _require(self.alpha > 0, "lora.alpha", f"got {self.alpha}; must be > 0.")
        _require(0.0 <= self.dropout < 1.0, "lora.dropout", "must be in [0, 1).")
        _require(
            bool(self.target_modules) and all(bool(m) for m in self.target_modules),
            "lora.target_modules",
            "must name at least one module, e.g. [q_proj, v_proj].",
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


# ----------------------------------------------------------------------------- scaling


@dataclass
class ScalingConfig:
    """How many Ray Train workers, and what each reserves."""

    num_workers: int = 0
    """Training workers (ranks); 0 derives it: one per node with CPUs, or 2 on a single
    machine with at least 2 CPUs; a resume keeps its checkpoint's. Another count resumes too,
    when micro batch x accumulation keep the checkpoint's global batch."""
    min_workers: int = 0
    """Elastic training when above 0 and below scaling.num_workers: the run starts with as many
    workers as the cluster holds in [min_workers, num_workers], goes on with fewer when nodes
    go (a spot node reclaimed for good) and grows back when nodes come, each time from the
    latest checkpoint. The global batch stays num_workers x micro_batch_size x
    grad_accum_steps: fewer workers accumulate more micro batches, so every worker count in
    the range must split it into micro batches. 0: always num_workers."""
    resize_check_s: float = 60.0
    """Elastic training: how often Ray Train looks for room for more workers. A resize restarts
    the workers from the latest checkpoint, so the steps since it are trained again."""
    cpus_per_worker: float = 0.0
    """Ray CPUs each worker reserves; 0 derives it from what Ray reports, leaving
    scaling.data_cpus free for Ray Data."""
    data_cpus: float = 0.0
    """CPUs per node left unreserved so Ray Data can read and prefetch next to training;
    0 derives it: 1 on machines with up to 16 CPUs, 2 above."""
    threads_per_worker: int = 0
    """torch intra-op threads per worker; 0 uses the physical cores behind the worker's CPUs."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources each worker needs, e.g. {c7i_worker: 1}, to land on given nodes."""
    node_wait_s: int = 1800
    """On a cluster that has no node for the workers yet (an autoscaler starts them on demand,
    as cluster/aws-c7i.yaml's worker types start at 0), how long the driver asks for them and
    waits before it stops; 0 stops at once. Needs scaling.num_workers."""
    check_memory: bool = True
    """Before data preparation, compare the planner's training peak per rank (times the ranks
    on a node) with the worker nodes' memory, and stop a run that cannot fit: Ray's memory
    monitor would kill its workers after loading, and again on every restart. false skips it."""
    pin_cores: bool = False
    """Pin each worker's threads to its own physical cores (split by local rank; one socket
    per rank on multi-socket nodes). Pays on a dedicated node; hurts on a shared one."""
    allocator: str = "auto"
    """malloc of the training workers: 'auto' preloads jemalloc (the system's, apt-get install
    libjemalloc2, else the one Ray's wheel ships), else tcmalloc; 'jemalloc', 'tcmalloc' or
    'system' (glibc)."""
    jemalloc_conf: str = ""
    """The workers' MALLOC_CONF when jemalloc is preloaded; '' is raytrain's (cpu.JEMALLOC_CONF:
    freed pages stay for the next step and go back to the OS at phase ends). A MALLOC_CONF in
    the driver's environment (the cluster images') wins over both."""
    glibc_mmap_threshold: int = GLIBC_HEAP_THRESHOLD
    """With glibc malloc (no jemalloc/tcmalloc): allocations at least this many bytes get their
    own mapping, returned to the OS when freed and faulted in afresh when made again; smaller
    ones come from the heap, which keeps up to twice this free before trimming (glibc's own
    dynamic rule, at its 32 MiB ceiling by default), so a step reuses the last step's
    activations without page faults. 1048576 keeps RSS near live memory (the planner's
    calibration) at the cost of faults on every large tensor; 0 leaves both to glibc's dynamic
    thresholds, which trim the heap and fault: the embedded default ran 1.2-1.7x slower with
    them. The planner's estimate is for jemalloc (the cluster images preload it) or 1 MiB."""
    free_memory_growth_mib: int = 512
    """Hand malloc's free pages back to the OS when a worker's resident memory has grown this
    many MiB past its size after the first steps (or after the last such release): a bound on
    whatever an allocator keeps and does not reuse. Before cpu.JEMALLOC_CONF let jemalloc reuse
    any kept extent, its kept pages grew every step in some runs (10-20 MiB a step on a
    16-layer model, to twice the live memory in 100 steps). The next step faults its pages in
    again. 0: never. The planner (`python -m raytrain_cpu.plan`) leaves this much free per rank
    in every fit."""

    def __post_init__(self) -> None:
        _require(self.num_workers >= 0, "scaling.num_workers", "must be >= 0 (0 = auto).")
        _require(self.min_workers >= 0, "scaling.min_workers", "must be >= 0 (0 = not elastic).")
        if self.min_workers:
            _require(
                self.num_workers > 0,
                "scaling.min_workers",
                "elastic training needs scaling.num_workers, the most workers the run may have.",
            )
            _require(
                self.min_workers <= self.num_workers,
                "scaling.min_workers",
                f"{self.min_workers} is above scaling.num_workers={self.num_workers}, the most workers.",
            )
        _require(self.resize_check_s > 0, "scaling.resize_check_s", "must be > 0 seconds.")
        _require(self.free_memory_growth_mib >= 0, "scaling.free_memory_growth_mib", "must be >= 0 (0 = never).")
        _choice(self.allocator, "scaling.allocator", ("auto", "jemalloc", "tcmalloc", "system"))
        _require(
            self.glibc_mmap_threshold >= 0, "scaling.glibc_mmap_threshold", "must be >= 0 (0 = glibc's dynamic one)."
        )
        _require(self.cpus_per_worker >= 0, "scaling.cpus_per_worker", "must be >= 0 (0 = auto).")
        _require(self.data_cpus >= 0, "scaling.data_cpus", "must be >= 0 (0 = auto).")
        _require(self.threads_per_worker >= 0, "scaling.threads_per_worker", "must be >= 0 (0 = auto).")
        _require(self.node_wait_s >= 0, "scaling.node_wait_s", "must be >= 0 (0 = don't wait).")
        for k, v in self.resources_per_worker.items():
            _require(
                isinstance(v, (int, float)) and v > 0,
                f"scaling.resources_per_worker.{k}",
                "must be a positive number.",
            )


# ----------------------------------------------------------------------------- deepspeed


@dataclass
class DeepSpeedSettings:
    """DeepSpeed engine settings; a JSON file can add or override raw DeepSpeed keys."""

    zero_stage: int = 3
    """ZeRO stage: 3 shards parameters, gradients and optimizer states (and loads sharded);
    1 and 2 shard only optimizer states (and gradients)."""
    config_file: str = ""
    """Optional DeepSpeed JSON merged over the generated config (batch sizes, precision and
    optimizer are always set from this config; a ZeRO key or gradient_clipping that a
    deepspeed.* or train.* key also sets must agree with it, or be "auto")."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward (helps with real networks, not on one host)."""
    param_persistence_threshold: int = 10000
    """ZeRO-3: parameters smaller than this many elements stay whole on every rank."""
    max_live_parameters: int = 1_000_000_000
    """ZeRO-3: parameters kept gathered at once. Forward's gathers stay live for the backward up
    to this many; lower saves memory (1e8 instead of 1e9: 1.3 GiB per rank at 0.5B) but
    re-gathers in the backward (+16% step time there). `python -m raytrain_cpu.plan` shows
    both peaks."""
    shm_collectives: bool = True
    """DeepSpeed's all-gathers, reduce-scatters and all-reduces go through shared memory when
    every rank runs on one machine (raytrain_cpu.trainer.collectives): gloo sends each byte through
    the loopback TCP stack, 4-7x slower at ZeRO-3's sizes. Ranks on several machines, or no
    room in /dev/shm, keep gloo; false always uses gloo."""
    sub_group_size: int = 100_000_000
    """ZeRO-3: elements of this rank's partition the optimizer updates at a time (DeepSpeed's
    sub groups). One sub group's fp32 gradient exists at a time, so this bounds it: 0.49 GiB
    per rank for Llama-3-8B at 4 ranks (its largest sub group) instead of the whole fp32
    gradient's 7.5 GiB. Checkpoints hold one entry per sub group: resume with the value the
    run started with (DeepSpeed's default, 1e9, for runs made before raytrain_cpu set this);
    the manifest records it, and another value stops the run before Ray starts."""
    reuse_fp32_grad_buffer: bool = True
    """ZeRO-3: cast each sub group's gradients into one fp32 buffer kept between steps, instead
    of DeepSpeed's fresh flattened copy and fresh fp32 copy every step, whose new pages each
    cost a fault (optimizer phase 0.06 s against 0.15 s on the ~50M bench model). The buffer
    is the size of the largest sub group and stays resident; the planner counts it."""
    reuse_reduce_buffer: bool = True
    """ZeRO-3: flatten each gradient bucket for its reduce-scatter into one buffer kept between
    buckets and steps, instead of DeepSpeed's new tensor per bucket (same bits; 107 MB flattened
    in 12-14 ms instead of 69-78 on the AMD host). Resident: one reduce bucket (5e7 elements)."""
    gather_whole_layers: bool = True
    """ZeRO-3: gather each decoder layer's parameters at once when the layer starts (DeepSpeed
    leaf modules), instead of each projection and norm as it runs: one hook pair and one
    all-gather per layer instead of about thirteen. ZeRO-3's per-step Python is what it saves
    (0.1 s a step at 16 layers: 1.45x on a 16-layer model of hidden size 64, 1.006x on the
    ~50M bench model, AMD Zen 4), and LoRA, whose adapters each carry hooks otherwise, trained
    1.1-1.3x faster with it. A gathered layer (plus the next, prefetched) is what the planner
    counts live anyway. model.compile (compile_scope 'layers') needs it: the gathers must stay
    outside the compiled layer."""

    def __post_init__(self) -> None:
        _choice(str(self.zero_stage), "deepspeed.zero_stage", ("1", "2", "3"))
        if self.config_file:
            _require(
                Path(self.config_file).is_file(),
                "deepspeed.config_file",
                f"{self.config_file!r} does not exist; give the path of a DeepSpeed JSON file or ''.",
            )
            self.config_file = _absolute(self.config_file)  # the workers read it
        _require(self.param_persistence_threshold >= 0, "deepspeed.param_persistence_threshold", "must be >= 0.")
        _require(
            self.max_live_parameters > 0, "deepspeed.max_live_parameters", "must be > 0 (DeepSpeed's default is 1e9)."
        )
        _require(self.sub_group_size > 0, "deepspeed.sub_group_size", "must be > 0 (raytrain_cpu's default is 1e8).")


# ----------------------------------------------------------------------------- run


@dataclass
class RunSettings:
    """Where the run lives and how it recovers."""

    name: str = "tiny-local"
    """Run name; re-running with the same name and storage path resumes the run."""
    storage_path: str = "./runs"
    """Directory for runs (shared by all nodes on a cluster, e.g. /fsx/runs)."""
    ray_address: str = ""
    """'' starts a local Ray (or joins RAY_ADDRESS when set, as under `ray job submit`);
    'auto' joins a running cluster; or host:port."""
    num_to_keep: int = 2
    """Checkpoints kept on storage: the newest ones, or with run.best_metric the best ones (and
    the newest beside them, which a resume loads)."""
    best_metric: str = ""
    """Rank the checkpoints by an eval metric, lowest best: 'eval_loss', or 'eval_loss/<name>'
    for one source of a mixture. run.num_to_keep then keeps the best, summary.json names the best,
    and run.export_on_finish (and `export --best`) exports it. '': keep the newest."""
    max_failures: int = 0
    """Times Ray Train restarts the worker group after a failure (a worker or node lost); each restart
    resumes from the latest checkpoint; -1 retries forever. Spot preemptions Ray announced are
    retried without limit and not counted here."""
    gloo_timeout_s: int = 600
    """Seconds a collective may wait on a peer before the attempt fails (Ray's default is 1800); also
    bounds Ray Train's own barriers and worker health checks, so a dead or hung peer ends the
    attempt within about this time."""
    poll_interval_s: float = 0.5
    """Seconds between Ray Train's polls of the workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S): each
    poll collects their reports (so registers checkpoints) and notices an attempt that finished or
    failed. Ray's default, 2 s, kept every run ~2.3 s longer past its workers' end (the controller
    polls twice before it lets them go; benchmarks/poll_interval.py); a poll is one small call to
    each worker."""
    preemption_check_every: int = 1
    """Ask Ray every this many steps whether a node of the run is being drained (a spot notice) and
    checkpoint at once if so; 0 never asks. Each check is a small barrier across the workers. An
    elastic run below its most workers also checks then whether nodes joined that hold more,
    and checkpoints at once before Ray Train grows it (it restarts from the latest checkpoint)."""
    export_on_finish: bool = False
    """When training ends, write <run dir>/export (a Hugging Face model: safetensors, config,
    tokenizer) from the final checkpoint and check its logits against the trained model."""
    verbose: bool = False
    """Also show Ray's own driver and worker log lines on the console, as before (Ray Train's and
    Ray Data's logs, worker tracebacks, raylet notices). Off, the console keeps raytrain's lines
    (progress, phases, restarts with their reason, the summary); Ray's logs stay in its log
    directory either way (the run's first lines name it)."""

    def __post_init__(self) -> None:
        _require(
            bool(self.name) and "/" not in self.name and self.name not in (".", ".."),
            "run.name",
            f"{self.name!r} must be a plain directory name (no '/').",
        )
        _require(bool(self.storage_path), "run.storage_path", "must not be empty; e.g. ./runs or /fsx/runs.")
        _require_filesystem(self.storage_path, "run.storage_path")
        _require(self.num_to_keep >= 1, "run.num_to_keep", "must be >= 1.")
        _require(self.max_failures >= -1, "run.max_failures", "must be >= -1 (-1 = retry forever).")
        _require(self.gloo_timeout_s >= 10, "run.gloo_timeout_s", "must be at least 10 seconds.")
        _require(
            0.05 <= self.poll_interval_s <= 60,
            "run.poll_interval_s",
            f"got {self.poll_interval_s}; use 0.05 to 60 (e.g. 0.5).",
        )
        _require(self.preemption_check_every >= 0, "run.preemption_check_every", "must be >= 0 (0 = never).")

    @property
    def run_dir(self) -> Path:
        return Path(self.storage_path).expanduser().absolute() / self.name

    @property
    def hub_cache(self) -> Path:
        """What the driver fetches from the hub (models, tokenizers), kept for later runs."""
        return self.run_dir.parent / "hf_cache"

    @property
    def ray_init_address(self) -> str:
        """The address for ray.init: run.ray_address, else RAY_ADDRESS (set under `ray job
        submit`), else 'local'. Plain ray.init() would join whatever cluster
        /tmp/ray/ray_current_cluster names, even one left by a killed head or started by
        someone else on the machine; a run without an address gets its own local Ray."""
        return self.ray_address or os.environ.get("RAY_ADDRESS", "") or "local"


# ----------------------------------------------------------------------------- guards


_INJECT = re.compile(r"^(spike@\d+(:[0-9.eE+-]+)?|nan@\d+)$")


@dataclass
class GuardConfig:
    """Stability guards: loss spikes, gradient-norm spikes and non-finite losses."""

    action: str = "log"
    """What a loss spike or a gradient-norm spike does: 'log' (warn, count it in summary.json
    and go on), 'skip' (drop that step's update on every rank; its data stays consumed) or
    'stop' (end the run with a message naming the step). A non-finite loss or gradient is never
    applied: it skips the step under 'log' and 'skip' and stops the run under 'stop'."""
    loss_spike_factor: float = 2.0
    """A step's loss (mean over ranks and micro batches) above this many times the running mean
    of the last guards.loss_window steps is a spike; 0 disables the check."""
    loss_window: int = 50
    """Steps in the running mean of the loss; spikes are looked for once it holds
    min(guards.loss_window, 10) steps (it starts empty after a resume)."""
    max_grad_norm: float = 0.0
    """A global gradient norm (before clipping) above this is a spike; 0 disables the check.
    With guards.action=skip the norm is taken before the update (ZeRO-3 only: one extra pass
    over each rank's gradient shard)."""
    max_skips: int = 20
    """Stop the run once more than this many steps have been skipped (spikes and non-finite
    losses together, counted across resumes)."""
    inject: str = ""
    """Testing aid: 'spike@STEP[:FACTOR]' and/or 'nan@STEP', comma-separated, multiply rank
    0's loss at that step by FACTOR (default 100) or by NaN; '' injects nothing."""

    def __post_init__(self) -> None:
        _choice(self.action, "guards.action", ("log", "skip", "stop"))
        _require(
            self.loss_spike_factor == 0 or self.loss_spike_factor > 1,
            "guards.loss_spike_factor",
            f"got {self.loss_spike_factor}; use a factor > 1 (e.g. 2) or 0 to disable.",
        )
        _require(self.loss_window >= 1, "guards.loss_window", "must be a positive number of steps.")
        _require(self.max_grad_norm >= 0, "guards.max_grad_norm", "must be >= 0 (0 disables the check).")
        _require(self.max_skips >= 0, "guards.max_skips", "must be >= 0.")
        for item in filter(None, (x.strip() for x in self.inject.split(","))):
            _require(bool(_INJECT.match(item)), "guards.inject", f"{item!r}: write spike@STEP[:FACTOR] or nan@STEP.")


# ----------------------------------------------------------------------------- metrics


@dataclass
class MetricsConfig:
    """Metric sinks besides metrics.jsonl, which is always written and is the source of truth."""

    tensorboard: bool = True
    """Write TensorBoard event files to <run dir>/tensorboard (from rank 0)."""
    mlflow_tracking_uri: str = ""
    """Also log to MLflow at this tracking URI (e.g. http://mlflow:5000 or sqlite:///fsx/mlflow.db);
    needs the mlflow extra installed on every node; '' disables MLflow."""
    mlflow_experiment: str = "raytrain_cpu"
    """MLflow experiment the run is logged under (the MLflow run is named after run.name)."""

    def __post_init__(self) -> None:
        # A plain directory (MLflow's file store) is opened by rank 0, which runs elsewhere.
        if self.mlflow_tracking_uri and ":" not in self.mlflow_tracking_uri:
            self.mlflow_tracking_uri = _absolute(self.mlflow_tracking_uri)


# ----------------------------------------------------------------------------- root


@dataclass
class Config:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA fine-tuning (off by default: full fine-tuning)."""
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    """Workers and resources."""
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)
    """DeepSpeed."""
    run: RunSettings = field(default_factory=RunSettings)
    """Run directory, recovery."""
    guards: GuardConfig = field(default_factory=GuardConfig)
    """Stability guards."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metric sinks."""

    def __post_init__(self) -> None:
        if self.model.is_tiny:
            _require(
                self.model.tiny.max_position_embeddings >= self.data.seq_len,
                "data.seq_len",
                f"{self.data.seq_len} exceeds model.tiny.max_position_embeddings="
                f"{self.model.tiny.max_position_embeddings}; lower seq_len or raise the other.",
            )
        if self.guards.action == "skip" and self.guards.max_grad_norm > 0:
            # Skipping on the gradient norm reads each rank's gradient shard before the update,
            # which DeepSpeed exposes for ZeRO-3 partitions only.
            _require(
                self.deepspeed.zero_stage == 3,
                "guards.max_grad_norm",
                "skipping steps on the gradient norm needs deepspeed.zero_stage=3; use guards.action=log "
                "or stop, or guards.max_grad_norm=0.",
            )

        if self.run.best_metric or self.train.early_stop_patience:
            _check_watched_metric(self)
        if self.train.dpo_precompute_reference:
            _require(
                self.data.format == "preference" and self.train.dpo_reference,
                "train.dpo_precompute_reference",
                "precomputes a DPO reference model's log-likelihoods, and "
                + (
                    f"train.dpo_loss={self.train.dpo_loss} compares no reference; leave it false."
                    if self.data.format == "preference"
                    else f"data.format={self.data.format} trains on no preference pairs; leave it false."
                ),
            )
        _require(
            not self.train.sample_prompt or self.train.sample_tokens < self.data.seq_len,
            "train.sample_tokens",
            f"{self.train.sample_tokens} leaves no room for the prompt in data.seq_len={self.data.seq_len} (the "
            "positions the model trains on); lower it.",
        )
        if self.deepspeed.config_file:
            _check_deepspeed_file(self)
        if self.elastic:
            _check_elastic_batch(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def watched_metric(self) -> str:
        """The eval metric run.best_metric ranks by and train.early_stop_patience watches."""
        return self.run.best_metric or "eval_loss"

    @property
    def elastic(self) -> bool:
        return 0 < self.scaling.min_workers < self.scaling.num_workers

    @property
    def worker_counts(self) -> range:
        """The worker counts the run may have: scaling.min_workers..num_workers when elastic."""
        s = self.scaling
        return range(s.min_workers if self.elastic else s.num_workers, s.num_workers + 1)

    def accumulation_for(self, world: int) -> int:
        """grad_accum_steps for `world` workers in an elastic run: the global batch stays the one
        of scaling.num_workers workers (it is what the LR schedule and the data position count)."""
        t = self.train
        return t.derive_global_batch(self.scaling.num_workers) // (world * t.micro_batch_size)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        return _build(cls, d, prefix="")


def _or(items: list[Any]) -> str:
    return " or ".join(map(str, items)) if len(items) < 3 else f"{', '.join(map(str, items[:-1]))} or {items[-1]}"


def _check_watched_metric(cfg: Config) -> None:
    """run.best_metric and train.early_stop_patience need an eval metric the run reports, and
    evaluations to read it from; ranking checkpoints needs one at each checkpoint's step."""
    t, key = cfg.train, "run.best_metric" if cfg.run.best_metric else "train.early_stop_patience"
    names = [m.name for m in cfg.data.mix]
    metrics = ["eval_loss", *(f"eval_loss/{n}" for n in names)]
    if cfg.data.format == "preference":
        metrics.append("eval_dpo_loss")
    _choice(cfg.watched_metric, "run.best_metric", tuple(metrics))
    _require(
        t.eval_every > 0,
        key,
        "needs evaluations during the run, and train.eval_every=0 evaluates only at the end; set "
        "train.eval_every (e.g. 100).",
    )
    if cfg.run.best_metric:
        _require(
            t.checkpoint_every > 0 and t.checkpoint_every % t.eval_every == 0,
            "run.best_metric",
            f"ranks each checkpoint by the evaluation at its step, and train.checkpoint_every="
            f"{t.checkpoint_every} is not a multiple of train.eval_every={t.eval_every}; set "
            f"train.checkpoint_every={max(t.checkpoint_every // t.eval_every, 1) * t.eval_every}.",
        )


def _check_elastic_batch(cfg: Config) -> None:
    """Every worker count of an elastic range must split the global batch into whole micro
    batches; else the error names a grad_accum_steps or micro_batch_size that does."""
    t, s = cfg.train, cfg.scaling
    batch = t.derive_global_batch(s.num_workers)
    odd = [w for w in cfg.worker_counts if batch % (w * t.micro_batch_size)]
    if not odd:
        return
    lcm = math.lcm(*cfg.worker_counts)
    accum = t.grad_accum_steps * lcm // math.gcd(lcm, s.num_workers * t.grad_accum_steps)
    fixes = [f"train.grad_accum_steps={accum} (a global batch of {s.num_workers * t.micro_batch_size * accum})"]
    if batch % lcm == 0:  # every count divides the batch: a smaller micro batch keeps it
        micro = math.gcd(*(batch // w for w in cfg.worker_counts))
        fixes.append(f"train.micro_batch_size={micro} with train.grad_accum_steps={batch // (s.num_workers * micro)}")
    raise ConfigError(
        f"scaling.min_workers: the global batch of {batch} blocks ({s.num_workers} workers x micro_batch_size "
        f"{t.micro_batch_size} x grad_accum_steps {t.grad_accum_steps}) does not split into micro batches of "
        f"{t.micro_batch_size} over {_or(odd)} workers, which the elastic range "
        f"{s.min_workers}..{s.num_workers} allows. Use {' or '.join(fixes)}."
    )


def _check_deepspeed_file(cfg: Config) -> None:
    """deepspeed.config_file must be a JSON object, and must not set what a raytrain key sets to
    another value: the run would train with the file's value while the manifest, the resume
    checks and the planner read the key's (a file's stage 2 under deepspeed.zero_stage=3)."""
    path = cfg.deepspeed.config_file
    try:
        extra = json.loads(Path(path).read_text())
    except ValueError as e:
        raise ConfigError(f"deepspeed.config_file: {path} is not valid JSON ({e}).") from None
    _require(isinstance(extra, dict), "deepspeed.config_file", f"{path} must hold a JSON object of DeepSpeed keys.")
    ds, zero = cfg.deepspeed, extra.get("zero_optimization") or {}
    owned = {
        "zero_optimization.stage": (zero.get("stage"), "deepspeed.zero_stage", ds.zero_stage),
        "zero_optimization.sub_group_size": (zero.get("sub_group_size"), "deepspeed.sub_group_size", ds.sub_group_size),
        "zero_optimization.overlap_comm": (zero.get("overlap_comm"), "deepspeed.overlap_comm", ds.overlap_comm),
        "zero_optimization.stage3_param_persistence_threshold": (
            zero.get("stage3_param_persistence_threshold"),
            "deepspeed.param_persistence_threshold",
            ds.param_persistence_threshold,
        ),
        "zero_optimization.stage3_max_live_parameters": (
            zero.get("stage3_max_live_parameters"),
            "deepspeed.max_live_parameters",
            ds.max_live_parameters,
        ),
        "gradient_clipping": (extra.get("gradient_clipping"), "train.grad_clip", cfg.train.grad_clip),
    }
    for name, (value, key, ours) in owned.items():
        _require(
            value in (None, "auto") or value == ours,
            "deepspeed.config_file",
            f"{path} sets {name}={value!r}, and {key}={ours!r} sets it too: set {key}={value} instead (the manifest, "
            "resume checks and planner read that) and leave it out of the file.",
        )
    _require(
        not (extra.get("checkpoint") or {}).get("load_universal"),
        "deepspeed.config_file",
        f"{path} sets checkpoint.load_universal: raytrain sets it for a resume on another number of workers "
        "(and only then: every other checkpoint is not universal); leave it out of the file.",
    )


# ----------------------------------------------------------------------------- building


def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks one leaf value against its annotated type; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):  # YAML 1.1 reads 1e9 (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}.")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}.")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str) and item_tp is str:  # key=q_proj,v_proj on the command line
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            example = "[q_proj, v_proj]" if item_tp is str else "[0.9, 0.95]"
            raise ConfigError(f"{key}: expected a list like {example}, got {value!r}.")
        if dataclasses.is_dataclass(item_tp):  # data.mix: a list of sections
            return [_build(item_tp, _section(v, f"{key}[{i}]"), f"{key}[{i}].") for i, v in enumerate(value)]
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping like {{name: 1}}, got {value!r}.")
        _, val_tp = typing.get_args(tp)
        return {str(k): _coerce(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    return value


def _section(value: Any, key: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    raise ConfigError(f"{key}: expected a section (mapping), got {value!r}.")


def _build(cls: type, d: dict[str, Any] | None, prefix: str) -> Any:
    d = dict(d or {})
    hints = _type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        where = prefix.rstrip(".") or "the top level"
        close = difflib.get_close_matches(unknown[0], names, n=1)
        guess = f"did you mean {prefix}{close[0]}? " if close else ""
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key in {where}; {guess}valid keys are {', '.join(names)}. "
            "Run `python -m raytrain_cpu.main --help` to list every option."
        )
    kwargs = {}
    for name in names:
        if name not in d:
            continue
        tp, key = hints[name], f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, _section(d[name], key), prefix=f"{key}.")
        else:
            kwargs[name] = _coerce(d[name], tp, key)
    return cls(**kwargs)


def _set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = d
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {p} is a value, not a section.")
        node = nxt
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'train.lr=1e-3' -> ('train.lr', 0.001); values are read as YAML scalars/lists."""
    if "=" not in text or text.startswith("="):
        raise ConfigError(f"{text!r}: overrides look like section.key=value, e.g. train.max_steps=20.")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot read value {raw!r} ({e.__class__.__name__}).") from None
    return key.strip(), "" if value is None else value


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- overrides, validated. Raises ConfigError."""
    raw: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            what = "is a directory" if p.is_dir() else "does not exist"
            raise ConfigError(f"--config: {str(path)!r} {what}; pass a YAML file such as configs/local.yaml.")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config: {path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"--config: {path} must hold a mapping of sections (model:, data:, train:, ...).")
    given = [parse_override(item) for item in overrides]
    _choose_run_length(raw, {key: value for key, value in given}, path)
    for key, value in given:
        _set_dotted(raw, key, value)
    return Config.from_dict(raw)


def _choose_run_length(raw: dict[str, Any], overrides: dict[str, Any], path: Any) -> None:
    """train.max_steps or train.epochs (> 0): one of them says how long the run is. The file
    and the command line may each choose one; the command line's replaces the file's."""

    def chosen(train: dict[str, Any]) -> set[str]:  # epochs=0 chooses nothing: it leaves max_steps to say
        return {"max_steps"} & train.keys() | ({"epochs"} if train.get("epochs") not in (None, 0, 0.0) else set())

    cli = chosen({k.removeprefix("train."): v for k, v in overrides.items() if k.startswith("train.")})
    if len(cli) == 2:
        raise ConfigError(
            "train.max_steps and train.epochs: the command line sets both; keep one (train.epochs derives "
            "the steps from the packed data)."
        )
    train = raw.get("train")
    if not isinstance(train, dict):
        return
    if cli:  # the command line's choice of length replaces the file's
        train.pop("epochs" if cli == {"max_steps"} else "max_steps", None)
    elif len(chosen(train)) == 2:
        raise ConfigError(
            f"train.max_steps and train.epochs: --config {path} sets both; keep one (train.epochs derives the "
            "steps from the packed data), or choose on the command line, which replaces the file's choice."
        )


# ----------------------------------------------------------------------------- help text


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal right under each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        is_field = isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
        if (
            is_field
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)
        ):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def describe_options(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, meaning) for every leaf option: the default as declared ('auto'), not
    what validation resolves it to on this machine ('bundled')."""
    docs = _field_docs(cls)
    hints = _type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe_options(hints[f.name], f"{prefix}{f.name}.")
        else:
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((f"{prefix}{f.name}", repr(value), docs.get(f.name, "")))
    return rows


def options_help() -> str:
    lines = ["options (set in the YAML file or as key=value after it):"]
    for key, default, doc in describe_options():
        lines.append(f"  {key} (default {default})")
        lines.extend("      " + ln for ln in textwrap.wrap(doc, 84))
    return "\n".join(lines)
