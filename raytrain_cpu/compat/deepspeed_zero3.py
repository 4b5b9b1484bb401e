"""DeepSpeed's private internals the trainer reaches into: its op-compatibility probe, its Muon
module, ZeRO-3's fp32 gradient preparation and gradient reduce-scatter, each replaced by an
equivalent that computes the same bits with fewer new pages, and ZeRO++ hpZ's secondary
partitions and group."""

from __future__ import annotations

import functools
import math
import sys
import types

from raytrain_cpu.compat import written_for

written_for(__name__, "deepspeed", "0.19")

# ----------------------------------------------------------------------------- start-up


def skip_shm_op_probe() -> None:
    """Marks DeepSpeed's shared-memory communication op unusable without probing it.

    Set without reading it first: the first read probes every DeepSpeed op, compiling test
    programs with the C compiler in each worker; only this entry is ever read back."""
    import deepspeed

    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def keep_muon_unimported() -> None:
    """A stand-in for DeepSpeed's Muon optimizer module, unless something imported the real one.

    Building any ZeRO engine imports it, only to ask whether the optimizer is a Muon
    (zero/utils.py is_zero_supported_optimizer, stage3.py); the module compiles its kernels with
    torch.compile at import, which loads inductor at every worker start (benchmarks/engine_setup.py
    measures the difference). Our optimizer is always AdamW (the trainer's DeepSpeed config never
    passes an "optimizer" section through), so nothing is a Muon and the answer stays the same."""
    if MUON_MODULE not in sys.modules:
        stand_in = types.ModuleType(MUON_MODULE, "raytrain_cpu's stand-in: runs never use Muon")
        stand_in.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})  # an instance of it: never
        sys.modules[MUON_MODULE] = stand_in


# ----------------------------------------------------------------------------- the fp32 gradient buffer


