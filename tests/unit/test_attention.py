"""raytrain_cpu.attention: the causal-blocks attention against an fp64 reference and SDPA, and
its place in a transformers Llama (what it computes, what it leaves to SDPA).
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_attention_e2e.py."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_llama_choosing

from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.schema import load_config
from raytrain_cpu.model import shape as model_shape
from raytrain_cpu.model.ops import attention, fused_attention

# (batch, heads, kv_heads, seq, head_dim): whole blocks, grouped queries with a ragged last
# block, one kv head, and a sequence shorter than one block.
SHAPES = [(2, 4, 4, 128, 16), (1, 8, 2, 100, 32), (2, 4, 1, 150, 16), (1, 2, 2, 7, 8)]


def _inputs(shape):
    b, h, hk, s, d = shape
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*dims, generator=gen) for dims in ((b, h, s, d), (b, hk, s, d), (b, hk, s, d), (b, h, s, d))]


def _output_and_grads(fn, q, k, v, grad, dtype):
    q, k, v = (t.to(dtype).clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad.to(dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _rel_errors(got, ref):
    return [((g.double() - r).norm() / r.norm()).item() for g, r in zip(got, ref, strict=True)]


@pytest.mark.parametrize("block", attention.BLOCKS)
@pytest.mark.parametrize("shape", SHAPES)
def test_causal_blocks_matches_an_fp64_reference_as_closely_as_sdpa(shape, block):
    q, k, v, grad = _inputs(shape)
    ref = _output_and_grads(_sdpa, q, k, v, grad, torch.float64)

    def blocks_fn(q, k, v):
        return attention.causal_blocks(q, k, v, block=block)

    # fp32: the same to rounding.
    assert max(_rel_errors(_output_and_grads(blocks_fn, q, k, v, grad, torch.float32), ref)) < 1e-6
    # bf16: scores rounded to bf16 by the GEMM (as eager attention does); within 1.5x of the
    # flash kernel's error in the output and each gradient.
    blocks = _rel_errors(_output_and_grads(blocks_fn, q, k, v, grad, torch.bfloat16), ref)
    flash = _rel_errors(_output_and_grads(_sdpa, q, k, v, grad, torch.bfloat16), ref)
    for name, b, f in zip(("out", "dq", "dk", "dv"), blocks, flash, strict=True):
        assert b < 1.5 * f, f"{name}: {b:.2e} against SDPA's {f:.2e}"


@pytest.mark.parametrize("block", attention.BLOCKS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kept_probabilities_give_the_same_bits_as_recomputed_ones(shape, block):
    """The backward reading the forward's probabilities computes exactly what recomputing them
    does; what the forward keeps is the causal triangle in blocks (the planner's count), and in
    place of q its scaled query blocks."""
    q, k, v, grad = _inputs(shape)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    results = []
    for keep in (False, True):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            results.append(
                _output_and_grads(
                    lambda q, k, v: attention.causal_blocks(q, k, v, block=block, keep_probs=keep),  # noqa: B023
                    q,
                    k,
                    v,
                    grad,
                    torch.bfloat16,
                )  # fmt: skip
            )
        b, h, hk, s, d = shape
        kept = b * h * model_shape.causal_block_probs(s, block)
        query_blocks = b * h * -(-s // block) * block * d  # q scaled, in whole blocks: q's size when s fills them
        assert saved == [query_blocks, k.numel(), v.numel(), kept if keep else 0]
    for name, r, k in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert torch.equal(r, k), name


def _document_mask_of(lengths: list[int]) -> torch.Tensor:
    """(1, 1, S, S) boolean: causal within each of the packed documents of `lengths`."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    causal = torch.ones(len(doc), len(doc), dtype=torch.bool).tril()
    return (causal & (doc[:, None] == doc[None, :]))[None, None]


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("block", attention.BLOCKS)
@pytest.mark.parametrize("shape", SHAPES)
def test_causal_blocks_under_a_document_mask_match_masked_sdpa(shape, block, keep):
    q, k, v, grad = _inputs(shape)
    seq = shape[3]
    mask = _document_mask_of([seq // 3, 1, seq - seq // 3 - 1])  # a document of one token among them

    def sdpa_fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    def blocks_fn(q, k, v):
        return attention.causal_blocks(q, k, v, block=block, keep_probs=keep, mask=mask)

    ref = _output_and_grads(sdpa_fn, q, k, v, grad, torch.float64)
    assert max(_rel_errors(_output_and_grads(blocks_fn, q, k, v, grad, torch.float32), ref)) < 1e-6
    blocks = _rel_errors(_output_and_grads(blocks_fn, q, k, v, grad, torch.bfloat16), ref)
    masked_sdpa = _rel_errors(_output_and_grads(sdpa_fn, q, k, v, grad, torch.bfloat16), ref)
    for name, b, f in zip(("out", "dq", "dk", "dv"), blocks, masked_sdpa, strict=True):
        assert b < 1.5 * f, f"{name}: {b:.2e} against masked SDPA's {f:.2e}"


def test_llama_on_causal_blocks_trains_like_sdpa_and_leaves_masked_cached_and_autocast_calls_to_sdpa():
    sdpa, _, _ = tiny_llama_choosing("sdpa")
    blocks, chosen, timings = tiny_llama_choosing("causal_blocks")
    assert chosen == "causal_blocks" and timings == {}
    assert blocks.config._attn_implementation == attention.NAME
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))

    # Plain causal: fp32 loss and gradients agree with SDPA's to rounding.
    losses, grads = [], []
    for model in (sdpa, blocks):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)

    # A padding mask, a KV cache and autocast go to SDPA: the same logits to the bit.
    mask = torch.ones_like(ids)
    mask[0, :10] = 0
    with torch.no_grad():
        assert torch.equal(
            sdpa(input_ids=ids, attention_mask=mask).logits, blocks(input_ids=ids, attention_mask=mask).logits
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(sdpa(input_ids=ids).logits, blocks(input_ids=ids).logits)
        prompt = ids[:1, :12]
        a = sdpa.generate(prompt, max_new_tokens=5, do_sample=False)
        b = blocks.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b)


