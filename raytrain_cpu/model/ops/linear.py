"""model.weight_grad_kernel: linear layers whose weight gradient runs on a kernel of our own.

Why: a linear layer's weight gradient dW = dy^T x reduces over the tokens, the slow dimension
of both its operands, and autograd hands oneDNN dy^T as a transposed view: on AMX that GEMM ran
at about half the forward's rate (benchmarks/gemm_layouts.py), about half of a step's GEMM
time. raytrain_cpu/model/ops/csrc/weight_grad.cpp prepares each chunk of 512 tokens once, in cache, and
runs oneDNN's micro-kernels on it: faster than autograd's at the bench model's shapes on one
thread (benchmarks/weight_grad.py). It runs on the rank's ATen threads (each owns blocks of
dW), but a win at one thread says nothing of many: oneDNN's own weight gradient
scales differently. So 'auto' times both at the model's linear shapes on the worker's own
threads at start-up (`choose`, as model.attention=auto does) and takes the kernel only where it
wins by WIN_MARGIN on the ranks' mean (benchmarks/kernel_threads.py: both at 1 to all cores).

`install` swaps the forward of every bf16 nn.Linear whose weight trains for one custom
operator: the same forward (F.linear), and a backward whose input gradient is autograd's
product and whose weight gradient is the kernel's (fp32 accumulation, rounded to bf16 once, as
oneDNN's). The operator keeps x and the weight for the backward, as autograd's linear does;
under ZeRO-3 the module's hooks gather the weight before the forward and again before the
backward, as before. torch.compile keeps each call as one operator in its graphs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).parent / "csrc" / "weight_grad.cpp"


def _build():
    """(the loaded operators, '') or (None, why it is unavailable): fused_attention.build_kernel."""
    from raytrain_cpu.model.ops.fused_attention import build_kernel

    return build_kernel("raytrain_weight_grad", SOURCE)


def kernel():
    """The built kernel's operators (torch.ops.<its library>), or None (why_unavailable() says why)."""
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
    """model.weight_grad_kernel's gates before any timing, for a model of `n_params` parameters
    training in `dtype` ('bf16' or 'fp32', as resolved): whether the kernel may run here, and why
    not ('' where there is nothing to say: 'auto' on a model too small to win back the build).
    'auto' passes only on AMX, where oneDNN's micro-kernels run it (elsewhere they fall back to a
    plain GEMM), for models of COMPILE_AUTO_MIN_PARAMS or more; `choose` then times it."""
    from raytrain_cpu.config.model import COMPILE_AUTO_MIN_PARAMS
    from raytrain_cpu.host import features as host_features

    if setting is False:
        return False, "model.weight_grad_kernel=false"
    if dtype != "bf16":
        return False, "training in fp32"
    if setting == "auto":
        if n_params < COMPILE_AUTO_MIN_PARAMS:
            return False, ""  # the build (~30 s) would cost a small model more than it saves
        if "amx_bf16" not in host_features.cpu_flags():
            return False, "model.weight_grad_kernel=auto: no AMX here"
    if kernel() is None:
        return False, f"the kernel is unavailable: {why_unavailable()}"
    return True, ""


# 'auto' takes the kernel only when its summed time at the model's shapes is under autograd's by
# more than this share: within it the two are noise on a shared host, and a pick that flips
# between runs changes their losses in the last bits (bf16 rounding of dW differs).
WIN_MARGIN = 0.05
# Timing at most this many tokens a shape: the kernel's work repeats every 512 tokens, so a few
# chunks time its rate, and an 8B model's 8,192 tokens would cost each rank seconds.
TIMING_MAX_TOKENS = 4096
TIMING_MAX_BYTES = 512e6  # a timed shape's bf16 operands at most (as host_gemm.PROBE_MAX_BYTES)
MIN_TIMING_S = 0.3  # more rounds while they take less (up to MAX_ROUNDS): the best of each counts
MAX_ROUNDS = 10


@dataclass
class Choice:
    """model.weight_grad_kernel as a run resolved it: on or not, why not, and what 'auto' timed
    (seconds of one micro batch's weight gradients at the model's linear shapes, 'kernel' and
    'autograd', the ranks' mean; {} where nothing was timed) at `threads` ATen threads."""

    on: bool
    why: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    threads: int = 0


def _takes(m) -> bool:
    """Whether `install` swaps this module's forward: a plain bf16 nn.Linear that trains, its
    forward its class's own (not the fused loss's output layer)."""
    own = "forward" not in vars(m)  # another install (the fused loss) already replaced it
    return type(m) is torch.nn.Linear and own and m.weight.dtype == torch.bfloat16 and m.weight.requires_grad


