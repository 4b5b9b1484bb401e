"""Model: build the tiny Llama on the driver, load any causal LM sharded on the workers.

The driver never loads a real model's weights: for 'tiny' it creates one from a config and
writes it as safetensors, so the workers go through the same loading path a Llama-3-8B
takes. Before Ray starts it checks a model directory from its files alone (config.json for
the architecture and context length, the safetensors headers for the parameter count). On the
workers, transformers builds the model already partitioned when an `HfDeepSpeedConfig` is
alive, and each rank reads only its own slice of every tensor from the safetensors files: no
rank ever holds (or reads) the whole model.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.schema import Config
from raytrain_cpu.model.hub import is_hub_id
from raytrain_cpu.model.shape import (
    config_value,
    counts_from_tensors,
    model_dims,
    read_model_config,
    shape_of_model_config,
)


def tiny_llama_config(cfg: Config, vocab_size: int, eos_token_id: int):
    from transformers import LlamaConfig

    t = cfg.model.tiny
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=t.tie_word_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,
    )


# The config.json keys tiny_llama_config decides: a base_model whose keys differ was built from
# other model.tiny settings (or another tokenizer's vocabulary).
TINY_MODEL_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
)
TINY_RECORD = "raytrain_tiny.json"  # the settings a base_model was built from: its config keys and train.seed


def _tiny_settings(config, seed: int) -> dict[str, Any]:
    full = json.loads(config.to_json_string())
    return {"seed": seed, "config": {k: full.get(k) for k in TINY_MODEL_KEYS}}


def tiny_model_differences(out_dir: Path, wanted: dict[str, Any]) -> list[str]:
    """'key: built → wanted' for each setting a written tiny model differs in. A key its files
    do not record (a base_model written before the record, or by another transformers) is not
    compared: only a difference they show counts."""
    record = out_dir / TINY_RECORD
    built = json.loads(record.read_text()) if record.is_file() else {"config": _config_json(str(out_dir))}
    diffs = [
        f"{k}: {built['config'][k]!r} → {v!r}"
        for k, v in wanted["config"].items()
        if k in built["config"] and built["config"][k] != v
    ]
    if "seed" in built and built["seed"] != wanted["seed"]:
        diffs.append(f"train.seed: {built['seed']} → {wanted['seed']}")
    return diffs


def write_tiny_model(cfg: Config, tokenizer, out_dir: Path, log=print) -> Path:
    """Initialises the tiny Llama with train.seed and saves it (safetensors + config + tokenizer).

    Written once per run directory and reused on resume, so every attempt starts from the
    same initial weights. A base_model built from other model.tiny settings (or another seed)
    is never reused silently: it is rebuilt where no checkpoint of the run was trained from it,
    and refused, naming the differences, where one was (its weights are what they continued).
    """
    import torch
    from transformers import LlamaForCausalLM

    out_dir = Path(out_dir)
    config = tiny_llama_config(cfg, len(tokenizer), tokenizer.eos_token_id)
    wanted = _tiny_settings(config, cfg.train.seed)
    if (out_dir / "model.safetensors").is_file():
        diffs = tiny_model_differences(out_dir, wanted)
        if not diffs:
            return out_dir
        trained = sorted(p.name for p in out_dir.parent.glob("checkpoint_*") if (p / "manifest.json").is_file())
        if trained:
            raise ConfigError(
                f"model.tiny: {out_dir} was built from other settings ({'; '.join(diffs)}) and {trained[-1]} was "
                "trained from it, so it is kept as it is. Set those back to resume this run, or start a new "
                "run.name for the new settings."
            )
        log(
            f"[raytrain] {out_dir} was built from other settings ({'; '.join(diffs)}); no checkpoint was trained "
            "from it: rebuilding it"
        )
    check_tiny_model_fits(config)
    torch.manual_seed(cfg.train.seed)
    model = LlamaForCausalLM(config)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # an interrupted earlier write's
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / TINY_RECORD).write_text(json.dumps(wanted, indent=2))
    if out_dir.exists():  # the old one (nothing trained from it) goes only once the new one is whole
        old = out_dir.with_name(f"{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out_dir)
    return out_dir


# Initialising model.tiny in fp32 and writing it with save_pretrained, over the process's own memory:
# measured 1.08x the fp32 bytes (280M parameters, peak RSS), so 4 bytes a parameter and a tenth more.
TINY_WRITE_BYTES_PER_PARAM = 4.4


def check_tiny_model_fits(config) -> None:
    """The driver builds model.tiny whole before writing it. A size past the memory this machine
    has free would push it into swap (or the OOM killer) with nothing said; refuse it instead."""
    import psutil

    n = sum(shape_of_model_config(config).param_numels())
    need, free = n * TINY_WRITE_BYTES_PER_PARAM, psutil.virtual_memory().available
    if need > free:
        raise ConfigError(
            f"model.tiny: the {n / 1e9:.1f}B-parameter model it describes is initialised whole in fp32 on the "
            f"driver before it is written (~{need / 2**30:.0f} GiB; {free / 2**30:.0f} GiB available here). Make "
            "model.tiny smaller, or start from a model directory (model.name_or_path=<dir>): its safetensors load "
            "sharded, never whole in one process."
        )


def check_model_path(name_or_path: str) -> None:
    """Fails early for a local-looking path that doesn't hold a model."""
    if is_hub_id(name_or_path):
        return  # fetched (and so checked) first thing in main.run
    p = Path(name_or_path).expanduser()
    if not p.is_dir():
        raise ConfigError(
            f"model.name_or_path: {name_or_path!r} does not exist. Give a directory with config.json and "
            "*.safetensors, a hub id such as meta-llama/Meta-Llama-3-8B, or 'tiny'."
        )
    if not (p / "config.json").is_file():
        if (p / "adapter_config.json").is_file():  # a LoRA export: the adapter, not a model
            why = (
                "it holds a LoRA adapter. To train on, export its checkpoint with the adapter merged in: "
                "python -m raytrain_cpu.export <checkpoint> <dir> --merge, then model.name_or_path=<dir>/merged"
            )
        elif (p / "manifest.json").is_file() or any(p.glob("checkpoint_*/manifest.json")):
            why = (
                "it is a raytrain checkpoint or run. Export it first (python -m raytrain_cpu.export "
                f"{name_or_path} <dir>), then model.name_or_path=<dir>; to continue the run itself, rerun it"
            )
        else:
            why = "it is not a Hugging Face model directory"
        raise ConfigError(f"model.name_or_path: {p} has no config.json; {why}.")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ConfigError(f"model.name_or_path: {p} has config.json but no *.safetensors weights.")


