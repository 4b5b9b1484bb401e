"""Capacity planner: memory per rank, communication per step, and which c7i nodes to rent.

    python -m raytrain_cpu.plan --model meta-llama/Meta-Llama-3-8B --world-size 4 --seq-len 1024 -c
    python -m raytrain_cpu.plan --config configs/llama3-8b-c7i.yaml      # everything from a run config
    python -m raytrain_cpu.plan --model path/to/config.json --zero-stage 2 --json

Memory follows what DeepSpeed 0.19 allocates on a CPU node: per parameter 2 bytes of bf16
weights, 4 of fp32 master copy, 8 of AdamW moments and 2 of bf16 gradient partition, divided
over the ranks as the ZeRO stage says; loading holds the partitioned weights plus the one
tensor zero.Init builds whole (the sharded loader maps nothing); then what a step adds on top:
activations (with or without activation checkpointing), logits, ZeRO-3's gathered parameters
and gradient bucket, and in the optimizer step the fp32 gradient (4 bytes) and, with the
per-tensor AdamW only, its temporaries. The per-process baseline, the fixed overheads and the
allocator's share were measured on real ZeRO-3 runs up to a 0.5B model
(``benchmarks/calibrate_planner.py``, ``CALIBRATION_FILE``); ``tests/test_plan.py`` keeps each
phase (load, initialize, training peak) within 10% of the measured RSS per rank.

LoRA (``--lora-rank``): the base stays partitioned in bf16 and frozen, only the fp32 adapters
have a master copy, gradients and AdamW state, the gradient reduce-scatter carries only them,
while the base is still gathered in forward and backward; activations change as
``_lora_act_delta`` says (measured with autograd's saved-tensor hooks).

Bytes internally, GiB (2**30) in what it reports.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from raytrain_cpu.config import model as config_module
from raytrain_cpu.model.shape import (
    LORA_TARGETS,
    ModelShape,
    causal_block_probs,
    shape_from_file,
    shape_of_model_config,
)

GIB = 2**30

# ----------------------------------------------------------------------------- known shapes

# A model's shape is read by raytrain_cpu.model.shape; these are the ones planning knows by name.


def _shape(name: str, v: int, h: int, i: int, layers: int, heads: int, kv: int, tied: bool = False) -> ModelShape:
    return ModelShape(name, v, h, i, layers, heads, kv, tied)


_LLAMA3_8B = dict(v=128256, h=4096, i=14336, layers=32, heads=32, kv=8)
_LLAMA3_70B = dict(v=128256, h=8192, i=28672, layers=80, heads=64, kv=8)
_LLAMA2_7B = dict(v=32000, h=4096, i=11008, layers=32, heads=32, kv=32)
_TINYLLAMA = dict(v=32000, h=2048, i=5632, layers=22, heads=32, kv=4)

# Hub ids whose config.json we know, so planning needs no download (ids are matched
# case-insensitively). 'tiny' is the project's default model with the bundled 2048-token
# tokenizer (raytrain_cpu.config.model.TinyModelConfig defaults).
KNOWN_SHAPES: dict[str, ModelShape] = {
    s.name.lower(): s
    for s in [
        _shape("meta-llama/Meta-Llama-3-8B", **_LLAMA3_8B),
        _shape("meta-llama/Meta-Llama-3-8B-Instruct", **_LLAMA3_8B),
        _shape("meta-llama/Llama-3.1-8B", **_LLAMA3_8B),
        _shape("meta-llama/Llama-3.1-8B-Instruct", **_LLAMA3_8B),
        _shape("meta-llama/Meta-Llama-3-70B", **_LLAMA3_70B),
        _shape("meta-llama/Llama-3.1-70B", **_LLAMA3_70B),
        _shape("meta-llama/Llama-2-7b-hf", **_LLAMA2_7B),
        _shape("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", **_TINYLLAMA),
        _shape("TinyLlama/TinyLlama_v1.1", **_TINYLLAMA),
        _shape("TinyLlama/TinyLlama-1.1B-Chat-v1.0", **_TINYLLAMA),
        _shape("tiny", v=2048, h=64, i=176, layers=2, heads=4, kv=2),
    ]
}

# The models benchmarks/calibrate_planner.py measures (and tests/test_plan.py predicts): the
# project's tiny default, a ~37M-parameter Llama with the same 2048-token vocabulary, and
# the largest this 2-core, 24 GiB machine trains at world size 2: a 0.5B Llama with
# Llama-2's 32000-token vocabulary, where the model's state, not the process, dominates.
CALIBRATION_SHAPES: dict[str, ModelShape] = {
    "tiny": KNOWN_SHAPES["tiny"],
    "llama-37m": _shape("llama-37m", v=2048, h=640, i=1728, layers=8, heads=10, kv=2),
    "llama-0.5b": _shape("llama-0.5b", v=32000, h=1536, i=4096, layers=16, heads=12, kv=4),
}
CALIBRATION_SEQ_LEN = 256  # configs/local.yaml
# The measurements the constants below are fitted to (written by the script; one folder per machine).
CALIBRATION_FILE = "benchmarks/results/amd-epyc-avx512_bf16/planner_calibration.json"
# (model, micro batch, activation checkpointing), 2 ranks, ZeRO-3, bf16. The first two fit the
# fixed overheads and FRAGMENTATION below; the others are held out to check the fit.
CALIBRATION_CASES: list[tuple[str, int, bool]] = [
    ("tiny", 8, False),
    ("llama-37m", 8, False),
    ("llama-37m", 8, True),
    ("llama-37m", 2, False),
    ("llama-0.5b", 2, False),
    ("llama-0.5b", 8, False),  # 2,048 tokens x 32,000 entries: the output layer and loss count
]


def resolve_shape(model: str) -> ModelShape:
    """'tiny', a known hub id, a config.json file, or a directory holding one."""
    known = KNOWN_SHAPES.get(model.lower())
    if known:
        return known
    p = Path(model).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return shape_from_file(p, model)
    if _looks_like_a_path(model):
        where = f"{p.parent} has no config.json" if p.parent.is_dir() else f"{p} does not exist"
        raise ValueError(f"model {model!r}: {where}; give a Hugging Face config.json (or its directory)")
    raise ValueError(
        f"unknown model {model!r}: give a local config.json (or a directory with one), or one of "
        f"{', '.join(s.name for s in KNOWN_SHAPES.values())}."
    )


def _looks_like_a_path(model: str) -> bool:
    """A file name rather than a hub id ('org/name' is both, and stays 'unknown model')."""
    return model.startswith(("/", ".", "~")) or model.endswith(".json")


# ----------------------------------------------------------------------------- calibrated constants

# Resident memory of one Ray Train worker before the model exists: Python, torch, transformers,
# DeepSpeed and Ray's core worker imported, the gloo process group up (measured: 0.48 GiB).
BASELINE_BYTES = int(0.48 * GIB)
# Fixed costs that do not grow with the model: the module objects and zero.Init hooks (load),
# the DeepSpeed engine (initialize), autograd / oneDNN state of a step. The load's includes what
# the attention pick leaves resident (its custom operators' code, heap it does not give back):
# +0.02 GiB when the calibration moved from the bare loader to the workers' own load_model.
LOAD_OVERHEAD_BYTES = int(0.055 * GIB)
# model.attention=auto's start-up timing of both attentions, forward and backward at the run's
# shape: its high-water mark over the resident model, in units of the queries' bytes (the causal
# blocks' regrouped copies, per-block probabilities and fp32 dK/dV; SDPA takes about half).
ATTENTION_PICK_FACTOR = 14
INIT_OVERHEAD_BYTES = int(0.04 * GIB)
STEP_OVERHEAD_BYTES = int(0.04 * GIB)
# A step's transients cost this many times their live size. With glibc's own dynamic mmap
# threshold they fragment its heap (well above 1, and more for LoRA's mid-size fp32
# temporaries). The planner plans for jemalloc (the cluster images preload it) or glibc with the
# fixed 1 MiB threshold (scaling.glibc_mmap_threshold; the workers' 32 MiB default keeps more
# on the heap), which reach the same peak: the cases of CALIBRATION_FILE fit 1.0 with
# STEP_OVERHEAD_BYTES, but for activations made of tensors under the threshold, which stay on
# the heap.
FRAGMENTATION = 1.0
# The workers' jemalloc keeps the pages a step frees for the next step (host.memory.JEMALLOC_CONF:
# no faults on the tensors made again) instead of handing each large block back as the
# calibration's glibc does; a tensor made again in pages kept from a larger one leaves their
# tail resident. Its training peak settles this much above the calibration's (fitted with
# `python benchmarks/calibrate_planner.py --no-write --case ...` under the workers' default
# allocator: benchmarks/results/*/planner_jemalloc_kept.json). Only the training peak, which
# decides the fit, counts it.
KEPT_PAGES = 1.09
# LoRA's mid-size fp32 temporaries (each adapter's input cast to fp32, B's output, its scaled
# copy, their sum with the base output) still leave some holes: fitted on a llama-37m run at
# micro batch 8 (full fine-tuning's peak there matched the prediction).
LORA_FRAGMENTATION = 1.16
# A worker hands malloc's kept pages back only once its resident size has grown
# scaling.free_memory_growth_mib past its size after the first steps (train.FreePages: in some
# runs jemalloc's kept pages crept 5-20 MiB a step at a constant live size). Until then a rank
# may hold up to that much above the training peak, so a fit leaves it free on every rank.
FREE_MEMORY_GROWTH_MIB = 512  # config.ScalingConfig.free_memory_growth_mib's default


def _act_bytes_per_token_layer(s: ModelShape) -> int:
    """Activation bytes saved for backward per token per decoder layer (bf16, SDPA attention).

    The two RMSNorms keep an fp32 copy of their input plus the bf16 output (6h each); q,
    rotate_half(q), rotated q, the attention output and o_proj's input (2h each); k and its
    rotary temporaries and v (2 kv_dim each); the SwiGLU MLP's gate, up, silu(gate) and their
    product (2i each). Checked against autograd's saved tensors (within 10%).
    """
    # The q-wide five at q_dim: the hidden size, but for a config with its own head_dim (Gemma).
    return 16 * s.hidden_size + 10 * s.q_dim + 8 * s.kv_dim + 8 * s.intermediate_size


# model.attention_probs=auto: the causal blocks keep their probabilities for the backward (no
# recomputed scores and softmax: one batched GEMM of seven and half the softmax work, faster in
# benchmarks/attention.py) when that adds at most this share to the activations the run keeps.
# They grow with the sequence (heads x ~seq/2 elements a token a layer): kept at moderate
# sequence lengths, not at long ones unless activation checkpointing keeps one layer's
# activations at a time.
KEEP_PROBS_SHARE = 0.25
# Queries a causal block where the planner cannot know model.attention=auto's timed pick: the
# larger of raytrain_cpu.model.ops.attention.BLOCKS (more probabilities).
PROBS_BLOCK = 128
CAUSAL_BLOCKS_DEFAULT = config_module.CAUSAL_BLOCKS_DEFAULT


def attention_block(attention: str) -> int | None:
    """Queries a block the planner counts for a model.attention setting; None for SDPA."""
    return PROBS_BLOCK if attention == "auto" else config_module.causal_blocks_size(attention)


def probs_bytes_per_token_layer(shape: ModelShape, seq_len: int, block: int, dtype_bytes: int = 2) -> float:
    return dtype_bytes * shape.num_heads * causal_block_probs(seq_len, block) / seq_len


def keeps_attention_probs(
    shape: ModelShape, seq_len: int, activation_checkpointing: bool, setting: str = "auto", block: int = PROBS_BLOCK
) -> bool:
    """model.attention_probs for the causal blocks at this shape: 'keep', 'recompute', or 'auto':
    keep while they add at most KEEP_PROBS_SHARE to the activations the run keeps."""
    if setting != "auto":
        return setting == "keep"
    layer = _act_bytes_per_token_layer(shape)
    probs = probs_bytes_per_token_layer(shape, seq_len, block)
    if activation_checkpointing:  # one layer's probabilities at a time, beside every layer's input
        return probs <= KEEP_PROBS_SHARE * (2 * shape.hidden_size * shape.num_layers + layer)
    return probs <= KEEP_PROBS_SHARE * layer


def probs_keeper(model_config: Any, seq_len: int, activation_checkpointing: bool, setting: str):
    """keeps_attention_probs for a loaded model, as a function of the block size: what
    attention.choose asks (the trainers' workers and the bench's plain-PyTorch reference)."""

    def keep(block: int) -> bool:  # asked only for the causal blocks: a config without their shape never is
        return keeps_attention_probs(
            shape_of_model_config(model_config), seq_len, activation_checkpointing, setting, block
        )

    return keep


# model.fused_norm: activation bytes per token per layer per hidden unit that the fused
# RMSNorms do not keep (two norms: 12h under Hugging Face's, 4h fused, in bf16 and in fp32);
# autograd's saved tensors of a 50M bench layer measured 10h less, the layer input included
# (which the next layer's fused norm keeps: 2h of those 10 come back).
FUSED_NORM_SAVED_PER_HIDDEN = 8


# Logits per token: the bf16 logits, their fp32 copy in the loss, log-softmax's fp32 output
# and its fp32 gradient live together at the start of backward (Hugging Face's loss,
# model.fused_loss=false).
LOGITS_BYTES_PER_VOCAB = 2 + 4 + 4 + 4
# The fused loss (raytrain_cpu.model.ops.loss) runs one chunk of tokens at a time through the same
# kernels: at most three fp32 tensors of the chunk's logits' size live at once. It keeps the
# logits' gradient of every token in the training dtype for the output layer's weight gradient,
# which it makes at the end of the forward. The chunk size mirrors loss.CHUNK_BYTES
# (tests/test_plan.py checks).
FUSED_LOSS_CHUNK_BYTES_PER_VOCAB = 3 * 4
LOSS_CHUNK_BYTES = 256 << 20
# Without ZeRO-3 every rank loads the whole model with from_pretrained, which maps the
# checkpoint; the pages of the shard being read count as resident (Hugging Face checkpoints
# are sharded at about 5 GB). ZeRO-3's sharded load maps nothing (model.load_sharded).
CHECKPOINT_SHARD_BYTES = 5 * 10**9

# ZeRO settings as raytrain_cpu.trainer.engine.deepspeed_config writes them (tests/test_plan.py checks);
# the persistence threshold is deepspeed.param_persistence_threshold's default.
DS_REDUCE_BUCKET_SIZE = 50_000_000
DS_PREFETCH_BUCKET_SIZE = 50_000_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000  # deepspeed.max_live_parameters' default
LIVE_CHOICES = {"1e9": DS_MAX_LIVE_PARAMETERS, "1e8": 100_000_000}  # the peaks the report compares
# What 1e8 costs: the backward re-gathers what forward released (measured at 0.5B).
LOW_LIVE_STEP_COST = "+16% step time measured at 0.5B"
DS_PARAM_PERSISTENCE_THRESHOLD = 10_000
DS_SUB_GROUP_SIZE = 100_000_000  # deepspeed.sub_group_size's default
# raytrain_cpu.trainer.collectives' slot size: ranks on one machine map 2 x world slots, and each rank
# touches them all (tests/test_plan.py checks it is the same number).
SHM_SLOT_BYTES = 16 << 20

# ----------------------------------------------------------------------------- instances

# (vCPUs, GiB, network Gbit/s) for the c7i family; m7i has 4 GiB per vCPU and r7i 8, at the
# same sizes and network bandwidth.
C7I_SIZES: dict[str, tuple[int, int, float]] = {
    "c7i.8xlarge": (32, 64, 12.5),
    "c7i.12xlarge": (48, 96, 18.75),
    "c7i.16xlarge": (64, 128, 25.0),
    "c7i.24xlarge": (96, 192, 37.5),
    "c7i.48xlarge": (192, 384, 50.0),
}
GIB_PER_VCPU = {"c7i": 2, "m7i": 4, "r7i": 8}

# What a node keeps for itself: OS, page cache, raylet / GCS / dashboard agent, Ray Data's
# tokenize and prefetch actors. Ray's memory monitor kills workers above 95% of node memory,
# so training plans to stay under 90%.
NODE_RESERVE_BYTES = 4 * GIB
NODE_USABLE_FRACTION = 0.90


def instance_catalog(family: str = "c7i") -> dict[str, tuple[int, int, float]]:
    """{instance type: (vCPUs, GiB, Gbit/s)} for c7i, m7i or r7i."""
    per_vcpu = GIB_PER_VCPU[family]
    return {f"{family}.{k.split('.')[1]}": (cpu, cpu * per_vcpu, net) for k, (cpu, _, net) in C7I_SIZES.items()}


def usable_bytes(instance_gib: float) -> float:
    return instance_gib * GIB * NODE_USABLE_FRACTION - NODE_RESERVE_BYTES


# ----------------------------------------------------------------------------- the memory model


def _bytes_per_param(dtype: str) -> int:
    """Bytes of a weight (and of its gradient) in the training dtype."""
    return 2 if dtype == "bf16" else 4


def memory_breakdown(
    shape: ModelShape,
    world_size: int,
    zero_stage: int = 3,
    offload: str = "none",
    micro_batch: int = 1,
    seq_len: int = 1024,
    activation_checkpointing: bool = False,
    dtype: str = "bf16",
    reduce_bucket_size: int = DS_REDUCE_BUCKET_SIZE,
    prefetch_bucket_size: int = DS_PREFETCH_BUCKET_SIZE,
    max_live_parameters: int = DS_MAX_LIVE_PARAMETERS,
    param_persistence_threshold: int = DS_PARAM_PERSISTENCE_THRESHOLD,
    lora_rank: int = 0,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    lora_dropout: float = 0.0,
    fused_adamw: bool = True,
    shm_ranks: int = 0,
    sub_group_size: int = DS_SUB_GROUP_SIZE,
    reuse_fp32_grad_buffer: bool = True,
    reuse_reduce_buffer: bool = True,
    fused_loss: bool = True,
    fused_norm: bool = True,
    fused_mlp: bool = False,
    attention: str = "auto",
    attention_probs: str = "auto",
    reference_copy: bool = False,
) -> dict[str, float]:
    """Per-rank bytes of each component (not cumulative), named after where it comes from.

    `reference_copy`: full fine-tuning DPO keeps a frozen copy of the starting model as its
    reference, its weights held (and partitioned) as the trained ones are (`reference`).

    `shm_ranks`: ranks sharing one machine's shared-memory collectives (all of them when the
    run fits one node, deepspeed.shm_collectives), 0 when they talk through gloo.

    `fused_adamw` (train.fused_adamw): PyTorch's fused AdamW updates each partition in one
    pass with no temporaries; the per-tensor loop makes two partition-sized ones.

    ZeRO-3 updates the partition a sub group (`sub_group_size` elements, closed at the
    parameter that reaches it) at a time, so the fp32 gradient (and the per-tensor AdamW's
    temporaries) exist for one sub group at once: made and freed inside each step
    (master_grad), or with `reuse_fp32_grad_buffer` one buffer the size of the largest,
    resident from the first step on (fp32_grad_buffer). With `reuse_reduce_buffer` ZeRO-3
    flattens each gradient bucket for its reduce-scatter into one kept buffer of up to a
    bucket (reduce_buffer, resident); without it that flat copy is a new tensor per bucket.

    `fused_loss` (model.fused_loss): the output layer and the loss a chunk of tokens at a time,
    instead of Hugging Face's logits for every token (`logits` counts either).

    `fused_norm` (model.fused_norm): each RMSNorm keeps its bf16 input (2h bytes a token) for
    the backward instead of an fp32 copy and its bf16 output (6h): 8h less per token per layer.

    `fused_mlp` (model.fused_mlp): the SwiGLU activation recomputes silu(gate) in the backward
    instead of keeping it: one intermediate-size tensor in the training dtype less per token
    per layer.

    `attention`, `attention_probs` (model.attention, model.attention_probs): the causal blocks'
    probabilities, where kept (keeps_attention_probs), are activations of each layer too;
    'auto' attention counts them at PROBS_BLOCK queries a block, SDPA keeps none.

    With `lora_rank` the base model is frozen: its weights are held (and gathered) as in full
    fine-tuning, but it has no fp32 master copy, gradients or optimizer state; those exist
    only for the adapters (`_lora_state`). Activations change as `_lora_act_delta` says.
    """
    P, W = shape.num_params, world_size
    b = _bytes_per_param(dtype)
    numels = shape.param_numels()

    # ---- state that lives for the whole run
    if zero_stage == 3:
        # Tensors under the persistence threshold stay whole on every rank (norms, small layers).
        persistent = sum(n for n in numels if n < param_persistence_threshold)
        weights = b * ((P - persistent) / W + persistent)
        grads = b * P / W  # grad_partitions_flat_buffer, in the training dtype
    else:
        weights = b * P  # ZeRO-1/2 keep the whole model on every rank
        grads = b * P / W if zero_stage == 2 else b * P  # ZeRO-1 keeps whole gradients until the step
    master = 4 * P / W  # fp32 partition the optimizer updates (a copy even in fp32 training)
    master_grad = 4 * P / W  # its fp32 gradient
    adam = 8 * P / W  # exp_avg + exp_avg_sq
    adam_temp = 8 * P / W  # the per-tensor AdamW: sqrt(v) and its quotient are new tensors
    if offload == "nvme":
        # Master weights, moments and fp32 gradients live on disk; ~2 sub-groups of 1e8
        # elements are swapped in at a time (set zero_optimization.sub_group_size=1e8).
        swap = min(P / W, 2e8)
        master, master_grad, adam, adam_temp = 4 * swap, 4 * swap, 8 * swap, 8 * min(P / W, 1e8)
    # offload 'cpu' moves nothing on a CPU node: the states are in host memory either way.
    if fused_adamw:
        adam_temp = 0.0  # one pass per partition, no temporaries

    # ---- transients
    if zero_stage == 3:
        # zero.Init partitions each parameter as its module is built, so the largest tensor
        # exists whole for a moment; each rank then reads its 1/W of every tensor into a
        # buffer of that size (model.load_sharded).
        load_transient = b * max(numels)
    else:
        load_transient = min(b * P, CHECKPOINT_SHARD_BYTES)
    tokens = micro_batch * seq_len
    # model.attention=auto times both attentions once, right after the load, on tensors of the
    # run's shape (counted whichever model.attention says: the planner assumes the default).
    attention_pick = ATTENTION_PICK_FACTOR * b * tokens * shape.q_dim  # heads x head_dim
    block = attention_block(attention)
    kept = block is not None and keeps_attention_probs(shape, seq_len, activation_checkpointing, attention_probs, block)
    probs = probs_bytes_per_token_layer(shape, seq_len, block, b) if kept else 0.0
    attention_pick += probs * tokens  # the timed blocks keep them too
    per_token_layer = (
        _act_bytes_per_token_layer(shape) * b // 2
        - (FUSED_NORM_SAVED_PER_HIDDEN * shape.hidden_size if fused_norm else 0)
        - (b * shape.intermediate_size if fused_mlp else 0)
        + probs
    )
    if lora_rank:
        per_token_layer += _lora_act_delta(shape, lora_rank, tuple(lora_targets), dtype, lora_dropout)
    per_layer = per_token_layer * tokens
    if activation_checkpointing:
        # Each layer keeps only its input; backward recomputes one layer at a time.
        activations = b * shape.hidden_size * tokens * shape.num_layers + per_layer
    else:
        activations = per_layer * shape.num_layers
    if fused_loss:
        rows = min(tokens, max(1, LOSS_CHUNK_BYTES // (4 * shape.vocab_size)))
        chunk = FUSED_LOSS_CHUNK_BYTES_PER_VOCAB * shape.vocab_size * rows
        if lora_rank:  # a frozen output layer: no weight gradient, nothing kept for it
            logits = chunk
        else:
            logits = b * shape.vocab_size * tokens + max(chunk, b * shape.vocab_size * shape.hidden_size)
    else:
        logits = LOGITS_BYTES_PER_VOCAB * shape.vocab_size * tokens
    if zero_stage == 3:
        # Gathered whole parameters, and the bucket that collects whole gradients before the
        # reduce-scatter. Once the first step has recorded the module order, ZeRO-3 keeps what
        # it gathered in forward live for the backward, up to stage3_max_live_parameters
        # (measured on the 0.5B calibration model: +1.3 GiB per rank at 1e9 against 1e8).
        largest_unit = max(shape.layer_params, shape.vocab_size * shape.hidden_size)
        gathered = b * min(max(max_live_parameters, largest_unit + prefetch_bucket_size), P)
        bucket = b * min(reduce_bucket_size, P)
    else:
        gathered = 0.0
        bucket = b * min(reduce_bucket_size, P) if zero_stage == 2 else 0.0

    parts = {
        "baseline": BASELINE_BYTES,
        "reference": weights if reference_copy else 0.0,
        "collective_buffers": 2 * shm_ranks * SHM_SLOT_BYTES if shm_ranks > 1 else 0,
        "overheads": LOAD_OVERHEAD_BYTES + INIT_OVERHEAD_BYTES + STEP_OVERHEAD_BYTES,
        "weights": weights,
        "master": master,
        "master_grad": master_grad,
        "grads": grads,
        "adam": adam,
        "load_transient": load_transient,
        "attention_pick": attention_pick,
        "activations": activations,
        "logits": logits,
        "gathered_params": gathered,
        "grad_bucket": bucket,
        "adam_temp": adam_temp,
    }
    if lora_rank:
        adapters = shape.lora_params(lora_rank, tuple(lora_targets))
        parts |= _lora_state(adapters, W, parts, reduce_bucket_size, fused_adamw)
    parts["fp32_grad_buffer"] = 0.0
    if zero_stage == 3 and offload == "none":
        # The 1-D norms form a small parameter group of their own.
        largest = largest_sub_group(shape.param_numels(matrices_only=True), W, sub_group_size)
        parts["master_grad"] = min(parts["master_grad"], 4 * largest)
        parts["adam_temp"] = min(parts["adam_temp"], 8 * largest)  # the per-tensor loop steps a sub group
        if reuse_fp32_grad_buffer:
            parts["fp32_grad_buffer"], parts["master_grad"] = parts["master_grad"], 0.0
    parts["reduce_buffer"] = parts["grad_bucket"] if zero_stage == 3 and reuse_reduce_buffer else 0.0
    return parts


def largest_sub_group(numels: list[int], world_size: int, sub_group_size: int) -> int:
    """Elements of the largest of ZeRO-3's optimizer sub groups over parameters of `numels`
    (in model order): DeepSpeed closes a group at the parameter whose partition
    (ceil(numel / world_size)) takes it to sub_group_size (stage3._create_fp16_sub_groups)."""
    largest = current = 0
    for n in numels:
        current += -(-n // world_size)
        if current >= sub_group_size:
            largest, current = max(largest, current), 0
    return max(largest, current)


def _lora_state(
    adapter_params: int, world_size: int, full: dict[str, float], reduce_bucket_size: int, fused_adamw: bool
) -> dict[str, float]:
    """The trainable state of full fine-tuning swapped for the adapters'.

    peft keeps the adapters in fp32 beside a bf16 base (autocast_adapter_dtype) and
    `deepspeed.initialize` partitions them like every parameter (ZeRO-3 partitions all
    trainable tensors, so the adapters count divided by the world size, as their fp32 master
    copy, gradients and AdamW moments do). Only they reach the optimizer.
    """
    A, W = adapter_params, world_size
    return {
        "weights": full["weights"] + 4 * A / W,  # the frozen base as before + the fp32 adapters
        "master": 4 * A / W,
        "master_grad": 4 * A / W,
        "grads": 4 * A / W,  # fp32 like the adapters
        "adam": 8 * A / W,
        "adam_temp": 0.0 if fused_adamw else 8 * A / W,
        "grad_bucket": 4 * min(reduce_bucket_size, A) if full["grad_bucket"] else 0.0,
    }


# o_proj's input (the attention output) is kept by the attention's own backward; q/k/v and
# gate/up read one tensor each.
_LORA_SHARED_INPUT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}


def _lora_act_delta(shape: ModelShape, rank: int, targets: tuple[str, ...], dtype: str, dropout: float) -> int:
    """Activation bytes per token per decoder layer that LoRA adds to full fine-tuning's (may be < 0).

    Measured with autograd's saved-tensor hooks on transformers' Llama + peft (exact on 4
    shapes, bf16 and fp32; tests/test_plan.py keeps the formula). The backward still runs
    through every frozen layer (the adapters below need the input gradients), so most of
    full fine-tuning's activations stay, but:
    - the frozen base keeps (4h + i) elements fewer: the tensors only its weight gradients
      read (the norms' normalised inputs, Linear inputs no other op keeps);
    - each adapter's A keeps its input for dA, in fp32: beside a bf16 base peft casts the input
      to the adapters' fp32, a new tensor per targeted Linear (4 * in bytes each); in fp32
      training A shares the base's input tensor (q/k/v one, gate/up one, o_proj's is kept
      anyway, down_proj's its own);
    - with lora.dropout > 0 each adapter keeps its dropout mask and output, fp32 (8 * in);
    - each B keeps A's output (4 * rank).
    """
    h, shapes = shape.hidden_size, shape.projection_shapes()
    frozen = -_bytes_per_param(dtype) * (4 * h + shape.intermediate_size)
    if dropout > 0:
        inputs = 8 * sum(shapes[t][1] for t in targets)
    elif dtype == "bf16":
        inputs = 4 * sum(shapes[t][1] for t in targets)
    else:
        kept = {_LORA_SHARED_INPUT.get(t, t): shapes[t][1] for t in targets if t != "o_proj"}
        inputs = 4 * sum(kept.values())
    return frozen + inputs + 4 * rank * len(targets)


def memory_stages(parts: dict[str, float], lora: bool = False, kept_pages: bool = True) -> dict[str, float]:
    """Cumulative per-rank bytes at each stage of start-up, and the training peak.

    after_load: the high-water mark of loading (weights partitioned under zero.Init, plus the
    largest tensor built whole or, without ZeRO-3, the checkpoint shard being mapped, or the
    attention pick's timing after it, whichever is larger).
    after_master: deepspeed.initialize (fp32 master partition and the gradient partition in
    the training dtype; the load's transients are gone). The fp32 gradient the optimizer reads
    (master_grad) is made inside each optimizer step and freed after it.
    after_optimizer: the first optimizer step (AdamW's moments exist from here on, and the
    shared-memory collectives' slots, the reused fp32 gradient buffer and the kept reduce
    buffer are touched).
    peak: the high-water mark from the second step on, the larger of the forward/backward's
    transients (activations, logits, ZeRO-3's gathered parameters and gradient bucket, times
    the allocator's FRAGMENTATION) and the optimizer step's (master_grad, and with the
    per-tensor AdamW its two temporaries). `lora`: the parts are a LoRA run's
    (LORA_FRAGMENTATION). `kept_pages`: the workers' jemalloc, which keeps freed pages
    (KEPT_PAGES); False plans for glibc with scaling.glibc_mmap_threshold=1048576.
    """
    base = parts["baseline"] + LOAD_OVERHEAD_BYTES + parts["weights"] + parts.get("reference", 0.0)
    after_load = base + max(parts["load_transient"], parts["attention_pick"])
    after_master = base + INIT_OVERHEAD_BYTES + parts["master"] + parts["grads"]
    # The shared-memory slots count once the first step's collectives have touched them.
    after_optimizer = after_master + parts["adam"] + parts["collective_buffers"]
    after_optimizer += parts["fp32_grad_buffer"] + parts["reduce_buffer"]
    backward = parts["activations"] + parts["logits"] + parts["gathered_params"] + parts["grad_bucket"]
    fragmentation = LORA_FRAGMENTATION if lora else FRAGMENTATION
    optimizer_step = parts["master_grad"] + parts["adam_temp"]
    peak = after_optimizer + STEP_OVERHEAD_BYTES + max(fragmentation * backward, optimizer_step)
    peak = max(peak * (KEPT_PAGES if kept_pages else 1.0), after_load)
    return {"after_load": after_load, "after_master": after_master, "after_optimizer": after_optimizer, "peak": peak}


# ----------------------------------------------------------------------------- communication and compute


def comm_bytes_per_step(
    shape: ModelShape,
    world_size: int,
    zero_stage: int,
    grad_accum_steps: int = 1,
    dtype: str = "bf16",
    param_persistence_threshold: int = DS_PARAM_PERSISTENCE_THRESHOLD,
    lora_rank: int = 0,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    reference_forward: bool = False,
) -> float:
    """Bytes each rank sends (and receives) per optimizer step, ring algorithms.

    With LoRA the frozen base is gathered exactly as in full fine-tuning, but only the fp32
    adapters' gradients are reduced (and, at ZeRO-1/2, only they are re-gathered after the step).
    DPO's `reference_forward` (every micro batch: the base with the adapters off, or full
    fine-tuning's frozen copy of the starting model) gathers the model once more at ZeRO-3.

    ZeRO-3 all-gathers the (non-persistent) parameters in forward and again in backward and
    reduce-scatters the gradients, every micro batch: ~3x the model bytes. ZeRO-2 reduce-
    scatters gradients every micro batch and all-gathers the updated parameters once; ZeRO-1
    does both once per step: ~2x (an all-reduce).
    """
    W = world_size
    if W <= 1:
        return 0.0
    w_bytes = g_bytes = _bytes_per_param(dtype)
    P = shape.num_params
    if lora_rank:  # gradients (and updated weights) only of the adapters, in fp32
        P, g_bytes = shape.lora_params(lora_rank, tuple(lora_targets)), 4
    ring = (W - 1) / W
    if zero_stage == 3:
        gathered = sum(n for n in shape.param_numels() if n >= param_persistence_threshold)
        gathers = 3 if reference_forward else 2
        per_micro = gathers * w_bytes * gathered * ring + g_bytes * P * ring
        return per_micro * grad_accum_steps
    if zero_stage == 2:
        return (g_bytes * P * grad_accum_steps + g_bytes * P) * ring
    return (g_bytes * P + g_bytes * P) * ring


def train_flops_per_step(
    shape: ModelShape, tokens: int, activation_checkpointing: bool, lora: bool = False, reference_forward: bool = False
) -> float:
    """Model FLOPs of forward + backward (6 per parameter per token, 8 when recomputing; LoRA
    computes no weight gradients for the frozen base: 4, or 6 when recomputing; DPO's reference
    forward adds 2)."""
    per_param = (4 if lora else 6) + (2 if activation_checkpointing else 0) + (2 if reference_forward else 0)
    return per_param * shape.num_params * tokens


# ----------------------------------------------------------------------------- recommendation


def _stages(shape: ModelShape, world_size: int, mem_kwargs: dict[str, Any]) -> tuple[dict, dict]:
    """(memory_breakdown's parts, memory_stages) for plan()'s memory arguments."""
    kwargs = dict(mem_kwargs)
    kept_pages = kwargs.pop("kept_pages", True)
    kwargs.pop("free_memory_growth_mib", None)  # a margin of the fit (_margin), not of the stages
    parts = memory_breakdown(shape, world_size, **kwargs)
    return parts, memory_stages(parts, lora=bool(kwargs.get("lora_rank")), kept_pages=kept_pages)


def _peak(shape: ModelShape, world_size: int, mem_kwargs: dict[str, Any]) -> float:
    return _stages(shape, world_size, mem_kwargs)[1]["peak"]


def _margin(mem_kwargs: dict[str, Any]) -> float:
    """Bytes a rank may hold above its training peak before its kept pages go back (FREE_MEMORY_GROWTH_MIB)."""
    return mem_kwargs.get("free_memory_growth_mib", FREE_MEMORY_GROWTH_MIB) * 2**20


def _fits(peak_bytes: float, ranks_per_node: int, instance_gib: float, margin_bytes: float) -> bool:
    return (peak_bytes + margin_bytes) * ranks_per_node <= usable_bytes(instance_gib)


def recommend(
    shape: ModelShape,
    world_size: int,
    ranks_per_node: int = 1,
    max_workers: int = 512,
    **mem_kwargs: Any,
) -> dict[str, Any]:
    """The smallest node that holds `world_size` ranks, and the fewest workers per c7i size.

    Memory decides the smallest node that works; a bigger c7i only adds cores (and network),
    which is what makes a step faster. c7i first (2 GiB/vCPU), then m7i (4) and r7i (8).
    """
    peak = _peak(shape, world_size, mem_kwargs)
    nodes = math.ceil(world_size / ranks_per_node)
    candidates = [(name, gib) for fam in ("c7i", "m7i", "r7i") for name, (_, gib, _) in instance_catalog(fam).items()]
    margin = _margin(mem_kwargs)
    chosen = next((name for name, gib in candidates if _fits(peak, ranks_per_node, gib, margin)), None)

    # ZeRO-3 shards with the world size, so more, smaller nodes can replace fewer, bigger ones.
    one_per_node = mem_kwargs | {"shm_ranks": 0}  # one rank per node: gloo
    min_workers = {
        name: next((w for w in range(1, max_workers + 1) if _fits(_peak(shape, w, one_per_node), 1, gib, margin)), None)
        for name, (_, gib, _) in C7I_SIZES.items()
    }

    if chosen is None:
        need = min_workers["c7i.48xlarge"]
        note = (
            f"{world_size} ranks do not fit any c7i/m7i/r7i node; use at least {need} c7i.48xlarge workers."
            if need
            else "does not fit at any world size tried; use ZeRO-3, activation checkpointing or offload nvme."
        )
    elif chosen.startswith("c7i"):
        note = f"{nodes} x {chosen} ({ranks_per_node} rank(s) per node)."
        if chosen != "c7i.48xlarge":
            note += " Bigger c7i sizes add cores (speed), not needed memory."
    else:
        note = f"{nodes} x {chosen}: needs more memory per vCPU than c7i has (m7i: 4 GiB/vCPU, r7i: 8)."
    return {
        "instance": chosen,
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "min_workers_per_c7i_size": min_workers,
        "note": note,
    }


# What the advice quotes: `bench options` side by side, the ~50M bench model on 2 workers, ZeRO-2
# against ZeRO-3 (benchmarks/results/<machine>/options-zero*.md).
ZERO2_SPEEDUP_50M = "1.08-1.10x on an AVX-512 BF16 host, 0.90x in one noisy run on AMX"


def lower_stage_advice(
    zero_stage: int,
    offload: str,
    stages_compared: dict[str, dict[str, float]],
    node: str,
    ranks_per_node: int,
    node_gib: float,
    margin_bytes: float,
) -> str | None:
    """Where a ZeRO-3 run would fit `node` at ZeRO-2 too, the line that says so (else None).

    ZeRO-2 keeps the whole bf16 model on every rank, so forward and backward gather nothing:
    no per-layer hooks, and about 2/3 of ZeRO-3's traffic per step. Worth it only where
    memory allows, which is the planner's to say.
    """
    if zero_stage != 3 or offload != "none":
        return None
    z2, z3 = stages_compared["2"], stages_compared["3"]
    if not _fits(z2["peak_gib"] * GIB, ranks_per_node, node_gib, margin_bytes):
        return None
    return (
        f"ZeRO-2 also fits {node} ({z2['peak_gib']:.1f} GiB per rank against {z3['peak_gib']:.1f}) and moves "
        f"{z2['comm_gib_per_step']:.3g} GiB per rank per step against {z3['comm_gib_per_step']:.3g}, with no "
        f"parameter gathers: deepspeed.zero_stage=2 (the ~50M bench model on 2 workers, against ZeRO-3: "
        f"{ZERO2_SPEEDUP_50M})."
    )


# What the advice quotes: `bench options --variants "micro batch 4"`, the ~50M bench model on 2
# workers (benchmarks/results/<machine>/options-mb8*.md); the gain is larger where the GEMMs are a
# smaller share of the step.
LARGER_MICRO_BATCH_SPEEDUP = "1.20x and 1.27x at micro batch 8 against 4 on AMX, 1.00x and 1.03x on AMD Zen 5"


def micro_batch_advice(
    shape: ModelShape,
    world_size: int,
    micro_batch: int,
    grad_accum_steps: int,
    mem_kwargs: dict[str, Any],
    node: str,
    ranks_per_node: int,
    node_gib: float,
) -> str | None:
    """With gradient accumulation at ZeRO-3, the largest micro batch that keeps the global batch
    (fewer accumulation steps) and still fits `node`; None where none does or none is asked.

    ZeRO-3 gathers the whole model and runs its hooks once per micro batch, so k times the micro
    batch at 1/k the accumulation makes the same optimizer steps with 1/k of those per token."""
    if mem_kwargs.get("zero_stage") != 3 or grad_accum_steps == 1:
        return None
    for k in sorted((k for k in range(2, grad_accum_steps + 1) if grad_accum_steps % k == 0), reverse=True):
        peak = _peak(shape, world_size, mem_kwargs | {"micro_batch": micro_batch * k})
        if _fits(peak, ranks_per_node, node_gib, _margin(mem_kwargs)):
            return (
                f"micro batch {micro_batch * k} x grad accum {grad_accum_steps // k} keeps the global batch and fits "
                f"{node} ({peak / GIB:.1f} GiB per rank): 1/{k} of ZeRO-3's gathers and hooks per token "
                f"(train.micro_batch_size={micro_batch * k} train.grad_accum_steps={grad_accum_steps // k}; the "
                f"~50M bench model: {LARGER_MICRO_BATCH_SPEEDUP})."
            )
    return None


# ----------------------------------------------------------------------------- public entry point


def plan(
    model_shape: ModelShape | str,
    world_size: int,
    zero_stage: int = 3,
    offload: str = "none",
    micro_batch: int = 1,
    seq_len: int = 1024,
    activation_checkpointing: bool = False,
    dtype: str = "bf16",
    grad_accum_steps: int = 1,
    ranks_per_node: int = 1,
    instance: str | None = None,
    lora_rank: int = 0,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    lora_dropout: float = 0.0,
    fused_adamw: bool = True,
    max_live_parameters: int = DS_MAX_LIVE_PARAMETERS,
    sub_group_size: int = DS_SUB_GROUP_SIZE,
    reuse_fp32_grad_buffer: bool = True,
    reuse_reduce_buffer: bool = True,
    fused_loss: bool = True,
    fused_norm: bool = True,
    fused_mlp: bool = False,
    attention: str = "auto",
    attention_probs: str = "auto",
    kept_pages: bool = True,
    free_memory_growth_mib: int = FREE_MEMORY_GROWTH_MIB,
    dpo_reference: str = "",
) -> dict[str, Any]:
    """The whole estimate as a JSON-able dict (what `--json` prints).

    `lora_rank` > 0 plans LoRA fine-tuning: a frozen, partitioned base and trainable adapters
    on `lora_targets` (`lora_dropout` > 0 keeps more activations). `dpo_reference` says how a
    DPO run (data.format=preference) keeps its reference: "each-step" plans one more forward a
    micro batch, the reference's, under no_grad (its activations are not kept, so the peak is
    the training's), which gathers the model once more; without LoRA that reference is a frozen
    copy of the starting model, whose weights are held beside the trained ones. "precomputed"
    (train.dpo_precompute_reference) and "none" (SimPO) plan as SFT, and the table says which;
    "" is a run without DPO.

    `instance` (e.g. 'c7i.48xlarge') checks the fit on that node and times the communication
    at its network rate; without it, the recommended node is used. Every fit leaves
    `free_memory_growth_mib` (scaling.free_memory_growth_mib) free per rank above the peak.
    """
    shape = resolve_shape(model_shape) if isinstance(model_shape, str) else model_shape
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
    if offload not in ("none", "cpu", "nvme"):
        raise ValueError(f"offload must be none, cpu or nvme, got {offload!r}")
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype must be bf16 or fp32, got {dtype!r}")
    counts = dict(
        world_size=world_size,
        micro_batch=micro_batch,
        seq_len=seq_len,
        grad_accum_steps=grad_accum_steps,
        ranks_per_node=ranks_per_node,
        max_live_parameters=max_live_parameters,
    )
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if lora_rank < 0:
        raise ValueError(f"lora_rank must be >= 0, got {lora_rank}")
    if free_memory_growth_mib < 0:
        raise ValueError(f"free_memory_growth_mib must be >= 0, got {free_memory_growth_mib}")
    if not 0.0 <= lora_dropout < 1.0:
        raise ValueError(f"lora_dropout must be in [0, 1), got {lora_dropout}")
    if dpo_reference not in DPO_REFERENCES:
        raise ValueError(f"dpo_reference must be one of {DPO_REFERENCES}, got {dpo_reference!r}")
    reference_forward = dpo_reference == "each-step"
    lora_targets = tuple(lora_targets)
    trainable = shape.lora_params(lora_rank, lora_targets) if lora_rank else shape.num_params

    mem_kwargs = dict(
        zero_stage=zero_stage,
        offload=offload,
        micro_batch=micro_batch,
        seq_len=seq_len,
        activation_checkpointing=activation_checkpointing,
        dtype=dtype,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        lora_dropout=lora_dropout,
        fused_adamw=fused_adamw,
        max_live_parameters=max_live_parameters,
        sub_group_size=sub_group_size,
        reuse_fp32_grad_buffer=reuse_fp32_grad_buffer,
        reuse_reduce_buffer=reuse_reduce_buffer,
        fused_loss=fused_loss,
        fused_norm=fused_norm,
        fused_mlp=fused_mlp,
        attention=attention,
        attention_probs=attention_probs,
        shm_ranks=world_size if world_size <= ranks_per_node else 0,  # all ranks on one node
        kept_pages=kept_pages,
        free_memory_growth_mib=free_memory_growth_mib,
        reference_copy=reference_forward and not lora_rank,  # full fine-tuning DPO's frozen reference
    )
    # What the traffic depends on beyond the stage: LoRA's trainable part, DPO's reference gathers.
    comm_kw = dict(lora_rank=lora_rank, lora_targets=lora_targets, reference_forward=reference_forward)
    margin = _margin(mem_kwargs)
    parts, stages = _stages(shape, world_size, mem_kwargs)
    comm = comm_bytes_per_step(shape, world_size, zero_stage, grad_accum_steps, dtype, **comm_kw)
    rec = recommend(shape, world_size, ranks_per_node=ranks_per_node, **mem_kwargs)
    node = instance or rec["instance"] or "c7i.48xlarge"
    family, _, size = node.partition(".")
    if family not in GIB_PER_VCPU or f"c7i.{size}" not in C7I_SIZES:
        raise ValueError(f"instance {node!r}: use a c7i, m7i or r7i size from 8xlarge to 48xlarge")
    net_gbps = C7I_SIZES[f"c7i.{size}"][2]  # m7i and r7i have c7i's network at each size
    node_gib = instance_catalog(family)[node][1]
    if instance:
        rec["fits_instance"] = _fits(stages["peak"], ranks_per_node, node_gib, margin)
    tokens = micro_batch * seq_len * grad_accum_steps
    # The same run at each ZeRO stage: ZeRO-3 gathers the model every micro batch, so when
    # memory allows, a lower stage often moves far fewer bytes per step.
    stages_compared = {
        str(z): {
            "peak_gib": _peak(shape, world_size, mem_kwargs | {"zero_stage": z}) / GIB,
            "comm_gib_per_step": comm_bytes_per_step(shape, world_size, z, grad_accum_steps, dtype, **comm_kw) / GIB,
        }
        for z in (1, 2, 3)
    }
    stage_advice = lower_stage_advice(zero_stage, offload, stages_compared, node, ranks_per_node, node_gib, margin)
    batch_advice = micro_batch_advice(
        shape, world_size, micro_batch, grad_accum_steps, mem_kwargs, node, ranks_per_node, node_gib
    )
    # ZeRO-3 keeps forward's gathers live for the backward up to max_live_parameters: DeepSpeed's
    # 1e9 against 1e8, which re-gathers in the backward instead (LOW_LIVE_STEP_COST).
    live_compared = (
        {k: _peak(shape, world_size, mem_kwargs | {"max_live_parameters": n}) / GIB for k, n in LIVE_CHOICES.items()}
        if zero_stage == 3
        else {}
    )
    return {
        "model": asdict(shape) | {"num_params": shape.num_params, "trainable_params": trainable},
        "inputs": dict(world_size=world_size, grad_accum_steps=grad_accum_steps, ranks_per_node=ranks_per_node)
        | mem_kwargs
        | {"lora_targets": list(lora_targets), "reference_forward": reference_forward, "dpo_reference": dpo_reference},
        "memory_gib": {k: v / GIB for k, v in stages.items()},
        # What every fit leaves free per rank above the peak (FREE_MEMORY_GROWTH_MIB).
        "release_margin_gib": margin / GIB,
        "components_gib": {k: v / GIB for k, v in parts.items()},
        "comm_gib_per_step": comm / GIB,
        "network_node": node,
        # A lower bound: the node's network at line rate, nothing overlapped.
        "comm_seconds_per_step_min": comm * 8 / (net_gbps * 1e9) if comm else 0.0,
        "train_tflop_per_rank_per_step": train_flops_per_step(
            shape, tokens, activation_checkpointing, lora_rank > 0, reference_forward
        )
        / 1e12,
        "zero_stages_compared": stages_compared,
        "zero_stage_advice": stage_advice,
        "micro_batch_advice": batch_advice,
        "zero3_max_live_parameters_compared": live_compared,
        "recommendation": rec,
    }


# ----------------------------------------------------------------------------- CLI


def inputs_from_run_config(path: str) -> dict[str, Any]:
    """Planner inputs from a raytrain run config (YAML): model, world size, stage, batch, seq_len."""
    from raytrain_cpu.config.schema import load_config

    return inputs_from_config(load_config(path))


def inputs_from_config(cfg: Any, model: str = "", world_size: int = 0) -> dict[str, Any]:
    """Planner inputs from a run's Config; `model` is where its model's config.json lies (default
    model.name_or_path), `world_size` the workers (default scaling.num_workers, an elastic run's
    scaling.min_workers, whose shards are the largest, or 2 for auto)."""
    m = cfg.model
    if m.is_tiny:
        t = m.tiny
        shape = ModelShape("tiny", 2048, t.hidden_size, t.intermediate_size, t.num_layers, t.num_heads, t.num_kv_heads)
        shape = ModelShape(**{**asdict(shape), "tie_word_embeddings": t.tie_word_embeddings})
    else:
        shape = resolve_shape(model or m.name_or_path)
    return dict(
        model_shape=shape,
        # 0 = auto: 2 on one machine
        world_size=world_size or (cfg.scaling.min_workers if cfg.elastic else cfg.scaling.num_workers) or 2,
        zero_stage=cfg.deepspeed.zero_stage,
        micro_batch=cfg.train.micro_batch_size,
        seq_len=cfg.data.seq_len,
        activation_checkpointing=m.activation_checkpointing,
        # "auto" resolves at start-up from a GEMM probe; the planner sizes c7i/m7i/r7i nodes,
        # whose AMX makes bf16 the faster choice, so plan for bf16.
        dtype="bf16" if m.dtype == "auto" else m.dtype,
        grad_accum_steps=cfg.train.grad_accum_steps,
        lora_rank=cfg.lora.rank,
        lora_targets=tuple(cfg.lora.target_modules),
        lora_dropout=cfg.lora.dropout,
        fused_adamw=cfg.train.fused_adamw,
        max_live_parameters=cfg.deepspeed.max_live_parameters,
        sub_group_size=cfg.deepspeed.sub_group_size,
        reuse_fp32_grad_buffer=cfg.deepspeed.reuse_fp32_grad_buffer,
        reuse_reduce_buffer=cfg.deepspeed.reuse_reduce_buffer,
        fused_loss=m.fused_loss,
        fused_norm=m.fused_norm,
        fused_mlp=m.fused_mlp,
        attention=m.attention,
        attention_probs=m.attention_probs,
        kept_pages=cfg.scaling.allocator != "system",
        free_memory_growth_mib=cfg.scaling.free_memory_growth_mib,
        # SimPO (train.dpo_loss=simpo) compares no reference, and a precomputed one runs no forward:
        # neither plans the forward nor a copy.
        dpo_reference=_dpo_reference(cfg),
    )


def _dpo_reference(cfg: Any) -> str:
    """How a DPO run keeps its reference ("" for every other run): plan()'s `dpo_reference`."""
    if cfg.data.format != "preference":
        return ""
    if cfg.train.reference_each_step:
        return "each-step"
    return "precomputed" if cfg.train.dpo_reference else "none"


# The table's note for a DPO run that runs no reference forward beside training (its figures
# are SFT's): train.dpo_precompute_reference, and SimPO, which compares no reference at all.
DPO_WITHOUT_FORWARD = {
    "precomputed": "; DPO: the reference's log-likelihoods computed once before step 1 (a forward over "
    "every block the run trains and evaluates on), no reference forward or copy beside training",
    "none": "; SimPO: no reference model",
}
DPO_REFERENCES = ("", "each-step", *DPO_WITHOUT_FORWARD)  # plan()'s dpo_reference


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(int(n))


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report."""
    m, i, mem = result["model"], result["inputs"], result["memory_gib"]
    rec = result["recommendation"]
    offload = "" if i["offload"] == "none" else f" + offload {i['offload']}"
    lines = [
        f"model       {m['name']}  ({_count(m['num_params'])} params, {m['num_layers']} layers, "
        f"hidden {m['hidden_size']}, vocab {m['vocab_size']})",
        f"setup       {i['world_size']} ranks, ZeRO-{i['zero_stage']}{offload}, {i['dtype']}, micro batch "
        f"{i['micro_batch']} x seq {i['seq_len']}, grad accum {i['grad_accum_steps']}, activation checkpointing "
        f"{'on' if i['activation_checkpointing'] else 'off'}, AdamW {'fused' if i['fused_adamw'] else 'per-tensor'}, "
        f"loss {'fused' if i['fused_loss'] else 'unfused'}, norms {'fused' if i['fused_norm'] else 'unfused'}, "
        f"MLP activations {'fused' if i['fused_mlp'] else 'unfused'}, "
        f"attention {i['attention']} (probabilities {i['attention_probs']})",
        f"trainable   {_count(m['trainable_params'])} params"
        + (
            f" (LoRA rank {i['lora_rank']} on {', '.join(i['lora_targets'])}"
            + (f", dropout {i['lora_dropout']:g}" if i["lora_dropout"] else "")
            + ": "
            f"{m['trainable_params'] / m['num_params']:.2%} of the model; the base is frozen)"
            if i["lora_rank"]
            else " (full fine-tuning)"
        )
        + (
            "; DPO: a reference forward each micro batch, "
            + ("the base with the adapters off" if i["lora_rank"] else "a frozen copy of the starting model")
            if i["reference_forward"]
            else DPO_WITHOUT_FORWARD.get(i.get("dpo_reference", ""), "")
        ),
        "",
        "memory per rank (GiB, resident)",
        f"  after sharded load        {mem['after_load']:10.2f}",
        f"  after fp32 master         {mem['after_master']:10.2f}",
        f"  after optimizer states    {mem['after_optimizer']:10.2f}",
        f"  peak during training      {mem['peak']:10.2f}",
        "  of which: " + ", ".join(f"{k} {v:.2f}" for k, v in result["components_gib"].items() if v >= 0.005),
        (
            f"  (for the workers' jemalloc, which keeps freed pages: x{KEPT_PAGES} at the peak; glibc with"
            " scaling.glibc_mmap_threshold=1048576 is --no-kept-pages, its 32 MiB default ~25% higher)"
            if i.get("kept_pages", True)
            else "  (for glibc with scaling.glibc_mmap_threshold=1048576; its 32 MiB default measured ~25% higher)"
        ),
        (
            f"  fits leave {result['release_margin_gib']:.2f} GiB per rank above the peak: malloc's kept pages go back"
            " to the OS only past that growth (scaling.free_memory_growth_mib)"
            if result["release_margin_gib"]
            else "  fits leave no margin above the peak: scaling.free_memory_growth_mib=0 never hands kept pages back,"
            " so a rank's memory is not bounded by this estimate"
        ),
        "",
        f"communication per rank per step   {result['comm_gib_per_step']:.3g} GiB "
        f"(>= {result['comm_seconds_per_step_min']:.2f} s at {result['network_node']}'s line rate)",
        f"compute per rank per step         {result['train_tflop_per_rank_per_step']:.3g} TFLOP",
        "",
        "same run per ZeRO stage (peak GiB / comm GiB per step): "
        + ", ".join(
            f"ZeRO-{z} {v['peak_gib']:.1f} / {v['comm_gib_per_step']:.1f}"
            for z, v in result["zero_stages_compared"].items()
        ),
    ]
    if result["zero3_max_live_parameters_compared"]:
        lines.append(
            "ZeRO-3 peak by deepspeed.max_live_parameters: "
            + ", ".join(f"{k} {v:.1f} GiB" for k, v in result["zero3_max_live_parameters_compared"].items())
            + f" (the lower re-gathers in the backward: {LOW_LIVE_STEP_COST})"
        )
    lines += [
        "",
        f"recommendation    {rec['note']}",
        *([f"  {result['zero_stage_advice']}"] if result["zero_stage_advice"] else []),
        *([f"  {result['micro_batch_advice']}"] if result["micro_batch_advice"] else []),
        "  fewest workers per c7i size: "
        + ", ".join(f"{k.split('.')[1]} {v if v else '-'}" for k, v in rec["min_workers_per_c7i_size"].items()),
    ]
    if "fits_instance" in rec:
        verdict = "fits" if rec["fits_instance"] else "does NOT fit"
        lines.append(f"  on {result['network_node']}: {verdict} ({i['ranks_per_node']} rank(s) per node)")
    if i["offload"] == "cpu":
        lines.append("  note: offload to 'cpu' saves nothing on a CPU node (the states are in RAM either way).")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m raytrain_cpu.plan",
        description="Estimate memory per rank, communication per step and the c7i nodes for a ZeRO run.",
        epilog="Model: 'tiny', a known hub id (" + ", ".join(s.name for s in KNOWN_SHAPES.values()) + ") "
        "or a local config.json. Flags override what --config says.",
    )
    p.add_argument("--config", help="a raytrain run config (YAML) to read model, workers and batch from")
    p.add_argument("--model", help="'tiny', a known hub id, or a config.json path (or its directory)")
    p.add_argument("--world-size", "-w", type=int, help="ranks (training workers); default 2 or from --config")
    p.add_argument("--zero-stage", "-z", type=int, choices=(1, 2, 3))
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), help="optimizer offload (default none)")
    p.add_argument("--micro-batch", "-b", type=int, help="blocks per rank per forward pass")
    p.add_argument("--seq-len", "-s", type=int, help="tokens per block")
    p.add_argument("--grad-accum", type=int, help="micro batches per optimizer step")
    p.add_argument(
        "--activation-checkpointing", "-c", action=argparse.BooleanOptionalAction, default=None, help="recompute"
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"))
    p.add_argument("--lora-rank", type=int, help="plan LoRA fine-tuning with adapters of this rank (0 = full)")
    p.add_argument(
        "--lora-targets",
        help="comma-separated projections that get adapters (default: all of q,k,v,o,gate,up,down _proj)",
    )
    p.add_argument("--lora-dropout", type=float, help="adapter dropout (> 0 keeps more activations; default 0)")
    p.add_argument(
        "--fused-adamw",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="PyTorch's fused AdamW (the default, train.fused_adamw); --no-fused-adamw adds its 8 B/param temporaries",
    )
    p.add_argument(
        "--fused-loss",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the output layer and loss a chunk of tokens at a time (the default, model.fused_loss); "
        "--no-fused-loss counts Hugging Face's logits for every token",
    )
    p.add_argument(
        "--fused-norm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="RMSNorms as one autograd operation (the default, model.fused_norm); "
        "--no-fused-norm counts Hugging Face's fp32 copies",
    )
    p.add_argument(
        "--fused-mlp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count model.fused_mlp=true (the SwiGLU activation as one autograd operation, which "
        "keeps no silu(gate)); the default counts Hugging Face's, as model.fused_mlp defaults to false",
    )
    p.add_argument(
        "--attention-probs",
        choices=("auto", "keep", "recompute"),
        help="model.attention_probs: whether the causal blocks keep their probabilities for the "
        f"backward (auto, the default: while they add at most {KEEP_PROBS_SHARE * 100:.0f}%% to the activations)",
    )
    p.add_argument(
        "--kept-pages",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"count the workers' jemalloc keeping freed pages for the next step (x{KEPT_PAGES} at the "
        "peak; the default); --no-kept-pages plans for glibc with scaling.glibc_mmap_threshold=1048576",
    )
    p.add_argument(
        "--free-memory-growth-mib",
        type=int,
        help="scaling.free_memory_growth_mib: the growth a rank may hold above its peak before malloc's kept "
        f"pages go back; every fit leaves it free per rank (default {FREE_MEMORY_GROWTH_MIB})",
    )
    p.add_argument(
        "--max-live-parameters",
        type=float,
        help="ZeRO-3 parameters kept gathered (deepspeed.max_live_parameters; default 1e9)",
    )
    p.add_argument(
        "--dpo",
        nargs="?",
        const="each-step",
        choices=("each-step", "precomputed"),
        help="plan DPO (data.format=preference). each-step (the default): a reference forward each micro "
        "batch, and without --lora-rank a frozen copy of the starting model too; precomputed "
        "(train.dpo_precompute_reference=true): the reference's log-likelihoods computed before training, "
        "so training plans as SFT",
    )
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--instance", help="check the fit on this node and time the traffic at its network rate")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return p


# Flags that count something (args attribute: the flag as the user typed it).
COUNT_FLAGS = {
    "world_size": "--world-size (-w)",
    "micro_batch": "--micro-batch (-b)",
    "seq_len": "--seq-len (-s)",
    "grad_accum": "--grad-accum",
    "ranks_per_node": "--ranks-per-node",
    "max_live_parameters": "--max-live-parameters",
}
LORA_ONLY_FLAGS = {"lora_targets": "--lora-targets", "lora_dropout": "--lora-dropout"}


def check_flags(args: argparse.Namespace, inputs: dict[str, Any]) -> None:
    """Every flag's range, and the flags that mean nothing without another, in one place, each
    error naming the flag and its value (plan() checks its own arguments by their names);
    `inputs` is the plan's inputs with --config's merged in, which may supply the LoRA rank."""
    for dest, flag in COUNT_FLAGS.items():
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value:g}")
    if args.lora_rank is not None and args.lora_rank < 0:
        raise ValueError(f"--lora-rank must be >= 0 (0 plans full fine-tuning), got {args.lora_rank}")
    if args.lora_dropout is not None and not 0.0 <= args.lora_dropout < 1.0:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if args.free_memory_growth_mib is not None and args.free_memory_growth_mib < 0:
        raise ValueError(f"--free-memory-growth-mib must be >= 0, got {args.free_memory_growth_mib}")
    for dest, flag in LORA_ONLY_FLAGS.items():
        if getattr(args, dest) is not None and not inputs["lora_rank"]:
            raise ValueError(
                f"{flag} sets LoRA's adapters and this plan has none (no --lora-rank): give --lora-rank "
                "(e.g. 16) too, or a --config with a lora: section"
            )
    if args.max_live_parameters is not None and inputs["zero_stage"] != 3:
        raise ValueError(
            f"--max-live-parameters is ZeRO-3's (deepspeed.max_live_parameters) and this plan is "
            f"ZeRO-{inputs['zero_stage']}: drop it, or plan ZeRO-3 (-z 3)"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    inputs: dict[str, Any] = dict(
        model_shape=None,
        world_size=2,
        zero_stage=3,
        offload="none",
        micro_batch=1,
        seq_len=1024,
        activation_checkpointing=False,
        dtype="bf16",
        grad_accum_steps=1,
        lora_rank=0,
        lora_targets=LORA_TARGETS,
        lora_dropout=0.0,
        fused_adamw=True,
        fused_loss=True,
        fused_norm=True,
        fused_mlp=False,
        attention="auto",
        attention_probs="auto",
        kept_pages=True,
        free_memory_growth_mib=FREE_MEMORY_GROWTH_MIB,
        max_live_parameters=DS_MAX_LIVE_PARAMETERS,
        dpo_reference="",
    )
    try:
        if args.config:
            inputs |= inputs_from_run_config(args.config)
        flags = dict(
            world_size=args.world_size,
            zero_stage=args.zero_stage,
            offload=args.offload,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            activation_checkpointing=args.activation_checkpointing,
            dtype=args.dtype,
            grad_accum_steps=args.grad_accum,
            lora_rank=args.lora_rank,
            lora_targets=tuple(t.strip() for t in args.lora_targets.split(",")) if args.lora_targets else None,
            lora_dropout=args.lora_dropout,
            fused_adamw=args.fused_adamw,
            fused_loss=args.fused_loss,
            fused_norm=args.fused_norm,
            fused_mlp=args.fused_mlp,
            attention_probs=args.attention_probs,
            kept_pages=args.kept_pages,
            free_memory_growth_mib=args.free_memory_growth_mib,
            max_live_parameters=None if args.max_live_parameters is None else int(args.max_live_parameters),
            dpo_reference=args.dpo,
        )
        inputs |= {k: v for k, v in flags.items() if v is not None}
        check_flags(args, inputs)
        if args.model:
            inputs["model_shape"] = resolve_shape(args.model)
        if inputs["model_shape"] is None:
            raise ValueError("give --model or --config")
        result = plan(**inputs, ranks_per_node=args.ranks_per_node, instance=args.instance)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
