"""Model: build the tiny Llama on the driver, load any Llama sharded on the workers.

The driver never loads a real model's weights: for 'tiny' it creates one from a config and
writes it as safetensors, so the workers go through the same `from_pretrained` path a
Llama-3-8B takes. On the workers, transformers loads each shard straight into ZeRO-3
partitions when an `HfDeepSpeedConfig` is alive: no rank ever holds the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raytrain_cpu.config import Config, ConfigError


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


def write_tiny_model(cfg: Config, tokenizer, out_dir: Path) -> Path:
    """Initialises the tiny Llama with train.seed and saves it (safetensors + config + tokenizer).

    Written once per run directory and reused on resume, so every attempt starts from the
    same initial weights.
    """
    import torch
    from transformers import LlamaForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    torch.manual_seed(cfg.train.seed)
    model = LlamaForCausalLM(tiny_llama_config(cfg, len(tokenizer), tokenizer.eos_token_id))
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


def check_model_path(name_or_path: str) -> None:
    """Fails early for a local-looking path that doesn't hold a model."""
    looks_local = name_or_path.startswith((".", "/", "~")) or Path(name_or_path).expanduser().exists()
    if not looks_local and name_or_path.count("/") == 1:
        return  # a hub id: checked when the workers load it
    p = Path(name_or_path).expanduser()
    if not p.is_dir():
        raise ConfigError(
            f"model.name_or_path: {name_or_path!r} does not exist. Give a directory with config.json and "
            "*.safetensors, a hub id such as meta-llama/Meta-Llama-3-8B, or 'tiny'."
        )
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.name_or_path: {p} has no config.json; it is not a Hugging Face model directory.")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ConfigError(f"model.name_or_path: {p} has config.json but no *.safetensors weights.")


def count_parameters(model_dir: str) -> dict[str, int]:
    """Parameter counts from config.json alone (no weights loaded)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    d, L, v = c.hidden_size, c.num_hidden_layers, c.vocab_size
    kv = c.num_key_value_heads * (d // c.num_attention_heads)
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * c.intermediate_size + 2 * d
    embed = v * d
    head = 0 if c.tie_word_embeddings else v * d
    return {
        "total": embed + head + L * per_layer + d,
        "non_embedding": head + L * per_layer + d,
        "num_layers": L,
        "hidden_size": d,
    }


def load_sharded(model_dir: str, ds_config: dict[str, Any], dtype):
    """Loads the model straight into ZeRO-3 partitions; returns (model, hf_ds_config).

    The caller must keep the returned HfDeepSpeedConfig referenced for as long as the model
    lives: transformers finds it through a weak reference, and without it `from_pretrained`
    silently materialises the full model on every rank.
    """
    import torch
    import torch._dynamo  # noqa: F401  (must be imported before zero.Init patches Tensor.__new__)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    AutoConfig.from_pretrained(model_dir)  # read config files before zero.Init is active
    hf_ds_config = HfDeepSpeedConfig(ds_config) if ds_config["zero_optimization"]["stage"] == 3 else None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.config.use_cache = False
    del torch
    return model, hf_ds_config


def model_summary(model_dir: str) -> dict[str, Any]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return {
        k: cfg.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    }