def _checkpoint_files(model_dir: str) -> dict[str, str] | None:
    """Tensor name -> safetensors file of a local model directory; None when it has none."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return {k: str(d / f) for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = d / "model.safetensors"
    if not single.is_file():
        return None
    return dict.fromkeys(_safetensors_header(str(single))[0], str(single))


def _safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    """(tensor name -> {dtype, shape, data_offsets}, byte offset of the data) of one file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    # FP8 checkpoints (DeepSeek-V3 style) and unsigned ints: torch has each, and copy_ converts
    # them into the parameter's dtype as the other types are.
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
}

# os.preadv returns at most this many bytes a call on Linux (MAX_RW_COUNT: 2 GiB less a page),
# whatever the buffer's size; reads loop until the range is whole.
_MAX_READ = 0x7FFFF000


def safetensors_dtype(code: str, path: str, name: str):
    """The torch dtype of a safetensors dtype code, or a clear refusal naming it (not a KeyError)."""
    import torch

    if code not in _SAFETENSORS_DTYPES:
        raise ValueError(
            f"{path}: tensor {name} is stored as {code!r}, which raytrain_cpu does not load (it reads "
            f"{', '.join(_SAFETENSORS_DTYPES)}). Convert the checkpoint to bf16 or fp32 first."
        )
    return getattr(torch, _SAFETENSORS_DTYPES[code])


def pread_exact(fd: int, buf: bytearray | memoryview, offset: int, path: str, name: str) -> None:
    """Fills `buf` from `offset` of fd. One preadv returns at most 2 GiB less a page (and may
    return less at any size), so a tensor past that is read in as many calls as it takes; a
    file that ends first is named as truncated."""
    view, done = memoryview(buf).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done : done + _MAX_READ]], offset + done)
        if got == 0:
            raise ValueError(f"{path}: {name} is truncated (read {done} of {len(view)} bytes)")
        done += got


# ----------------------------------------------------------------------------- shape and size from the files

# config.json names the context differently across architectures (GPT-2: n_positions).
_CONTEXT = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def _config_json(model_dir: str) -> dict[str, Any]:
    return json.loads((Path(model_dir).expanduser() / "config.json").read_text())


