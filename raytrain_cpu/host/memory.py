"""The worker's allocator and resident memory: which malloc to preload, freeing kept pages, peak RSS.

jemalloc/tcmalloc keep freed activations for reuse without fragmenting; they must be preloaded
before the worker starts, so the driver puts them in the workers' LD_PRELOAD (`preload_env`).
Without them glibc malloc gets a fixed mmap threshold at its 32 MiB ceiling and a heap it does
not trim below twice that (`GLIBC_HEAP_THRESHOLD`), or the planner's calibration's 1 MiB
(`GLIBC_MMAP_THRESHOLD`) on request.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from raytrain_cpu.config.scaling import GLIBC_HEAP_THRESHOLD

# ----------------------------------------------------------------------------- allocator

ALLOCATOR_LIBS = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc.so.4", "libtcmalloc_minimal.so.4", "libtcmalloc.so"),
}
_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    "/lib64",
)
# Never purge freed pages on a timer: a training step frees and makes again the same tensors,
# and every page handed back faults in afresh (in a VM a host fault too). With a decay jemalloc
# returns a share of the dirty pages on every step, which measured slower than keeping them and
# than glibc. What a phase end leaves free (the sharded load's buffers, the engine's set-up, a
# checkpoint's save) goes back at once (`release_free_memory`), so RSS follows the training
# step's own peak.
#
# lg_extent_max_active_fit:16: jemalloc reuses a kept free extent for a request only when the
# extent is at most 2^lg_extent_max_active_fit times the request (default 6: 64x). Kept pages
# coalesce as neighbours are freed, and once a free extent outgrew 64x a step's smaller tensors
# those took fresh pages while the kept ones sat idle: RSS crept every step at a constant live
# size. With 2^16 any kept extent serves (split as needed) and RSS stays flat. Measurements:
# benchmarks/results/*/options-alloc.md, alloc-extent-fit-creep.md, options-extent-fit.md.
JEMALLOC_DEFAULT_FIT = "background_thread:false,metadata_thp:auto,dirty_decay_ms:-1,muzzy_decay_ms:-1"
JEMALLOC_CONF = JEMALLOC_DEFAULT_FIT + ",lg_extent_max_active_fit:16"


def bundled_jemalloc() -> str:
    """Ray's wheel ships jemalloc 5.3 (ray/core/libjemalloc.so, malloc unprefixed, so it can be
    preloaded): every install has one, without apt-get. '' when Ray is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    for d in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(d, "core", "libjemalloc.so")
        if os.path.isfile(path):
            return path
    return ""


def find_allocator(choice: str = "auto", search_dirs: Sequence[str] = ()) -> tuple[str, str]:
    """(name, library path) of the allocator to preload, or ('system', '') when none is found.

    'auto' prefers jemalloc, then tcmalloc (tcmalloc 2.x prints a warning to stderr for every
    allocation above 1 GiB, which an 8B model's embedding gradients hit).
    """
    if choice == "system":
        return "system", ""
    dirs = [
        *search_dirs,
        *(os.path.join(p, "lib") for p in (os.environ.get("CONDA_PREFIX", ""), sys.prefix) if p),
        *_LIB_DIRS,
    ]
    for name in ("jemalloc", "tcmalloc") if choice == "auto" else (choice,):
        for lib in ALLOCATOR_LIBS[name]:
            for d in dirs:
                path = os.path.join(d, lib)
                if os.path.isfile(path):
                    return name, path
        if name == "jemalloc" and (bundled := bundled_jemalloc()):  # after a system one (the cluster images')
            return name, bundled
    return "system", ""


# glibc serves allocations of at least M_MMAP_THRESHOLD bytes with their own mapping, returned
# to the OS when freed. By default that threshold is dynamic: each freed mapped block raises
# it to the block's size (up to 32 MiB), so from the first step on, activations and gathered
# layers come from the heap, where freed pieces of mixed sizes cannot all be reused. Fixing it
# (which also fixes the trim threshold) keeps each rank's RSS at its live memory, at the cost
# of page faults on every large allocation, which made training markedly slower. So it is
# opt-in (scaling.glibc_mmap_threshold) and the planner's calibration.
GLIBC_MMAP_THRESHOLD = 1 << 20


def preload_env(
    choice: str = "auto", glibc_mmap_threshold: int = GLIBC_HEAP_THRESHOLD, jemalloc_conf: str = ""
) -> dict[str, str]:
    """Env vars a worker process must start with for its allocator.

    jemalloc or tcmalloc when installed (LD_PRELOAD); otherwise glibc's fixed mmap threshold
    and twice it as its trim threshold (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_; 0 keeps
    glibc's dynamic ones; a value already in this process's environment wins).
    """
    name, path = find_allocator(choice)
    if not path:
        if not glibc_mmap_threshold:
            return {}
        return {
            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(glibc_mmap_threshold)),
            "MALLOC_TRIM_THRESHOLD_": os.environ.get("MALLOC_TRIM_THRESHOLD_", str(2 * glibc_mmap_threshold)),
        }
    env = {"LD_PRELOAD": ":".join(p for p in (path, os.environ.get("LD_PRELOAD", "")) if p)}
    if name == "jemalloc":
        env["MALLOC_CONF"] = os.environ.get("MALLOC_CONF", jemalloc_conf or JEMALLOC_CONF)
    return env


def release_free_memory() -> str:
    """Hands the pages malloc holds free back to the OS, at a phase end whose peak the training
    steps will not make again (JEMALLOC_CONF keeps them otherwise). Which call it made."""
    import ctypes

    libc = ctypes.CDLL(None)  # the process's global symbols: a preloaded jemalloc's come first
    malloc = allocator_in_use()
    if malloc == "jemalloc" and hasattr(libc, "mallctl"):
        libc.mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0))  # 4096: every arena
        return "jemalloc purge"
    if malloc == "system" and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(ctypes.c_size_t(0))  # every arena's free pages, not only the heap's top
        return "malloc_trim"
    return "none"


def freeze_gc_objects() -> None:
    """Moves every object alive now into the cyclic collector's permanent generation (gc.freeze):
    later collections skip them. A worker's start-up makes several hundred thousand long-lived
    objects (torch, transformers, DeepSpeed, the model); without this every full collection walks
    them all again: the interpreter's own, triggered by start-up's allocations, and the explicit
    gc.collect() DeepSpeed runs in each ZeRO engine's set-up. Called at phase ends whose objects
    live as long as the worker; garbage made after still goes by refcount or the next collection."""
    import gc

    gc.freeze()


def allocator_in_use(maps_path: str = "/proc/self/maps") -> str:
    """'jemalloc', 'tcmalloc' or 'system': what this process's malloc actually is (see malloc_setting)."""
    try:
        maps = Path(maps_path).read_text()
    except OSError:
        maps = ""
    maps += os.environ.get("LD_PRELOAD", "") if not maps else ""
    for name in ("jemalloc", "tcmalloc"):
        if f"lib{name}" in maps:
            return name
    return "system"


def malloc_setting() -> str:
    """The allocator with glibc's mmap threshold, e.g. 'system (mmap threshold 1048576)'."""
    name = allocator_in_use()
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if name != "system":
        return name
    return f"system (mmap threshold {threshold})" if threshold else "system (dynamic mmap threshold)"


def reset_peak_rss() -> bool:
    """Resets VmHWM so the next peak read covers only what follows (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM: the peak resident set size since start or since reset_peak_rss()."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0
