"""Several benchmark commands at once, each on its own few physical cores.

    python benchmarks/pinned_suites.py [--cores 2] [--timeout 540] \
        "benchmarks/suites.py train --size 50m" "benchmarks/compile_levers.py" ...

Issue 12's figures are defined on a 2-core host. On a many-core machine (a c7i.4xlarge, a lent
device machine) each command here runs under its own affinity mask of `--cores` physical cores
(with their hyperthreads), so six 2-core suites take the time of the slowest one instead of
their sum. Each command is the argument list after `python`; bench commands get their own
--workdir (their data caches would race). raytrain sizes its local Ray and its workers from the
mask (main.local_ray_cpus, CpuFeatures.usable_cores), so every suite sees a 2-core machine.

The suites share the socket's L3 cache and memory bandwidth: the ratios inside one suite are
side by side as always; figures across suites are a little lower than on an idle host.
Commands beyond the free core groups wait for one. Logs: <workdir>/<i>.log; each suite's
results go where it writes them (benchmarks/results/<machine>/).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from raytrain_cpu.host.features import cpu_features
from raytrain_cpu.host.threads import rank_cores


def core_groups(cores_per_group: int) -> list[list[int]]:
    """vCPU sets of `cores_per_group` physical cores each, within one socket: each socket's
    allowed cores split as the workers' pinning splits a node among ranks (raytrain_cpu.host.threads.rank_cores)."""
    feats = cpu_features()
    allowed = set(feats.allowed_cpus)
    rows = [[*row[:2], *vcpus] for row in feats.cores if (vcpus := [c for c in row[2:] if c in allowed])]
    groups: list[list[int]] = []
    for socket in sorted({row[0] for row in rows}):
        mine = [row for row in rows if row[0] == socket]
        n = len(mine) // cores_per_group
        groups += [rank_cores(mine, 1, i, n, cores_per_group) for i in range(n)]
    if not groups:
        raise SystemExit(f"fewer than {cores_per_group} usable physical cores here")
    return groups


def command_for(args: str, i: int, workdir: Path) -> list[str]:
    argv = shlex.split(args)
    suites = argv[:2] == ["-m", "raytrain_cpu.bench"] or (argv and Path(argv[0]).name == "suites.py")
    if suites and "--workdir" not in argv:
        argv += ["--workdir", str(workdir / f"w{i}")]
    return [sys.executable, *argv]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("commands", nargs="+", help="argument lists for python, one per suite")
    ap.add_argument("--cores", type=int, default=2, help="physical cores per command")
    ap.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds each command may run from its own start (on a host with one core group they run one after another)",
    )
    ap.add_argument("--workdir", default="/tmp/raytrain_pinned")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    free = core_groups(args.cores)
    waiting = list(enumerate(args.commands))
    running: dict[int, tuple[subprocess.Popen, list[int], float]] = {}
    codes: dict[int, int | None] = {}
    while waiting or running:
        while waiting and free:
            i, cmd_args = waiting.pop(0)
            cpus = free.pop(0)
            argv = command_for(cmd_args, i, workdir)
            # The mask is set in the child before exec, so Ray and every worker it starts inherit it.
            with open(workdir / f"{i}.log", "w") as log:  # the child keeps its own copy of the file
                proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda c=cpus: os.sched_setaffinity(0, c)
                )
            running[i] = (proc, cpus, time.monotonic())
            print(f"[pinned] {i} on vCPUs {cpus}: {shlex.join(argv[1:])}", flush=True)
        time.sleep(0.25)  # a look at the running commands: a freed core group starts the next at once
        for i, (proc, cpus, t0) in list(running.items()):
            if proc.poll() is None and time.monotonic() - t0 < args.timeout:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            codes[i] = proc.returncode
            print(f"[pinned] {i} ended with {proc.returncode} after {time.monotonic() - t0:.0f}s", flush=True)
            del running[i]
            free.append(cpus)
    failed = {i: c for i, c in codes.items() if c != 0}
    for i in failed:
        print(f"[pinned] {i} failed; the end of {workdir / f'{i}.log'}:", flush=True)
        print("".join((workdir / f"{i}.log").read_text().splitlines(keepends=True)[-30:]), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
