"""The step model across a real network: two Ray nodes in two network namespaces, the link shaped
with tbf, flat ZeRO-3 against the in-node variant (hpZ), predicted beside measured.

    python benchmarks/two_node_model.py [--rates 300,600,1200] [--variants flat,hpz] [--steps 10]

Per case, `benchmarks/two_nodes.py train` runs the project's job on 4 workers, 2 a node, at the
tbf rate; `planner.steptime.step_time` predicts the same run from this machine's rates
(`planner.measure.measure_rates` at the run's shapes, one thread) on that link: every in-node
link over loopback gloo (each node's /dev/shm is its own, so the shared-memory collectives are
off), the ring's cross-node link at the tbf rate (NETWORK_EFFICIENCY of it). The four ranks share
this machine's two cores, so each computes at half its one-thread rate.

The rates are chosen so that network and compute stand in about the proportion the planner
predicts for Llama-3-8B on c7i.48xlarge nodes (network time about compute's; see
docs/performance.md): the bench's ~50M model at this run's batch moves a few hundred MB a step
across the link. Writes benchmarks/results/<machine>/two_node_model.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.common import SIZES, model_overrides, report_script

from raytrain_cpu.host.features import cpu_features
from raytrain_cpu.model.shape import ModelShape
from raytrain_cpu.planner.measure import measure_rates
from raytrain_cpu.planner.steptime import GBIT, NETWORK_EFFICIENCY, Topology, step_time

REPO = Path(__file__).resolve().parents[1]
MODEL = SIZES["50m"]["model"]
SEQ, MICRO, ACCUM = 256, 4, 2  # two micro batches a step: hpZ's second gathers inside the node
WORLD, PER_NODE = 4, 2
VARIANTS = {"flat": ["deepspeed.hpz_partition_size=1"], "hpz": ["deepspeed.hpz_partition_size=2"]}


def shape() -> ModelShape:
    m = MODEL
    return ModelShape(
        "50m", 2048, m["hidden_size"], m["intermediate_size"], m["num_layers"], m["num_heads"], m["num_kv_heads"]
    )


def run_overrides(variant: str) -> list[str]:
    return [
        *model_overrides(MODEL, SEQ),
        f"train.micro_batch_size={MICRO}",
        f"train.grad_accum_steps={ACCUM}",
        "train.profile_breakdown=true",
        "model.dtype=bf16",
        *VARIANTS[variant],
    ]


def measured(rate: float, variant: str, steps: int, out: Path) -> dict[str, Any]:
    path = out / f"{variant}-{rate:g}.json"
    cmd = [sys.executable, str(REPO / "benchmarks/two_nodes.py"), "train", "--rate-mbit", str(rate),
           "--steps", str(steps), "--json", str(path), *run_overrides(variant)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads(path.read_text())


def predicted(rates, rate_mbit: float, variant: str) -> dict[str, Any]:
    link = rate_mbit * 1e6 / 8 * NETWORK_EFFICIENCY
    here = rates.__class__(
        **(
            rates.__dict__
            | {
                "source": rates.source + f"; compute at half (4 ranks on 2 cores); link {rate_mbit:g} Mbit/s",
                "gemm_flops_per_s": rates.gemm_flops_per_s * 2 / WORLD,
                "flow_bytes_per_s": link,
                "nic_bytes_per_s": link,
            }
        )
    )
    hpz = 2 if variant == "hpz" else 1
    return step_time(
        shape(),
        Topology(WORLD, PER_NODE, hpz, shm=True),  # shm_usable is False across two nodes
        here,
        zero_stage=3,
        micro_batch=MICRO,
        seq_len=SEQ,
        grad_accum_steps=ACCUM,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="300,600,1200", help="tbf rates, Mbit/s")
    ap.add_argument("--variants", default="flat,hpz")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rates, raw = measure_rates(shape(), MICRO, SEQ, threads=1, host=cpu_features().slug)
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="two-node-model-") as tmp:
        for rate in (float(r) for r in args.rates.split(",")):
            for variant in args.variants.split(","):
                m = measured(rate, variant, args.steps, Path(tmp))
                p = predicted(rates, rate, variant)
                bd = m["step_breakdown"]
                row = m["tables"][next(iter(m["tables"]))][0]
                veth = (row["veth_KiB_per_step_a_to_b"] + row["veth_KiB_per_step_b_to_a"]) / 2 * 1024
                rows.append(
                    {
                        "variant": variant,
                        "rate_mbit": rate,
                        "predicted_step_s": p["step_time_s"],
                        "measured_step_s": bd["step_wall_s"],
                        "measured / predicted": bd["step_wall_s"] / p["step_time_s"],
                        "predicted_comm_exposed_s": p["comm_exposed_s"],
                        "measured_comm_s": bd.get("comm_s"),
                        "predicted_compute_s": p["compute_s"],
                        "measured_forward_backward_s": bd["forward_s"] + bd["backward_s"],
                        "predicted_MB_per_step_each_way": p["network_gib_per_step"] * 2**30 / 1e6,
                        "measured_veth_MB_per_step_each_way": veth / 1e6,
                    }
                )
                runs.append({"predicted": p, "measured": m})
                print(rows[-1], flush=True)
    report_script(
        "two_node_model",
        args.json,
        tables={"predicted against measured, 4 workers in two network namespaces (2 a node)": rows},
        rates=rates.__dict__,
        rates_raw=raw,
        runs=runs,
        notes=[
            f"model: the bench's 50m shape, seq {SEQ}, micro batch {MICRO} x {ACCUM} accumulated, ZeRO-3, bf16",
            "measured: summary.json's step breakdown after the warm-up; veth bytes per step from the link's counters",
            f"predicted: planner.steptime with this machine's one-thread rates, compute at 2/{WORLD}, the link at "
            f"{NETWORK_EFFICIENCY} of the tbf rate ({GBIT:g} bytes/s a Gbit/s)",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
