"""Unit tests of the capacity planner, including its calibration against measured runs.
This module's in-process tests: tests/unit/test_plan.py."""

from __future__ import annotations

import subprocess
import sys

from raytrain_cpu.planner import cli as plan_cli


def test_cli_errors_and_help(capsys):
    assert plan_cli.main(["--model", "no/such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert plan_cli.main([]) == 2
    result = subprocess.run([sys.executable, "-m", "raytrain_cpu.plan", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--world-size" in result.stdout and "--json" in result.stdout


def test_measure_times_this_machines_ranks_and_predicts_their_step():
    """`plan --measure`: the run's ranks at once on this machine (spawned, a layer, the head, the
    GEMMs, the optimizer; gloo over loopback), then this machine's own step beside the c7i one."""
    import json

    cmd = [sys.executable, "-m", "raytrain_cpu.plan", "--model", "tiny", "-w", "2", "-s", "64", "-b", "4"]
    result = subprocess.run([*cmd, "--measure", "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    here = out["step_here"]
    assert here["rates"]["source"].startswith("measured on ") and here["rates"]["threads"] >= 1
    assert here["step_time_s"] > 0 and here["comm_network_s"] == 0.0  # every rank on this machine
    assert 0.0 <= here["rates"]["non_gemm_share"] < 1 and here["rates"]["loopback_bytes_per_s"] > 0
    assert out["step"]["rates"]["source"].startswith(("assumed", "measured"))
