"""The one reader of a model's shape: from a Hugging Face config (dict, object or directory) to
ModelShape, parameter counts, the attention's shape and the weight GEMMs.

Every number this project derives from a model's config (the planner's memory, the GEMM probe,
MFU's FLOPs, the attention pick, the benchmarks) goes through here, so they all follow the same
rules: head_dim is the config's own where it names one (Gemma's is not hidden // heads), an
unset tie_word_embeddings is the model type's default, GPT-2's key names mean Llama's.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_cpu.host.gemm import Gemm

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# ----------------------------------------------------------------------------- ModelShape


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a Llama-architecture decoder that decide its memory and its FLOPs."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_word_embeddings: bool = False
    # A config's own head_dim (Gemma-7B: 256 with hidden 3072 over 16 heads); 0 where it names
    # none, which means Llama's hidden // heads.
    attention_head_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        """Width of the query projection (and the input of o_proj): heads x head_dim, which is the
        hidden size only where head_dim is hidden // heads."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection under grouped-query attention."""
        return self.num_kv_heads * self.head_dim

    def layer_param_numels(self, matrices_only: bool = False) -> list[int]:
        """Element counts of one decoder layer's tensors (q, k, v, o, gate, up, down, 2 norms;
        `matrices_only`: without the 1-D norms)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        return [h * q, h * kv, h * kv, q * h, h * i, h * i, i * h, *([] if matrices_only else [h, h])]

    def param_numels(self, matrices_only: bool = False) -> list[int]:
        """Element counts of every parameter tensor in model order, as DeepSpeed sees them
        (`matrices_only`: the weight-decay group of trainer.engine.param_groups, without the norms)."""
        embed = self.vocab_size * self.hidden_size
        heads = [] if self.tie_word_embeddings else [embed]
        final_norm = [] if matrices_only else [self.hidden_size]
        return [embed, *self.layer_param_numels(matrices_only) * self.num_layers, *final_norm, *heads]

    @property
    def layer_params(self) -> int:
        return sum(self.layer_param_numels())

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each Linear of a decoder layer, by its Llama module name."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        return {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }

    def lora_params(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        """Adapter parameters: A (rank x in) + B (out x rank) beside each targeted Linear."""
        shapes = self.projection_shapes()
        unknown = sorted(set(targets) - set(shapes))
        if unknown:
            raise ValueError(f"LoRA targets {unknown}: the planner knows the Llama projections {sorted(shapes)}")
        return rank * sum(sum(shapes[t]) for t in targets) * self.num_layers if rank else 0

    @property
    def num_params(self) -> int:
        return sum(self.param_numels())

    def parameter_counts(self) -> dict[str, int]:
        """count_parameters' numbers for this shape, without a file: the input embedding is all
        that non_embedding leaves out (a tied one stays: the output head's matmul still runs)."""
        total = self.num_params
        return {
            "total": total,
            "non_embedding": total - (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size),
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "attention_width": self.q_dim,
        }

    def llama_config(self) -> dict[str, Any]:
        """This shape as Llama config.json keys (shape_from_hf_config's inverse): what builds a
        model of it, e.g. LlamaConfig(**shape.llama_config())."""
        keys = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        return keys | ({"head_dim": self.attention_head_dim} if self.attention_head_dim else {})


# ----------------------------------------------------------------------------- config.json dicts

# config.json names the same quantity differently across architectures (GPT-2: n_layer, n_embd).
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_HEADS = ("num_attention_heads", "n_head")


def read_model_config(model_dir: str) -> dict[str, Any]:
    """config.json as a dict; a multimodal model's text_config is merged over its top level."""
    c = json.loads((Path(model_dir).expanduser() / "config.json").read_text())
    return {**c, **(c.get("text_config") or {})}


def config_value(config: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, int] | None:
    """(key, value) of the first of `keys` that config.json sets to a number, else None."""
    for k in keys:
        if isinstance(config.get(k), int) and not isinstance(config.get(k), bool):
            return k, config[k]
    return None


def config_head_dim(cfg: dict[str, Any]) -> int:
    """head_dim as a config dict sets it, 0 where it sets none (hidden // heads then): the one
    rule every shape this project derives follows."""
    value = cfg.get("head_dim")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _default_tie(model_type: str | None) -> bool:
    """Whether transformers ties a model type's output head to its embeddings when config.json
    does not say (its config class's default); False for a type it does not know."""
    try:
        from transformers import CONFIG_MAPPING

        return bool(CONFIG_MAPPING[model_type]().tie_word_embeddings)
    except Exception:  # transformers absent, an unknown or missing type: Llama's default
        return False


def shape_from_hf_config(cfg: dict[str, Any], name: str = "") -> ModelShape:
    """A ModelShape from a Hugging Face config.json dict (Llama, Mistral, Qwen2, Gemma style keys).
    head_dim is the config's own where it names one (Gemma's is not hidden // heads); an
    unset tie_word_embeddings is the model type's default (Gemma ties, Llama does not)."""
    heads = cfg["num_attention_heads"]
    tied = cfg.get("tie_word_embeddings")
    return ModelShape(
        name=name or cfg.get("_name_or_path") or cfg.get("model_type", "model"),
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        tie_word_embeddings=bool(_default_tie(cfg.get("model_type")) if tied is None else tied),
        attention_head_dim=config_head_dim(cfg),
    )


def shape_from_file(path: Path, name: str) -> ModelShape:
    """shape_from_hf_config of a config.json file; a ValueError naming the file where it is not one."""
    try:
        return shape_from_hf_config(json.loads(path.read_text()), name=name)
    except (ValueError, KeyError, TypeError) as e:  # not JSON, or not a decoder's config
        what = f"no {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{path} is not a Llama-style Hugging Face config.json ({what})") from None