def test_llama_on_causal_blocks_keeps_packed_documents_apart(monkeypatch):
    sdpa, _, _ = tiny_llama_choosing("sdpa")
    blocks, _, _ = tiny_llama_choosing("causal_blocks")
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    lengths = [[40, 56], [10, 1, 85]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    masks = []
    blocks_alone = attention.causal_blocks

    def recording(*args, mask=None, **kwargs):
        masks.append(mask)
        return blocks_alone(*args, mask=mask, **kwargs)

    monkeypatch.setattr(attention, "causal_blocks", recording)

    # Each document gives the logits it gives alone (fp32, to rounding): nothing of the others.
    with torch.no_grad():
        packed = blocks(input_ids=ids, position_ids=positions, use_cache=False).logits
        for r, row in enumerate(lengths):
            starts = [0, *torch.tensor(row).cumsum(0).tolist()]
            for a, b in zip(starts, starts[1:]):
                alone = blocks(input_ids=ids[r : r + 1, a:b], use_cache=False).logits[0]
                assert torch.allclose(packed[r, a:b], alone, atol=1e-5)
    assert masks and masks[0] is not None  # the blocks ran, under transformers' packed mask

    # And it trains like SDPA under the same mask: loss and gradients to rounding.
    losses, grads = [], []
    for model in (sdpa, blocks):
        loss = model(input_ids=ids, labels=ids, position_ids=positions, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_auto_times_both_and_every_rank_takes_the_same_choice():
    seen = []

    def agree(values):  # stands in for the ranks' all-reduce: this "rank" is told SDPA was faster
        seen.append(list(values))
        return [0.001, 1.0]

    # At seq 96 a block of 128 would be one padded block: only the default block is timed.
    model, chosen, timings = tiny_llama_choosing("auto", agree=agree)
    assert set(timings) == {"sdpa", "causal_blocks"} and len(seen[0]) == 2
    assert chosen == "sdpa" and model.config._attn_implementation == "sdpa"


def test_the_pick_keeps_the_earlier_implementation_within_the_tie_margin():
    pick = attention.pick_fastest
    assert pick({"sdpa": 1.0, "causal_blocks": 0.98, "causal_blocks_128": 0.975}) == "sdpa"
    assert pick({"sdpa": 1.0, "causal_blocks": 0.9, "causal_blocks_128": 0.89}) == "causal_blocks"
    assert pick({"sdpa": 1.0, "causal_blocks": 0.9, "causal_blocks_128": 0.8}) == "causal_blocks_128"
    assert pick({"sdpa": 1.0, "causal_blocks": 1.1, "causal_blocks_128": 0.96}) == "causal_blocks_128"


def test_timing_takes_more_rounds_where_they_are_quick(monkeypatch):
    """At least `reps` rounds of every implementation in turn, more while under MIN_TIMING_S (up
    to MAX_ROUNDS), after one warm-up call each."""
    calls = []
    blocks = attention.causal_blocks

    def counted(*args, **kwargs):
        calls.append(kwargs["block"])
        return blocks(*args, **kwargs)

    monkeypatch.setattr(attention, "causal_blocks", counted)
    shape = (1, 2, 2, 200, 8)  # 64 and 128 queries a block both timed
    monkeypatch.setattr(attention, "MIN_TIMING_S", 0.0)
    assert set(attention.time_attention(shape, torch.float32, reps=3)) == {"sdpa", "causal_blocks", "causal_blocks_128"}
    assert calls.count(64) == calls.count(128) == 1 + 3
    calls.clear()
    monkeypatch.setattr(attention, "MIN_TIMING_S", 60.0)
    monkeypatch.setattr(attention, "MAX_ROUNDS", 5)
    attention.time_attention(shape, torch.float32, reps=3)
    assert calls.count(64) == calls.count(128) == 1 + 5


def test_auto_times_each_block_size_and_the_taller_blocks_train_like_the_default():
    # The ranks' all-reduce says: blocks of 128 queries were the fastest (as on AMX).
    tall, chosen, timings = tiny_llama_choosing("auto", seq_len=256, agree=lambda v: [3.0, 2.0, 1.0])
    assert list(timings) == ["sdpa", "causal_blocks", "causal_blocks_128"]
    assert chosen == "causal_blocks_128" and tall.config._attn_implementation == "raytrain_causal_blocks_128"
    default, chosen, _ = tiny_llama_choosing("causal_blocks", seq_len=256)
    assert chosen == "causal_blocks" and default.config._attn_implementation == attention.NAME
    ids = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(1))
    losses = [m(input_ids=ids, labels=ids).loss.item() for m in (default, tall)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_implementation_names_carry_the_block_size():
    assert [attention.impl_name(n) for n in (64, 128)] == ["causal_blocks", "causal_blocks_128"]
    for name, block in [("causal_blocks", 64), ("causal_blocks_128", 128), ("raytrain_causal_blocks_32", 32)]:
        assert attention.block_of(name) == block
    for name in ("sdpa", None, "causal_blocks_0", "causal_blocks_x", "eager"):
        assert attention.block_of(name) is None
    assert load_config(None, ["model.attention=causal_blocks_128"]).model.attention == "causal_blocks_128"


@pytest.mark.parametrize("kept", ["sdpa", "causal_blocks", "causal_blocks_128"])
def test_a_resumed_auto_run_keeps_the_checkpoints_attention_without_timing(kept):
    """A resumed 'auto' run continues bit for bit: it takes the attention its manifest recorded and
    times nothing (timing all-reduces over the ranks; there is no process group here to do it)."""
    from raytrain_cpu.trainer.loading import choose_attention
    from raytrain_cpu.trainer.state import Worker

    model, _, _ = tiny_llama_choosing("sdpa")
    logged = []
    cfg = load_config(None, ["model.attention=auto"])
    w = Worker(cfg, {}, 0, 1, Path("."), 4, logged.append, resumed={"attention": kept, "step": 3})
    assert choose_attention(w, model) == kept
    assert model.config._attn_implementation == ("sdpa" if kept == "sdpa" else f"raytrain_{kept}")
    # This model's probabilities at seq 256 would add 38-46% to its activations: recomputed (auto).
    probs = "" if kept == "sdpa" else "; probabilities recomputed for the backward"
    assert logged == [f"[model] attention: {kept} (auto: kept from the checkpoint at step 3){probs}"]


@pytest.mark.parametrize("setting", ["keep", "recompute"])
def test_the_worker_keeps_the_probabilities_as_configured(setting):
    from transformers import AttentionInterface

    from raytrain_cpu.trainer.loading import choose_attention
    from raytrain_cpu.trainer.state import Worker

    model, _, _ = tiny_llama_choosing("sdpa")
    logged = []
    cfg = load_config(None, ["model.attention=causal_blocks_128", f"model.attention_probs={setting}"])
    w = Worker(cfg, {}, 0, 1, Path("."), 4, logged.append)
    assert choose_attention(w, model) == "causal_blocks_128"
    fn = AttentionInterface._global_mapping[model.config._attn_implementation]
    assert fn.keywords == {"block": 128, "keep_probs": setting == "keep", "fused": False}
    word = "kept" if setting == "keep" else "recomputed"
    assert logged == [f"[model] attention: causal_blocks_128; probabilities {word} for the backward"]


def test_config_rejects_an_unknown_attention():
    for bad in ("flash", "causal_blocks_0", "causal_blocks_"):
        with pytest.raises(ConfigError, match="model.attention"):
            load_config(None, [f"model.attention={bad}"])
    for good in ("auto", "keep", "recompute"):
        assert load_config(None, [f"model.attention_probs={good}"]).model.attention_probs == good
    with pytest.raises(ConfigError, match="model.attention_probs"):
        load_config(None, ["model.attention_probs=true"])


def test_a_llama_keeping_the_probabilities_trains_to_the_same_bits():
    """model.attention_probs=keep through transformers' attention interface: the same loss and
    gradients as recomputing; evaluation (no autograd) keeps nothing."""
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    results = []
    for keep in (False, True):
        model, chosen, _ = tiny_llama_choosing("causal_blocks", keep_probs=lambda block: keep)  # noqa: B023
        model.to(torch.bfloat16)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
        with torch.no_grad():
            q = torch.randn(1, 4, 96, 16, dtype=torch.bfloat16)
            kv = torch.randn(1, 2, 96, 16, dtype=torch.bfloat16)
            out, _ = attention.attention_forward(model.model.layers[0].self_attn, q, kv, kv, None, keep_probs=keep)
            assert out.shape == (1, 96, 4, 16)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_the_custom_operators_pass_torch_library_opcheck():
    # Schema, autograd registration, fake (meta) kernels and AOT dispatch: what torch.compile needs.
    q, k, v, grad = _inputs((1, 4, 2, 70, 8))
    q = q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # as projections hand it over
    k, v = k.requires_grad_(), v.requires_grad_()
    _, probs, qb = torch.ops.raytrain.causal_blocks(q, k, v, None, 0.3, 64, True)
    saved = (qb.detach(), k.detach(), v.detach())
    grad = grad.transpose(1, 2).contiguous().transpose(1, 2)  # as o_proj's backward hands it over
    mask = _document_mask_of([30, 40])
    for op, args in (
        (torch.ops.raytrain.causal_blocks.default, (q, k, v, None, 0.3, 64, False)),
        (torch.ops.raytrain.causal_blocks.default, (q, k, v, None, 0.3, 64, True)),
        (torch.ops.raytrain.causal_blocks.default, (q, k, v, mask, 0.3, 64, False)),
        (torch.ops.raytrain.causal_blocks_backward.default, (grad, *saved, probs[:0], None, 0.3, 64)),
        (torch.ops.raytrain.causal_blocks_backward.default, (grad, *saved, probs.detach(), None, 0.3, 64)),
        (torch.ops.raytrain.causal_blocks_backward.default, (grad, *saved, probs[:0], mask, 0.3, 64)),
    ):
        assert set(torch.library.opcheck(op, args).values()) == {"SUCCESS"}


# ----------------------------------------------------------------------------- the fused kernel

# (batch, heads, kv_heads, seq, head_dim): whole blocks, grouped queries with a ragged last block,
# Llama-3-8B's head dim with one kv head, and a sequence shorter than one block.
FUSED_SHAPES = [(2, 4, 4, 128, 64), (1, 8, 2, 100, 64), (2, 2, 1, 130, 128), (1, 2, 2, 7, 16)]


def _fused_kernel():
    if fused_attention.kernel() is None:
        pytest.skip(f"the fused kernel is unavailable here: {fused_attention.why_unavailable()}")


@pytest.mark.parametrize("threads", [1, 4])  # 4: grouped heads split a task per query head
@pytest.mark.parametrize("shape", FUSED_SHAPES)
def test_the_fused_kernel_matches_an_fp64_reference_as_closely_as_sdpa(shape, threads):
    _fused_kernel()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_fused_against_fp64(shape)
    finally:
        torch.set_num_threads(before)


def _check_fused_against_fp64(shape):
    q, k, v, grad = _inputs(shape)
    ref = _output_and_grads(_sdpa, q, k, v, grad, torch.float64)
    # Inputs as transformers hands them over: (B, H, S, D) views of (B, S, H, D) memory.
    q, k, v, grad = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, grad))
    fused = _rel_errors(_output_and_grads(fused_attention.fused_causal, q, k, v, grad, torch.bfloat16), ref)
    flash = _rel_errors(_output_and_grads(_sdpa, q, k, v, grad, torch.bfloat16), ref)
    for name, f, s in zip(("out", "dq", "dk", "dv"), fused, flash, strict=True):
        assert f < 1.5 * s, f"{name}: {f:.2e} against SDPA's {s:.2e}"
    out = fused_attention.fused_causal(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.transpose(1, 2).is_contiguous()  # (B, S, H, D) memory: o_proj takes it without a copy


def test_the_fused_operators_pass_torch_library_opcheck():
    _fused_kernel()
    q, k, v, grad = (t.bfloat16().transpose(1, 2).contiguous().transpose(1, 2) for t in _inputs((1, 4, 2, 70, 64)))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    _, lse = torch.ops.raytrain.fused_causal(q, k, v, 0.125)
    for op, args in (
        (torch.ops.raytrain.fused_causal.default, (q, k, v, 0.125)),
        (torch.ops.raytrain.fused_causal_backward.default, (grad, q.detach(), k.detach(), v.detach(), lse, 0.125)),
    ):
        assert set(torch.library.opcheck(op, args).values()) == {"SUCCESS"}


def test_a_bf16_llama_on_the_fused_kernel_trains_like_the_blocks_and_sends_documents_to_them():
    _fused_kernel()
    blocks, _, _ = tiny_llama_choosing("causal_blocks", seq_len=128, dtype=torch.bfloat16)
    fused, chosen, _ = tiny_llama_choosing("fused", seq_len=128, dtype=torch.bfloat16)
    assert chosen == "fused" and fused.config._attn_implementation == "raytrain_fused"
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (blocks, fused):
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-2)
    g = [m.model.layers[0].self_attn.q_proj.weight.grad.float() for m in (blocks, fused)]
    assert ((g[0] - g[1]).norm() / g[0].norm()).item() < 0.05
    # Packed documents: the kernel is plainly causal, so their masked calls run the blocks.
    mask = _document_mask_of([50, 78]).expand(2, 1, 128, 128)
    q, k, v = (torch.randn(2, 4, 128, 16, dtype=torch.bfloat16) for _ in range(3))
    module = fused.model.layers[0].self_attn
    out, _ = attention.attention_forward(module, q, k, v, mask, fused=True)
    assert torch.equal(out, attention.attention_forward(module, q, k, v, mask)[0])


