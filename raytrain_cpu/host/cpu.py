"""Know the CPU and place work on it: features, GEMM probes, dtype choice, threads, allocator.

Everything here runs on a training worker (or the driver, for the node it sits on) and is
cheap: reading /proc and /sys, plus a sub-second GEMM probe. The pure helpers (parsing,
placement arithmetic, FLOP counting) take their inputs as arguments so the unit tests can
feed them the topology of machines we don't have, such as a two-socket c7i.48xlarge.

Why each piece exists:

* **features**: bf16 is fast only with AMX (`amx_bf16`, Sapphire Rapids and later) or at
  least AVX-512 BF16; elsewhere it is emulated and slower than fp32. Hyperthreads share a
  core's matrix units, so threads should follow physical cores, not Ray's vCPU count.
* **probe**: flags say what the CPU can do, not what oneDNN/MKL make of it in this VM at
  these shapes, so the dtype decision is measured (`choose_dtype`).
* **placement**: one intra-op thread per owned physical core, one inter-op thread, and
  optional pinning of the whole worker process to its cores (on a two-socket node: one
  socket per rank, so memory stays NUMA-local).
* **allocator**: jemalloc/tcmalloc keep freed activations for reuse without fragmenting; they
  must be preloaded before the worker starts, so the driver puts them in the workers'
  LD_PRELOAD (`preload_env`). Without them glibc malloc gets a fixed mmap threshold at its
  32 MiB ceiling and a heap it does not trim below twice that (`GLIBC_HEAP_THRESHOLD`), or
  the planner's calibration's 1 MiB (`GLIBC_MMAP_THRESHOLD`) on request.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from raytrain_cpu.config.scaling import GLIBC_HEAP_THRESHOLD

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


# ----------------------------------------------------------------------------- GEMM shapes


@dataclass(frozen=True)
class Gemm:
    """One matrix product C[m,n] = A[m,k] @ B[k,n] the model runs `count` times per micro batch."""

    name: str
    m: int
    k: int
    n: int
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def llama_gemms(
    hidden: int,
    intermediate: int,
    num_heads: int,
    num_kv_heads: int,
    vocab: int,
    num_layers: int,
    tokens: int,
    training: bool = True,
    head_dim: int = 0,
) -> list[Gemm]:
    """The weight GEMMs of one Llama micro batch of `tokens` tokens; `head_dim` the config's own
    where it names one (Gemma-7B: 256, not hidden // heads = 192), 0 for hidden // heads.

    Forward is x[t,in] @ Wᵀ; backward adds the input gradient g[t,out] @ W and the weight
    gradient gᵀ[out,t] @ x[t,in]. Same-shape products are merged into one row with a count.
    """
    from raytrain_cpu.planner.memory import ModelShape

    shape = ModelShape("", 0, hidden, intermediate, num_layers, num_heads, num_kv_heads, attention_head_dim=head_dim)
    q, kv = shape.q_dim, shape.kv_dim
    linears = [  # (in, out, count per model); with kv == hidden the shapes repeat and merge below
        (hidden, q, num_layers),  # q
        (q, hidden, num_layers),  # o
        (hidden, kv, 2 * num_layers),  # k, v
        (hidden, intermediate, 2 * num_layers),  # gate, up
        (intermediate, hidden, num_layers),  # down
        (hidden, vocab, 1),  # lm_head
    ]
    merged: dict[tuple[int, int], int] = {}
    for fin, fout, count in linears:
        merged[(fin, fout)] = merged.get((fin, fout), 0) + count
    out = []
    for (fin, fout), count in merged.items():
        out.append(Gemm(f"fwd {fin}->{fout}", tokens, fin, fout, count))
        if training:
            out.append(Gemm(f"dgrad {fout}->{fin}", tokens, fout, fin, count))
            out.append(Gemm(f"wgrad {fin}x{fout}", fout, tokens, fin, count))
    return out


# ----------------------------------------------------------------------------- GEMM probe


def _operands(g: Gemm, dtype):
    """Operands laid out as autograd has them: Wᵀ for forward, a transposed gradient for wgrad."""
    import torch

    if g.name.startswith("fwd"):
        return torch.randn(g.m, g.k, dtype=dtype), torch.randn(g.n, g.k, dtype=dtype).t()
    if g.name.startswith("wgrad"):
        return torch.randn(g.k, g.m, dtype=dtype).t(), torch.randn(g.k, g.n, dtype=dtype)
    return torch.randn(g.m, g.k, dtype=dtype), torch.randn(g.k, g.n, dtype=dtype)


def time_calls(fn: Callable[[], object], min_time_s: float = 0.2, warmup: int = 2) -> tuple[float, float]:
    """(best, mean) seconds per call of `fn` over timed batches of ~50 ms for at least
    `min_time_s`, after `warmup` calls: the best batch (noise only ever adds time) and every
    timed call's mean (the rate the host gave over those seconds)."""
    for _ in range(warmup):
        fn()
    best, spent, reps, calls = float("inf"), 0.0, 1, 0
    while spent < min_time_s:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        dt = time.perf_counter() - t0
        best, spent, calls = min(best, dt / reps), spent + dt, calls + reps
        reps = max(1, min(reps * 2, int(0.05 / max(best, 1e-9))))  # batches of ~50 ms
    return best, spent / calls


def best_seconds(fn: Callable[[], object], min_time_s: float = 0.2, warmup: int = 2) -> float:
    """Seconds per call of `fn`: the best of timed batches (time_calls)."""
    return time_calls(fn, min_time_s, warmup)[0]


def time_gemm(
    g: Gemm, dtype, min_time_s: float = 0.2, warmup: int = 2, weight_grad: Callable | None = None
) -> tuple[float, float]:
    """(best, mean) seconds per call of one GEMM (time_calls), its operands laid out as autograd
    has them; a weight gradient by `weight_grad(dy, x)` instead where the model runs one
    (model.weight_grad_kernel: raytrain_cpu.model.ops.linear.weight_grad)."""
    import torch

    if weight_grad is not None and g.name.startswith("wgrad"):
        dy, x = torch.randn(g.k, g.m, dtype=dtype), torch.randn(g.k, g.n, dtype=dtype)
        return time_calls(lambda: weight_grad(dy, x), min_time_s, warmup)
    a, b = _operands(g, dtype)
    return time_calls(lambda: torch.mm(a, b), min_time_s, warmup)


def gemm_probe(
    gemms: Sequence[Gemm], dtype, min_time_s: float = 0.2, weight_grad: Callable | None = None
) -> dict[str, Any]:
    """FLOP/s of a GEMM mix on this process's threads.

    `flops_per_s` weights each shape by how often the model runs it (total FLOPs over
    total time): the rate a step made only of these GEMMs would reach, which is the
    denominator MFU needs. `best_flops_per_s` is the fastest single shape. Both from each
    shape's best batch; `mean_flops_per_s` is the mix's rate from every timed call instead.
    """
    rows, total_flops, total_time, total_mean = [], 0.0, 0.0, 0.0
    for g in gemms:
        t, mean = time_gemm(g, dtype, min_time_s, weight_grad=weight_grad)
        rows.append({"name": g.name, "m": g.m, "k": g.k, "n": g.n, "count": g.count, "gflops": g.flops / t / 1e9})
        total_flops += g.flops * g.count
        total_time += t * g.count
        total_mean += mean * g.count
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "flops_per_s": total_flops / total_time if total_time else 0.0,
        "mean_flops_per_s": total_flops / total_mean if total_mean else 0.0,
        "best_flops_per_s": max((r["gflops"] for r in rows), default=0.0) * 1e9,
        "shapes": rows,
    }


