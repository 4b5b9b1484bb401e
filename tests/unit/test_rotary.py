"""raytrain_cpu.rotary: the fused rotary embedding gives Hugging Face's bits, in a chunk of rows at
a time, inside a Llama, and leaves what it does not compute to Hugging Face's."""

import pytest
import torch
from aten_threads import aten_threads
from transformers.models.llama import modeling_llama

from raytrain_cpu.config.schema import load_config
from raytrain_cpu.model.loading import tiny_llama_config
from raytrain_cpu.model.ops import attention, rotary


def _rotated_and_grads(apply, q, k, cos, sin, grads, projected):
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    qv, kv = (q.transpose(1, 2), k.transpose(1, 2)) if projected else (q, k)
    out = apply(qv, kv, cos, sin)
    torch.autograd.backward(out, grads)
    return [out[0].detach(), out[1].detach(), q.grad, k.grad]


def _inputs(b, h, hk, s, d, dtype, projected=True, cos_batch=None):
    gen = torch.Generator().manual_seed(0)
    if projected:  # (B, S, H, D) memory, transposed by the caller as transformers does
        q, k = torch.randn(b, s, h, d, generator=gen), torch.randn(b, s, hk, d, generator=gen)
    else:
        q, k = torch.randn(b, h, s, d, generator=gen), torch.randn(b, hk, s, d, generator=gen)
    angles = torch.randn(cos_batch or b, s, d // 2, generator=gen).repeat(1, 1, 2)
    grads = [torch.randn(b, n, s, d, generator=gen).to(dtype) for n in (h, hk)]
    return q.to(dtype), k.to(dtype), angles.cos().to(dtype), angles.sin().to(dtype), grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape, projected, cos_batch",
    [((2, 4, 4, 37, 16), True, None), ((3, 8, 2, 11, 8), True, 1), ((1, 2, 1, 5, 32), False, None)],
)
def test_fused_rotary_gives_hugging_faces_bits_over_ragged_chunks(monkeypatch, shape, projected, cos_batch, dtype):
    """Output and both gradients equal Hugging Face's with 3 tokens a chunk and a ragged last one,
    for grouped keys, one position row for the batch and q, k in (B, H, S, D) memory too."""
    b, h, hk, s, d = shape
    monkeypatch.setattr(rotary, "chunk_elements", lambda: 3 * h * d)
    q, k, cos, sin, grads = _inputs(*shape, dtype, projected, cos_batch)
    ours = _rotated_and_grads(rotary.apply_rotary_pos_emb, q, k, cos, sin, grads, projected)
    theirs = _rotated_and_grads(modeling_llama.apply_rotary_pos_emb, q, k, cos, sin, grads, projected)
    for name, a, t in zip(("q", "k", "dq", "dk"), ours, theirs, strict=True):
        assert torch.equal(a, t), name
    if projected:  # laid out as Hugging Face's result (other layouts come out in the projections')
        assert ours[0].stride() == theirs[0].stride()


def test_at_two_threads_the_chunks_split_among_them_give_hugging_faces_bits(monkeypatch):
    """A chunk is CHUNK_ELEMENTS a thread (norm.chunk_elements), each of its passes ATen's, split
    among the threads: at 2 threads, chunks large enough to split (1,400 of q's 6,000 tokens, a
    ragged last one), the output and gradients are still Hugging Face's bits."""
    from raytrain_cpu.model.ops import norm

    shape = (2, 4, 2, 3000, 16)
    monkeypatch.setattr(norm, "CHUNK_ELEMENTS", 700 * 4 * 16)
    q, k, cos, sin, grads = _inputs(*shape, torch.bfloat16)
    with aten_threads(2):
        assert norm.chunk_elements() == 1400 * 4 * 16
        ours = _rotated_and_grads(rotary.apply_rotary_pos_emb, q, k, cos, sin, grads, True)
        theirs = _rotated_and_grads(modeling_llama.apply_rotary_pos_emb, q, k, cos, sin, grads, True)
    for name, a, t in zip(("q", "k", "dq", "dk"), ours, theirs, strict=True):
        assert torch.equal(a, t), name


def test_what_the_fused_rotary_does_not_compute_goes_to_hugging_faces():
    q, k, cos, sin, grads = _inputs(1, 2, 2, 6, 8, torch.bfloat16)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    for args in ((q, k, cos.float(), sin.float()), (q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2)):
        ours = rotary.apply_rotary_pos_emb(*args)
        theirs = modeling_llama.apply_rotary_pos_emb(*args)
        assert all(torch.equal(a, t) and a.dtype == t.dtype for a, t in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("attn", ["sdpa", "causal_blocks"])
def test_a_llama_with_the_fused_rotary_trains_to_hugging_faces_bits(attn):
    from transformers import LlamaForCausalLM

    cfg = load_config(
        None,
        ["model.tiny.hidden_size=64", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2", "model.tiny.num_layers=2"],
    )
    config = tiny_llama_config(cfg, 256, eos_token_id=0)
    ids = torch.randint(0, 256, (3, 70), generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16).train()
        attention.choose(model, attn, micro_batch=3, seq_len=70)
        if fused:
            assert rotary.install(model) == 2  # every layer: transformers' Llama attention is still ours line for line
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
        with torch.no_grad():  # evaluation and generation go through it too
            assert torch.equal(model(input_ids=ids[:, :9]).logits, model(input_ids=ids[:, :9]).logits)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
