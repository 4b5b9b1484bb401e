"""A training worker's set-up on its host: threads, allocator facts, the training dtype, torch.compile."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from raytrain_cpu.host.features import FORCE_AUTO_DTYPE, cpp_compiler_name, cpu_features, forced_auto_dtype, ipex_status
from raytrain_cpu.host.gemm import choose_dtype
from raytrain_cpu.host.memory import allocator_in_use, malloc_setting
from raytrain_cpu.host.threads import place_threads
from raytrain_cpu.model.shape import gemms_for_model

# ----------------------------------------------------------------------------- worker set-up


def setup_worker(
    requested_dtype: str,
    model_dir: str,
    tokens_per_micro_batch: int,
    threads: int,
    local_rank: int,
    local_world: int,
    pin: bool,
    agree: Callable[[list[float]], list[float]],
    resumed_dtype: str | None = None,
) -> dict[str, Any]:
    """Places this worker's threads and settles the training dtype; returns the facts for summary.json.

    A resumed run keeps its checkpoint's dtype (bf16 and fp32 optimizer states don't load
    into each other); otherwise `choose_dtype` decides, identically on every rank, unless
    $RAYTRAIN_DTYPE_AUTO forces 'auto' (forced_auto_dtype).
    """
    feats = cpu_features()
    placement = place_threads(threads, local_rank, local_world, pin, feats)
    choice = choose_dtype(requested_dtype, gemms_for_model(model_dir, tokens_per_micro_batch), agree)
    forced = forced_auto_dtype()
    if requested_dtype == "auto" and forced:
        choice |= {
            "dtype": forced,
            "reason": f"auto: {forced}, forced by {FORCE_AUTO_DTYPE} (measured: {choice['reason']})",
        }
        choice["peak_flops_per_s"] = choice[f"{forced}_flops_per_s"]
    if resumed_dtype and resumed_dtype != choice["dtype"]:
        choice |= {"dtype": resumed_dtype, "reason": f"{resumed_dtype} from the checkpoint being resumed"}
        choice["peak_flops_per_s"] = choice[f"{resumed_dtype}_flops_per_s"]
    return {
        "features": feats.to_dict(),
        "placement": placement,
        "allocator": allocator_in_use(),
        "malloc": malloc_setting(),
        "ipex": ipex_status(),
        "dtype": choice,
    }


def describe_setup(rank: int, setup: dict[str, Any]) -> str:
    """One log line per worker: CPU, threads, pinning, allocator, dtype."""
    f, pl = setup["features"], setup["placement"]
    pinned = f"pinned to CPUs {pl['pinned_cpus']}" if pl["pinned_cpus"] else "not pinned"
    return (
        f"[rank {rank}] cpu: {f['model_name']} ({f['best_isa']}, {f['physical_cores']} cores / {f['vcpus']} vCPUs, "
        f"{f['sockets']} socket(s), {f['numa_nodes']} NUMA); {pl['intra_op_threads']} intra-op + "
        f"{pl['inter_op_threads']} inter-op threads, {pinned}; malloc {setup['malloc']}; "
        f"dtype {setup['dtype']['dtype']} ({setup['dtype']['reason']})"
    )


# ----------------------------------------------------------------------------- torch.compile


def compile_auto(n_params: int, dtype: str, attention_span: str, compiler: str) -> tuple[bool, str]:
    """model.compile=auto for a model of `n_params` parameters training in `dtype` ('bf16' or
    'fp32', as resolved) with data.attention_span and inductor's C++ compiler ('' for none):
    whether to compile, and why not where the model is large enough for it to pay ('' else).

    Per-layer compile paid in bf16 at the bench model on every host measured, and cost more than
    it saved on the tiny embedded default (COMPILE_AUTO_MIN_PARAMS lies between). In fp32 (a CPU
    without bf16 GEMMs) the GEMMs take more of the step and compiling lost. Document masks send a
    compiled layer's attention to SDPA.
    """
    from raytrain_cpu.config.model import COMPILE_AUTO_MIN_PARAMS

    if n_params < COMPILE_AUTO_MIN_PARAMS:
        return False, ""
    if dtype != "bf16":
        return False, "training in fp32 (no bf16 GEMMs here), where compiling has not paid"
    if attention_span == "document":
        return False, "document masks (data.attention_span=document) would put SDPA in the compiled layers"
    if not compiler:
        return False, f"no C++ compiler for inductor ({cpp_compiler_name()}; apt-get install g++)"
    return True, ""


def _use_compile_cache(cache_dir: str) -> None:
    """Inductor compiles C++ per graph with the host compiler: minutes on a few cores the first
    time, seconds from this cache after that (every rank and every later run reads it)."""
    os.makedirs(cache_dir, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    from raytrain_cpu.compat.torch import enable_fx_graph_cache

    enable_fx_graph_cache()


def compile_engine(engine, cache_dir: str) -> None:
    """torch.compile (inductor) of the whole model through DeepSpeed (model.compile_scope=model)."""
    _use_compile_cache(cache_dir)
    engine.compile(backend="inductor")


def compile_layers(layers, cache_dir: str) -> int:
    """torch.compile (inductor) of each layer's forward (model.compile_scope=layers).

    The forward, not the module: the module's call runs ZeRO-3's gather and release hooks,
    which must stay outside the graph. Every layer runs the same code, so the graph compiled
    for the first is reused by the rest. Returns the number of layers compiled.
    """
    import torch

    _use_compile_cache(cache_dir)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend="inductor")
    return len(layers)