PROBE_MAX_BYTES = 512e6  # a probed GEMM's fp32 operands at most (an 8B model's vocabulary head would take GBs)


def fp32_operand_bytes(m: int, k: int, n: int) -> float:
    return 4.0 * (m * k + k * n + m * n)


def probe_gemms(gemms: Sequence[Gemm], max_tokens: int = 1024, max_bytes: float = PROBE_MAX_BYTES) -> list[Gemm]:
    """A cheap subset for the start-up dtype probe: forward shapes, token dimension capped, and
    none whose fp32 operands exceed `max_bytes` (an 8B model's vocabulary head would take GBs)."""
    out = []
    for g in gemms:
        m = min(g.m, max_tokens)
        if g.name.startswith("fwd") and fp32_operand_bytes(m, g.k, g.n) <= max_bytes:
            out.append(Gemm(g.name, m, g.k, g.n, g.count))
    return out


def decide_dtype(requested: str, bf16_flops: float, fp32_flops: float, margin: float = 1.05) -> tuple[str, str]:
    """(dtype, reason): 'auto' takes bf16 only when it measured at least `margin` x fp32.

    An explicit 'bf16' or 'fp32' is kept; when bf16 was asked for and measured slower the
    reason says so (the caller warns).
    """
    ratio = bf16_flops / fp32_flops if fp32_flops > 0 else float("inf")
    measured = f"bf16 GEMM {bf16_flops / 1e9:.1f} GFLOP/s vs fp32 {fp32_flops / 1e9:.1f} GFLOP/s ({ratio:.2f}x)"
    if requested != "auto":
        slow = requested == "bf16" and ratio < 1.0
        return requested, f"{requested} as configured; {measured}" + ("; bf16 is slower here" if slow else "")
    if ratio >= margin:
        return "bf16", f"auto: {measured}"
    return "fp32", f"auto: {measured}; bf16 is not faster on this CPU, training in fp32"


