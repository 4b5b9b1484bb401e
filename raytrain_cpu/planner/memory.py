"""The planner's memory model: the bytes per rank of each component, and at each stage of a run.

Memory follows what DeepSpeed 0.19 allocates on a CPU node: per parameter 2 bytes of bf16
weights, 4 of fp32 master copy, 8 of AdamW moments and 2 of bf16 gradient partition, divided
over the ranks as the ZeRO stage says; loading holds the partitioned weights plus the one
tensor zero.Init builds whole (the sharded loader maps nothing); then what a step adds on top:
activations (with or without activation checkpointing), logits, ZeRO-3's gathered parameters
and gradient bucket, and in the optimizer step the fp32 gradient (4 bytes) and, with the
per-tensor AdamW only, its temporaries. The per-process baseline, the fixed overheads and the
allocator's share were measured on real ZeRO-3 runs up to a 0.5B model
(``benchmarks/calibrate_planner.py``, ``CALIBRATION_FILE``); ``tests/unit/test_plan.py`` keeps each
phase (load, initialize, training peak) within 10% of the measured RSS per rank.

LoRA (``--lora-rank``): the base stays partitioned in bf16 and frozen, only the fp32 adapters
have a master copy, gradients and AdamW state, the gradient reduce-scatter carries only them,
while the base is still gathered in forward and backward; activations change as
``_lora_act_delta`` says (measured with autograd's saved-tensor hooks).

Bytes internally, GiB (2**30) in what it reports.
"""

from __future__ import annotations

from typing import Any

from raytrain_cpu.config import model as config_module
from raytrain_cpu.model.shape import (
    LORA_TARGETS,
    ModelShape,
    causal_block_probs,
    shape_of_model_config,
)
from raytrain_cpu.planner.tables import (
    ATTENTION_PICK_FACTOR,
    BASELINE_BYTES,
    CHECKPOINT_SHARD_BYTES,
    DS_MAX_LIVE_PARAMETERS,
    DS_PARAM_PERSISTENCE_THRESHOLD,
    DS_PREFETCH_BUCKET_SIZE,
    DS_REDUCE_BUCKET_SIZE,
    DS_SUB_GROUP_SIZE,
    FRAGMENTATION,
    FUSED_LOSS_CHUNK_BYTES_PER_VOCAB,
    FUSED_NORM_SAVED_PER_HIDDEN,
    INIT_OVERHEAD_BYTES,
    KEEP_PROBS_SHARE,
    KEPT_PAGES,
    LOAD_OVERHEAD_BYTES,
    LOGITS_BYTES_PER_VOCAB,
    LORA_FRAGMENTATION,
    LOSS_CHUNK_BYTES,
    PROBS_BLOCK,
    SHM_SLOT_BYTES,
    STEP_OVERHEAD_BYTES,
)


def _act_bytes_per_token_layer(s: ModelShape) -> int:
    """Activation bytes saved for backward per token per decoder layer (bf16, SDPA attention).

    The two RMSNorms keep an fp32 copy of their input plus the bf16 output (6h each); q,
    rotate_half(q), rotated q, the attention output and o_proj's input (2h each); k and its
    rotary temporaries and v (2 kv_dim each); the SwiGLU MLP's gate, up, silu(gate) and their
    product (2i each). Checked against autograd's saved tensors (within 10%).
    """
    # The q-wide five at q_dim: the hidden size, but for a config with its own head_dim (Gemma).
    return 16 * s.hidden_size + 10 * s.q_dim + 8 * s.kv_dim + 8 * s.intermediate_size


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


def bytes_per_param(dtype: str) -> int:
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
    hpz_partition_size: int = 1,
) -> dict[str, float]:
    """Per-rank bytes of each component (not cumulative), named after where it comes from.

    `hpz_partition_size` > 1 (deepspeed.hpz_partition_size, ZeRO-3): each rank also holds its
    1/hpz of the gathered parameters as hpZ's secondary copy once the first forward has run
    (`hpz_secondary`), which its group's later gathers read instead of crossing nodes.

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
    b = bytes_per_param(dtype)
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
        # it gathered in forward live for the backward, up to stage3_max_live_parameters.
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
    hpz = hpz_partition_size if zero_stage == 3 and 1 < hpz_partition_size < W else 1
    gathered_numel = sum(n for n in numels if n >= param_persistence_threshold)
    parts["hpz_secondary"] = b * gathered_numel / hpz if hpz > 1 else 0.0
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
    shapes, bf16 and fp32; tests/unit/test_plan.py keeps the formula). The backward still runs
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
    frozen = -bytes_per_param(dtype) * (4 * h + shape.intermediate_size)
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
    after_optimizer += parts["fp32_grad_buffer"] + parts["reduce_buffer"] + parts.get("hpz_secondary", 0.0)
    backward = parts["activations"] + parts["logits"] + parts["gathered_params"] + parts["grad_bucket"]
    fragmentation = LORA_FRAGMENTATION if lora else FRAGMENTATION
    optimizer_step = parts["master_grad"] + parts["adam_temp"]
    peak = after_optimizer + STEP_OVERHEAD_BYTES + max(fragmentation * backward, optimizer_step)
    peak = max(peak * (KEPT_PAGES if kept_pages else 1.0), after_load)
    return {"after_load": after_load, "after_master": after_master, "after_optimizer": after_optimizer, "peak": peak}
