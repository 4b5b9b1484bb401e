"""How long a run takes past its workers' end, by Ray Train's poll interval (run.poll_interval_s).

    python benchmarks/poll_interval.py [--rounds 2] [--intervals 2.0,0.5,0.25] [overrides ...]

Ray Train's controller polls the workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray: 2 s):
it collects their reports that way and notices that the attempt finished. The embedded default
run (`python -m raytrain_cpu.main`, extra key=value overrides on top) at each interval, one
process a run, alternating the order every round (this machine is shared and noisy: compare
ratios). Per run: the process's wall time, `end_lag_s` (from rank 0's last metrics row, the
final evaluation, to the process's exit: the summary, the workers' release, the driver's
summary) and the training tokens/s. Writes benchmarks/results/<machine>/poll_interval.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from raytrain_cpu.host.features import cpu_features
from raytrain_cpu.obs.metrics import markdown_table

RESULTS = Path(__file__).parent / "results" / cpu_features().slug  # one folder per machine


def one_run(storage: Path, interval: float, rnd: int, overrides: list[str]) -> dict:
    name = f"poll-{interval}-{rnd}"
    cmd = [sys.executable, "-m", "raytrain_cpu.main", f"run.storage_path={storage}", f"run.name={name}"]
    t0 = time.time()
    subprocess.run([*cmd, f"run.poll_interval_s={interval}", *overrides], check=True, capture_output=True)
    t_exit = time.time()
    run_dir = storage / name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "interval_s": interval,
        "round": rnd,
        "wall_s": t_exit - t0,
        "end_lag_s": t_exit - max(r["time"] for r in rows if "time" in r),
        "tokens_per_s": summary["tokens_per_s"],
        "final_loss": summary["final_loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--intervals", default="2.0,0.5,0.25")
    ap.add_argument("overrides", nargs="*", help="key=value settings for every run")
    args = ap.parse_args()
    intervals = [float(x) for x in args.intervals.split(",")]
    runs = []
    with tempfile.TemporaryDirectory(prefix="poll-bench-") as tmp:
        for rnd in range(args.rounds):
            for interval in intervals if rnd % 2 == 0 else intervals[::-1]:
                runs.append(one_run(Path(tmp), interval, rnd, args.overrides))
                print(json.dumps(runs[-1]), flush=True)
    base = intervals[0]
    med = {
        i: {
            k: statistics.median(r[k] for r in runs if r["interval_s"] == i)
            for k in ("wall_s", "end_lag_s", "tokens_per_s")
        }
        for i in intervals
    }
    table = [
        {
            "run.poll_interval_s": i,
            "wall s (median)": round(m["wall_s"], 2),
            f"wall vs {base} s": round(m["wall_s"] / med[base]["wall_s"], 3),
            "end lag s (median)": round(m["end_lag_s"], 2),
            "tokens/s (median)": round(m["tokens_per_s"]),
            f"tokens/s vs {base} s": round(m["tokens_per_s"] / med[base]["tokens_per_s"], 3),
            "end lag s each": ", ".join(f"{r['end_lag_s']:.2f}" for r in runs if r["interval_s"] == i),
        }
        for i, m in med.items()
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/poll_interval.py " + " ".join(sys.argv[1:])
    (RESULTS / "poll_interval.json").write_text(
        json.dumps({"command": command, "runs": runs, "table": table}, indent=2)
    )
    md = f"# Ray Train's poll interval: a run's end\n\n`{command.strip()}`, {cpu_features().slug}\n\n"
    (RESULTS / "poll_interval.md").write_text(md + markdown_table(table) + "\n")
    print(markdown_table(table))


if __name__ == "__main__":
    main()