def choose_dtype(
    requested: str,
    gemms: Sequence[Gemm],
    agree: Callable[[list[float]], list[float]] | None = None,
    min_time_s: float = 0.02,
) -> dict[str, Any]:
    """Probes bf16 and fp32 at the model's GEMM shapes and picks per decide_dtype.

    `agree` averages the measurements over ranks (an all-reduce), so every rank takes the
    same decision: a split one would give the ranks different DeepSpeed configs. Both
    dtypes are probed even when one is configured (the log says when bf16 is the slower);
    MFU's denominator is timed again once the worker is set up (time_peak_flops), since this
    probe runs beside Ray's start-up. 20 ms a shape and dtype: time_gemm keeps the best of
    doubling batches, which measured the same GFLOP/s as 100 ms for the tiny, 50M and 0.5B
    shapes (within the host's run-to-run noise), and costs every worker start 0.3 s instead
    of 1.3 s at tiny size.
    """
    import torch

    probe = probe_gemms(gemms)
    bf16 = gemm_probe(probe, torch.bfloat16, min_time_s)["flops_per_s"]
    fp32 = gemm_probe(probe, torch.float32, min_time_s)["flops_per_s"]
    if agree is not None:
        bf16, fp32 = agree([bf16, fp32])
    dtype, reason = decide_dtype(requested, bf16, fp32)
    if (dtype == "fp32" and requested == "auto") or "slower" in reason:
        warnings.warn(reason, stacklevel=2)
    return {
        "dtype": dtype,
        "requested": requested,
        "reason": reason,
        "bf16_flops_per_s": bf16,
        "fp32_flops_per_s": fp32,
        "peak_flops_per_s": bf16 if dtype == "bf16" else fp32,
    }


def time_peak_flops(
    gemms: Sequence[Gemm],
    dtype: str,
    agree: Callable[[list[float]], list[float]] | None = None,
) -> float:
    """The per-worker GEMM rate MFU is logged against, timed again once the worker is set up.

    The start-up probe (choose_dtype) runs while Ray still starts the data pipeline's processes
    beside the workers: on a 2-core host it read half the rate (the ~50M model's shapes: bf16
    99.8 and 103.5 GFLOP/s, against 205.9 timed after the engine's set-up and 205.5 in `bench
    train`'s GEMM peak), and the logged MFU read 120-147%. Its bf16/fp32 ratio, both timed in
    the same conditions, still decides the dtype; MFU's denominator is the faster of the two
    timings of the chosen dtype (train.time_mfu_peak). `agree` averages it over ranks, as
    choose_dtype's does."""
    import torch

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    rate = gemm_probe(probe_gemms(gemms), torch_dtype, min_time_s=0.02)["flops_per_s"]
    return agree([rate])[0] if agree is not None else rate


def time_training_mix(
    gemms: Sequence[Gemm],
    dtype: str,
    agree: Callable[[list[float]], list[float]] | None = None,
    weight_grad: Callable | None = None,
) -> tuple[float, float]:
    """(peak, mean) FLOP/s of the whole training mix, for train.mfu_probe_every, timed the way
    `bench train`'s peak is: forward, input and weight gradients at the micro batch's tokens (the
    weight gradients run at about half the forward's rate), 0.2 s a shape, two rounds (shapes
    whose operands exceed 512 MB left out, as in the start-up subset). At 0.02 s a shape the rate
    read lower and scattered (386-872 GFLOP/s against 860-904, alternating in the same two
    processes, the ~50M model on the AMX host), which would flatter MFU.

    `peak` is the better round, each shape at its best ~50 ms batch. `mean` is the rate over
    every timed call of both rounds: what the host gave on average. They differ where the host
    slows the cores in spells: the 2-vCPU AMX VM ran one bf16 GEMM at 1x or 2-2.7x its best time
    in spells of ~30 and ~100 ms (all operations slowed together, the GEMMs most), and the best
    batches time only the fast spells while a step runs through both. `agree` averages both
    over ranks. `weight_grad`: the weight gradients as the model runs them (time_gemm)."""
    import torch

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    mix = [g for g in gemms if fp32_operand_bytes(g.m, g.k, g.n) <= PROBE_MAX_BYTES]
    rounds = [gemm_probe(mix, torch_dtype, min_time_s=0.2, weight_grad=weight_grad) for _ in range(2)]
    peak = max(r["flops_per_s"] for r in rounds)
    mean = len(rounds) / sum(1.0 / r["mean_flops_per_s"] for r in rounds)  # equal FLOPs a round
    return tuple(agree([peak, mean])) if agree is not None else (peak, mean)


