"""Two Ray nodes on one machine, each in its own network namespace (benchmarks/netns.py: a veth
pair between them, a private /dev/shm each, so the ranks talk over a real link as on two
machines), 2 workers a node: ZeRO-3 with its gathers kept inside a node
(deepspeed.hpz_partition_size=2) trains as flat ZeRO-3 does, resumes, and the bytes that cross
the link are those the planner's step model counts. Needs root (ip netns, tc)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import FAST, as_stopped_at, run_losses

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
        reason="a network namespace per node needs root, ip and tc",
    ),
]

STEPS, SAVE_AT, ACCUM = 12, 6, 2  # two micro batches a step: hpZ's second gathers inside the node


def _driver(net, env, tn, overrides: list[str]) -> None:
    r = net.run("A", [tn.PY, "-m", "raytrain_cpu.main", *overrides], cwd=tn.REPO, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def _crossed_per_step(sampler, run_dir: Path) -> float:
    """Bytes a step over the link, each way on average, from the first timed step to the last."""
    times = [json.loads(x)["time"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    return sum(sampler.per_step(times)) / 2


def _predicted_per_step(hpz: int) -> float:
    """The planner's bytes a step over the link between the nodes, each way (the default model)."""
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.planner.plan import inputs_from_config
    from raytrain_cpu.planner.steptime import Topology, cross_node_bytes, step_collectives

    shape = inputs_from_config(load_config(None))["model_shape"]
    topo = Topology(4, 2, hpz)
    return cross_node_bytes(step_collectives(shape, topo, 3, grad_accum_steps=ACCUM), topo)


def test_hpz_across_two_ray_nodes_trains_as_flat_zero3_resumes_and_crosses_as_modelled(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import netns
    import two_nodes as tn

    env = tn.ray_env()
    common = [
        *tn.TRAIN_DEFAULTS,
        *FAST,  # the suite's quick settings: no start-up attention timing, no eval, no cleaner actor
        f"run.ray_address={netns.IP['A']}:{tn.RAY_PORT}",
        f"run.storage_path={tmp_path / 'runs'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"train.max_steps={STEPS}",
        f"train.checkpoint_every={SAVE_AT}",
        f"train.grad_accum_steps={ACCUM}",
        "scaling.num_workers=4",
        "scaling.cpus_per_worker=1",
        f"scaling.resources_per_worker={{{tn.SLOT}: 1}}",
    ]
    # Ray's socket paths must fit 107 bytes: its session folders go in a short temporary folder.
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt2n-", dir="/tmp"))
    crossed = {}
    try:
        with netns.two_nodes(None, name="rtest") as net, tn.ray_on_both(net, ray_tmp, env):
            assert netns.check_private_shm(net)["private"]
            for name, hpz in (("flat", 1), ("hpz", 2)):
                sampler = tn.Sampler(net)
                sampler.start()
                _driver(net, env, tn, [*common, f"run.name={name}", f"deepspeed.hpz_partition_size={hpz}"])
                time.sleep(0.3)
                sampler.stop.set()
                sampler.join()
                crossed[name] = _crossed_per_step(sampler, tmp_path / "runs" / name)
            resumed = as_stopped_at(tmp_path / "runs" / "hpz", SAVE_AT, tmp_path / "runs" / "resumed")
            _driver(net, env, tn, [*common, "run.name=resumed", "deepspeed.hpz_partition_size=2"])
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    runs = tmp_path / "runs"
    summary = json.loads((runs / "hpz" / "summary.json").read_text())
    assert any("do not share one machine's /dev/shm" in c for c in summary.get("choices", [])), summary.get("choices")
    flat, hpz, again = (run_losses(runs / n) for n in ("flat", "hpz", "resumed"))
    assert sorted(flat) == sorted(hpz) == list(range(1, STEPS + 1))
    for step in flat:  # the same sums in another order at most: bf16's tolerance
        assert hpz[step] == pytest.approx(flat[step], abs=1e-2), (step, flat, hpz)
    assert json.loads((resumed / "summary.json").read_text())["resumed_from_step"] == SAVE_AT
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert again[step] == pytest.approx(hpz[step], abs=1e-2), (step, hpz, again)
    # What crossed the link a step (Ray's own traffic included) against the model's count.
    for name, hpz_size in (("flat", 1), ("hpz", 2)):
        assert crossed[name] == pytest.approx(_predicted_per_step(hpz_size), rel=0.2), crossed
    assert crossed["hpz"] < crossed["flat"]
