"""RMSNorm as one autograd operation: Hugging Face's forward, a hand-written backward.

Why: Hugging Face's Llama RMSNorm is a chain of eager operators (cast to fp32, square, mean,
rsqrt, scale, cast back, weight), so autograd keeps an fp32 copy of the input and the bf16 output for
the backward (6 bytes per element, twice per decoder layer), and its backward is a dozen more
operators, among them a broadcast product from `mean`'s expanded gradient that runs off
PyTorch's vectorized path. Here the forward runs the very same operators (the output is the
same bits) and keeps only the input, which the residual stream holds anyway, and the fp32
reciprocal norm of each row; the backward is the closed form in fp32:

    x̂ = x·r,  dx = r · (g·w − x̂ · mean(g·w·x̂)),  dw = Σ_rows g · bf16(x̂)

Both run a chunk of rows at a time (CHUNK_ELEMENTS a thread: chunk_elements): each fp32 pass
then reads what the one before wrote from the core's cache, not from memory, and the work is
memory-bound (a dozen passes over fp32 tensors of the input's size). Each pass is ATen's,
parallel over the rank's threads. Forward and backward take about half Hugging Face's time at
the bench model's shape and less at Llama-3-8B's width (benchmarks/norm.py). The gradients differ from Hugging Face's by rounding only (its backward
rounds g·w to bf16 before the fp32 math; the weight's sums the chunks' sums).

`install` swaps the forward of every norm module whose class runs exactly Llama's formula
(Llama, Mistral, Mixtral, Qwen2/3 and their MoE variants, Phi-3, Granite); OLMo-2 and Gemma,
which weight before the cast or add 1 to the weight, keep theirs. Under ZeRO-3 the module's own
hooks still gather its weight around the call.
"""

from __future__ import annotations

import torch

# Rows a chunk: the fp32 work of each norm runs over this many elements at a time (1 MiB per fp32
# buffer), so its passes over the chunk's three buffers hit the core's cache instead of memory:
# the backward runs in about half the time of whole-tensor passes, and larger or smaller chunks
# were slower (benchmarks/norm.py).
CHUNK_ELEMENTS = 1 << 18


def chunk_elements() -> int:
    """Elements a chunk: CHUNK_ELEMENTS for each of this process's ATen threads. ATen splits an
    operator among its threads by at least 32,768 elements a task (at::internal::GRAIN_SIZE), so
    chunks of CHUNK_ELEMENTS alone, run one after another, would keep at most 8 of a rank's 16-92
    threads busy; scaled so, each thread's share of a chunk is the one-thread chunk above, its
    passes still in that thread's cache (one thread: the same chunks, the same bits)."""
    return CHUNK_ELEMENTS * torch.get_num_threads()


def _row_chunks(rows: int, d: int):
    step = max(1, chunk_elements() // d)
    for i0 in range(0, rows, step):
        yield i0, min(i0 + step, rows)


class RMSNormFunction(torch.autograd.Function):
    """weight * bf16(x * rsqrt(mean(x², -1) + eps)) as Hugging Face's LlamaRMSNorm computes it,
    a chunk of rows at a time (every step is per row but the weight's gradient, summed over
    the chunks' sums)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        d = x.shape[-1]
        x2 = x.reshape(-1, d)
        out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
        r = torch.empty(x2.shape[0], 1, dtype=torch.float32)
        n = min(x2.shape[0], max(1, chunk_elements() // d))
        xf_buf, sq_buf = torch.empty(n, d), torch.empty(n, d)
        for i0, i1 in _row_chunks(x2.shape[0], d):
            xf = xf_buf[: i1 - i0].copy_(x2[i0:i1])  # a copy in fp32 training too: scaled in place
            torch.pow(xf, 2, out=sq_buf[: i1 - i0])
            torch.rsqrt(sq_buf[: i1 - i0].mean(-1, keepdim=True).add_(eps), out=r[i0:i1])
            torch.mul(weight, xf.mul_(r[i0:i1]).to(x.dtype), out=out[i0:i1])  # the same bits as a whole
        ctx.save_for_backward(x, weight, r)
        return out.view(*x.shape[:-1], d)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        d = x.shape[-1]
        x2, g2 = x.reshape(-1, d), grad_out.reshape(-1, d)
        # Three fp32 chunk buffers, each reused: x̂ = x·r, g (then g·w), and the work tensor.
        n = min(x2.shape[0], max(1, chunk_elements() // d))
        xh_buf, g_buf, work_buf = torch.empty(n, d), torch.empty(n, d), torch.empty(n, d)
        grad_x = torch.empty_like(x2) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(d, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for i0, i1 in _row_chunks(x2.shape[0], d):
            ri, k = r[i0:i1], i1 - i0
            x_hat = xh_buf[:k].copy_(x2[i0:i1]).mul_(ri)
            g = g_buf[:k].copy_(g2[i0:i1])
            work = work_buf[:k]
            if grad_w is not None:
                # d(out)/dw is the rounded output the forward multiplied by w.
                grad_w += torch.mul(g, x_hat.to(x.dtype), out=work).sum(0)
            if grad_x is not None:
                gw = g.mul_(weight)
                dot = torch.mul(gw, x_hat, out=work).sum(-1, keepdim=True)
                torch.addcmul(gw, x_hat, dot, value=-1.0 / d, out=work).mul_(ri)
                grad_x[i0:i1] = work
        return (
            None if grad_x is None else grad_x.view_as(x),
            None if grad_w is None else grad_w.to(weight.dtype),
            None,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def install(model) -> int:
    """Swaps in the fused norm on every module of `model` that runs Llama's RMSNorm; how many."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from raytrain_cpu.model.loading import install_forward, same_forward

    def runs_llama_norm(module) -> bool:
        cls = type(module)
        return (
            cls.__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and same_forward(cls, LlamaRMSNorm)
        )

    return install_forward(model, runs_llama_norm, _norm_forward)
