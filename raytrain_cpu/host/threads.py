"""Place a worker's threads: intra-op threads per physical core, one rank per socket, pinning.

One intra-op thread per owned physical core, one inter-op thread, and optional pinning of the
whole worker process to its cores (on a two-socket node: one socket per rank, so memory stays
NUMA-local).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raytrain_cpu.host.features import CpuFeatures, cpu_features


def affinity_cpus() -> int | None:
    """vCPUs this process may run on, when an affinity mask leaves fewer than the machine has.

    Ray counts every vCPU of the machine (or its cgroup quota), not the process's affinity, so
    under `taskset -c 0,1` on a 16-vCPU host it would hand 2 workers 7 threads each on 2 vCPUs.
    None when nothing narrows the machine.
    """
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return allowed if allowed < (os.cpu_count() or allowed) else None


# ----------------------------------------------------------------------------- thread placement


def threads_per_worker(
    cpus_per_worker: float, threads_per_core: int, physical_cores: int, workers_per_node: int
) -> int:
    """Intra-op threads = physical cores behind the worker's Ray CPUs, capped at its share of the node.

    Ray counts vCPUs; two hyperthreads share one core's FMA/AMX units, so a thread per vCPU
    only adds contention.
    """
    from_cpus = int(max(cpus_per_worker, 1.0) // max(threads_per_core, 1))
    share = physical_cores // max(workers_per_node, 1)
    return max(1, min(from_cpus, share) if share else from_cpus)


def default_workers_per_node(sockets: int) -> int:
    """One rank per socket: a rank's threads and memory then stay on one NUMA domain."""
    return max(1, sockets)


def rank_cores(
    cores: Sequence[Sequence[int]], sockets: int, local_rank: int, local_world: int, threads: int
) -> list[int]:
    """vCPUs for `local_rank` to pin to: `threads` physical cores (with their hyperthreads).

    `cores` rows are [socket, core id, vCPU...], ordered by socket. Ranks split the node's
    cores in contiguous runs, so with one rank per socket each rank gets its own socket;
    the cores a rank owns but does not use stay free for data loading.
    """
    if local_world <= 0 or not cores:
        return []
    per_rank = len(cores) // local_world
    if sockets >= local_world and sockets % local_world == 0:
        socket_ids = sorted({row[0] for row in cores})
        mine = set(socket_ids[local_rank * sockets // local_world : (local_rank + 1) * sockets // local_world])
        owned = [row for row in cores if row[0] in mine]
    else:
        owned = (
            list(cores[local_rank * per_rank : (local_rank + 1) * per_rank])
            if per_rank
            else [cores[local_rank % len(cores)]]
        )
    chosen = owned[: max(1, threads)]
    return sorted(cpu for row in chosen for cpu in row[2:])


def _pin_all_threads(cpus: Sequence[int]) -> int:
    """sched_setaffinity on every thread of this process; returns how many were pinned.

    Setting it on pid 0 only moves the calling thread; OpenMP, gloo and Ray threads that
    already exist keep their old masks, and threads started later inherit from their creator.
    """
    pinned = 0
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), set(cpus))
            pinned += 1
        except OSError:
            pass  # a thread that exited in between
    return pinned


def openmp_runtime() -> str:
    """Which OpenMP runtime is loaded: 'libgomp' (PyTorch wheels), 'libiomp5' (Intel) or ''."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ""
    for name in ("libiomp5", "libgomp", "libomp"):
        if name in maps:
            return name
    return ""


def place_threads(
    threads: int, local_rank: int, local_world: int, pin: bool, feats: CpuFeatures | None = None
) -> dict[str, Any]:
    """Sets this worker's torch threads and (optionally) pins it to its cores; returns what it did.

    OpenMP affinity is set by pinning, not OMP_PROC_BIND: libgomp reads OMP_PROC_BIND and
    OMP_PLACES once, when torch is imported, and binds its first thread to the first
    place of the whole node, so every rank on a node would land on core 0. Pinning every
    thread of the process to the rank's cores after the rank is known has the effect
    OMP_PROC_BIND=close + OMP_PLACES=cores was meant to have, per rank.
    """
    import torch

    torch.set_num_threads(threads)
    interop = torch.get_num_interop_threads()
    if interop != 1:
        try:
            torch.set_num_interop_threads(1)  # only jit.fork uses it; one thread is enough
            interop = 1
        except RuntimeError:
            pass  # already started (Ray Train may have run torch work); harmless
    out: dict[str, Any] = {
        "intra_op_threads": torch.get_num_threads(),
        "inter_op_threads": interop,
        "openmp": openmp_runtime(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "pinned_cpus": None,
    }
    if pin:
        feats = feats or cpu_features()
        cpus = rank_cores(feats.cores, feats.sockets, local_rank, local_world, threads)
        allowed = set(feats.allowed_cpus)
        cpus = [c for c in cpus if not allowed or c in allowed]
        if cpus:
            _pin_all_threads(cpus)
            out["pinned_cpus"] = cpus
    return out
