"""The fused RMSNorm (raytrain_cpu.model.ops.norm) against Hugging Face's: the same output bits, gradients
as close to fp64's as Hugging Face's, and installed only where a model runs Llama's formula."""

from __future__ import annotations

import copy

import pytest
import torch
from aten_threads import aten_threads

from raytrain_cpu.model.ops import norm


def _norm_pair(dtype: torch.dtype, d: int = 96):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    hf = LlamaRMSNorm(d, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * torch.randn(d))
    ours = copy.deepcopy(hf)
    assert norm.install(ours) == 1
    return hf, ours


def _run(module, x, g):
    x = x.detach().clone().requires_grad_()
    module.weight.grad = None
    out = module(x)
    out.backward(g)
    return out.detach(), x.grad, module.weight.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_same_output_bits_and_gradients_within_hugging_face_rounding(dtype):
    hf, ours = _norm_pair(dtype)
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(2, 50, 96, generator=gen)).to(dtype)
    g = torch.randn(2, 50, 96, generator=gen).to(dtype)
    out_hf, gx_hf, gw_hf = _run(hf, x, g)
    out_ours, gx_ours, gw_ours = _run(ours, x, g)
    assert torch.equal(out_hf, out_ours)
    # The exact derivative of the same function in fp64.
    x64 = x.double().requires_grad_()
    w64 = hf.weight.detach().double().requires_grad_()
    (w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))).backward(g.double())
    # Within the dtype's rounding of the exact gradient, or at least as close as Hugging Face's
    # (which worst element rounds which way can differ between CPUs' summation orders).
    rounding = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-20
    for ours_grad, hf_grad, exact in ((gx_ours, gx_hf, x64.grad), (gw_ours, gw_hf, w64.grad)):
        assert ours_grad.dtype == dtype
        err_ours = (ours_grad.double() - exact).abs().max()
        err_hf = (hf_grad.double() - exact).abs().max()
        assert err_ours <= max(1.01 * err_hf, rounding * exact.abs().max())


def test_frozen_weight_and_frozen_input():
    """LoRA freezes the norm's weight; the first layer's input may not need a gradient."""
    hf, ours = _norm_pair(torch.bfloat16)
    ours.weight.requires_grad_(False)
    x = torch.randn(4, 96, dtype=torch.bfloat16, requires_grad=True)
    ours(x).sum().backward()
    assert x.grad is not None and ours.weight.grad is None
    ours.weight.requires_grad_(True)
    ours(x.detach()).sum().backward()
    assert ours.weight.grad is not None


def test_installed_on_llama_norms_only():
    from transformers import LlamaConfig, LlamaForCausalLM, Olmo2Config, Olmo2ForCausalLM

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    llama = LlamaForCausalLM(LlamaConfig(**small))
    assert norm.install(llama) == 2 * 2 + 1  # two per layer and the final one
    assert norm.install(Olmo2ForCausalLM(Olmo2Config(**small))) == 0  # weights before the cast


def test_a_llama_trains_the_same_within_rounding():
    """A whole tiny Llama in bf16: the same loss bits, gradients within bf16 rounding of HF's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4
    )
    hf = LlamaForCausalLM(config).to(torch.bfloat16)
    ours = copy.deepcopy(hf)
    norm.install(ours)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (hf, ours):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(*losses)
    for p_hf, p_ours in zip(hf.parameters(), ours.parameters(), strict=True):
        scale = p_hf.grad.float().abs().max() + 1e-6
        assert (p_hf.grad.float() - p_ours.grad.float()).abs().max() <= 0.05 * scale


def test_inputs_and_incoming_gradient_left_alone_in_fp32():
    """In fp32 a cast to fp32 is no copy: the in-place scaling must not reach the caller's tensors."""
    _, ours = _norm_pair(torch.float32)
    x = torch.randn(4, 96, requires_grad=True)
    g = torch.randn(4, 96)
    x0, g0 = x.detach().clone(), g.clone()
    ours(x).backward(g)
    assert torch.equal(x.detach(), x0) and torch.equal(g, g0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunks_of_rows_give_what_the_whole_tensor_gives(monkeypatch, dtype):
    """The fp32 work runs a chunk of rows at a time (norm.chunk_elements): with 7 rows a chunk and
    a ragged last one, the same output and input-gradient bits as in one chunk; the weight's
    gradient sums the chunks' sums (within its dtype's rounding)."""
    _, ours = _norm_pair(dtype)
    gen = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(2, 50, 96, generator=gen)).to(dtype)
    g = torch.randn(2, 50, 96, generator=gen).to(dtype)
    whole = _run(ours, x, g)
    monkeypatch.setattr(norm, "chunk_elements", lambda: 7 * 96)
    chunked = _run(ours, x, g)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    rounding = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-20
    assert (whole[2].float() - chunked[2].float()).abs().max() <= rounding * whole[2].float().abs().max()


def test_at_two_threads_chunks_split_among_them_match_one_thread_and_hugging_faces_bits(monkeypatch):
    """A chunk is CHUNK_ELEMENTS a thread, each of its passes ATen's, split among the threads (a
    rank runs 16-92: chunks of one thread's size would keep at most 8 busy). At 2 threads over
    chunks large enough to split (800 rows, a ragged last one): Hugging Face's output bits, and
    the gradients of one thread with the same chunks (each row's arithmetic is its own; the
    weight's sums the same chunks' sums)."""
    hf, ours = _norm_pair(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(2, 3000, 96, generator=gen)).to(torch.bfloat16)
    g = torch.randn(2, 3000, 96, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(norm, "CHUNK_ELEMENTS", 400 * 96)
    with aten_threads(2):
        assert norm.chunk_elements() == 800 * 96
        two = _run(ours, x, g)
        out_hf = _run(hf, x, g)[0]
    monkeypatch.setattr(norm, "chunk_elements", lambda: 800 * 96)
    with aten_threads(1):
        one = _run(ours, x, g)
    assert torch.equal(two[0], out_hf)
    for a, b in zip(two, one, strict=True):
        assert torch.equal(a, b)
