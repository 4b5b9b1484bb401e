"""The run report, the metric sinks and the guards end to end, on one small real run.

The run is conftest's `cli_run` (`python -m raytrain_cpu.main`, once per session, also read by
tests/test_console.py): an injected loss spike at step 12 and an injected NaN at step 16 with
guards.action=skip, so the same run shows the guards at work through Ray Train and gives the
report something to mark. Resumed and still-running runs are made from copies of its directory
(duplicate steps appended, summary.json removed, a line cut short).
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_report_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_cpu.obs import metrics as obs
from raytrain_cpu.obs.report import key_figures, load_run, plot_loss, write_report


def test_report_names_a_change_of_worker_count():
    from raytrain_cpu.obs.report import worker_counts

    rows = [{"step": s, "workers": 2} for s in (10, 20)] + [{"step": s, "workers": 1} for s in (30, 40)]
    assert worker_counts(rows) == "2 (to step 20) → 1 (from step 30)"
    assert worker_counts(rows[:2]) == "2" and worker_counts([{"step": 10}]) == ""  # rows made before the key


def test_report_names_an_early_stop_and_the_best_checkpoint(tmp_path):
    from raytrain_cpu.obs.report import key_figures

    rows = [{"step": 2, "loss": 5.0, "tokens_seen": 512}, {"step": 2, "eval_loss": 4.5, "eval_perplexity": 90.0}]
    rows += [{"step": 4, "loss": 4.0, "tokens_seen": 1024}, {"step": 4, "eval_loss": 4.7, "eval_perplexity": 110.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    why = "eval_loss has not improved on its best (4.5000 at step 2) in 1 evaluations (train.early_stop_patience=1)"
    best = {"path": str(tmp_path / "checkpoint_000002"), "step": 2, "metric": "eval_loss", "value": 4.5}
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 4, "early_stop": why, "best_checkpoint": best}))
    figures = key_figures(load_run(tmp_path))
    assert figures["status"] == f"stopped early at step 4: {why}"
    assert figures["best checkpoint"] == "checkpoint_000002 (eval_loss 4.5000 at step 2)"
    star = [line for line in plot_loss(load_run(tmp_path)).axes[0].get_lines() if line.get_label().startswith("best")]
    assert star[0].get_label() == "best checkpoint (eval_loss, step 2)" and list(star[0].get_ydata()) == [4.5]


def test_a_dpo_runs_report_plots_its_loss_and_reward_accuracy(tmp_path):
    """A preference run: the loss plot's eval curve is DPO's (its eval_loss is the chosen answers'
    cross-entropy, another scale), rewards.png shows the reward accuracy, the table both."""
    from raytrain_cpu.obs.report import key_figures, plot_chosen_loss, plot_rewards

    dpo = {"eval_dpo_loss": 0.69, "eval_reward_accuracy": 0.0, "eval_pairs": 16}
    rows = [{"step": 0, "eval_loss": 7.6, "eval_perplexity": 2000.0, **dpo}]
    rows += [{"step": 2, "loss": 0.69, "tokens_seen": 512, "reward_accuracy": 0.25, "chosen_loss": 7.7}]
    rows += [{"step": 4, "loss": 0.55, "tokens_seen": 1024, "reward_accuracy": 1.0, "chosen_loss": 7.4}]
    rows += [{"step": 4, "eval_loss": 7.5, "eval_perplexity": 1800.0, **dpo, "eval_dpo_loss": 0.5}]
    rows[-1] |= {"eval_reward_accuracy": 0.9375}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(tmp_path)
    assert run.preference
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in plot_loss(run).axes[0].get_lines()}
    assert lines["train loss"] == [0.69, 0.55] and lines["eval loss"] == [0.69, 0.5]
    rewards = {ln.get_label(): list(ln.get_ydata()) for ln in plot_rewards(run).axes[0].get_lines()}
    assert rewards["train"] == [25.0, 100.0] and rewards["eval"] == [0.0, 93.75]
    chosen = {ln.get_label(): list(ln.get_ydata()) for ln in plot_chosen_loss(run).axes[0].get_lines()}
    assert chosen["train"] == [7.7, 7.4] and chosen["eval"] == [7.6, 7.5]
    figures = key_figures(run)
    assert figures["eval DPO loss, reward accuracy (step 4)"] == "0.5000, 93.8% of 16 pairs"
    assert figures["best eval loss (perplexity) of the chosen answers"] == "7.5000 (1800.00) at step 4"
    written = write_report(tmp_path)
    assert "rewards.png" in written and "![rewards](rewards.png)" in written["report.md"].read_text()
    assert "chosen_loss.png" in written
    # Under train.dpo_sft_weight a row's loss adds the chosen answers' loss: the plot takes dpo_loss.
    rows[1] |= {"loss": 8.39, "dpo_loss": 0.69}
    rows[2] |= {"loss": 7.95, "dpo_loss": 0.55}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in plot_loss(load_run(tmp_path)).axes[0].get_lines()}
    assert lines["train loss"] == [0.69, 0.55]


def _hand_made_run(run_dir: Path, config: str = "run:\n  name: r\ntrain:\n  max_steps: 6\n") -> Path:
    """A run directory written by hand: two train rows, a config and an earlier report.md."""
    run_dir.mkdir()
    rows = [{"step": 2, "loss": 5.0, "tokens_seen": 512}, {"step": 4, "loss": 4.0, "tokens_seen": 1024}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "config.yaml").write_text(config)
    (run_dir / "report.md").write_text("an earlier, good report\n")
    return run_dir


def test_report_cli_refuses_a_file_as_out(tmp_path, capsys):
    from raytrain_cpu.obs.report import main

    run_dir = _hand_made_run(tmp_path / "rrep")
    (tmp_path / "afile.txt").write_text("")
    assert main([str(run_dir), "--out", str(tmp_path / "afile.txt")]) == 2
    err = capsys.readouterr().err
    assert (
        err == f"error: --out {tmp_path / 'afile.txt'} is a file: give a directory (made if missing), or drop --out\n"
    )


@pytest.mark.parametrize(
    "text, why",
    [("run: [a\n  b: :\n", "is not valid YAML at line 2, column 4"), ("- a\n", "holds a list, not a mapping")],
)
def test_report_cli_names_a_config_yaml_it_cannot_read(tmp_path, capsys, text, why):
    from raytrain_cpu.obs.report import main

    run_dir = _hand_made_run(tmp_path / "rrep", config=text)
    assert main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run_dir / 'config.yaml'} {why}") and err.count("\n") == 1
    assert "move it aside" in err


@pytest.mark.parametrize("text", ["", "garbage\n", '[1, 2]\n{"loss": 3.0}\n'])
def test_report_cli_of_no_readable_rows_keeps_the_earlier_report(tmp_path, capsys, text):
    """An empty or unreadable metrics.jsonl is an error, and the report written before stays."""
    from raytrain_cpu.obs.report import main

    run_dir = _hand_made_run(tmp_path / "rrep")
    (run_dir / "metrics.jsonl").write_text(text)
    assert main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run_dir / 'metrics.jsonl'} holds no readable train or eval rows")
    assert "nothing was written" in err and err.count("\n") == 1
    assert (run_dir / "report.md").read_text() == "an earlier, good report\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "metrics.jsonl", "report.md"]


# ----------------------------------------------------------------------------- metrics helpers


def test_read_metrics_drops_rows_of_a_superseded_attempt(tmp_path):
    rows = [
        {"step": 2, "loss": 5.0},
        {"step": 4, "loss": 4.0},
        {"step": 4, "eval_loss": 4.5, "eval_perplexity": 90.0},
        {"step": 6, "loss": 3.0},
        {"step": 6, "event": "loss_spike", "value": 3.0, "threshold": 2.0, "action": "log"},
        {"step": 8, "loss": 2.0},  # the first attempt got to step 8, then failed
        {"step": 6, "loss": 3.5},  # the second resumed from step 4's checkpoint
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + '\n{"step": 8, "lo')
    m = obs.read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in m.train] == [(2, 5.0), (4, 4.0), (6, 3.5)]
    assert [r["step"] for r in m.eval] == [4] and m.events == [] and m.restarts == [6]
    assert obs.count_events(m) == {"loss_spike": 0, "grad_norm": 0, "nonfinite": 0, "skipped_steps": 0}


def test_attempt_rows_name_each_restart_at_its_checkpoints_step(tmp_path):
    """Each attempt writes where it starts. Without that a resume was told only by a step logged
    again, at that row's step: none where it resumed at its last logged step (a longer
    train.max_steps, a stop between a checkpoint and the next row), the wrong step elsewhere."""
    rows = [
        {"step": 0, "attempt": {"workers": 2}},
        {"step": 2, "loss": 5.0},
        {"step": 4, "loss": 4.0},
        {"step": 5, "loss": 3.8},  # a checkpoint at 4; the attempt failed after logging step 5
        {"step": 4, "attempt": {"workers": 2}},
        {"step": 6, "loss": 3.5},
        {"step": 6, "attempt": {"workers": 1}},  # resumed at its last logged step: no row repeats
        {"step": 8, "loss": 3.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    m = obs.read_metrics(tmp_path)
    assert m.restarts == [4, 6]
    assert [(r["step"], r["loss"]) for r in m.train] == [(2, 5.0), (4, 4.0), (6, 3.5), (8, 3.0)]
    assert m.events == [] and obs.count_events(m)["nonfinite"] == 0


def test_a_resumed_run_in_progress_shows_no_wall_time_of_its_earlier_attempt(tmp_path):
    """summary.json is the last finished attempt's: while a resumed one runs past it, its wall
    time was shown as this attempt's."""
    rows = [{"step": 0, "attempt": {"workers": 2}}, {"step": 4, "loss": 4.0}, {"step": 4, "attempt": {"workers": 2}}]
    rows += [{"step": 8, "loss": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 4, "wall_s": 80.0}))
    figures = key_figures(load_run(tmp_path))
    assert figures["status"].startswith("in progress or interrupted") and "wall time (last attempt)" not in figures
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 8, "wall_s": 95.0}))
    figures = key_figures(load_run(tmp_path))
    assert figures["status"] == "finished" and figures["wall time (last attempt)"] == "95s"


