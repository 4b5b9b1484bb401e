"""Causal self-attention for CPU training: each block of queries against its key prefix, as GEMMs.

Why not SDPA's CPU flash-attention kernel: at the bench model's shape it runs far below the
host's GEMM rate and was a large share of the training step. Here the attention of 64 queries at
a time against the keys up to the block's end is two batched GEMMs and a softmax, so the work
runs in the BLAS (oneDNN, AMX where present) and only the causal triangle's blocks are computed
(5/8 of the square at 4 blocks), in about half SDPA's time (benchmarks/attention.py). The
backward either recomputes each block's probabilities from q and k (flash attention's way: it
keeps the output and the log-sum-exp besides) or, with `keep_probs` (model.attention_probs),
reads what the forward kept: one batched GEMM of seven, the causal mask and the softmax's
forward fewer, the same bits, for heads x ~seq/2 elements a token (faster, at that memory;
raytrain_cpu.planner.memory decides 'auto').

The scores come out of the GEMM in the inputs' dtype (as in transformers' eager attention);
softmax and its backward run in fp32 inside, and dK, dV accumulate in fp32 over the blocks.
The relative error against an fp64 reference is within 1.5x of the flash kernel's
(tests/test_attention.py).

Which one runs is `model.attention`: "auto" times SDPA, the blocks at each of BLOCKS queries
and, in bf16 where it builds, the fused kernel (raytrain_cpu.model.ops.fused_attention: the same
arithmetic in one C++ kernel per head, its GEMMs on oneDNN's micro-kernels) at the run's shape
on every rank at start-up, and all ranks take the fastest by their summed times, so each host
(AVX2, AVX-512, AMX) keeps what is fastest on it. Among the blocks, AMX favours 128 queries a
block (its small batched GEMMs cost more a call, and a taller block makes half as many); elsewhere
64 and 128 are close. Packed documents' masks always run the blocks.

Packed documents (data.attention_span=document): transformers builds a boolean mask, causal
within each document, from the blocks' position ids; the blocks add it to each query block's
scores in place of the causal square and skip the keys before the first document any of the
block's rows is in (benchmarks/document_mask.py). Anything else (padding masks, whose padding
rows see nothing, KV caches, attention dropout, masks under torch.compile) goes to SDPA unchanged.
The blocks are custom operators: under model.compile inductor keeps each as one call and
compiles the layer's other work around it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from raytrain_cpu.compat.torch import softmax_backward
from raytrain_cpu.config.model import CAUSAL_BLOCKS_DEFAULT, FUSED, causal_blocks_size
from raytrain_cpu.model.ops import fused_attention
from raytrain_cpu.model.shape import attention_shape, causal_block_probs

BLOCK = CAUSAL_BLOCKS_DEFAULT  # queries per block of model.attention=causal_blocks
NAME = "raytrain_causal_blocks"  # its name in transformers' attention interfaces (register)
# The block sizes 'auto' times (benchmarks/attention.py, one layer at the bench model's shape,
# forward + backward): 128 is fastest on AMX, both alike elsewhere; 32 and 256 were slower.
BLOCKS = (64, 128)


def impl_name(block: int) -> str:
    """The implementation's name in model.attention and manifests: 'causal_blocks' at BLOCK
    queries a block (what older manifests recorded, before the size was a choice), else
    'causal_blocks_<block>'."""
    return "causal_blocks" if block == BLOCK else f"causal_blocks_{block}"


def block_of(name: str | None) -> int | None:
    """Queries a block of a causal-blocks implementation (by impl_name or its transformers name);
    None for anything else, SDPA's names included."""
    return causal_blocks_size(name)