def reuse_fp32_grad_buffer(engine) -> int:
    """Casts ZeRO-3's gradient partitions into one fp32 buffer kept between steps; its bytes
    (0 where DeepSpeed's step is left as it is: ZeRO-1/2, optimizer offload).

    DeepSpeed's step makes each sub group's fp32 gradient anew: it flattens the bf16
    partitions into a new tensor, casts that into another, and frees both after the update.
    Their pages are new each step, and every 4 KiB page faults on first touch, a large share
    of a small model's optimizer phase. Sub groups are updated one after another, so one
    buffer the size of the largest serves them all. The arithmetic is DeepSpeed's: the same bits.
    """
    import torch

    opt = engine.optimizer
    flats = getattr(opt, "fp32_partitioned_groups_flat", None)
    if not flats or getattr(opt, "offload_optimizer", True) or not hasattr(opt, "_prepare_fp32_grad_for_sub_group"):
        return 0
    # Pages are touched (resident) from the first step on, as the planner counts them.
    buffer = torch.empty(max(f.numel() for f in flats), dtype=flats[0].dtype)

    def prepare(sub_group_id: int) -> None:
        fp32 = opt.fp32_partitioned_groups_flat[sub_group_id]
        grad, offset = buffer[: fp32.numel()], 0
        for g in opt.averaged_gradients[sub_group_id]:
            grad[offset : offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        if offset != fp32.numel():
            raise RuntimeError(f"sub group {sub_group_id}: {offset} gradient elements for {fp32.numel()} parameters")
        fp32.grad = grad.view_as(fp32)
        opt.averaged_gradients[sub_group_id] = None  # as DeepSpeed's own: the partitions are read

    prepare.buffer = buffer  # type: ignore[attr-defined]  (kept_fp32_grad_buffer_bytes reads it)
    opt._prepare_fp32_grad_for_sub_group = prepare
    return kept_fp32_grad_buffer_bytes(engine)


def kept_fp32_grad_buffer_bytes(engine) -> int:
    """The bytes of the fp32 gradient buffer reuse_fp32_grad_buffer keeps, 0 if none."""
    buffer = getattr(getattr(engine.optimizer, "_prepare_fp32_grad_for_sub_group", None), "buffer", None)
    return 0 if buffer is None else buffer.numel() * buffer.element_size()


# ----------------------------------------------------------------------------- the reduce-scatter buffer


_KEPT_REDUCE_BUFFERS: dict = {}  # dtype -> the flat reduce-scatter buffer, grown to the largest bucket


def _reduce_scatter_into_kept_buffer(tensors, group=None, *, limit: int):
    """DeepSpeed's reduce_scatter_coalesced with its flat buffer kept (up to `limit` elements):
    the same interleaving, pre-division and reduce-scatter, so the same bits; the outputs view
    the buffer until the next bucket (ZeRO-3 copies them into its gradient partitions first)."""
    import torch
    from deepspeed import comm as dist
    from deepspeed.runtime.comm.coalesced_collectives import _torch_reduce_scatter_fn

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    chunks = [math.ceil(t.numel() / world) for t in tensors]
    total = sum(chunks) * world
    dtype = tensors[0].dtype
    if len(tensors) == 1 and tensors[0].numel() == total:
        flat = tensors[0].view(-1)  # as DeepSpeed: one unpadded tensor reduces in place
    else:
        if total > limit:
            flat = torch.empty(total, dtype=dtype)  # a lone parameter over the bucket size: not kept
        else:
            kept = _KEPT_REDUCE_BUFFERS.get(dtype)
            if kept is None or kept.numel() < total:
                kept = _KEPT_REDUCE_BUFFERS[dtype] = torch.empty(total, dtype=dtype)
            flat = kept[:total]
        parts = []
        for r in range(world):  # rank r's piece of every tensor, each padded to its chunk
            for t, c in zip(tensors, chunks, strict=True):
                piece = t.view(-1)[r * c : r * c + c]
                parts += [piece] if piece.numel() == c else [piece, flat.new_empty(c - piece.numel())]
        torch.cat(parts, out=flat)
    flat.div_(world)
    mine = flat.chunk(world)[rank]
    _torch_reduce_scatter_fn(flat, mine, group=group)
    out, offset = [], 0
    for t, c in zip(tensors, chunks, strict=True):
        out.append(mine.narrow(0, offset, max(0, min(c, t.numel() - rank * c))))  # this rank's unpadded piece
        offset += c
    return out


def reuse_reduce_scatter_buffer(on: bool, bucket_elements: int) -> None:
    """ZeRO-3 flattens each gradient bucket (up to reduce_bucket_size elements) into a new
    tensor before its reduce-scatter and frees it after: new pages, each faulting on first touch,
    where a kept buffer's are already resident. With `on`, ZeRO-3 flattens into one kept buffer
    per dtype of at most `bucket_elements`; off restores DeepSpeed's."""
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero import stage3

    stage3.reduce_scatter_coalesced = (
        functools.partial(_reduce_scatter_into_kept_buffer, limit=bucket_elements)
        if on
        else coalesced_collectives.reduce_scatter_coalesced
    )


# ----------------------------------------------------------------------------- ZeRO++ hpZ


def drop_stale_secondary_partitions(model) -> int:
    """Forgets every hpZ secondary partition (zero_hpz_partition_size > 1); returns how many.

    zero.Init makes each parameter's secondary partition (its 1/hpz slice, which forward and
    backward gather within the node) from the parameter as built, before the sharded loader
    writes the checkpoint's bytes into the primary partitions (model.loading reads into
    `ds_tensor` only). The secondaries then hold the uninitialised weights, and DeepSpeed
    refreshes them only after an optimizer step that is not skipped (stage3 _post_step) or a
    checkpoint load, never for frozen parameters (LoRA's base, DPO's reference): the first
    loss is garbage, bf16 overflows, every step is skipped, and nothing ever refreshes them.
    Without a secondary, the next gather goes over all ranks from the primary partitions and
    makes a new secondary from the gathered weights, which is what DeepSpeed does after a step.
    """
    dropped = 0
    for p in model.parameters():
        if getattr(p, "ds_secondary_tensor", None) is not None:
            p.ds_secondary_tensor = None
            dropped += 1
    return dropped


def reuse_hpz_group() -> None:
    """Lets a second zero.Init in one process reuse the hpZ group the first one made.

    DeepSpeed keeps one hpZ group per process (utils.groups) and asserts when asked to make it
    again, which zero.Init does whenever it is given no group: transformers' zero.Init (through
    HfDeepSpeedConfig) gives none, so a second model under the same config (DPO's reference,
    a test's second engine) would fail. The same size reuses the group (new_group is a
    collective that every rank must call alike, and each does the same here); another size
    raises: DeepSpeed keeps one group a process. (A flat engine built after an hpZ one in the same
    process would still pick the group up: stage3 reads it whatever the config says.)"""
    from deepspeed import comm as dist
    from deepspeed.utils import groups

    create = groups._create_zero_param_parallel_group
    if getattr(create, "reuses_group", False):
        return

    def create_once(group_size: int) -> None:
        if groups._get_zero_param_intra_parallel_group() is None:
            create(group_size)
            return
        wanted, have = min(group_size, dist.get_world_size()), groups._get_zero_param_intra_parallel_group_world_size()
        if wanted != have:
            raise RuntimeError(
                f"this process already has an hpZ group of {have} ranks and a model asks for {wanted}: one "
                "deepspeed.hpz_partition_size per process"
            )

    create_once.reuses_group = True  # type: ignore[attr-defined]
    groups._create_zero_param_parallel_group = create_once