def model_dims(model_dir: str) -> dict[str, int | None]:
    """The shape numbers the FLOP formula and the GEMM probe need, whatever config.json calls
    them; None where the config doesn't say."""
    c = read_model_config(model_dir)
    layers, hidden, heads = (config_value(c, keys) for keys in (_LAYERS, _HIDDEN, _HEADS))
    dims = {
        "num_layers": layers and layers[1],
        "hidden_size": hidden and hidden[1],
        "num_heads": heads and heads[1],
        "vocab_size": c.get("vocab_size"),
    }
    dims["num_kv_heads"] = c.get("num_key_value_heads") or dims["num_heads"]
    dims["head_dim"] = config_head_dim(c) or (hidden and heads and hidden[1] // heads[1])
    # GPT-2 style configs leave the MLP width unset (n_inner: None) for 4 x hidden.
    dims["intermediate_size"] = c.get("intermediate_size") or c.get("n_inner") or (hidden and 4 * hidden[1])
    return dims


# ----------------------------------------------------------------------------- config objects


def shape_of_model_config(config: Any) -> ModelShape:
    """A ModelShape from a loaded transformers config object, whose attribute_map answers the
    Llama names for other families too (GPT-2's n_head, n_embd, n_layer; its MLP is n_inner
    or 4 x hidden)."""
    hidden = config.hidden_size
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    keys += ("head_dim", "tie_word_embeddings", "model_type")
    return shape_from_hf_config(
        {k: getattr(config, k, None) for k in keys}
        | {
            "intermediate_size": getattr(config, "intermediate_size", None)
            or getattr(config, "n_inner", None)
            or 4 * hidden
        },
        name=getattr(config, "model_type", "model"),
    )


def attention_shape(model_config: Any, micro_batch: int, seq_len: int) -> tuple[int, int, int, int, int] | None:
    """(batch, heads, kv_heads, seq, head_dim) of the model's self-attention, None if it names no heads."""
    heads = getattr(model_config, "num_attention_heads", None)
    hidden = getattr(model_config, "hidden_size", None)
    if not heads or not hidden:
        return None
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = config_head_dim({"head_dim": getattr(model_config, "head_dim", None)}) or hidden // heads
    return micro_batch, heads, kv, seq_len, head_dim


def causal_block_probs(seq_len: int, block: int) -> int:
    """Elements of one head's probabilities in the causal blocks: each block of `block` queries
    against the keys up to its end (raytrain_cpu.model.ops.attention keeps them in this layout)."""
    return block * sum(min((i + 1) * block, seq_len) for i in range(-(-seq_len // block)))


# ----------------------------------------------------------------------------- parameter counts

# Checkpoint modules (the name part before ".weight") of the input embeddings and the output head.
_TOKEN_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "embed_in")
_POSITION_EMBEDDINGS = ("wpe", "position_embeddings", "embed_positions")
_OUTPUT_HEADS = ("lm_head", "embed_out")


def counts_from_tensors(numels: dict[str, int], dims: dict[str, int | None]) -> dict[str, int | None]:
    """Parameter counts from a checkpoint's tensor sizes (name -> elements, a tied weight once)
    and model_dims: see model.loading.count_parameters."""
    by_module: dict[str, int] = {}
    for name, n in numels.items():
        module = name.split(".")[-2] if "." in name else name
        by_module[module] = by_module.get(module, 0) + n
    tokens = sum(by_module.get(m, 0) for m in _TOKEN_EMBEDDINGS)
    positions = sum(by_module.get(m, 0) for m in _POSITION_EMBEDDINGS)
    tied = not any(m in by_module for m in _OUTPUT_HEADS)  # the head is the token embedding
    total = sum(numels.values())
    return {
        "total": total,
        "non_embedding": total - positions - (0 if tied else tokens),
        "num_layers": dims["num_layers"],
        "hidden_size": dims["hidden_size"],
        # The attention's q width (heads x head_dim): Gemma's is not hidden_size.
        "attention_width": dims["num_heads"] and dims["head_dim"] and dims["num_heads"] * dims["head_dim"],
    }


def param_counts(model) -> dict[str, int]:
    """Trainable and total parameters of a live model; ZeRO-3 parameters report their full size in ds_numel."""
    trainable = total = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return {"trainable": trainable, "total": total}


# ----------------------------------------------------------------------------- GEMM shapes


def llama_gemms(
    hidden: int,
    intermediate: int,
    num_heads: int,
    num_kv_heads: int,
    vocab: int,
    num_layers: int,
    tokens: int,
    training: bool = True,
    head_dim: int = 0,
) -> list[Gemm]:
    """The weight GEMMs of one Llama micro batch of `tokens` tokens; `head_dim` the config's own
    where it names one (Gemma-7B: 256, not hidden // heads = 192), 0 for hidden // heads.

    Forward is x[t,in] @ Wᵀ; backward adds the input gradient g[t,out] @ W and the weight
    gradient gᵀ[out,t] @ x[t,in]. Same-shape products are merged into one row with a count.
    """
    shape = ModelShape("", 0, hidden, intermediate, num_layers, num_heads, num_kv_heads, attention_head_dim=head_dim)
    q, kv = shape.q_dim, shape.kv_dim
    linears = [  # (in, out, count per model); with kv == hidden the shapes repeat and merge below
        (hidden, q, num_layers),  # q
        (q, hidden, num_layers),  # o
        (hidden, kv, 2 * num_layers),  # k, v
        (hidden, intermediate, 2 * num_layers),  # gate, up
        (intermediate, hidden, num_layers),  # down
        (hidden, vocab, 1),  # lm_head
    ]
    merged: dict[tuple[int, int], int] = {}
    for fin, fout, count in linears:
        merged[(fin, fout)] = merged.get((fin, fout), 0) + count
    out = []
    for (fin, fout), count in merged.items():
        out.append(Gemm(f"fwd {fin}->{fout}", tokens, fin, fout, count))
        if training:
            out.append(Gemm(f"dgrad {fout}->{fin}", tokens, fout, fin, count))
            out.append(Gemm(f"wgrad {fin}x{fout}", fout, tokens, fin, count))
    return out


@functools.lru_cache(maxsize=8)
def gemms_for_model(model_dir: str, tokens: int) -> list[Gemm]:
    """llama_gemms for a Hugging Face model directory (config.json only, no weights; GPT-2 style
    key names too). Cached: the start-up probe and MFU's second timing read the same config."""
    d = model_dims(model_dir)
    return llama_gemms(
        hidden=d["hidden_size"],
        intermediate=d["intermediate_size"],
        num_heads=d["num_heads"],
        num_kv_heads=d["num_kv_heads"],
        vocab=d["vocab_size"],
        num_layers=d["num_layers"],
        tokens=tokens,
        head_dim=d["head_dim"] or 0,
    )
