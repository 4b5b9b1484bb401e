"""The run report, the metric sinks and the guards end to end, on one small real run.

The run is conftest's `cli_run` (`python -m raytrain_cpu.main`, once per session, also read by
tests/test_console.py): an injected loss spike at step 12 and an injected NaN at step 16 with
guards.action=skip, so the same run shows the guards at work through Ray Train and gives the
report something to mark. Resumed and still-running runs are made from copies of its directory
(duplicate steps appended, summary.json removed, a line cut short).
This module's in-process tests: tests/unit/test_report.py."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CLI_STEPS as STEPS

from raytrain_cpu.obs import metrics as obs
from raytrain_cpu.obs.report import PLOTS, load_run, plot_loss, plot_lr, plot_memory, write_report

ROOT = Path(__file__).resolve().parents[2]


def raw_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl parsed line by line, independently of metrics.read_metrics."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def run_dir(cli_run) -> Path:
    assert cli_run["returncode"] == 0, cli_run["stdout"][-3000:] + cli_run["stderr"][-3000:]
    return cli_run["run_dir"]


# ----------------------------------------------------------------------------- the run itself


@pytest.mark.slow
def test_metrics_jsonl_has_train_eval_and_memory_rows(run_dir):
    rows = raw_rows(run_dir)
    train = [r for r in rows if "loss" in r and "event" not in r]
    assert [r["step"] for r in train] == list(range(2, STEPS + 1, 2))
    for r in train:
        assert r["mem_rss_rank0_gib"] > 0.1 and r["mem_rss_max_gib"] >= r["mem_rss_rank0_gib"]
        assert r["mem_peak_max_gib"] >= r["mem_rss_max_gib"] - 1e-9
        assert 0 < r["mfu"] < 1  # against the faster of the GEMM rates the workers timed
    assert [r["step"] for r in rows if "eval_loss" in r] == [STEPS]
    dtype = json.loads((run_dir / "summary.json").read_text())["cpu"]["dtype"]
    timings = (dtype["start_probe_flops_per_s"], dtype["retimed_flops_per_s"])
    assert min(timings) > 0 and dtype["peak_flops_per_s"] == max(timings)  # the faster of the two


@pytest.mark.slow
def test_guards_fire_on_injected_spike_and_nan(run_dir):
    events = [(r["step"], r["event"], r["action"]) for r in raw_rows(run_dir) if "event" in r]
    assert events == [(12, "loss_spike", "skip"), (16, "nonfinite", "skip")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["guard_events"] == {"loss_spike": 1, "grad_norm": 0, "nonfinite": 1, "skipped_steps": 2}
    assert summary["skipped_steps"] == 2  # DeepSpeed's own count agrees: two updates were dropped
    assert summary["guard_stop"] is None and summary["steps"] == STEPS
    train = {r["step"]: r for r in obs.read_metrics(run_dir).train}
    assert train[12]["loss"] > 10 * train[10]["loss"]  # the spike is visible in the log...
    assert train[16]["loss"] is None  # ...the NaN is written as null, never as NaN
    assert math.isfinite(train[STEPS]["loss"]) and train[STEPS]["loss"] < train[2]["loss"]  # and training went on


@pytest.mark.slow
def test_tensorboard_events_mirror_metrics_jsonl(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "memory/rss_max_gib", "eval/loss"}
    assert expected <= tags, tags
    assert {"eval/perplexity", "memory/rss_rank0_gib", "guards/loss_spike"} <= tags
    tb_loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    for r in obs.read_metrics(run_dir).train:
        if r["loss"] is not None:
            assert tb_loss[r["step"]] == pytest.approx(r["loss"], rel=1e-6)


# ----------------------------------------------------------------------------- the report


@pytest.mark.slow
def test_report_writes_readable_pngs_and_markdown(run_dir, tmp_path):
    from PIL import Image

    written = write_report(run_dir, tmp_path)
    for name in PLOTS:
        with Image.open(written[name]) as img:
            img.verify()
        with Image.open(written[name]) as img:
            assert img.format == "PNG" and img.size == (800, 450)
            colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
            assert colors is not None and len(colors) > 20, f"{name} looks blank"
    md = written["report.md"].read_text()
    assert "| status | finished |" in md and f"| steps | {STEPS} / {STEPS} |" in md
    assert "| 12 | loss_spike |" in md and "| 16 | nonfinite |" in md
    for name in PLOTS:
        assert f"]({name})" in md


@pytest.mark.slow
def test_plotted_values_come_from_metrics_jsonl(run_dir):
    rows = raw_rows(run_dir)
    train = [r for r in rows if "loss" in r and "event" not in r]
    evals = [r for r in rows if "eval_loss" in r]
    run = load_run(run_dir)

    loss_ax = plot_loss(run).axes[0]
    lines = {ln.get_label(): ln for ln in loss_ax.get_lines()}
    finite = [r for r in train if r["loss"] is not None]
    assert list(lines["train loss"].get_xdata()) == [r["tokens_seen"] for r in finite]
    assert list(lines["train loss"].get_ydata()) == [r["loss"] for r in finite]
    tokens_per_step = train[-1]["tokens_seen"] / train[-1]["step"]
    assert list(lines["eval loss"].get_xdata()) == [r["step"] * tokens_per_step for r in evals]
    assert list(lines["eval loss"].get_ydata()) == [r["eval_loss"] for r in evals]

    lr_line = plot_lr(run).axes[0].get_lines()[0]
    assert list(lr_line.get_ydata()) == [r["lr"] for r in train]
    mem = {ln.get_label(): list(ln.get_ydata()) for ln in plot_memory(run).axes[0].get_lines()}
    assert mem["RSS max over ranks"] == [r["mem_rss_max_gib"] for r in train]


@pytest.mark.slow
def test_report_on_a_resumed_run_keeps_the_last_attempt(run_dir, tmp_path):
    copy = tmp_path / "resumed"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoint_*", "base_model", "tensorboard"))
    rows = raw_rows(copy)
    # A second attempt resumed from step 14: it logs steps 16.. again, with other values.
    replay = [
        dict(r, loss=None if r["loss"] is None else r["loss"] + 1.0)
        for r in rows
        if "loss" in r and "event" not in r and r["step"] >= 16
    ]
    assert [r["step"] for r in rows if "attempt" in r] == [0]  # where the run's one attempt started
    with open(copy / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in [{"step": 14, "attempt": {"workers": 2}}, *replay])
    run = load_run(copy)
    assert run.metrics.restarts == [14]
    assert [r["step"] for r in run.metrics.train] == list(range(2, STEPS + 1, 2))  # each step once
    loss_line = plot_loss(run).axes[0].get_lines()[0]
    plotted = dict(zip(loss_line.get_xdata(), loss_line.get_ydata(), strict=True))
    for r in replay:
        assert plotted.get(r["tokens_seen"]) == r["loss"]  # the replayed attempt's values (None: not plotted)
    assert [e["step"] for e in run.metrics.events] == [12]  # the superseded attempt's step-16 event is gone
    md = write_report(copy)["report.md"].read_text()
    assert "| resumed at steps | 14 |" in md and "| workers | 2 |" in md


@pytest.mark.slow
def test_report_on_a_still_running_run(run_dir, tmp_path):
    copy = tmp_path / "running"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoint_*", "base_model", "tensorboard"))
    (copy / "summary.json").unlink()
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    half = lines[: len(lines) // 2]
    (copy / "metrics.jsonl").write_text("\n".join(half) + "\n" + lines[len(lines) // 2][:25])  # a line mid-write
    result = subprocess.run(
        [sys.executable, "-m", "raytrain_cpu.report", str(copy)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    md = (copy / "report.md").read_text()
    assert "in progress or interrupted" in md
    assert all((copy / name).stat().st_size > 5000 for name in PLOTS)


def test_report_cli_explains_a_wrong_directory(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "raytrain_cpu.report", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2 and "metrics.jsonl" in result.stderr