def check_causal_lm(model_dir: str) -> None:
    """The model type must have a transformers causal-LM class: the workers build every model
    with AutoModelForCausalLM.from_config (encoder-decoder and vision-language types have none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    c = _config_json(model_dir)  # the top level: the type AutoModelForCausalLM sees
    model_type = c.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"model.name_or_path: {model_dir} holds a {model_type!r} model ({', '.join(c.get('architectures') or [])}), "
            "which transformers has no AutoModelForCausalLM class for; raytrain_cpu trains decoder-only causal LMs "
            "(Llama, Qwen2, Mistral, Gemma, GPT-2, Phi-3 and the others transformers maps). Choose such a model."
        )


def context_length(config: dict[str, Any]) -> tuple[str, int] | None:
    """(key, positions) of the context a config.json dict sets (a multimodal one's text_config
    first), else None."""
    return config_value({**config, **(config.get("text_config") or {})}, _CONTEXT)


def check_context_length(model_dir: str, seq_len: int) -> None:
    """data.seq_len must fit the positions the model has: a learned-position model (GPT-2)
    would crash mid-run past them, a rotary one trains on positions it never saw."""
    found = context_length(_config_json(model_dir))
    if found is not None and seq_len > found[1]:
        key, limit = found
        raise ConfigError(
            f"data.seq_len: {seq_len} exceeds the model's context: {model_dir}/config.json has {key}={limit}. "
            f"Set data.seq_len={limit} or lower, or train a model with a longer context."
        )


def check_vocab(model_dir: str, tokenizer_json: str, tokenizer: str) -> None:
    """Every id the tokenizer gives needs a row in the model's embedding: past them the workers
    fail on their first batch with an IndexError (and restart into it again)."""
    from tokenizers import Tokenizer

    rows = read_model_config(model_dir).get("vocab_size")
    if not isinstance(rows, int):
        return
    top = max(Tokenizer.from_file(tokenizer_json).get_vocab(with_added_tokens=True).values())
    if top >= rows:
        fix = (
            "Its tokenizer files and config.json disagree: fix the model directory."
            if tokenizer == ""
            else "Train with the model's own tokenizer (model.tokenizer=''), or a model made for this tokenizer."
        )
        named = repr(tokenizer) if tokenizer else "the model's own tokenizer"
        raise ConfigError(
            f"model.tokenizer: {named} gives token ids up to {top}, but the model's embedding has {rows} rows "
            f"(vocab_size in {model_dir}/config.json). {fix}"
        )


def _tensor_numels(model_dir: str) -> dict[str, int]:
    """Tensor name -> element count: from the safetensors headers (no weights read), else from
    a meta-device copy of the model (.bin checkpoints). Both hold a tied weight once."""
    files = _checkpoint_files(model_dir)
    if files is not None:
        out = {}
        for path in sorted(set(files.values())):
            for name, meta in _safetensors_header(path)[0].items():
                if meta["dtype"] not in ("BOOL", "U8"):  # attention-mask buffers old GPT-2 saves carry
                    out[name] = math.prod(meta["shape"])
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return {name: p.numel() for name, p in model.named_parameters()}


def count_parameters(model_dir: str) -> dict[str, int | None]:
    """Parameter counts as the model holds them, exact for any architecture, and the FLOP
    formula's shape (metrics.flops_per_token).

    total: every tensor of the checkpoint (a tied embedding is stored, and counted, once).
    non_embedding: the parameters each token's matmuls go through: total less the input
        embeddings (token and learned-position tables), plus the output head when it is tied
        to the token embedding (its matmul still runs).
    num_layers, hidden_size: from config.json; None when it names neither (MFU is then not logged).
    attention_width: heads x head_dim (the config's head_dim where it sets one); None if unknown.
    """
    return counts_from_tensors(_tensor_numels(model_dir), model_dims(model_dir))


def _read_own_partitions(model, files: dict[str, str]) -> None:
    """Fills each ZeRO-3 partition of this rank from the checkpoint, reading only its bytes.

    ZeRO-3 keeps elements [r*P, (r+1)*P) of each flattened parameter on rank r (P = the
    partition size, the last one zero-padded). Safetensors stores each tensor as one
    contiguous row-major run of bytes, so rank r reads exactly its range with a positioned
    read: 1/W of the checkpoint per rank, no weights over the network, and no memory map
    (a mapped file's touched pages count in the rank's RSS until it is closed).
    """
    import torch
    import torch.distributed as dist

    params = dict(model.named_parameters())  # tied weights appear once
    missing = sorted(set(params) - set(files))
    if missing:
        raise ValueError(f"checkpoint has no tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    by_file: dict[str, list[str]] = {}
    for name in params:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        header, data_start = _safetensors_header(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            for name in names:
                p, meta = params[name], header[name]
                if tuple(meta["shape"]) != tuple(p.ds_shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(meta['shape'])} != model {tuple(p.ds_shape)}")
                dtype = safetensors_dtype(meta["dtype"], path, name)
                part = p.ds_tensor
                start = part.ds_numel * dist.get_rank(group=p.ds_process_group)
                n = max(0, min(start + part.ds_numel, p.ds_numel) - start)  # elements this rank holds
                with torch.no_grad():
                    part.narrow(0, n, part.ds_numel - n).zero_()  # the padding past the tensor's end
                    if n == 0:
                        continue
                    buf = bytearray(n * dtype.itemsize)
                    pread_exact(fd, buf, data_start + meta["data_offsets"][0] + start * dtype.itemsize, path, name)
                    part.narrow(0, 0, n).copy_(torch.frombuffer(buf, dtype=dtype))
        finally:
            os.close(fd)


def load_sharded(model_dir: str, ds_config: dict[str, Any], dtype):
    """Loads the model straight into ZeRO-3 partitions; returns (model, hf_ds_config).

    The caller must keep the returned HfDeepSpeedConfig referenced for as long as the model
    lives: transformers finds it through a weak reference, and without it the model would be
    materialised whole on every rank.

    With a local safetensors checkpoint, the model is built partitioned by transformers
    (`from_config` enters zero.Init itself) and each rank then reads only its own slice of
    every tensor (`_read_own_partitions`), with plain positioned reads. transformers' own
    ZeRO-3 `from_pretrained` maps the whole checkpoint on rank 0 and broadcasts it (measured:
    rank 0 peaked at 2.77 GB loading a 459M model stored in fp32, against 1.02 GB on rank 1);
    it stays the fallback for checkpoints without safetensors files.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from raytrain_cpu.compat import deepspeed_zero3
    from raytrain_cpu.compat.torch import preload_dynamo
    from raytrain_cpu.compat.transformers import no_zero3_weight_init

    preload_dynamo()  # before zero.Init patches Tensor.__new__
    config = AutoConfig.from_pretrained(model_dir)  # read config files before zero.Init is active
    zero3 = ds_config["zero_optimization"]["stage"] == 3
    hf_ds_config = HfDeepSpeedConfig(ds_config) if zero3 else None
    files = _checkpoint_files(model_dir) if zero3 else None
    if files is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    else:
        with no_zero3_weight_init():  # the checkpoint overwrites every weight
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        _read_own_partitions(model, files)  # every parameter, or an error naming the missing ones
        # hpZ's in-node copies were cut from the weights as built, not as read (compat's why)
        deepspeed_zero3.drop_stale_secondary_partitions(model)
    model.config.use_cache = False
    del torch
    return model, hf_ds_config


def unwrapped(model):
    """The transformers model itself: peft wraps LoRA models."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@functools.cache
def same_source(fn, reference) -> bool:
    """Whether function `fn` is `reference` line for line (transformers' modular copies give each
    architecture its own functions and classes with the same source); read once per pair."""
    try:
        return fn is reference or inspect.getsource(fn) == inspect.getsource(reference)
    except (OSError, TypeError):
        return False


def same_forward(cls: type, reference: type) -> bool:
    """Whether `cls.forward` is `reference.forward` line for line; read once per class."""
    return same_source(cls.forward, reference.forward)


def install_forward(model, runs_reference, forward) -> int:
    """Binds `forward` to every module of `model` for which runs_reference(module) holds (its
    class runs a reference forward: the fused norm and MLP); how many."""
    import types

    n = 0
    for module in model.modules():
        if runs_reference(module):
            module.forward = types.MethodType(forward, module)
            n += 1
    return n


def decoder_layers(model) -> list:
    """The model's decoder layers, for any architecture: the modules of the classes transformers
    never splits across devices (`_no_split_modules`)."""
    base = unwrapped(model)
    names = set(getattr(base, "_no_split_modules", None) or [])
    return [m for m in base.modules() if type(m).__name__ in names]


def mark_layers_as_zero3_leaves(model, layers: list) -> list[str]:
    """Flags each layer as a ZeRO-3 leaf: DeepSpeed then gathers and releases the layer's
    parameters as one unit and puts no hooks on its projections and norms. Must run before
    deepspeed.initialize registers the hooks; returns the class names flagged."""
    from deepspeed.utils import set_z3_leaf_module

    for layer in layers:
        set_z3_leaf_module(layer, True)
    if layers:
        # DeepSpeed reduces a leaf's gradients in a full backward hook, which fires once the
        # gradients of the layer's inputs exist; where no input needs one (the first layer behind
        # frozen embeddings, as under LoRA) it fired before the layer's backward had run and
        # reduced zeros in place of the real gradients, which then failed to accumulate.
        # Embedding outputs that require grad make every layer's input need one (a no-op where
        # the embeddings train).
        model.enable_input_require_grads()
    return sorted({type(m).__name__ for m in layers})