@functools.lru_cache(maxsize=8)
def gemms_for_model(model_dir: str, tokens: int) -> list[Gemm]:
    """llama_gemms for a Hugging Face model directory (config.json only, no weights; GPT-2 style
    key names too). Cached: the start-up probe and MFU's second timing read the same config."""
    from raytrain_cpu.model.loading import model_dims

    d = model_dims(model_dir)
    return llama_gemms(
        hidden=d["hidden_size"],
        intermediate=d["intermediate_size"],
        num_heads=d["num_heads"],
        num_kv_heads=d["num_kv_heads"],
        vocab=d["vocab_size"],
        num_layers=d["num_layers"],
        tokens=tokens,
        head_dim=d["head_dim"] or 0,
    )


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
# and every page handed back faults in afresh (in a VM a host fault too: the 16 MB tensors of
# the bench model's loss took 25-45 ms an operation under the profiler, 0.2-0.4 ms with their
# pages kept). With a decay jemalloc returns a share of the dirty pages on every step. The
# bench model on the Zen 5 host (`benchmarks/results/amd-epyc-zen5-avx512_bf16/
# options-alloc.md`, order-balanced): 1,509 and 1,622 tokens/s at 2.57 GB peak per rank,
# against glibc's 32 MiB heap 1,480 and 1,505 at 2.85 GB and jemalloc with a 30 s decay (the
# setting until then) 1,343 and 1,323 at 2.39 GB; a worker took 0.6k page faults a second
# against 13.7k with glibc. What a phase end leaves free (the sharded load's buffers, the
# engine's set-up, a checkpoint's save) goes back at once (`release_free_memory`),
# so RSS follows the training step's own peak. On the AMX host, without those purges and with
# eight suites sharing the socket, never purging ran at 0.99x and 1.01x glibc's dynamic
# thresholds (`benchmarks/results/intel-xeon-amx_bf16/options-lease4b-alloc-*`).
#
# lg_extent_max_active_fit:16: jemalloc reuses a kept free extent for a request only when the
# extent is at most 2^lg_extent_max_active_fit times the request (default 6: 64x). Kept pages
# coalesce as neighbours are freed, and once a free extent outgrew 64x a step's smaller tensors
# those took fresh pages while the kept ones sat idle: RSS crept every step at a constant live
# size (a 16-layer, hidden-64 model: 0.72 -> 1.25 GiB in 150 steps, 2.02 with one arena). With
# 2^16 any kept extent serves (split as needed): flat at 0.69-0.70 GiB in four runs; the bench
# model 1.05x and 1.04x faster at the same 3.53 GB peak (`benchmarks/results/
# amd-epyc-avx512_bf16/alloc-extent-fit-creep.md`, `options-extent-fit.md`).
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
# of page faults on every large allocation. Measured on the 37M calibration model, micro
# batch 8, 2 ranks: peak RSS 3.11 GiB dynamic, 2.10 GiB at 1 MiB, 2.07 GiB at 64 KiB, 3.10
# GiB at 8 MiB; on the ~50M bench model the fixed 1 MiB ran at 0.73-0.77x the dynamic one's
# tokens/s. So it is opt-in (scaling.glibc_mmap_threshold) and the planner's calibration.
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


# ----------------------------------------------------------------------------- worker set-up


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


def cpp_compiler_name() -> str:
    """The C++ compiler inductor builds with: $CXX, else g++ (torch._inductor's config.cpp.cxx)."""
    return os.environ.get("CXX") or "g++"


def cpp_compiler() -> str:
    """cpp_compiler_name() found on PATH; '' where it is not."""
    import shutil

    return shutil.which(cpp_compiler_name()) or ""


