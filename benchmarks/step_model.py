"""The planner's step model against measured steps on this machine: predicted and measured side by side.

    python benchmarks/step_model.py [--cases 50m,0.5b,1b-lora] [--steps 6] [--json PATH]

For each case: `planner.measure.measure_rates` times this machine's rates at the case's shapes
and one thread (a rank's threads here), `planner.steptime.step_time` predicts the step of the
case's run (every rank on this machine, the shared-memory collectives), then the project's real
run trains it (Ray Train, DeepSpeed ZeRO-3, the trainers' kernels, train.profile_breakdown) and
its mean step after the warm-up steps is set beside the prediction, part by part. Writes
benchmarks/results/<machine>/step_model.json and .md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import SIZES, report_script  # benchmarks/ is this script's path
from bench.runs import Runner

from raytrain_cpu.host.features import cpu_features
from raytrain_cpu.model.shape import ModelShape
from raytrain_cpu.planner.measure import measure_rates
from raytrain_cpu.planner.steptime import Topology, step_time

VOCAB = 2048  # the bundled tokenizer's

# Cases: a model shape (the trainers' tiny model settings), its run, and overrides.
CASES: dict[str, dict[str, Any]] = {
    "50m": SIZES["50m"] | {"lora_rank": 0},
    "0.5b": {
        "model": {"hidden_size": 1536, "num_layers": 20, "num_heads": 12, "num_kv_heads": 4, "intermediate_size": 4096},
        "seq_len": 256,
        "micro_batch": 2,
        "steps": 6,
        "load_model": None,
        "lora_rank": 0,
    },
    "1b-lora": {
        "model": {"hidden_size": 2048, "num_layers": 24, "num_heads": 16, "num_kv_heads": 4, "intermediate_size": 5632},
        "seq_len": 256,
        "micro_batch": 1,
        "steps": 6,
        "load_model": None,
        "lora_rank": 16,
    },
}
WORLD = 2


def case_shape(name: str, spec: dict[str, Any]) -> ModelShape:
    m = spec["model"]
    return ModelShape(
        name, VOCAB, m["hidden_size"], m["intermediate_size"], m["num_layers"], m["num_heads"], m["num_kv_heads"]
    )


def predict(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    shape = case_shape(name, spec)
    rates, raw = measure_rates(
        shape,
        spec["micro_batch"],
        spec["seq_len"],
        lora_rank=spec["lora_rank"],
        threads=1,
        host=cpu_features().slug,
        ranks=WORLD,
    )
    step = step_time(
        shape,
        Topology(WORLD, WORLD, 1, True),
        rates,
        zero_stage=3,
        micro_batch=spec["micro_batch"],
        seq_len=spec["seq_len"],
        lora_rank=spec["lora_rank"],
    )
    return {"step": step, "raw": raw, "params": shape.num_params}


def measure(name: str, spec: dict[str, Any], workdir: Path, steps: int) -> dict[str, Any]:
    SIZES[name] = spec | {"steps": steps}
    extra = ["scaling.num_workers=2", "scaling.threads_per_worker=1", "deepspeed.zero_stage=3"]
    if spec["lora_rank"]:
        extra += [f"lora.rank={spec['lora_rank']}"]
    return Runner(name, workdir, extra).run(name, [])


def row(name: str, p: dict[str, Any], m: dict[str, Any]) -> dict[str, Any]:
    s = p["step"]
    fb = m["forward_s"] + m["backward_s"]
    return {
        "case": name,
        "params": f"{p['params'] / 1e9:.2f} B",
        "predicted_step_s": s["step_time_s"],
        "measured_step_s": m["step_s"],
        "measured / predicted": m["step_s"] / s["step_time_s"],
        "predicted_compute_s": s["compute_s"],
        "measured_forward_backward_s": fb,
        "predicted_comm_s": s["comm_exposed_s"],
        "measured_comm_s": m["comm_s"],
        "predicted_optimizer_s": s["optimizer_s"],
        "measured_optimizer_step_s": m["optimizer_step_s"],
        "non_gemm_share": s["rates"]["non_gemm_share"],
        "gemm_tflops": s["rates"]["gemm_flops_per_s"] / 1e12,
        "within_25pct": abs(m["step_s"] / s["step_time_s"] - 1) <= 0.25,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps a run (the first 2 are warm-up)")
    ap.add_argument("--json", help="write the results here instead of benchmarks/results/<machine>/")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="step-model-") as tmp:
        for name in args.cases.split(","):
            spec = CASES[name]
            p = predict(name, spec)
            m = measure(name, spec, Path(tmp), args.steps)
            rows.append(row(name, p, m))
            runs[name] = {"predicted": p, "measured": {k: v for k, v in m.items() if k != "run_dir"}}
            print(rows[-1], flush=True)
    report_script(
        "step_model",
        args.json,
        tables={"predicted against measured (2 ranks x 1 thread, ZeRO-3, shared-memory collectives)": rows},
        runs=runs,
        notes=[
            "predicted: planner.steptime.step_time with planner.measure.measure_rates timed just before each run, at one thread",
            "measured: the run's mean step after the warm-up (train.profile_breakdown); comm_s is the time inside collectives",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
