"""The SwiGLU MLP's activation as one autograd operation: silu(gate) * up, keeping gate and up.

Why: Hugging Face's Llama MLP is `down_proj(act_fn(gate_proj(x)) * up_proj(x))`, two eager
operators under autograd, so the backward keeps four intermediate-size tensors per token and
layer: gate (for silu's backward), silu(gate) and up (for the product's) and the product
(down_proj's input). Here silu(gate) is not kept: the backward recomputes it, one more pass over
gate, and everything else is Hugging Face's own operators in the same order, so the output and
both gradients are the same bits. That is 2 bytes per intermediate unit per token per layer
less in bf16: at Llama-3-8B's 14,336 and 8,192 tokens a rank (micro batch 8 x 1,024), 7 GiB
per rank over its 32 layers (`plan`: 77 GiB peak against 84), or 0.2 GiB with activation
checkpointing, which keeps one layer's activations at a time. Alone (benchmarks/mlp.py), forward
and backward run faster than Hugging Face's at Llama-3-8B's width (two fresh tensors in the
backward where autograd makes three, each mapped and faulted in anew) and slower at the bench
model's small width (the recomputed silu), a negligible share of that model's step.

`install` swaps the forward of every MLP module whose class runs exactly Llama's (Llama,
Mistral, Qwen2/3, Granite and the other modular copies) with a SiLU activation; others keep
theirs. Under ZeRO-3 the three projections are still the module's own submodules, so their
hooks gather and release them as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up as Hugging Face's Llama MLP computes it, keeping only gate and up."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)  # in place: the same bits as silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_up = F.silu(gate).mul_(grad_out) if ctx.needs_input_grad[1] else None
        grad_gate = None
        if ctx.needs_input_grad[0]:
            # The product's gradient for silu(gate), then silu's backward: autograd's own two
            # steps, the second in place (two new tensors in this backward where autograd makes three).
            grad_gate = grad_out * up
            torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SwiGLUFunction.apply(gate, up)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def install(model) -> int:
    """Swaps in the fused activation on every module of `model` that runs Llama's SwiGLU MLP
    with SiLU; how many."""
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaMLP

    from raytrain_cpu.model.loading import install_forward, same_forward

    silu = (SiLUActivation, torch.nn.SiLU)  # hidden_act "silu" and "swish"
    return install_forward(
        model, lambda m: type(getattr(m, "act_fn", None)) in silu and same_forward(type(m), LlamaMLP), _mlp_forward
    )