def linear_shapes(model) -> dict[tuple[int, int], int]:
    """{(out, in): how many} of the layers `install` would take (ZeRO-3's partitioned weights by
    their whole shape)."""
    shapes: dict[tuple[int, int], int] = {}
    for m in model.modules():
        if _takes(m):
            out, inp = tuple(getattr(m.weight, "ds_shape", m.weight.shape))
            shapes[(out, inp)] = shapes.get((out, inp), 0) + 1
    return shapes


def time_weight_grads(shapes: dict[tuple[int, int], int], tokens: int, reps: int = 2) -> dict[str, float]:
    """Seconds of one micro batch's weight gradients at `shapes` ({(out, in): count}) and `tokens`
    on this thread's ATen threads, 'kernel' and 'autograd' (dy^T @ x on the transposed view, as
    autograd's linear backward runs it): per shape the best of at least `reps` rounds taking both
    in turn (more while quick: MIN_TIMING_S), summed by count. Shapes are timed at up to
    TIMING_MAX_TOKENS tokens and scaled to `tokens`; those whose operands exceed TIMING_MAX_BYTES
    are left out of both sums."""
    t = min(tokens, TIMING_MAX_TOKENS)
    total = {"kernel": 0.0, "autograd": 0.0}
    gen = torch.Generator().manual_seed(0)
    for (out, inp), count in shapes.items():
        if 2.0 * t * (out + inp) > TIMING_MAX_BYTES:
            continue
        dy = torch.randn(t, out, generator=gen).to(torch.bfloat16)
        x = torch.randn(t, inp, generator=gen).to(torch.bfloat16)
        calls: dict[str, Callable[[], torch.Tensor]] = {
            "kernel": lambda dy=dy, x=x: weight_grad(dy, x),
            "autograd": lambda dy=dy, x=x: dy.t().mm(x),
        }
        for fn in calls.values():
            fn()  # warms the allocator and the micro-kernels
        best = dict.fromkeys(calls, float("inf"))
        start, rounds = time.perf_counter(), 0
        while rounds < reps or (rounds < MAX_ROUNDS and time.perf_counter() - start < MIN_TIMING_S):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
            rounds += 1
        for name in total:
            total[name] += best[name] * count * tokens / t
    return total


def choose(
    setting: bool | str,
    dtype: str,
    n_params: int,
    shapes: dict[tuple[int, int], int],
    tokens: int,
    agree: Callable[[list[float]], list[float]] = lambda v: v,
) -> Choice:
    """model.weight_grad_kernel for this run: `wanted`'s gates, then for 'auto' the kernel against
    autograd timed at the model's linear `shapes` and a micro batch's `tokens` on this process's
    ATen threads (the worker's: torch.set_num_threads ran before), averaged over the ranks by
    `agree` (an all-reduce: every rank takes the same pick). Every rank past the gates that do
    not depend on the host (the setting, the dtype, the size) calls `agree`, also where this host
    has no AMX or no kernel build: a rank that skipped it would leave the others waiting."""
    threads = torch.get_num_threads()
    on, why = wanted(setting, dtype, n_params)
    host_gated = setting == "auto" and dtype == "bf16" and why != ""  # no AMX, or no build, here
    if setting != "auto" or not (on or host_gated):
        return Choice(on, why, threads=threads)
    local = time_weight_grads(shapes, tokens) if on else {"kernel": 0.0, "autograd": 0.0}
    unable, kernel_s, autograd_s = agree([0.0 if on else 1.0, local["kernel"], local["autograd"]])
    if unable > 0:
        return Choice(False, why or "model.weight_grad_kernel=auto: not every rank has AMX and the kernel", {}, threads)
    timings = {"kernel": kernel_s, "autograd": autograd_s}
    if kernel_s < autograd_s * (1 - WIN_MARGIN):
        return Choice(True, "", timings, threads)
    ratio = autograd_s / kernel_s if kernel_s > 0 else float("inf")
    why = (
        f"model.weight_grad_kernel=auto: the kernel {kernel_s * 1e3:.1f} ms against autograd's "
        f"{autograd_s * 1e3:.1f} at {threads} threads ({ratio:.2f}x; taken above {1 / (1 - WIN_MARGIN):.2f}x)"
    )
    return Choice(False, why, timings, threads)


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.bfloat16 or not self.weight.requires_grad:
        return F.linear(x, self.weight, self.bias)  # autocast or a frozen layer: autograd's own
    return linear(x, self.weight, self.bias)


def install(model) -> int:
    """Swaps in the kernel's backward on every nn.Linear of `model` with a bf16 weight that
    trains (not LoRA's frozen base layers, not GPT-2's Conv1D) and its own forward (not the
    output layer under model.fused_loss, which runs its GEMMs a chunk at a time); how many."""
    from raytrain_cpu.model.loading import install_forward

    return install_forward(model, _takes, _forward)