def compile_auto(n_params: int, dtype: str, attention_span: str, compiler: str) -> tuple[bool, str]:
    """model.compile=auto for a model of `n_params` parameters training in `dtype` ('bf16' or
    'fp32', as resolved) with data.attention_span and inductor's C++ compiler ('' for none):
    whether to compile, and why not where the model is large enough for it to pay ('' else).

    Per-layer compile paid in bf16 at the 53M bench model on every host measured (AMX, Zen 4,
    Zen 5), and cost more than it saved on the ~0.4M embedded default (config.COMPILE_AUTO_MIN_PARAMS
    lies between). In fp32 (a CPU without bf16 GEMMs) the GEMMs take more of the step and the one
    measurement lost (0.89x, AMD AVX2). Document masks send a compiled layer's attention to SDPA.
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
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True


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


def malloc_setting() -> str:
    """The allocator with glibc's mmap threshold, e.g. 'system (mmap threshold 1048576)'."""
    name = allocator_in_use()
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if name != "system":
        return name
    return f"system (mmap threshold {threshold})" if threshold else "system (dynamic mmap threshold)"


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


# ----------------------------------------------------------------------------- step-time breakdown

PHASES = ("data_wait", "forward", "backward", "optimizer_step")
# DeepSpeed's collectives, as methods of its communication backend (deepspeed.comm.comm.cdb).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_base",
    "all_gather_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
)


class CommTimer:
    """Seconds the training thread spends in DeepSpeed's collectives, waits included.

    ZeRO-3 launches its parameter all-gathers asynchronously and waits on the handle
    later, so both the calls and `Work.wait` are timed; a depth counter keeps a wait
    inside a timed call from counting twice. Only the installing thread is counted: gloo's
    own threads do the transfer, the training thread is what stalls.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        self._thread = threading.get_ident()
        self._undo: list[Callable[[], None]] = []

    def _timed(self, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if threading.get_ident() != self._thread or self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
                self._depth -= 1

        return wrapper

    def install(self) -> CommTimer:
        """Wraps the collectives of the live DeepSpeed backend (after deepspeed.init_distributed)."""
        import deepspeed.comm.comm as ds_comm
        import torch

        backend = ds_comm.cdb
        for name in COLLECTIVES:
            if hasattr(backend, name):
                before = backend.__dict__.get(name)  # the shared-memory route, where installed
                setattr(backend, name, self._timed(getattr(backend, name)))
                self._undo.append(
                    lambda n=name, b=before: setattr(backend, n, b) if b else delattr(backend, n)
                )  # back to the route before, or to the class method
        work = torch._C._distributed_c10d.Work
        wait = work.wait
        work.wait = self._timed(wait)
        self._undo.append(lambda: setattr(work, "wait", wait))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


# Training steps the step clock leaves out: the first compiles, allocates the activations and
# (in its optimizer step) AdamW's state; the second is the first in that memory layout and ran
# at 0.45-0.8x the later steps on the ~50M bench model (AMD Zen 5, 10-step runs), the third
# within 10% of them.
WARMUP_STEPS = 2


class StepClock:
    """Per-phase seconds of the training steps after `warmup` steps (which pay one-off costs).

    `start_step` .. `end_step` brackets one optimizer step (data wait through optimizer
    step), so logging, evaluation and checkpoints between steps are not counted. Each call
    costs a perf_counter. `comm` comes from a CommTimer when one is given and is part of
    forward, backward and optimizer step (ZeRO-3 gathers parameters in forward and backward
    and reduce-scatters gradients in backward and step).
    """

    def __init__(self, comm: CommTimer | None = None, warmup: int = WARMUP_STEPS) -> None:
        self.comm = comm
        self.warmup = warmup
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.comm_s = 0.0
        self.wall_s = 0.0
        self.steps = 0
        self._seen = 0
        self._pending = dict.fromkeys(PHASES, 0.0)
        self._t0 = 0.0
        self._comm0 = 0.0
        self._last_wall: float | None = None  # the last step's seconds, None while warming up
        self._peaks: list[tuple[float, float, float]] = []  # (a timed step's seconds, the GEMM rates after it)

    def start_step(self) -> None:
        self._pending = dict.fromkeys(PHASES, 0.0)
        self._t0 = time.perf_counter()
        self._comm0 = self.comm.seconds if self.comm else 0.0

    def add(self, phase: str, seconds: float) -> None:
        self._pending[phase] += seconds

    def end_step(self) -> None:
        self._seen += 1
        if self._seen <= self.warmup:
            return  # one-off costs (WARMUP_STEPS): not steady state
        for k, v in self._pending.items():
            self.totals[k] += v
        self.comm_s += (self.comm.seconds if self.comm else 0.0) - self._comm0
        self._last_wall = time.perf_counter() - self._t0
        self.wall_s += self._last_wall
        self.steps += 1

    def peak(self, flops_per_s: float, mean_flops_per_s: float) -> None:
        """The GEMM rates timed right after the last step (train.mfu_probe_every; peak and mean,
        cpu.time_training_mix); a warm-up step's are left out."""
        if self._last_wall is not None:
            self._peaks.append((self._last_wall, flops_per_s, mean_flops_per_s))
            self._last_wall = None

    def summary(self) -> dict[str, Any]:
        """Mean seconds per optimizer step by phase, the step's wall time, and (with peak()
        timings) the GEMM rate next to the steps."""
        n = max(self.steps, 1)
        out: dict[str, Any] = {f"{k}_s": v / n for k, v in self.totals.items()}
        out["comm_s"] = self.comm_s / n if self.comm else None
        out["step_wall_s"] = self.wall_s / n
        out["other_s"] = out["step_wall_s"] - sum(out[f"{k}_s"] for k in PHASES)
        out["steps"] = self.steps
        # MFU's denominator next to the steps: each timed step's rate weighted by its seconds,
        # so MFU = the steps' FLOPs over what the GEMMs could have done in their time.
        seconds = sum(t for t, _, _ in self._peaks)
        for key, i in (("peak_flops_per_s", 1), ("mean_gemm_flops_per_s", 2)):
            out[key] = sum(p[0] * p[i] for p in self._peaks) / seconds if self._peaks else None
        out["peak_timings"] = len(self._peaks)
        return out


