"""Issue 12's four goals in one command: `bench train` (MFU), `bench reference` (per core
against plain PyTorch), `bench seed` (raw tokens/s against the seed recipe) and `bench scaling`
at once, each on its own 2 physical cores (benchmarks/pinned_suites.py), then one table of the
figures against their goals.

    python benchmarks/device/goals.py --out DIR [--size 50m] [--timeout 540]

Made for a lent many-core machine, where a device call has minutes (benchmarks/device/README.md):
the four suites run side by side (the longest, `reference`, takes minutes at 50m), so the
figures arrive in one call. The suites share the L3 and memory bandwidth; the ratios inside
each suite are side by side as always. On a 2-core host they run one after another (tens of minutes at 50m; `--size tiny`
is a smoke run).

DIR gets goals.md and goals.json (the table), and results.tar.gz: each suite's JSON and
markdown (bench's own format, for benchmarks/results/<machine>/) and each suite's log.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from pathlib import Path

from raytrain_cpu.host.features import cpu_features

HERE = Path(__file__).resolve().parent


def train_mfu(result: dict) -> float:
    """`bench train`'s MFU: against the GEMM rate the workers timed after each step where the
    result has it (the host's rate drifts within minutes), else against the peaks around the run."""
    in_steps = result.get("mfu_in_steps")
    return in_steps if in_steps is not None else result["tables"]["MFU"][0]["MFU"]


# (suite, extra bench arguments, what the figure is, how to read it from the suite's JSON, goal)
GOALS = [
    ("train", [], "MFU against the bf16 model-mix GEMM peak", train_mfu, 0.45),
    (
        "reference",
        ["--variants", "bf16_master"],  # the faster plain-PyTorch recipe on every host so far
        "ZeRO-3 tokens/s per core / plain PyTorch's",
        lambda j: j["ratio"],
        0.95,
    ),
    ("seed", [], "raw tokens/s / the seed recipe's", lambda j: j["raw_ratio"], 2.0),
    ("scaling", [], "2-worker scaling efficiency", lambda j: j["efficiency"], 0.9),
]
# What a suite's figure is read against, where its JSON has it: bench scaling's host ceiling,
# the plain-PyTorch recipe in 2 processes at once against 1 alone.
CONTEXT = {
    "scaling": lambda j: (
        f"host's own 2-process efficiency {j['host_efficiency']:.3f}" if "host_efficiency" in j else ""
    ),
}


def suite_command(suite: str, extra: list[str], size: str, workdir: Path) -> str:
    json_path = workdir / f"{suite}.json"
    return " ".join([str(HERE.parent / "suites.py"), suite, "--size", size, *extra, "--json", str(json_path)])


def goals_table(workdir: Path, machine: str, amx: bool) -> tuple[str, list[dict]]:
    rows = []
    for suite, _, what, read, goal in GOALS:
        path = workdir / f"{suite}.json"
        result = json.loads(path.read_text()) if path.is_file() else None
        figure = read(result) if result is not None else None
        rows.append(
            {
                "suite": suite,
                "figure": what,
                "value": figure,
                "goal": goal,
                "met": figure is not None and figure >= goal,
                "context": CONTEXT[suite](result) if result is not None and suite in CONTEXT else "",
            }
        )
    lines = [
        "# Issue 12's goals, side by side",
        "",
        f"{machine}",
        "" if amx else "**Not an AMX host: these are not issue 12's figures.**",
        "",
        "| suite | figure | value | goal | met | read against |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        value = "failed (see its log)" if r["value"] is None else f"{r['value']:.3f}"
        met = "yes" if r["met"] else "no"
        lines.append(f"| {r['suite']} | {r['figure']} | {value} | >= {r['goal']} | {met} | {r['context']} |")
    return "\n".join(lines) + "\n", rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="where goals.md, goals.json and results.tar.gz go")
    ap.add_argument("--size", default="50m", choices=["50m", "tiny"])
    ap.add_argument("--timeout", type=float, default=540, help="seconds each suite may run before it is killed")
    ap.add_argument("--workdir", default="/tmp/raytrain_goals")
    args = ap.parse_args()
    out, workdir = Path(args.out), Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    feats = cpu_features()
    amx = bool(feats.flags.get("amx_bf16"))
    print(f"[goals] {feats.describe()}", flush=True)

    for stale in [*workdir.glob("*.json"), *workdir.glob("*.md")]:  # a warm machine keeps /tmp: no old figure may pass
        stale.unlink()
    commands = [suite_command(suite, extra, args.size, workdir) for suite, extra, *_ in GOALS]
    pinned = [sys.executable, str(HERE.parent / "pinned_suites.py"), "--cores", "2"]
    pinned += ["--timeout", str(args.timeout), "--workdir", str(workdir), *commands]
    code = subprocess.run(pinned).returncode

    table, rows = goals_table(workdir, feats.describe(), amx)
    (out / "goals.md").write_text(table)
    (out / "goals.json").write_text(json.dumps({"machine": feats.describe(), "amx": amx, "goals": rows}, indent=2))
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
        for path in sorted(workdir.glob("*.json")) + sorted(workdir.glob("*.md")) + sorted(workdir.glob("*.log")):
            tar.add(path, arcname=path.name)
    print(table, flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
