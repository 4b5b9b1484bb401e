"""What Ray Train's helper actors cost a short run: the machine's CPU and the wall time per run.

    python benchmarks/run_actors.py [--rounds 8] [--steps 4] [overrides ...]

Beside its workers a Ray Train run starts helper actors, each a process that imports Ray. Three
trainers run the same tiny run (the embedded default's model at the suite's short settings,
`--steps` steps, an evaluation every 2) one after another on one local Ray, in an order that
alternates every round (this machine is shared and noisy: compare the medians side by side):
- `torch_trainer`: `ray.train.torch.TorchTrainer`, every default actor (a dataset manager with
  no datasets, the placement-group cleaner), as the driver built it before;
- `lean`: `compat.ray_backend.LeanTorchTrainer` (no dataset manager), the cleaner kept (the
  default, run.placement_group_cleaner=true);
- `lean_no_cleaner`: run.placement_group_cleaner=false, as the test suite runs.
Per run: the machine's busy core-seconds (/proc/stat: every process, Ray's included) and the wall
time from run() to its return, then 2 s for the actors to go. Writes
benchmarks/results/<machine>/run_actors.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import in_rep_order, report_script  # benchmarks/ is this script's path

from raytrain_cpu.host.features import machine_cpu_seconds

VARIANTS = ("torch_trainer", "lean", "lean_no_cleaner")


# A short run, as the test suite's (tests/helpers.py FAST): start-up is what differs between the variants.
SHORT = [
    "data.seq_len=64",
    "train.micro_batch_size=4",
    "train.eval_batches=4",
    "train.warmup_steps=2",
    "model.attention=causal_blocks",
    "run.poll_interval_s=0.25",
]


def use_trainer(variant: str) -> None:
    """Points the driver's make_trainer at the variant's trainer class."""
    from ray.train.torch import TorchTrainer

    from raytrain_cpu.compat import ray_backend

    class EveryDefaultActor(TorchTrainer):  # the driver's trainer before LeanTorchTrainer
        def __init__(self, *args, backend_config, placement_group_cleaner: bool = True, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, torch_config=backend_config, **kwargs)

    if not hasattr(use_trainer, "lean"):
        use_trainer.lean = ray_backend.LeanTorchTrainer
    ray_backend.LeanTorchTrainer = EveryDefaultActor if variant == "torch_trainer" else use_trainer.lean


def one_run(storage: Path, variant: str, name: str, steps: int, overrides: list[str]) -> dict:
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.launch.driver import run

    use_trainer(variant)
    cfg = load_config(
        None,
        [f"run.storage_path={storage}", f"run.name={name}", f"train.max_steps={steps}", "train.eval_every=2"]
        + [f"run.placement_group_cleaner={variant != 'lean_no_cleaner'}", *SHORT, *overrides],
    )
    b0, t0 = machine_cpu_seconds()[0], time.time()
    with contextlib.redirect_stdout(io.StringIO()):
        run(cfg)
    wall = time.time() - t0
    time.sleep(2)  # the run's actors exit
    return {"variant": variant, "name": name, "wall_s": wall, "busy_core_s": machine_cpu_seconds()[0] - b0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", default=None, help="write the result here instead of benchmarks/results/<machine>/")
    ap.add_argument("overrides", nargs="*", help="key=value settings for every run")
    args = ap.parse_args()
    import ray

    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # the same in every variant
    ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # each run joins this Ray
    runs = []
    with tempfile.TemporaryDirectory(prefix="run-actors-") as tmp:
        one_run(Path(tmp), "lean", "warm-up", args.steps, args.overrides)  # data cache, imports
        for rnd in range(args.rounds):
            for variant in in_rep_order(VARIANTS, rnd):
                runs.append(one_run(Path(tmp), variant, f"{variant}-{rnd}", args.steps, args.overrides))
                print(f"round {rnd} {variant}: {runs[-1]['busy_core_s']:.1f} core-s, {runs[-1]['wall_s']:.1f} s")
    ray.shutdown()

    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["variant"] == variant)

    base = {k: median("torch_trainer", k) for k in ("busy_core_s", "wall_s")}
    table = [
        {
            "variant": v,
            "busy_core_s": round(median(v, "busy_core_s"), 1),
            "vs_torch_trainer": round(median(v, "busy_core_s") / base["busy_core_s"], 3),
            "wall_s": round(median(v, "wall_s"), 1),
            "wall_vs_torch_trainer": round(median(v, "wall_s") / base["wall_s"], 3),
        }
        for v in VARIANTS
    ]
    report_script(
        "run_actors",
        args.json,
        rounds=args.rounds,
        steps=args.steps,
        runs=runs,
        tables={f"medians of {args.rounds} rounds, the machine's busy CPU and wall time per run": table},
        notes=[
            "busy_core_s counts every process on the machine over the run: the driver, Ray's and the run's actors.",
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
