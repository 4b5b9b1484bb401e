"""Config parsing, overrides and every validation error, all before Ray starts.
This module's in-process tests: tests/unit/test_config.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from raytrain_cpu.config.help import describe_options


def test_help_lists_every_option():
    out = subprocess.run(
        [sys.executable, "-m", "raytrain_cpu.main", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for key, _, doc in describe_options():
        assert key in out, key
        assert doc, f"{key} has no docstring"
    # the defaults as declared, not as this machine resolves them ('bundled' was shown for 'auto')
    assert "  data.source (default 'auto')\n" in out and "  model.tokenizer (default 'auto')\n" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train.micro_batch_size=x"], "train.micro_batch_size: expected an integer"),
        (["model.name_or_path=/no/such/model"], "model.name_or_path"),
        (["run.storage_path=/proc/nope"], "run.storage_path"),
        (["data.source=text", "data.path=/no/such/file.txt"], "does not exist"),
    ],
)
def test_cli_bad_input_exits_before_ray(args, needle, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "raytrain_cpu.main", *args], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert r.returncode == 2
    assert needle in r.stderr and "error:" in r.stderr
    assert "Started a local Ray instance" not in r.stderr + r.stdout
    assert list(tmp_path.iterdir()) == []  # nothing half-written