# ----------------------------------------------------------------------------- operator profile

# Operator kinds for train.profile_step's table, matched on the profiler's names in this order.
OP_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("compiled kernels", ("cpp_fused", "compiledfxgraph", "torch-compiled region", "compiledfunction", "inductor")),
    # DeepSpeed's autograd functions around each gathered module: gathers, releases, gradient hand-off.
    ("ZeRO-3 hooks", ("backwardhookfunction", "prebackwardfunction", "postbackwardfunction", "zerostage3")),
    (
        "GEMM",
        ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm", "mkldnn", "raytrain::weight_grad"),
    ),
    # raytrain_cpu.model.ops.attention's and fused_attention's operators count with everything they run (their GEMMs, softmax).
    (
        "attention",
        (
            "scaled_dot_product",
            "flash_attention",
            "_efficient_attention",
            "raytrain::causal_blocks",
            "raytrain_causal_blocks",
            "raytrain::fused_causal",
        ),
    ),
    ("collectives", ("gloo", "c10d", "all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce")),
    ("optimizer", ("adamw", "_foreach_", "clip_grad")),
    ("copies and casts", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::index", "aten::empty")),
)


def _op_kind(name: str) -> str:
    name = name.lower()
    return next((k for k, pats in OP_KINDS if any(p in name for p in pats)), "other operators")


def _inside_attention(ev) -> bool:
    parent = getattr(ev, "cpu_parent", None)
    while parent is not None:
        if _op_kind(parent.name) == "attention":
            return True
        parent = parent.cpu_parent
    return False


def op_time_by_kind(events, step_wall_s: float) -> list[dict[str, Any]]:
    """Self time per operator kind (GEMM, attention, collectives, optimizer, copies and casts,
    ZeRO-3's hooks, other elementwise work) as seconds and shares of the profiled step; what
    no operator accounts for (Python, waiting for gloo's background collectives) is its own row.

    `events`: the profiler's events (`prof.events()`); an operator run inside an attention
    operator (raytrain_cpu.model.ops.attention's GEMMs and softmax) counts as attention."""
    seconds: dict[str, float] = {kind: 0.0 for kind, _ in OP_KINDS} | {"other operators": 0.0}
    for ev in events:
        kind = "attention" if _inside_attention(ev) else _op_kind(getattr(ev, "name", None) or ev.key)
        seconds[kind] += ev.self_cpu_time_total / 1e6
    seconds["outside operators (Python, collective waits)"] = max(0.0, step_wall_s - sum(seconds.values()))
    return [{"kind": k, "seconds": round(v, 4), "share": round(v / step_wall_s, 3)} for k, v in seconds.items()]
