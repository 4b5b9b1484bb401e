"""The driver, the CLI, the planner and the config load without torch or DeepSpeed: `--help`, a
plan and a config check start in a moment, and a driver that only submits work never pays for them;
nor does Ray Train's controller, which imports the module that holds the trainer's backend config.
A fresh interpreter per module, since this test process has imported torch already."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "deepspeed")


@pytest.mark.parametrize(
    "module",
    [
        "raytrain_cpu.launch.driver",
        "raytrain_cpu.cli",
        "raytrain_cpu.planner.cli",
        "raytrain_cpu.config.schema",
        "raytrain_cpu.compat.ray_backend",  # Ray Train's controller unpickles GlooConfig from it
    ],
)
def test_module_imports_without_torch_or_deepspeed(module):
    probe = f"import sys, {module}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "", f"importing {module} imported {p.stdout.strip()}"
