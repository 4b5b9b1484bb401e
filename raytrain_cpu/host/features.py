"""Know the CPU: ISA flags, topology, memory, the C++ compiler, IPEX, and a forced dtype.

Cheap reads of /proc and /sys on a worker (or the driver, for its own node). The parsers take
their inputs as arguments so the unit tests can feed them the topology of machines we don't
have, such as a two-socket node.

bf16 is fast only with AMX (`amx_bf16`) or at least AVX-512 BF16; elsewhere it is emulated and
slower than fp32. Hyperthreads share a core's matrix units, so threads follow physical cores
(raytrain_cpu.host.threads), not Ray's vCPU count.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# ----------------------------------------------------------------------------- features

# Flags from /proc/cpuinfo that change what runs fast, strongest first.
ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx512_vnni", "avx2", "fma")


@dataclass
class CpuFeatures:
    """What a node's CPUs offer (logged once per worker, recorded in summary.json)."""

    model_name: str = ""
    vendor: str = ""
    flags: dict[str, bool] = field(default_factory=dict)
    """The ISA_FLAGS present (amx_bf16, avx512_bf16, avx512f, avx2, ...)."""
    sockets: int = 1
    physical_cores: int = 1
    vcpus: int = 1
    threads_per_core: int = 1
    numa_nodes: int = 1
    numa_cpus: list[list[int]] = field(default_factory=list)
    """vCPU ids of each NUMA node."""
    cores: list[list[int]] = field(default_factory=list)
    """Each physical core as [socket, core id, vCPU ids...], ordered by socket then core."""
    allowed_cpus: list[int] = field(default_factory=list)
    """vCPUs this process may run on (sched_getaffinity)."""
    memory_bytes: int = 0
    """The node's memory: MemTotal, or a container's cgroup limit when lower (0: unknown)."""

    @property
    def usable_cores(self) -> int:
        """Physical cores this process may run on: all of them, unless an affinity mask
        (taskset, numactl, a container's cpuset) leaves fewer."""
        if not self.allowed_cpus or not self.cores:
            return self.physical_cores
        allowed = set(self.allowed_cpus)
        return max(1, sum(1 for core in self.cores if allowed.intersection(core[2:])))

    @property
    def best_isa(self) -> str:
        """The strongest matrix ISA: 'amx_bf16', 'avx512_bf16', 'avx512f', 'avx2' or 'baseline'."""
        for name in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"):
            if self.flags.get(name):
                return name
        return "baseline"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["best_isa"] = self.best_isa
        d.pop("cores")  # one row per core is noise in a summary; the counts say it
        return d

    @property
    def slug(self) -> str:
        """A folder name for this machine's benchmark results, e.g. 'amd-epyc-avx512_bf16'."""
        name = re.sub(r"\((r|tm)\)|\bcpu\b|\bprocessor\b|@.*", " ", (self.model_name or "unknown cpu").lower())
        return "-".join([*re.findall(r"[a-z0-9]+", name), self.best_isa])

    def describe(self) -> str:
        isa = ", ".join(k for k, v in self.flags.items() if v) or "no AVX"
        return (
            f"{self.model_name or 'unknown CPU'}: {self.sockets} socket(s), {self.physical_cores} physical cores, "
            f"{self.vcpus} vCPUs ({self.threads_per_core} per core), {self.numa_nodes} NUMA node(s); {isa}"
        )


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the format of /sys cpulist files)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def parse_cpuinfo(text: str) -> tuple[dict[str, str], list[tuple[int, int, int]]]:
    """/proc/cpuinfo -> (first processor's fields, [(vCPU, socket, core id), ...]).

    Hypervisors sometimes omit 'physical id'/'core id'; then every vCPU counts as a core
    of socket 0, which is the safe reading (no thread count gets halved by mistake).
    """
    first: dict[str, str] = {}
    cpus: list[tuple[int, int, int]] = []
    block: dict[str, str] = {}
    for line in text.splitlines() + [""]:
        if line.strip():
            key, _, value = line.partition(":")
            block[key.strip()] = value.strip()
            continue
        if "processor" in block:
            cpu = int(block["processor"])
            cpus.append((cpu, int(block.get("physical id", 0)), int(block.get("core id", cpu))))
            first = first or dict(block)
        block = {}
    return first, cpus


