"""The fused SwiGLU activation (raytrain_cpu.model.ops.mlp) against Hugging Face's Llama MLP: the same output
and gradient bits, less kept for the backward, and installed only where a model runs Llama's MLP."""

from __future__ import annotations

import copy

import pytest
import torch
from aten_threads import aten_threads
from helpers import forward_backward

from benchmarks.bench.kernels import saved_tensor_bytes
from raytrain_cpu.model.ops import mlp

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4)


def _mlp_pair(dtype: torch.dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    hf = LlamaMLP(LlamaConfig(**SMALL)).to(dtype)
    ours = copy.deepcopy(hf)
    assert mlp.install(ours) == 1
    return hf, ours


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_same_output_and_gradient_bits(dtype):
    hf, ours = _mlp_pair(dtype)
    gen = torch.Generator().manual_seed(1)
    x = (2 * torch.randn(3, 40, 32, generator=gen)).to(dtype)
    g = torch.randn(3, 40, 32, generator=gen).to(dtype)
    for a, b in zip(forward_backward(hf, x, g), forward_backward(ours, x, g), strict=True):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)


def test_at_two_threads_the_same_bits():
    """At 2 threads (ATen splits each elementwise pass among them past its 32,768-element grain:
    147,360 a tensor here) the output and both gradients are still Hugging Face's bits."""
    hf, ours = _mlp_pair(torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    x = (2 * torch.randn(3, 614, 32, generator=gen)).to(torch.bfloat16)
    g = torch.randn(3, 614, 32, generator=gen).to(torch.bfloat16)
    with aten_threads(2):
        for a, b in zip(forward_backward(hf, x, g), forward_backward(ours, x, g), strict=True):
            assert torch.equal(a, b)


def test_keeps_one_intermediate_tensor_less():
    hf, ours = _mlp_pair(torch.bfloat16)
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    intermediate = 2 * 16 * 80 * 2  # tokens x intermediate size x bf16
    hf_bytes, ours_bytes = (saved_tensor_bytes(lambda m=m: m(x), list(m.parameters())) for m in (hf, ours))
    assert hf_bytes - ours_bytes == intermediate


def test_frozen_projections_and_input():
    """LoRA freezes the projections; the first layer's input may not need a gradient."""
    _, ours = _mlp_pair(torch.bfloat16)
    ours.requires_grad_(False)
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    ours(x).sum().backward()
    assert x.grad is not None and all(p.grad is None for p in ours.parameters())
    ours.up_proj.requires_grad_(True)
    ours(x.detach()).sum().backward()
    assert ours.up_proj.weight.grad is not None and ours.gate_proj.weight.grad is None


def test_installed_on_llama_style_silu_mlps_only():
    from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    assert mlp.install(LlamaForCausalLM(LlamaConfig(**SMALL))) == 2  # one per layer
    assert mlp.install(Qwen2ForCausalLM(Qwen2Config(**SMALL))) == 2  # a modular copy of Llama's
    assert mlp.install(LlamaForCausalLM(LlamaConfig(**SMALL, hidden_act="gelu"))) == 0
    assert mlp.install(GemmaForCausalLM(GemmaConfig(**SMALL, head_dim=8))) == 0  # GELU


def test_a_llama_trains_the_same_bits():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SMALL)).to(torch.bfloat16)
    ours = copy.deepcopy(hf)
    mlp.install(ours)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    for model in (hf, ours):
        model(input_ids=ids, labels=ids).loss.backward()
    for p_hf, p_ours in zip(hf.parameters(), ours.parameters(), strict=True):
        assert torch.equal(p_hf.grad, p_ours.grad)
