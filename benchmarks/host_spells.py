"""Does this host run at one speed? Spells of slow-down, timed call by call on each vCPU.

    python benchmarks/host_spells.py [--seconds 20] [--size 50m] [--json PATH]

Three operations take turns in one process pinned to one vCPU, each call timed: the bench
model's gate/up forward GEMM in bf16 (AMX or AVX-512 through oneDNN; fp32 on a CPU without fast
bf16), an fp32 exp over 512 KB (vector units, in cache) and a Python integer loop (scalar). A
call is slow when it took more than 1.4x its operation's best. Two phases: each usable vCPU
alone in turn, then one process on every vCPU at once. Per vCPU and phase: each operation's
best, median / best and share of slow calls; the GEMM's spells (a run of slow or of fast calls:
their median and longest, ms); and how often the other operations were slow along with the
GEMM's call, against how often they were slow at all.

Why: `bench train`'s GEMM peak and the workers' timings after each step keep each shape's best
~50 ms batch (raytrain_cpu.host.gemm.time_calls), while a step runs through whatever spells come. Slow spells that
come and go within a timing, and hit every operation at once, are the host's, not the code's:
this says how far a best-batch peak sits from what the host gives on average, and the alone
and all-at-once phases tell the vCPUs' own contention from the neighbours'.

Writes benchmarks/results/<machine>/host_spells.json (and .md), or to --json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from statistics import median

from bench.common import SIZES, report_script

from raytrain_cpu.host import features as host_features

OPS = ("bf16 GEMM", "fp32 exp", "Python loop")
SLOW = 1.4  # a call over this many times its operation's best is slow


def _operations(size: str) -> dict:
    import torch

    m = SIZES[size]["model"]
    tokens = SIZES[size]["micro_batch"] * SIZES[size]["seq_len"]
    bf16 = host_features.cpu_features().best_isa in ("amx_bf16", "avx512_bf16")
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(tokens, m["hidden_size"], dtype=dtype)
    w = torch.randn(m["intermediate_size"], m["hidden_size"], dtype=dtype)
    v, out = torch.randn(128 * 1024), torch.empty(128 * 1024)

    def loop() -> int:
        s = 0
        for i in range(20000):
            s += i * i
        return s

    return dict(zip(OPS, (lambda: torch.mm(x, w.t()), lambda: [torch.exp(v, out=out) for _ in range(20)], loop)))


def _spells(slow: list[bool], starts: list[float], ends: list[float]) -> dict[str, list[float]]:
    """Lengths (s) of the runs of slow and of fast calls."""
    out: dict[str, list[float]] = {"slow": [], "fast": []}
    begin = 0
    for i in range(1, len(slow) + 1):
        if i == len(slow) or slow[i] != slow[begin]:
            out["slow" if slow[begin] else "fast"].append(ends[i - 1] - starts[begin])
            begin = i
    return out


def measure(vcpu: int, seconds: float, size: str, queue) -> None:
    """One process pinned to `vcpu`: OPS in turn for `seconds`; puts (vcpu, its row) on `queue`."""
    import torch

    os.sched_setaffinity(0, {vcpu})
    torch.set_num_threads(1)
    ops = _operations(size)
    for fn in ops.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in ops}
    starts, ends = [], []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        for name, fn in ops.items():
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            times[name].append(t1 - t0)
            if name == OPS[0]:
                starts.append(t0), ends.append(t1)
    n = min(len(v) for v in times.values())
    slow = {k: [t > SLOW * min(v) for t in v[:n]] for k, v in times.items()}
    gemm_slow = slow[OPS[0]]
    spells = _spells(gemm_slow, starts[:n], ends[:n])
    row: dict = {"vCPU": vcpu, "rounds": n}
    for k, v in times.items():
        row[f"{k} best ms"] = 1e3 * min(v)
        row[f"{k} median / best"] = median(v) / min(v)
        row[f"{k} slow share"] = sum(slow[k]) / n
    row["GEMM mean / best"] = sum(times[OPS[0]]) / len(times[OPS[0]]) / min(times[OPS[0]])
    for kind in ("slow", "fast"):
        got = spells[kind]
        row[f"GEMM {kind} spells"] = len(got)
        row[f"GEMM {kind} spell median ms"] = 1e3 * median(got) if got else 0.0
        row[f"GEMM {kind} spell longest ms"] = 1e3 * max(got) if got else 0.0
    for k in OPS[1:]:
        both = sum(1 for a, b in zip(gemm_slow, slow[k]) if a and b)
        row[f"P({k} slow | GEMM slow)"] = both / max(sum(gemm_slow), 1)
        row[f"P({k} slow)"] = sum(slow[k]) / n
    queue.put((vcpu, row))


def run_phase(vcpus: list[int], seconds: float, size: str) -> list[dict]:
    """`measure` on each of `vcpus` at once, in spawned processes; their rows by vCPU."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=measure, args=(c, seconds, size, q)) for c in vcpus]
    for p in procs:
        p.start()
    rows = dict(q.get(timeout=seconds + 300) for _ in procs)
    for p in procs:
        p.join()
    return [rows[c] for c in vcpus]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="per vCPU and phase")
    ap.add_argument("--size", choices=list(SIZES), default="50m", help="the bench model whose GEMM is timed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    feats = host_features.cpu_features()
    vcpus = feats.allowed_cpus or list(range(os.cpu_count() or 1))
    tables = {"each vCPU alone": [r for c in vcpus for r in run_phase([c], args.seconds, args.size)]}
    if len(vcpus) > 1:
        tables["every vCPU at once"] = run_phase(vcpus, args.seconds, args.size)
    report_script(
        "host_spells",
        args.json,
        tables=tables,
        notes=[
            f"A call is slow when it took over {SLOW}x its operation's best in that process; a spell is a run of "
            "slow (or fast) GEMM calls, timed from the first call's start to the last's end.",
            "GEMM mean / best: what a timing that keeps the best batch over-reads the host's average by.",
            "P(op slow | GEMM slow) well above P(op slow): the spells slow every operation at once (the vCPU's, "
            "not one unit's); alone and at once alike: not the two processes contending with each other.",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