def summarize_topology(
    cpus: Sequence[tuple[int, int, int]],
    numa: dict[int, list[int]],
    flags: Iterable[str],
    model_name: str = "",
    vendor: str = "",
) -> CpuFeatures:
    """Counts and core groups from (vCPU, socket, core) triples and the NUMA map."""
    by_core: dict[tuple[int, int], list[int]] = {}
    for cpu, socket, core in cpus:
        by_core.setdefault((socket, core), []).append(cpu)
    cores = [[s, c, *sorted(v)] for (s, c), v in sorted(by_core.items())]
    flag_set = set(flags)
    vcpus = max(1, len(cpus))
    physical = max(1, len(by_core))
    numa_cpus = [sorted(v) for _, v in sorted(numa.items())] or [sorted(c for c, _, _ in cpus)]
    return CpuFeatures(
        model_name=model_name,
        vendor=vendor,
        flags={f: f in flag_set for f in ISA_FLAGS},
        sockets=max(1, len({s for _, s, _ in cpus})),
        physical_cores=physical,
        vcpus=vcpus,
        threads_per_core=max(1, vcpus // physical),
        numa_nodes=max(1, len(numa_cpus)),
        numa_cpus=numa_cpus,
        cores=cores,
    )


def _sysfs_topology(root: str) -> list[tuple[int, int, int]]:
    """(vCPU, socket, core) from /sys/devices/system/cpu/cpu*/topology; [] when absent."""
    out = []
    for d in glob.glob(os.path.join(root, "cpu[0-9]*")):
        topo = Path(d) / "topology"
        try:
            socket = int((topo / "physical_package_id").read_text())
            core = int((topo / "core_id").read_text())
        except (OSError, ValueError):
            return []
        out.append((int(Path(d).name[3:]), socket, core))
    return sorted(out)


def _numa_map(root: str) -> dict[int, list[int]]:
    nodes = {}
    for d in glob.glob(os.path.join(root, "node[0-9]*")):
        try:
            nodes[int(Path(d).name[4:])] = parse_cpulist((Path(d) / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return {n: c for n, c in nodes.items() if c}


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """Every flag the first CPU in `cpuinfo` lists (empty when unreadable): what a build for
    this CPU needs, beyond the ISA_FLAGS CpuFeatures records."""
    try:
        return set(parse_cpuinfo(Path(cpuinfo).read_text())[0].get("flags", "").split())
    except OSError:
        return set()


def cpu_features(
    cpuinfo: str = "/proc/cpuinfo",
    cpu_root: str = "/sys/devices/system/cpu",
    node_root: str = "/sys/devices/system/node",
) -> CpuFeatures:
    """This machine's CPU features and topology (lscpu's view, without lscpu)."""
    try:
        first, cpus = parse_cpuinfo(Path(cpuinfo).read_text())
    except OSError:
        first, cpus = {}, []
    online = {c for c, _, _ in cpus}
    topo = [t for t in _sysfs_topology(cpu_root) if not online or t[0] in online] or cpus
    if not topo:
        n = os.cpu_count() or 1
        topo = [(c, 0, c) for c in range(n)]
    feats = summarize_topology(
        topo,
        _numa_map(node_root),
        first.get("flags", "").split(),
        first.get("model name", ""),
        first.get("vendor_id", ""),
    )
    try:
        feats.allowed_cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        feats.allowed_cpus = [c for c, _, _ in topo]
    feats.memory_bytes = memory_bytes()
    return feats


def memory_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
    """This machine's memory as its processes get it: MemTotal, or the cgroup's limit when lower
    (a Kubernetes pod's, v2 memory.max or v1 limit_in_bytes); 0 when neither can be read."""
    sizes = []
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(line for line in Path(meminfo).read_text().splitlines() if line.startswith("MemTotal:"))
        sizes.append(int(line.split()[1]) * 1024)
    for limit in ("memory.max", "memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            sizes.append(int((Path(cgroup) / limit).read_text().strip()))  # "max": no limit
    return min(sizes, default=0)


# ----------------------------------------------------------------------------- IPEX


def ipex_status() -> dict[str, Any]:
    """Whether Intel Extension for PyTorch imports and matches torch (it is used only then).

    IPEX's last release (2.8) pins torch 2.8, so with this project's torch it is normally
    absent; plain PyTorch reaches AMX through oneDNN anyway.
    """
    import importlib.util

    import torch

    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return {"available": False, "reason": "not installed"}
    try:
        import intel_extension_for_pytorch as ipex
    except Exception as e:  # an ABI mismatch raises anything from ImportError to OSError
        return {"available": False, "reason": f"import failed: {e.__class__.__name__}"}
    same = ipex.__version__.split(".")[:2] == torch.__version__.split(".")[:2]
    return {
        "available": same,
        "version": ipex.__version__,
        "reason": "" if same else f"built for another torch ({torch.__version__})",
    }


# ----------------------------------------------------------------------------- forced dtype


# model.dtype=auto's pick, forced: 'bf16' or 'fp32'. A test and debugging setting, not a
# config key: a suite run on a bf16 host with fp32 forced (or the reverse) shows a test that
# holds only for its own host's pick. Read by every worker, so it must be in the workers'
# environment (a local Ray started from a shell that sets it inherits it).
FORCE_AUTO_DTYPE = "RAYTRAIN_DTYPE_AUTO"


def forced_auto_dtype() -> str | None:
    """The dtype $RAYTRAIN_DTYPE_AUTO forces model.dtype=auto to ('bf16' or 'fp32'); None when unset."""
    value = os.environ.get(FORCE_AUTO_DTYPE, "").strip().lower()
    if not value:
        return None
    if value not in ("bf16", "fp32"):
        raise ValueError(
            f"{FORCE_AUTO_DTYPE}={os.environ[FORCE_AUTO_DTYPE]!r}: model.dtype=auto can be forced to bf16 or fp32; "
            f"set one of them or unset {FORCE_AUTO_DTYPE} to let the GEMM probe decide"
        )
    return value


# ----------------------------------------------------------------------------- C++ compiler


def cpp_compiler_name() -> str:
    """The C++ compiler inductor builds with: $CXX, else g++ (torch._inductor's config.cpp.cxx)."""
    return os.environ.get("CXX") or "g++"


def cpp_compiler() -> str:
    """cpp_compiler_name() found on PATH; '' where it is not."""
    import shutil

    return shutil.which(cpp_compiler_name()) or ""


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, total) core-seconds of this whole machine since boot, every process's (/proc/stat;
    busy leaves out idle and iowait): what a test or a benchmark cost the machine, Ray's
    processes included, is the difference of two readings."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / hz, sum(ticks) / hz
