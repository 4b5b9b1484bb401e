"""model.attention=fused: causal self-attention as one C++ kernel (raytrain_cpu/model/ops/csrc/fused_attention.cpp).

Why a kernel of our own: on AMX the causal blocks (raytrain_cpu.model.ops.attention) run forward +
backward at a small fraction of the host's rate for a plain GEMM, because each step between
their batched GEMMs is a pass over memory; SDPA's CPU flash kernel fuses its forward (faster
than the blocks') but not its backward (slower than theirs). The kernel here runs
both fused on oneDNN's AMX micro-kernels, and keeps for the backward only each row's
log-sum-exp (4 bytes a query a head), not the blocks' probabilities. See the .cpp for the passes.

It is built on first use with torch.utils.cpp_extension (tens of seconds on a few cores; then cached
under TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default, per source and CPU capability),
so it needs a C++ compiler and ninja where the workers run, as model.compile does. Where either
is missing or the build fails, `kernel()` says why and model.attention=auto leaves it out.
bf16 q, k and v only: an fp32 run (a CPU without fast bf16) keeps the other attentions.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "fused_attention.cpp"


def _capability() -> tuple[str, list[str]]:
    """The ATen vector width the kernel compiles for on this CPU, and its flags (ATen's own
    CPU_CAPABILITY builds): AVX-512 where the CPU has it (with AVX512-BF16's conversions where it
    has those too: Intel's Cooper Lake on, every AMX host, AMD's Zen 4 on), else AVX2, else
    plain C++."""
    from raytrain_cpu.host import features as host_features

    flags = host_features.cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        avx512 = ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
                  "-mavx512dq", "-mfma"]  # fmt: skip
        if "avx512_bf16" in flags:  # one instruction rounds 32 floats to bf16, where ATen's takes ~8
            return "avx512bf16", [*avx512, "-mavx512bf16"]
        return "avx512", avx512
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2", ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma", "-mf16c"]
    return "default", ["-DCPU_CAPABILITY=DEFAULT"]


@functools.cache
def build_kernel(name: str, source: Path):
    """One of the project's C++ kernels (`source`, whose TORCH_LIBRARY is named `name`) built for
    this CPU and loaded: (its operators, torch.ops.<name>, '') or (None, why it is unavailable).
    Cached per process."""
    compiler = os.environ.get("CXX") or "c++"  # cpp_extension's choice (inductor's, host_features.cpp_compiler, is g++)
    if not shutil.which(compiler) or not shutil.which("ninja"):
        return None, f"needs a C++ compiler ({compiler}) and ninja on PATH"
    cap, flags = _capability()
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what the sources include
    digest = hashlib.sha256(source.read_bytes() + headers + torch.__version__.encode()).hexdigest()[:10]
    try:
        from torch.utils.cpp_extension import load

        # The name carries the source (with its headers), torch and CPU capability: a changed
        # kernel, another torch or another CPU type sharing the cache directory builds afresh
        # instead of loading a stale .so.
        load(f"{name}_{cap}_{digest}", [str(source)], extra_cflags=["-O3", *flags], is_python_module=False)
    except Exception as e:  # a build error: the run goes on without the kernel
        return None, f"its build failed: {str(e).strip().splitlines()[-1][:200]}"
    return getattr(torch.ops, name), ""


def _build():
    """(the loaded operators, '') or (None, why it is unavailable)."""
    return build_kernel("raytrain_fused_attention", SOURCE)


def kernel():
    """The built kernel's operators (torch.ops.<its library>), or None (why_unavailable() says why)."""
    return _build()[0]


def why_unavailable() -> str:
    return _build()[1]


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel computes this call: bf16, the same head dim (even), grouped heads."""
    return (
        q.dtype == k.dtype == v.dtype == torch.bfloat16
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and q.shape[-1] % 2 == 0
        and q.shape[1] % k.shape[1] == 0
        and q.shape[2] == k.shape[2]
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with its head dim contiguous (the kernel reads rows through the other strides)."""
    return x if x.stride(-1) == 1 else x.contiguous()


# Custom operators (as the causal blocks'): torch.compile keeps each as one call in its graph.
@torch.library.custom_op("raytrain::fused_causal", mutates_args=())
def _fused_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = kernel().forward(_rows(q), _rows(k), _rows(v), scale)
    return out, lse


@torch.library.custom_op("raytrain::fused_causal_backward", mutates_args=())
def _fused_bwd(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = kernel().backward(_rows(grad_out), _rows(q), _rows(k), _rows(v), lse.contiguous(), scale)
    return dq, dk, dv


def _layout(shape, like: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, S, D) tensor as the kernel returns one: a view of (B, S, H, D) memory."""
    b, h, s, d = shape
    return like.new_empty(b, s, h, d).transpose(1, 2)


@_fused_fwd.register_fake
def _(q, k, v, scale):
    return _layout(q.shape, q), q.new_empty(q.shape[:3], dtype=torch.float32)


@_fused_bwd.register_fake
def _(grad_out, q, k, v, lse, scale):
    return _layout(q.shape, q), _layout(k.shape, k), _layout(v.shape, v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, ctx.scale = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, lse)


def _backward(ctx, grad_out, _):
    q, k, v, lse = ctx.saved_tensors
    return (*_fused_bwd(grad_out, q, k, v, lse, ctx.scale), None)


_fused_fwd.register_autograd(_backward, setup_context=_setup_context)


def fused_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention of bf16 (B, H, S, D) q, k, v (k and v may have fewer heads): (B, H, S, D)
    out, a view of (B, S, H, D) memory as transformers' output projection takes it."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _fused_fwd(q, k, v, scale)[0]
