"""torch internals the project reaches into, each where torch offers no public route.

torch is imported inside the functions: the driver must not import it at start-up.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from raytrain_cpu.compat import written_for

written_for(__name__, "torch", "2.13")


def c10d_work_class() -> type:
    """The class of the handles torch.distributed's asynchronous collectives return, whose
    `wait` a timer may wrap: `torch._C._distributed_c10d.Work` (torch.distributed.Work is an
    alias of it in some builds only)."""
    import torch

    return torch._C._distributed_c10d.Work


def enable_fx_graph_cache() -> None:
    """Turns on inductor's FX graph cache in this process: `torch._inductor.config.fx_graph_cache`
    (inductor's config module is not a documented API; its TORCHINDUCTOR_FX_GRAPH_CACHE
    variable is read only when that module is first imported)."""
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True


def preload_dynamo() -> None:
    """Imports `torch._dynamo`, which must be loaded before DeepSpeed's zero.Init patches
    Tensor.__new__: importing it later, under the patch, fails."""
    import torch._dynamo  # noqa: F401


def pickled_tensor_class(module: str, name: str) -> Callable[..., Any] | None:
    """What a (module, name) in a plain pickle of a CPU tensor resolves to, for an unpickler
    that admits only those: `torch.storage._load_from_bytes` (its storage, read back here with
    torch.load(weights_only=True)) and `torch._utils._rebuild_tensor_v2`; None for any other."""
    import io

    import torch

    if (module, name) == ("torch.storage", "_load_from_bytes"):
        return lambda b: torch.load(io.BytesIO(b), weights_only=True)
    if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
        return getattr(importlib.import_module(module), name)
    return None


def softmax_backward(grad_output, output, dim: int, input_dtype):
    """softmax's backward from its output: aten's `_softmax_backward_data` op, the kernel
    autograd runs (torch exposes no public function for it), as torch._softmax_backward_data."""
    import torch

    return torch._softmax_backward_data(grad_output, output, dim, input_dtype)


def log_softmax_backward(grad_output, output, dim: int, input_dtype):
    """log_softmax's backward from its output: aten's `_log_softmax_backward_data` op, the
    kernel autograd runs (torch exposes no public function for it)."""
    import torch

    return torch._log_softmax_backward_data(grad_output, output, dim, input_dtype)
