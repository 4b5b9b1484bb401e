"""model.weight_grad_kernel: linear layers whose weight gradient runs on a kernel of our own.

Why: a linear layer's weight gradient dW = dy^T x reduces over the tokens, the slow dimension
of both its operands, and autograd hands oneDNN dy^T as a transposed view: on AMX that GEMM ran
at about half the forward's rate (benchmarks/gemm_layouts.py), about half of a step's GEMM
time. raytrain_cpu/csrc/weight_grad.cpp prepares each chunk of 512 tokens once, in cache, and
runs oneDNN's micro-kernels on it: 1.07-1.55x autograd's at the ~50M bench model's shapes
(benchmarks/weight_grad.py, one thread, the AMX host).

`install` swaps the forward of every bf16 nn.Linear whose weight trains for one custom
operator: the same forward (F.linear), and a backward whose input gradient is autograd's
product and whose weight gradient is the kernel's (fp32 accumulation, rounded to bf16 once, as
oneDNN's). The operator keeps x and the weight for the backward, as autograd's linear does;
under ZeRO-3 the module's hooks gather the weight before the forward and again before the
backward, as before. torch.compile keeps each call as one operator in its graphs.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).parent / "csrc" / "weight_grad.cpp"


def _build():
    """(the loaded extension, '') or (None, why it is unavailable): fused_attention.build_kernel."""
    from raytrain_cpu.fused_attention import build_kernel

    return build_kernel("raytrain_weight_grad", SOURCE)


def kernel():
    """The built kernel module, or None (why_unavailable() says why)."""
    return _build()[0]


def why_unavailable() -> str:
    return _build()[1]


@torch.library.custom_op("raytrain::weight_grad", mutates_args=())
def weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dy^T x for bf16 dy [T, O] and x [T, I]: the weight gradient [O, I] of y = x W^T."""
    return kernel().weight_grad(dy.contiguous(), x.contiguous())


@weight_grad.register_fake
def _(dy, x):
    return dy.new_empty(dy.shape[1], x.shape[1])


@torch.library.custom_op("raytrain::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight)


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = (dy2 @ weight).view(*dy.shape[:-1], weight.shape[1]) if need_x else None
    dw = weight_grad(dy2, x.reshape(-1, x.shape[-1])) if need_w else None
    db = dy2.sum(0) if need_b and ctx.has_bias else None
    return dx, dw, db


linear.register_autograd(_backward, setup_context=_setup_context)


def wanted(setting: bool | str, dtype: str, n_params: int) -> tuple[bool, str]:
    """model.weight_grad_kernel for a model of `n_params` parameters training in `dtype` ('bf16'
    or 'fp32', as resolved): whether to install the kernel, and why not ('' where there is
    nothing to say: 'auto' on a model too small to win back the build). 'auto' takes it on AMX,
    where oneDNN's micro-kernels run it (elsewhere they fall back to a plain GEMM), for models of
    COMPILE_AUTO_MIN_PARAMS or more."""
    from raytrain_cpu import cpu
    from raytrain_cpu.config import COMPILE_AUTO_MIN_PARAMS

    if setting is False:
        return False, "model.weight_grad_kernel=false"
    if dtype != "bf16":
        return False, "training in fp32"
    if setting == "auto":
        if "amx_bf16" not in cpu.cpu_flags():
            return False, "model.weight_grad_kernel=auto: no AMX here"
        if n_params < COMPILE_AUTO_MIN_PARAMS:
            return False, ""  # the build (~30 s) would cost a small model more than it saves
    if kernel() is None:
        return False, f"the kernel is unavailable: {why_unavailable()}"
    return True, ""


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.bfloat16 or not self.weight.requires_grad:
        return F.linear(x, self.weight, self.bias)  # autocast or a frozen layer: autograd's own
    return linear(x, self.weight, self.bias)


def install(model) -> int:
    """Swaps in the kernel's backward on every nn.Linear of `model` with a bf16 weight that
    trains (not LoRA's frozen base layers, not GPT-2's Conv1D) and its own forward (not the
    output layer under model.fused_loss, which runs its GEMMs a chunk at a time); how many."""
    from raytrain_cpu.model import install_forward

    def takes(m) -> bool:
        own = "forward" not in vars(m)  # another install (the fused loss) already replaced it
        return type(m) is torch.nn.Linear and own and m.weight.dtype == torch.bfloat16 and m.weight.requires_grad

    return install_forward(model, takes, _forward)