def _query_blocks(x: torch.Tensor, groups: int, block: int) -> torch.Tensor:
    """(B, H, S, D) -> (blocks, B, H/groups, groups*block, D), contiguous, S padded with zeros to
    whole blocks: each block is one dense batch of matrices (a GEMM on a strided slice copies)."""
    b, h, s, d = x.shape
    nb = -(-s // block)
    if nb * block != s:
        x = torch.nn.functional.pad(x, (0, 0, 0, nb * block - s))
    x = x.reshape(b, h // groups, groups, nb, block, d).permute(3, 0, 1, 2, 4, 5)
    # Without grouped queries the reshape is a view of the projections' (B, S, H, D) memory; the
    # GEMMs would then copy each block they read, and write each out= block through a copy.
    return x.reshape(nb, b, h // groups, groups * block, d).contiguous()


def _unblocked(xb: torch.Tensor, groups: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of _query_blocks (in `dtype`) into a fresh (B, S, H, D) tensor, returned as its
    (B, H, S, D) view: one pass, where a contiguous (B, H, S, D) result would cost one more on
    either side of the operator, since transformers' projections hand q, k and v over as
    (B, S, H, D) memory, take the output back as it, and their gradients flow back as it."""
    nb, b, hk, gb, d = xb.shape
    n = gb // groups
    src = xb.view(nb, b, hk, groups, n, d).permute(1, 2, 3, 0, 4, 5)  # (B, H/groups, groups, blocks, n, D)
    out = xb.new_empty(b, seq, hk * groups, d, dtype=dtype)
    if nb * n == seq:
        out.view(b, nb, n, hk, groups, d).permute(0, 3, 4, 1, 2, 5).copy_(src)
    else:  # the last block's padded rows dropped on the way
        out.view(b, seq, hk, groups, d).permute(0, 2, 3, 1, 4).copy_(
            src.reshape(b, hk, groups, nb * n, d)[..., :seq, :]
        )
    return out.transpose(1, 2)


def _unblocked_layout(shape, like: torch.Tensor) -> torch.Tensor:
    """An empty tensor of (B, H, S, D) `shape` laid out as _unblocked's results (the fake kernels')."""
    b, h, s, d = shape
    return like.new_empty(b, s, h, d).transpose(1, 2)


def _block_bias(mask: torch.Tensor, i0: int, n: int, lo: int, e: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive form (0 or -inf) of rows [i0, i0 + n) and keys [lo, e) of a (B, 1, S, S)
    boolean mask, as (B, 1, 1, n, e - lo) to add to a query block's scores; rows past S (the
    last block's padding) see every key, and their outputs are dropped. None where the rows are
    plainly causal over those keys (one document across the whole block, as most blocks of
    long text are): the causal square is then all there is to add (blocks of one document each
    at the bench model's shape run nearly at the plain blocks' speed with this, slower adding
    the whole mask; benchmarks/document_mask.py)."""
    rows = min(n, mask.shape[2] - i0)
    seen = mask[:, 0, i0 : i0 + rows, lo:e]
    square = torch.ones(rows, e - i0, dtype=torch.bool).tril_()
    if bool(seen[..., : i0 - lo].all()) and torch.equal(seen[..., i0 - lo :], square.expand_as(seen[..., i0 - lo :])):
        return None
    bias = torch.zeros(mask.shape[0], n, e - lo, dtype=dtype)
    bias[:, :rows].masked_fill_(seen.logical_not(), float("-inf"))
    return bias.view(mask.shape[0], 1, 1, n, e - lo)


# The last mask's plan: (mask, (block, dtype), plan). transformers hands every layer the same
# mask object in a forward, and each layer's backward reads it again: the plan is made once.
_last_plan: list[Any] = [None, None, None]


def mask_plan(mask: torch.Tensor | None, seq: int, block: int, dtype: torch.dtype) -> list[tuple[int, Any]]:
    """Per query block: (lo, bias), with lo the first key any of its rows sees under `mask` (the
    keys before it belong to earlier documents: the block skips them) and bias its _block_bias
    over keys [lo, end); without a mask (0, None) each."""
    blocks = -(-seq // block)
    if mask is None:
        return [(0, None)] * blocks
    if _last_plan[0] is mask and _last_plan[1] == (block, dtype):
        return _last_plan[2]
    plan = []
    for i in range(blocks):
        e = min((i + 1) * block, seq)
        seen = mask[:, 0, i * block : e, :e].any(dim=1).any(dim=0)
        lo = int(seen.to(torch.uint8).argmax())
        plan.append((lo, _block_bias(mask, i * block, block, lo, e, dtype)))
    _last_plan[:] = [mask, (block, dtype), plan]
    return plan


def _probs(
    qi: torch.Tensor,
    k_e: torch.Tensor,
    i0: int,
    groups: int,
    causal: torch.Tensor,
    out: torch.Tensor | None,
    lo: int = 0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax of one query block's scores against keys [lo, e) (k_e; into `out` when given);
    the block's own square is causal: `causal` (block x block) is 0 on and below its diagonal
    and -inf above, added to the scores (2-4x faster than masked_fill_ with a broadcast boolean
    mask, and the same for finite scores). A document mask's `bias` (mask_plan) replaces the
    causal square: it is added over all the block's keys."""
    b, hk, gn, _ = qi.shape
    n, keys = gn // groups, k_e.shape[2]
    s = torch.matmul(qi, k_e.transpose(-1, -2)).view(b, hk, groups, n, keys)
    if bias is None:
        s[..., i0 - lo :].add_(causal[:, : lo + keys - i0])
    else:
        s.add_(bias)
    if out is None:
        return torch.softmax(s, -1).view(b, hk, gn, keys)
    torch.ops.aten._softmax.out(s, -1, False, out=out.view(s.shape))
    return out


def probs_numel(b: int, kv_heads: int, queries: int, seq: int, block: int) -> int:
    """Elements of all query blocks' probabilities (`queries` = groups x block rows a block): the
    causal triangle in blocks, each block against its key prefix (what the planner counts). A
    document mask's blocks take fewer (_each_block), within the same buffer."""
    return b * kv_heads * (queries // block) * causal_block_probs(seq, block)


def _each_block(
    qb: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, block: int, probs, kept: bool, mask=None
):
    """Per query block of `qb` (_query_blocks): (i, lo, k[lo:e], v[lo:e], its probabilities),
    with [lo, e) the keys it sees: up to the block's end, from the first key any of its rows
    sees under `mask` (0 without one). The probabilities are read from `probs` when `kept`, else
    computed (and written there when it has room: the forward keeping them); both passes take
    the same mask_plan, so they lay the kept blocks out alike."""
    seq = k.shape[2]
    _, b, hk, gn, _ = qb.shape
    causal = torch.full((block, block), float("-inf"), dtype=qb.dtype).triu_(1)
    offset = 0
    for i, (lo, bias) in enumerate(mask_plan(mask, seq, block, qb.dtype)):
        e = min((i + 1) * block, seq)
        # Copied: the batched GEMMs copy a prefix view (not one dense batch of matrices) anyway.
        k_e, v_e = k[:, :, lo:e].contiguous(), v[:, :, lo:e].contiguous()
        size = b * hk * gn * (e - lo)
        p = probs[offset : offset + size].view(b, hk, gn, e - lo) if probs.numel() else None
        offset += size
        yield i, lo, k_e, v_e, p if kept else _probs(qb[i], k_e, i * block, groups, causal, p, lo, bias)


def _accumulate(total: torch.Tensor, part: torch.Tensor, lo: int, seen: int) -> None:
    """total[:, :, lo:e] += part (part holds keys lo..e) for a fp32 `total` whose first `seen`
    keys earlier blocks wrote (lo <= seen: a block's first row sees itself): the rest are
    copied in, not added to zeros (the same values, with no zero fill and a conversion in place
    of an addition over the new keys)."""
    total[:, :, lo:seen] += part[:, :, : seen - lo]
    total[:, :, seen : lo + part.shape[2]].copy_(part[:, :, seen - lo :])


# Custom operators, not an autograd.Function: torch.compile (model.compile) keeps each one as
# a single call in its graph and compiles the layer's other work around it. The forward returns
# beside the output what the backward reads besides k and v: the scaled query blocks (saved in
# place of q: the same memory, and the backward need not make them again) and the
# probabilities, empty unless `keep`: kept, the backward reads them instead of recomputing each
# block's scores and softmax (one of the seven batched GEMMs and half the softmax work; the same
# bits either way). `mask`, when given, is packed documents' (B, 1, S, S) boolean mask (see
# attention_forward), which the backward reads again where it recomputes the probabilities.
@torch.library.custom_op("raytrain::causal_blocks", mutates_args=())
def _causal_blocks_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, block: int, keep: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = q.shape[1] // k.shape[1]
    qb = _query_blocks(q * scale, groups, block)
    ob = torch.empty_like(qb)
    probs = qb.new_empty(probs_numel(*qb.shape[1:4], k.shape[2], block) if keep else 0)
    for i, _, _, v_e, p in _each_block(qb, k, v, groups, block, probs, kept=False, mask=mask):
        torch.matmul(p, v_e, out=ob[i])
    return _unblocked(ob, groups, q.shape[2], q.dtype), probs, qb


@torch.library.custom_op("raytrain::causal_blocks_backward", mutates_args=())
def _causal_blocks_bwd(
    grad_out: torch.Tensor,
    qb: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    probs: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for q, k and v from the forward's scaled query blocks (`qb`), k, v, mask and
    (when kept) probabilities."""
    groups, seq = qb.shape[3] // block, k.shape[2]
    gb = _query_blocks(grad_out, groups, block)
    dqb = torch.empty_like(qb)
    dk = torch.empty(k.shape, dtype=torch.float32)  # accumulated over the query blocks
    dv = torch.empty(v.shape, dtype=torch.float32)
    for i, lo, k_e, v_e, p in _each_block(qb, k, v, groups, block, probs, kept=probs.numel() > 0, mask=mask):
        _accumulate(dv, torch.matmul(p.transpose(-1, -2), gb[i]), lo, i * block)
        # softmax's backward: p * (dp - rowsum(dp * p)); padded query rows have dp = 0.
        ds = softmax_backward(torch.matmul(gb[i], v_e.transpose(-1, -2)), p, -1, p.dtype)
        torch.matmul(ds, k_e, out=dqb[i])
        _accumulate(dk, torch.matmul(ds.transpose(-1, -2), qb[i]), lo, i * block)
    dq = _unblocked(dqb.mul_(scale), groups, seq, qb.dtype)
    return dq, _unblocked(dk.unsqueeze(0), 1, seq, k.dtype), _unblocked(dv.unsqueeze(0), 1, seq, v.dtype)


@_causal_blocks_fwd.register_fake
def _(q, k, v, mask, scale, block, keep):
    b, h, s, d = q.shape
    hk, nb, groups = k.shape[1], -(-s // block), h // k.shape[1]
    numel = probs_numel(b, hk, groups * block, s, block) if keep else 0
    return _unblocked_layout(q.shape, q), q.new_empty(numel), q.new_empty(nb, b, hk, groups * block, d)


@_causal_blocks_bwd.register_fake
def _(grad_out, qb, k, v, probs, mask, scale, block):
    b, hk, s, d = k.shape
    dq = _unblocked_layout((b, qb.shape[3] // block * hk, s, d), qb)
    return dq, _unblocked_layout(k.shape, k), _unblocked_layout(v.shape, v)


def _setup_context(ctx, inputs, output) -> None:
    _, k, v, mask, ctx.scale, ctx.block, _ = inputs
    _, probs, qb = output
    ctx.mark_non_differentiable(probs, qb)
    # Else autograd hands the backward a zero-filled gradient for each: as many bytes written
    # as the probabilities and q, for nothing.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(qb, k, v, probs, mask)


def _backward(ctx, grad_out, *_):
    qb, k, v, probs, mask = ctx.saved_tensors
    return (*_causal_blocks_bwd(grad_out, qb, k, v, probs, mask, ctx.scale, ctx.block), None, None, None, None)


_causal_blocks_fwd.register_autograd(_backward, setup_context=_setup_context)


def causal_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    block: int = BLOCK,
    keep_probs: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention, (B, H, S, D) out (a view of (B, S, H, D) memory); k and v may have fewer
    heads (grouped queries). `keep_probs`: keep the probabilities for the backward (probs_numel
    elements in q's dtype). `mask`: a (B or 1, 1, S, S) boolean mask (True: attend) in place of
    plain causality, every query seeing at least itself (packed documents)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _causal_blocks_fwd(q, k, v, mask, scale, block, keep_probs)[0]


def _blocks_take_mask(attention_mask, query) -> bool:
    """Whether the blocks take `attention_mask` in place of plain causality: a boolean
    (B, 1, S, S) mask in which every query sees at least itself (transformers builds one, causal
    within each document, from packed position ids), so the blocks' softmax has no empty row. A
    padding mask has such rows (a padding query sees nothing) and goes to SDPA, which handles
    them. The check reads the mask's diagonal, a value torch.compile cannot know while tracing:
    compiled layers leave masked calls to SDPA."""
    s = query.shape[2]
    return (
        attention_mask.dtype == torch.bool
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and tuple(attention_mask.shape[2:]) == (s, s)
        and not torch.compiler.is_compiling()
        and bool(attention_mask.diagonal(dim1=-2, dim2=-1).all())
    )


def _plain_causal(module, query, key, value, attention_mask, dropout: float, kwargs: dict[str, Any]) -> bool:
    """Whether this call is what the causal blocks compute (plain causal attention, or causal
    within packed documents); everything else goes to SDPA."""
    return (
        (attention_mask is None or _blocks_take_mask(attention_mask, query))
        and dropout == 0.0
        and getattr(module, "is_causal", True)
        and kwargs.get("is_causal") is not False
        and query.shape[2] == key.shape[2] > 1
        and query.shape[1] % key.shape[1] == 0
        and key.shape[-1] == value.shape[-1] == query.shape[-1]
        and query.dtype == key.dtype == value.dtype in (torch.bfloat16, torch.float32)
        and not torch.is_autocast_enabled("cpu")  # its casts would reach the blocks' out= GEMMs
        and all(kwargs.get(k) is None for k in ("softcap", "sliding_window", "position_bias", "cache"))
        and not kwargs.get("output_attentions", False)
    )


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    block: int = BLOCK,
    keep_probs: bool = False,
    fused: bool = False,
    **kwargs,
):
    """transformers' attention-function signature: (B, H, S, D) in, (B, S, H, D) out. `fused`:
    the fused kernel (raytrain_cpu.model.ops.fused_attention) where it applies, the blocks for a document
    mask (the kernel is plainly causal) and for what it does not compute (fp32)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _plain_causal(module, query, key, value, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if fused and attention_mask is None and fused_attention.supports(query, key, value):
        return fused_attention.fused_causal(query, key, value, scaling).transpose(1, 2), None
    keep_probs = keep_probs and torch.is_grad_enabled()  # evaluation has no backward to keep them for
    out = causal_blocks(query, key, value, scaling, block, keep_probs, mask=attention_mask)
    return out.transpose(1, 2), None  # (B, S, H, D) memory already: no copy


def register(block: int = BLOCK, keep_probs: bool = False, fused: bool = False) -> str:
    """Registers the blocks at `block` queries a block (keeping their probabilities for the
    backward or not), or with `fused` the fused kernel, as a transformers attention
    implementation (it takes SDPA's masks: None when plainly causal); returns its name there."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = "raytrain_" + (FUSED if fused else impl_name(block))
    forward = functools.partial(attention_forward, block=block, keep_probs=keep_probs, fused=fused)
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


# time_attention's rounds: at least `reps`, more while they take under this many seconds in all
# (up to MAX_ROUNDS). At small shapes one call is milliseconds and the workers' start-up shares
# the cores with Ray Data's tokenizing: with 2 rounds the tiny default model's pick flipped
# between runs. The best of each, over rounds that take every implementation in turn, leaves out
# what a burst of other work added.
MIN_TIMING_S = 0.5
MAX_ROUNDS = 20


def time_attention(
    shape: tuple[int, int, int, int, int],
    dtype: torch.dtype,
    reps: int = 2,
    keep_probs: Callable[[int], bool] = lambda block: False,
) -> dict[str, float]:
    """Seconds of one forward + backward of each implementation at `shape`: the best of at least
    `reps` rounds (more where they are quick: MIN_TIMING_S), each taking every implementation in
    turn, after a warm-up; the blocks keep their probabilities where `keep_probs(block)` says.
    The fused kernel is timed last, in bf16 where it builds (the build happens here, once per
    machine: fused_attention); in bf16 where it does not, its entry is inf."""
    b, h, hk, s, d = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, s, d, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(b, hk, s, d, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(b, hk, s, d, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(b, h, s, d, generator=gen).to(dtype)
    impls: dict[str, Callable[[], torch.Tensor]] = {
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != hk),
        **{
            impl_name(n): functools.partial(causal_blocks, q, k, v, block=n, keep_probs=keep_probs(n))
            for n in BLOCKS
            if n < s or n == BLOCK
        },
    }
    # In bf16 every rank lists the fused kernel, so the ranks' timings line up for their
    # all-reduce; where it does not build it stays untimed (inf: never the pick, on any rank).
    fused = fused_attention.supports(q, k, v)
    if fused and fused_attention.kernel() is not None:
        impls[FUSED] = functools.partial(fused_attention.fused_causal, q, k, v)
    for fn in impls.values():
        fn().backward(grad)  # the first call warms the allocator and the BLAS's kernels
    best = dict.fromkeys(impls, float("inf"))
    if fused:
        best.setdefault(FUSED, float("inf"))
    start, rounds = time.perf_counter(), 0
    while rounds < reps or (rounds < MAX_ROUNDS and time.perf_counter() - start < MIN_TIMING_S):
        for name, fn in impls.items():
            t0 = time.perf_counter()
            fn().backward(grad)
            best[name] = min(best[name], time.perf_counter() - t0)
        rounds += 1
    return best


# An implementation later in time_attention's order (SDPA, then each block size) replaces the
# one before only when faster by more than this share: within it the timings are noise, and a
# pick that flips between runs of one command changes their losses in the last bits (the tiny
# default model's 64- and 128-query blocks time within a few percent of each other).
TIE_MARGIN = 0.03


def pick_fastest(timings: dict[str, float]) -> str:
    """The fastest of `timings`, an earlier one kept against any within TIE_MARGIN of it."""
    best = next(iter(timings))
    for name, seconds in timings.items():
        if seconds < timings[best] * (1 - TIE_MARGIN):
            best = name
    return best


def choose(
    model,
    setting: str,
    micro_batch: int,
    seq_len: int,
    agree: Callable[[list[float]], list[float]] = lambda v: v,
    keep_probs: Callable[[int], bool] = lambda block: False,
) -> tuple[str, dict[str, float]]:
    """Sets the model's attention for `setting` ("auto", "sdpa", "fused" or a causal-blocks impl_name),
    the blocks keeping their probabilities where `keep_probs(block)` says; returns (the
    implementation's impl_name or "sdpa", the timings "auto" measured, averaged over ranks by
    `agree`)."""
    from raytrain_cpu.compat.transformers import can_set_attn_implementation

    shape = attention_shape(model.config, micro_batch, seq_len)
    # Attention dropout (GPT-2's attn_pdrop) would send every training call to SDPA anyway.
    dropout = max(float(getattr(model.config, k, 0.0) or 0.0) for k in ("attention_dropout", "attn_pdrop"))
    if setting == "sdpa" or shape is None or dropout > 0 or not can_set_attn_implementation(model):
        return "sdpa", {}
    timings: dict[str, float] = {}
    dtype = next(iter(model.parameters())).dtype
    if setting == "auto":
        local = time_attention(shape, dtype, keep_probs=keep_probs)
        # Every rank must run the same code: one rank's choice from its own noisy timings could differ.
        timings = dict(zip(local, agree(list(local.values())), strict=True))
        setting = pick_fastest(timings)
        if setting == "sdpa":
            return "sdpa", timings
    if setting == FUSED:
        if dtype != torch.bfloat16 or fused_attention.kernel() is None:
            why = "it computes bf16 only" if dtype != torch.bfloat16 else fused_attention.why_unavailable()
            raise RuntimeError(f"model.attention={FUSED}: {why}. Set model.attention=auto (or causal_blocks).")
        # Document masks go to the blocks (the kernel is plainly causal), recomputing: nothing kept.
        model.set_attn_implementation(register(BLOCK, False, fused=True))
        return FUSED, timings
    block = block_of(setting)
    model.set_attn_implementation(register(block, keep_probs(block)))
    return impl_name(block), timings
