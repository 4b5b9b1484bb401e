"""The benchmark harness: result files, and a smoke run at tiny size (no Ray, well under a minute).
This module's in-process tests: tests/unit/test_bench.py."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from benchmarks.bench import cli, common, reference


@pytest.mark.slow
def test_gemm_and_load_suites_at_tiny_size(tmp_path):
    assert cli.main(["gemm", "--size", "tiny", "--json", str(tmp_path / "gemm.json")]) == 0
    g = json.loads((tmp_path / "gemm.json").read_text())["gemm"]
    assert g["bfloat16"]["flops_per_s_per_worker"] > 0 and g["float32"]["flops_per_s_per_worker"] > 0

    args = ["load", "--size", "tiny", "--workdir", str(tmp_path), "--json", str(tmp_path / "load.json")]
    assert cli.main(args) == 0
    res = json.loads((tmp_path / "load.json").read_text())["train model"]
    for row in res["rows"]:
        assert 0 < row["sharded peak RSS (GB)"] < 10 and row["naive peak RSS (GB)"] > 0


@pytest.mark.parametrize("precision", reference.REFERENCE_PRECISIONS)
def test_reference_run_trains_the_tiny_model_in_one_plain_process(precision):
    res = reference.reference_run(common.SIZES["tiny"], "bf16", threads=1, batch=2, steps=2, precision=precision)
    assert res["tokens_per_step"] == 2 * common.SIZES["tiny"]["seq_len"] and res["tokens_per_s"] > 0
    assert res["threads"] == 1 and res["dtype"] == "bf16" and res["precision"] == precision
    assert res["steps_timed"] == 2 and math.isfinite(res["final_loss"])
    # bf16 weights take the trainers' start-up pick; under autocast the blocks leave attention to SDPA.
    assert res["attention"] in (("sdpa", "causal_blocks", "fused") if precision == "bf16_master" else ("sdpa",))
    parts = res["forward_s"] + res["backward_s"] + res["optimizer_step_s"]
    assert 0 < parts <= res["step_s"] * 1.001


def test_pinned_suites_gives_each_command_its_own_cores(tmp_path):
    """benchmarks/pinned_suites.py: each command runs under an affinity mask of its own cores."""
    import subprocess
    import sys

    from raytrain_cpu.host.features import cpu_features

    if cpu_features().usable_cores < 2:
        pytest.skip("needs 2 usable cores")
    show = "-c 'import os; print(sorted(os.sched_getaffinity(0)))'"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "pinned_suites.py"
    subprocess.run(
        [sys.executable, str(script), "--cores", "1", "--workdir", str(tmp_path), show, show],
        check=True,
        timeout=60,
    )
    masks = [ast.literal_eval((tmp_path / f"{i}.log").read_text()) for i in range(2)]
    assert all(len(m) >= 1 for m in masks) and not set(masks[0]) & set(masks[1])


def test_pinned_suites_times_each_command_from_its_own_start(tmp_path):
    """With one core group (all the usable cores) the commands run one after another, and each
    gets --timeout from its own start: one deadline for all killed the last of issue 12's four
    suites on the 2-core AMX host, after the first three had used it up."""
    import subprocess
    import sys

    from raytrain_cpu.host.features import cpu_features

    nap = "-c 'import time; time.sleep(2); print(\"done\")'"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "pinned_suites.py"
    cores = str(cpu_features().usable_cores)
    argv = [sys.executable, str(script), "--cores", cores, "--timeout", "3.5", "--workdir", str(tmp_path), nap, nap]
    assert subprocess.run(argv, timeout=60).returncode == 0
    assert [(tmp_path / f"{i}.log").read_text() for i in range(2)] == ["done\n"] * 2


def test_gemm_layouts_times_each_gemm_of_a_linear_layer_at_tiny_size(tmp_path):
    """benchmarks/gemm_layouts.py at the tiny model's shapes: a row per linear shape (Mistral-
    style grouped k/v apart from q/o), each GEMM's rate, the weight gradient against the forward,
    and the transpose's cost both ways."""
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gemm_layouts.py"
    out = tmp_path / "gl.json"
    argv = [sys.executable, str(script), "--size", "tiny", "--rounds", "1", "--min-time", "0.001", "--json", str(out)]
    subprocess.run(argv, check=True, timeout=300, capture_output=True)
    (rows,) = json.loads(out.read_text())["tables"].values()
    assert [r["shape (out x in)"] for r in rows] == [
        "q, o 64x64",
        "k, v 32x64",
        "gate, up 176x64",
        "down 64x176",
        "output 2048x64",
    ]
    for r in rows:
        assert all(v > 0 for k, v in r.items() if k != "shape (out x in)")
        assert r["weight grad / forward"] == pytest.approx(
            r["weight grad dy^T @ x GFLOP/s"] / r["forward x @ W^T GFLOP/s"]
        )
    assert out.with_suffix(".md").read_text().count("\n| ") == 1 + len(rows)  # the header, then each row


def test_host_spells_times_each_vcpu_alone_and_all_at_once(tmp_path):
    """benchmarks/host_spells.py at the tiny model's GEMM: a row per vCPU in each phase, every
    operation's best and slow share, the GEMM's spells and how the others slowed with it."""
    import json
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "host_spells.py"
    out = tmp_path / "hs.json"
    argv = [sys.executable, str(script), "--size", "tiny", "--seconds", "0.3", "--json", str(out)]
    subprocess.run(argv, check=True, timeout=300, capture_output=True)
    tables = json.loads(out.read_text())["tables"]
    vcpus = len(os.sched_getaffinity(0))
    assert [len(rows) for rows in tables.values()] == ([vcpus, vcpus] if vcpus > 1 else [1])
    for rows in tables.values():
        for r in rows:
            assert r["rounds"] > 0 and r["bf16 GEMM best ms"] > 0 and r["GEMM mean / best"] >= 1.0
            assert 0.0 <= r["P(Python loop slow | GEMM slow)"] <= 1.0
            assert r["GEMM slow spells"] + r["GEMM fast spells"] >= 1
