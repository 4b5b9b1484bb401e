"""model: and lora: settings: which model to train, how to compute it, and LoRA adapters on it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from raytrain_cpu.config.checks import absolute, choice, require, require_filesystem

Dtype = Literal["auto", "bf16", "fp32"]
AttentionProbs = Literal["auto", "keep", "recompute"]
CompileScope = Literal["layers", "model"]

# model.attention's causal blocks: 'causal_blocks' runs this many queries a block,
# 'causal_blocks_<N>' N (raytrain_cpu.model.ops.attention; parsed here, where nothing imports torch, for
# the config check, the attention module and the planner alike).
CAUSAL_BLOCKS_DEFAULT = 64
# model.attention's fused kernel (raytrain_cpu.model.ops.fused_attention)
FUSED = "fused"
# model.compile=auto (and model.weight_grad_kernel=auto) start at this many parameters: below it a
# run is too short to win back the compile's (or the kernel build's) fixed tens of seconds
# (docs/performance.md has the timings).
COMPILE_AUTO_MIN_PARAMS = 20_000_000


def causal_blocks_size(name: str | None) -> int | None:
    """Queries a block of a causal-blocks implementation name ('causal_blocks', 'causal_blocks_128',
    or transformers' 'raytrain_'-prefixed ones); None for anything else, SDPA's names included."""
    m = re.fullmatch(r"(?:raytrain_)?causal_blocks(?:_([1-9][0-9]*))?", name or "")
    return None if m is None else int(m.group(1) or CAUSAL_BLOCKS_DEFAULT)


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
            require(getattr(self, name) > 0, f"model.tiny.{name}", "must be a positive integer.")
        require(
            self.hidden_size % self.num_heads == 0,
            "model.tiny.num_heads",
            f"{self.num_heads} does not divide hidden_size {self.hidden_size}; pick a divisor.",
        )
        require(
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
    dtype: Dtype = "auto"
    """Training precision: 'bf16' (DeepSpeed bf16, fp32 master weights), 'fp32', or 'auto':
    the workers time bf16 and fp32 GEMMs at the model's shapes at start-up and take bf16 only
    where it is faster (AMX or AVX-512 BF16 CPUs), else fp32 with a warning. With 'bf16' the
    same probe warns when bf16 measures slower. A resumed run keeps its checkpoint's dtype."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory (costs ~1/3 more compute)."""
    attention: str = "auto"
    """Causal self-attention: 'causal_blocks' (raytrain_cpu.model.ops.attention: 64 queries at a time
    against their key prefix, as GEMMs; faster than SDPA's CPU flash kernel where measured),
    'causal_blocks_<N>' (N queries at a time: larger blocks can pay on AMX), 'sdpa',
    'fused' (raytrain_cpu.model.ops.fused_attention: one C++ kernel on oneDNN's AMX micro-kernels, built at
    first use; bf16 only; keeps no probabilities), or 'auto': every rank times SDPA, the blocks
    at 64 and 128 queries and (in bf16, where it builds) the fused kernel at the run's shape at
    start-up and all take the fastest (one more than 3% faster than those before it); a resumed
    run keeps its checkpoint's pick, so its losses continue bit for bit. Padding-masked or cached attention always runs SDPA."""
    attention_probs: AttentionProbs = "auto"
    """What the causal blocks keep for the backward: 'keep' their probabilities (the backward
    reads them: one batched GEMM of seven and half the softmax work fewer, the same bits), 'recompute' them from q and k, or 'auto':
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
    Hugging Face's keeps 6 (two norms per layer) and runs faster, a chunk of rows at a time
    (benchmarks/norm.py). OLMo-2 and Gemma norms, and compiled models (inductor fuses them itself), keep Hugging Face's."""
    fused_rotary: bool = True
    """Apply the rotary position embedding to q and k as one autograd operation a chunk of rows
    at a time (raytrain_cpu.model.ops.rotary): Hugging Face's products and sums in the same order (the same
    bits), about two passes over memory where its five operators and their backward make about
    a dozen. Llama's attention; other attention classes and compiled models keep Hugging Face's."""
    fused_mlp: bool = False
    """Run the SwiGLU MLP's silu(gate) * up as one autograd operation (raytrain_cpu.model.ops.mlp) that
    recomputes silu(gate) in the backward instead of keeping it: the same bits, 2 bytes per
    intermediate unit per token per layer less (7 GiB per rank for Llama-3-8B at 8,192 tokens
    a rank without activation checkpointing; `plan --fused-mlp` counts it). Off by default:
    the recompute and a Python autograd call per layer cost more time than they save where
    measured; turn it on where activations limit an uncompiled
    run. Llama-style MLPs with SiLU; compiled models keep Hugging Face's."""
    weight_grad_kernel: bool | str = "auto"
    """Run each bf16 linear layer's weight gradient on a kernel of our own (raytrain_cpu.model.ops.linear,
    csrc/weight_grad.cpp): autograd's runs well below the forward's rate on AMX
    (benchmarks/weight_grad.py, benchmarks/kernel_threads.py). true, false or 'auto': on AMX (oneDNN's AMX micro-kernels) for
    models of at least 20M parameters (COMPILE_AUTO_MIN_PARAMS: the first use builds the kernel,
    which a tiny model would not win back), and then only where it beats
    autograd's weight gradient timed at the model's linear shapes on the rank's own threads at
    start-up (linear.choose; all ranks take one pick): a speed-up measured at one thread says
    nothing about a rank of many threads. It needs a C++ compiler and ninja; where it does not build
    the run keeps autograd's."""
    compile: bool | str = "auto"
    """torch.compile with inductor (model.compile_scope): true, false or 'auto', which compiles
    where it has paid: a model of at least 20M parameters (COMPILE_AUTO_MIN_PARAMS), trained in
    bf16 without document masks, on a machine with inductor's C++ compiler ($CXX, else g++). Per-layer
    compile has paid in bf16 on models of that size, and cost a tiny model or an fp32 run more
    than it saved (docs/performance.md). Document masks (chat and instruction data) stay
    uncompiled under auto: the causal blocks take no mask inside a compiled graph, and SDPA's
    attention costs more than compile saves. The first steps compile (tens of seconds; seconds
    from the cache after that)."""
    compile_scope: CompileScope = "layers"
    """What model.compile compiles: 'layers' compiles each decoder layer's forward (one graph,
    reused by every layer; under ZeRO-3 the layers are gathered whole, so the gathers stay
    outside the graph), 'model' the whole model through DeepSpeed's engine.compile."""
    compile_cache_dir: str = ""
    """Persistent inductor cache shared by all workers and runs; '' means
    <run.storage_path>/inductor_cache."""

    def __post_init__(self) -> None:
        require(bool(self.name_or_path), "model.name_or_path", "must not be empty; use 'tiny'.")
        choice(self.dtype, "model.dtype", get_args(Dtype))
        choice(self.compile_scope, "model.compile_scope", get_args(CompileScope))
        for key in ("compile", "weight_grad_kernel"):
            value = getattr(self, key)
            if isinstance(value, str) and value.lower() in ("true", "false"):
                setattr(self, key, value := value.lower() == "true")
            require(
                isinstance(value, bool) or value == "auto",
                f"model.{key}",
                f"got {value!r}; choose true, false or auto.",
            )
        require(
            self.attention in ("auto", "sdpa", FUSED)
            or (causal_blocks_size(self.attention) is not None and not self.attention.startswith("raytrain_")),
            "model.attention",
            f"got {self.attention!r}; choose one of auto, sdpa, fused, causal_blocks, causal_blocks_<queries a block>.",
        )
        require(
            not (self.attention == FUSED and self.dtype == "fp32"),
            "model.attention",
            "fused computes in bf16 only; with model.dtype=fp32 choose auto, sdpa or causal_blocks.",
        )
        choice(self.attention_probs, "model.attention_probs", get_args(AttentionProbs))
        # A hub id stays as it is; a local directory (what model.check_model_path treats as one) goes absolute.
        if not self.is_tiny and Path(self.name_or_path).expanduser().exists():
            self.name_or_path = absolute(self.name_or_path)
        if self.tokenizer == "auto":  # resolved here, so checkpoints record what the run used
            self.tokenizer = "bundled" if self.is_tiny else ""
        require(
            not (self.is_tiny and self.tokenizer == ""),
            "model.tokenizer",
            "'' is the model's own tokenizer, and the tiny model has none: use auto or bundled, a tokenizer "
            "directory or a hub id.",
        )
        if self.tokenizer not in ("bundled", "") and Path(self.tokenizer).expanduser().exists():
            self.tokenizer = absolute(self.tokenizer)
        if self.compile_cache_dir:
            require_filesystem(self.compile_cache_dir, "model.compile_cache_dir")
            self.compile_cache_dir = absolute(self.compile_cache_dir)

    @property
    def is_tiny(self) -> bool:
        return self.name_or_path == "tiny"


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
        require(self.rank >= 0, "lora.rank", f"got {self.rank}; use 0 (full fine-tuning) or a positive rank.")
        require(self.alpha > 0, "lora.alpha", f"got {self.alpha}; must be > 0.")
        require(0.0 <= self.dropout < 1.0, "lora.dropout", "must be in [0, 1).")
        require(
            bool(self.target_modules) and all(bool(m) for m in self.target_modules),
            "lora.target_modules",
            "must name at least one module, e.g. [q_proj, v_proj].",
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0
