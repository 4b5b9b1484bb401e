"""RMSNorm as one autograd operation: Hugging Face's forward, a hand-written backward.

Why: Hugging Face's Llama RMSNorm is a chain of eager operators (cast to fp32, square, mean,
rsqrt, scale, cast back, weight), so autograd keeps an fp32 copy of the input and the bf16 output for
the backward (6 bytes per element, twice per decoder layer), and its backward is a dozen more
operators, among them a broadcast product from `mean`'s expanded gradient that runs off
PyTorch's vectorized path. Here the forward runs the very same operators (the output is the
same bits) and keeps only the input, which the residual stream holds anyway, and the fp32
reciprocal norm of each row; the backward is the closed form in fp32:

    x̂ = x·r,  dx = r · (g·w − x̂ · mean(g·w·x̂)),  dw = Σ_rows g · bf16(x̂)

On the ~50M bench model's shape (2,048 tokens x 512, bf16, one thread) forward and backward
take 2.55-3.04 ms against Hugging Face's 4.04-5.06, and 67-97 ms against 127-133 at
Llama-3-8B's width (benchmarks/norm.py, AMD Zen 5); the whole bench model trained 1.03x faster
on AMX. The gradients differ from Hugging Face's by rounding only (its backward rounds g·w to
bf16 before the fp32 math).

`install` swaps the forward of every norm module whose class runs exactly Llama's formula
(Llama, Mistral, Mixtral, Qwen2/3 and their MoE variants, Phi-3, Granite); OLMo-2 and Gemma,
which weight before the cast or add 1 to the weight, keep theirs. Under ZeRO-3 the module's own
hooks still gather its weight around the call.
"""

from __future__ import annotations

import torch


class RMSNormFunction(torch.autograd.Function):
    """weight * bf16(x * rsqrt(mean(x², -1) + eps)) as Hugging Face's LlamaRMSNorm computes it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.float32, copy=True)  # a copy in fp32 training too: it is scaled in place
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return weight * xf.mul_(r).to(x.dtype)  # in place: the same bits, one fp32 tensor fewer

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        d = x.shape[-1]
        # Three fp32 buffers the size of x, each reused: on CPU every fresh large tensor is
        # also a round of page faults (a Llama-3-8B layer's 2,048 x 4,096 fp32 is 32 MiB).
        x_hat = x.to(torch.float32, copy=True).mul_(r)
        g = grad_out.to(torch.float32, copy=True)
        work = torch.empty_like(g)
        grad_w = None
        if ctx.needs_input_grad[1]:
            # d(out)/dw is the rounded output the forward multiplied by w.
            torch.mul(g, x_hat.to(x.dtype), out=work)
            grad_w = work.reshape(-1, d).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gw = g.mul_(weight)
            dot = torch.mul(gw, x_hat, out=work).sum(-1, keepdim=True)
            grad_x = torch.addcmul(gw, x_hat, dot, value=-1.0 / d, out=work).mul_(r).to(x.dtype)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def install(model) -> int:
    """Swaps in the fused norm on every module of `model` that runs Llama's RMSNorm; how many."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from raytrain_cpu.model import install_forward, same_forward

    def runs_llama_norm(module) -> bool:
        cls = type(module)
        return (
            cls.__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and same_forward(cls, LlamaRMSNorm)
        )

    return install_forward(model, runs_llama_norm, _norm_forward)