def test_a_run_that_failed_is_reported_as_failed_until_it_logs_again(tmp_path):
    """The driver writes nothing else when a run fails: the report called it 'in progress or
    interrupted'. main.print_failed leaves the reason for it."""
    rows = [{"step": 0, "attempt": {"workers": 2}}, {"step": 4, "loss": 4.0, "time": 100.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    failure = {"time": 200.0, "reason": "rank 1, pid 7 on node 10.0.0.5: RuntimeError: boom"}
    (tmp_path / obs.FAILURE_FILE).write_text(json.dumps(failure))
    assert key_figures(load_run(tmp_path))["status"] == f"failed: {failure['reason']}"
    with open(tmp_path / "metrics.jsonl", "a") as f:  # resumed since, and logging again
        f.write(json.dumps({"step": 8, "loss": 3.0, "time": 300.0}) + "\n")
    assert key_figures(load_run(tmp_path))["status"].startswith("in progress or interrupted")


def test_sink_writes_null_for_nan_and_tensorboard_files(tmp_path):
    sink = obs.MetricsSink(tmp_path, tensorboard=True)
    sink.write({"step": 1, "loss": float("nan"), "lr": 1e-3, "grad_norm": float("inf"), "tokens_seen": 10})
    sink.write({"step": 1, "event": "nonfinite", "value": float("nan"), "threshold": None, "action": "skip"})
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "loss": None, "lr": 1e-3, "grad_norm": None, "tokens_seen": 10}
    assert "NaN" not in lines[1] and "Infinity" not in "".join(lines)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_mlflow_sink_logs_params_and_metrics(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store works with mlflow-skinny too
    uri = (tmp_path / "mlruns").as_uri()
    sink = obs.MetricsSink(
        tmp_path, tensorboard=False, mlflow_tracking_uri=uri, run_name="t", params={"train": {"lr": 0.1}}
    )
    sink.write({"step": 2, "loss": 3.0, "lr": 0.1})
    sink.close()
    run_id = (tmp_path / ".mlflow_run_id").read_text()
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.data.params["train.lr"] == "0.1" and run.data.metrics["train_loss"] == 3.0


def test_mfu_and_progress_line():
    n = {"non_embedding": 1_000_000, "num_layers": 2, "hidden_size": 64}
    assert obs.flops_per_token(n, 128) == 6e6 + 12 * 2 * 64 * 128
    assert obs.mfu(1000.0, n, 128, None) is None
    assert obs.mfu(1000.0, n, 128, 1e12) == pytest.approx(1000 * obs.flops_per_token(n, 128) / 1e12)
    p = obs.Progress(total_steps=100, start_step=0)
    p.update(10, now=p._origin[1] + 50.0)  # start-up: the first 10 steps took 50 s
    eta = p.update(20, now=p._origin[1] + 10.0)  # then 1 s per step
    assert eta == pytest.approx(80.0)
    line = p.line({"step": 20, "loss": 3.14159, "lr": 3e-4, "tokens_per_s": 1234.5, "mem_rss_max_gib": 1.5}, eta)
    assert line == "step 20/100 (20%) | loss 3.1416 | lr 3.00e-04 | 1,234 tok/s | mem 1.50 GiB | eta 1m20s"
    assert obs.format_duration(3 * 86400 + 7200) == "3d02h" and obs.format_duration(None) == "?"
