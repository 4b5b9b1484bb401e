"""The planner's public entry point: plan() (the whole estimate as a JSON-able dict) and the
inputs it takes from a run's config."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from raytrain_cpu.model.shape import (
    LORA_TARGETS,
    ModelShape,
)
from raytrain_cpu.planner.ckpt import checkpoint_cost
from raytrain_cpu.planner.comm import comm_bytes_per_step, train_flops_per_step
from raytrain_cpu.planner.compare import compare_variants, step_on
from raytrain_cpu.planner.recommend import (
    fits_node,
    lower_stage_advice,
    micro_batch_advice,
    planned_peak,
    planned_stages,
    recommend,
    release_margin,
)
from raytrain_cpu.planner.steptime import Rates
from raytrain_cpu.planner.tables import (
    C7I_SIZES,
    DS_MAX_LIVE_PARAMETERS,
    DS_SUB_GROUP_SIZE,
    FREE_MEMORY_GROWTH_MIB,
    GIB,
    GIB_PER_VCPU,
    LIVE_CHOICES,
    instance_catalog,
    resolve_shape,
    sockets_of,
)

# The table's note for a DPO run that runs no reference forward beside training (its figures
# are SFT's): train.dpo_precompute_reference, and SimPO, which compares no reference at all.
DPO_WITHOUT_FORWARD = {
    "precomputed": "; DPO: the reference's log-likelihoods computed once before step 1 (a forward over "
    "every block the run trains and evaluates on), no reference forward or copy beside training",
    "none": "; SimPO: no reference model",
}


DPO_REFERENCES = ("", "each-step", *DPO_WITHOUT_FORWARD)  # plan()'s dpo_reference


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
    hpz_partition_size: int = 1,
    shm_collectives: bool = True,
    cross_node_collectives: str = "gloo",
    threads_per_rank: int = 0,
    reserved_vcpus: float = 0,
    checkpoint_every: int = 0,
    rates: Rates | None = None,
    rates_here: Rates | None = None,
    placement_group: str = "cluster",
    usd_per_hour: float | None = None,
) -> dict[str, Any]:
    """The whole estimate as a JSON-able dict (what `--json` prints).

    The step (planner.steptime): on `instance` (else the recommended node) with `rates` (a c7i
    rank's, assumed unless measured on one), AWS's single-flow cap for `placement_group`
    ("cluster" or "none") and `usd_per_hour` (else the on-demand table's price);
    `rates_here` (plan --measure) adds this machine's own step with every rank on it.
    `hpz_partition_size` (deepspeed.hpz_partition_size): ZeRO-3's gathers kept in groups of this
    many ranks (0: the ranks of a node); `cross_node_collectives` (the deepspeed setting):
    "striped" crosses nodes on several TCP flows; `threads_per_rank` a rank's intra-op threads on
    those nodes (0: its share of the node's physical cores after `reserved_vcpus`, the
    scaling.data_cpus every node leaves to Ray and data).

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
    if hpz_partition_size < 0:
        raise ValueError(f"hpz_partition_size must be >= 0, got {hpz_partition_size}")
    hpz_partition_size = hpz_partition_size or ranks_per_node
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
        hpz_partition_size=hpz_partition_size,
    )
    # What the traffic depends on beyond the stage: LoRA's trainable part, DPO's reference gathers.
    comm_kw = dict(lora_rank=lora_rank, lora_targets=lora_targets, reference_forward=reference_forward)
    margin = release_margin(mem_kwargs)
    parts, stages = planned_stages(shape, world_size, mem_kwargs)
    comm = comm_bytes_per_step(shape, world_size, zero_stage, grad_accum_steps, dtype, **comm_kw)
    rec = recommend(shape, world_size, ranks_per_node=ranks_per_node, **mem_kwargs)
    node = instance or rec["instance"] or "c7i.48xlarge"
    family, _, size = node.partition(".")
    if family not in GIB_PER_VCPU or f"c7i.{size}" not in C7I_SIZES:
        raise ValueError(f"instance {node!r}: use a c7i, m7i or r7i size from 8xlarge to 48xlarge")
    net_gbps = C7I_SIZES[f"c7i.{size}"][2]  # m7i and r7i have c7i's network at each size
    node_gib = instance_catalog(family)[node][1]
    if instance:
        rec["fits_instance"] = fits_node(stages["peak"], ranks_per_node, node_gib, margin)
    tokens = micro_batch * seq_len * grad_accum_steps
    # The same run at each ZeRO stage: ZeRO-3 gathers the model every micro batch, so when
    # memory allows, a lower stage often moves far fewer bytes per step.
    stages_compared = {
        str(z): {
            "peak_gib": planned_peak(shape, world_size, mem_kwargs | {"zero_stage": z}) / GIB,
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
        {
            k: planned_peak(shape, world_size, mem_kwargs | {"max_live_parameters": n}) / GIB
            for k, n in LIVE_CHOICES.items()
        }
        if zero_stage == 3
        else {}
    )
    run = dict(
        zero_stage=zero_stage,
        micro_batch=micro_batch,
        seq_len=seq_len,
        grad_accum_steps=grad_accum_steps,
        activation_checkpointing=activation_checkpointing,
        dtype=dtype,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        reference_forward=reference_forward,
    )
    step = step_on(
        shape,
        node,
        world_size,
        ranks_per_node,
        hpz_partition_size,
        shm_collectives,
        run,
        rates,
        placement_group,
        usd_per_hour,
        cross_node_collectives,
        threads_per_rank,
    )
    here = (
        step_on(
            shape, None, world_size, world_size, hpz_partition_size, shm_collectives, run, rates_here, "cluster", None
        )
        if rates_here
        else None
    )
    variants = compare_variants(
        shape, world_size, mem_kwargs, run, rates, placement_group, usd_per_hour, reserved_vcpus
    )
    return {
        "step_time_s": step["step_time_s"],
        "tokens_per_s": step["tokens_per_s"],
        "comm_exposed_s": step["comm_exposed_s"],
        "usd_per_million_tokens": step["usd_per_million_tokens"],
        "step": step,
        **({"step_here": here} if here else {}),
        # train.checkpoint_every: the share of the run's time the saves take
        "checkpoint": checkpoint_cost(
            shape, world_size, zero_stage, lora_rank, lora_targets, checkpoint_every, step["step_time_s"]
        ),
        **variants,
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
    instance = cfg.scaling.instance_type
    if instance and instance.partition(".")[0] not in GIB_PER_VCPU:
        raise ValueError(f"scaling.instance_type={instance!r}: plan a c7i, m7i or r7i size (e.g. c7i.48xlarge)")
    return dict(
        model_shape=shape,
        instance=instance or None,
        # one rank a socket where the config names its node (two on a 48xlarge), else one a node
        ranks_per_node=sockets_of(instance) if instance else 1,
        hpz_partition_size=cfg.deepspeed.hpz_partition_size,
        shm_collectives=cfg.deepspeed.shm_collectives,
        cross_node_collectives=cfg.deepspeed.cross_node_collectives,
        # the config's threads a rank (its CPUs' physical cores), else its share of the node's
        threads_per_rank=cfg.scaling.threads_per_worker or int(cfg.scaling.cpus_per_worker // 2),
        reserved_vcpus=cfg.scaling.data_cpus,
        checkpoint_every=cfg.train.checkpoint_every,
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