def test_auto_times_the_fused_kernel_in_bf16_and_an_explicit_fused_needs_bf16():
    _fused_kernel()
    timings = attention.time_attention((1, 4, 2, 200, 64), torch.bfloat16)
    assert list(timings) == ["sdpa", "causal_blocks", "causal_blocks_128", "fused"]
    assert 0 < timings["fused"] < float("inf")
    assert "fused" not in attention.time_attention((1, 4, 2, 200, 64), torch.float32)
    with pytest.raises(RuntimeError, match="model.attention=fused: it computes bf16 only"):
        tiny_llama_choosing("fused")  # an fp32 model
    assert load_config(None, ["model.attention=fused"]).model.attention == "fused"
    with pytest.raises(ConfigError, match="fused computes in bf16 only"):
        load_config(None, ["model.attention=fused", "model.dtype=fp32"])


def test_a_resumed_auto_run_keeps_the_fused_kernel_and_times_afresh_where_it_does_not_build(monkeypatch):
    _fused_kernel()
    from raytrain_cpu.trainer import engine
    from raytrain_cpu.trainer.loading import choose_attention
    from raytrain_cpu.trainer.state import Worker

    # One rank: the ranks' sums (whether the kernel builds everywhere, the timings) are its own.
    monkeypatch.setattr(engine, "allreduce_sum", lambda values: values)
    cfg = load_config(None, ["model.attention=auto"])
    model, _, _ = tiny_llama_choosing("sdpa", dtype=torch.bfloat16)
    logged = []
    w = Worker(cfg, {}, 0, 1, Path("."), 4, logged.append, resumed={"attention": "fused", "step": 3})
    assert choose_attention(w, model) == "fused" and model.config._attn_implementation == "raytrain_fused"
    assert logged == ["[model] attention: fused (auto: kept from the checkpoint at step 3)"]

    # Another host, without a compiler: the run times what it has; the kernel's entry is inf.
    monkeypatch.setattr(fused_attention, "_build", lambda: (None, "needs a C++ compiler"))
    logged.clear()
    assert choose_attention(w, model) in ("sdpa", "causal_blocks", "causal_blocks_128")
    assert "fused inf ms" in logged[0]
    assert "; the checkpoint's fused kernel does not build on every rank (needs a C++ compiler)" in logged[0]
