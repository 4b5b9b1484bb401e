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
