"""The benchmark harness: result files, and a smoke run at tiny size (no Ray, well under a minute)."""

from __future__ import annotations

import json

import pytest

from raytrain_cpu import bench


def test_results_are_json_and_markdown(tmp_path):
    result = {
        "command": "python -m raytrain_cpu.bench gemm",
        "machine": "test box",
        "tables": {"GEMM peak": [{"dtype": "bfloat16", "GFLOP/s": 74.7}, {"dtype": "float32", "GFLOP/s": 120.0}]},
        "notes": ["measured side by side"],
    }
    path = bench.write_results("gemm", result, str(tmp_path / "gemm.json"))
    assert json.loads(path.read_text())["machine"] == "test box"
    md = path.with_suffix(".md").read_text()
    assert "| dtype | GFLOP/s |" in md and "| float32 | 120.0 |" in md and "- measured side by side" in md


def test_compare_reports_ratios_to_the_baseline():
    rows = [
        {
            "variant": "a",
            "tokens_per_s": 100.0,
            "dtype": "fp32",
            "allocator": "x",
            "threads": 1,
            "pinned": None,
            "final_loss": 1,
        },
        {
            "variant": "b",
            "tokens_per_s": 150.0,
            "dtype": "fp32",
            "allocator": "x",
            "threads": 1,
            "pinned": None,
            "final_loss": 1,
        },
        {
            "variant": "a",
            "tokens_per_s": 110.0,
            "dtype": "fp32",
            "allocator": "x",
            "threads": 1,
            "pinned": None,
            "final_loss": 1,
        },
    ]
    table = {r["variant"]: r for r in bench._compare(rows, "a")}
    assert table["a"]["tokens/s (median)"] == 110.0 and table["b"]["vs a"] == pytest.approx(150 / 110)


@pytest.mark.slow
def test_gemm_and_load_suites_at_tiny_size(tmp_path):
    assert bench.main(["gemm", "--size", "tiny", "--json", str(tmp_path / "gemm.json")]) == 0
    g = json.loads((tmp_path / "gemm.json").read_text())["gemm"]
    assert g["bfloat16"]["flops_per_s_per_worker"] > 0 and g["float32"]["flops_per_s_per_worker"] > 0

    args = ["load", "--size", "tiny", "--workdir", str(tmp_path), "--json", str(tmp_path / "load.json")]
    assert bench.main(args) == 0
    res = json.loads((tmp_path / "load.json").read_text())["train model"]
    for row in res["rows"]:
        assert 0 < row["sharded peak RSS (GB)"] < 10 and row["naive peak RSS (GB)"] > 0
