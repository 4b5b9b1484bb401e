"""Stability guards: decisions on synthetic loss sequences, and a real 2-rank DeepSpeed ZeRO-3
engine where an injected spike, an injected NaN and a gradient-norm spike leave parameters and
optimizer state untouched on every rank, while normal steps keep training.

(The end-to-end run through Ray Train, with events in metrics.jsonl and counts in summary.json,
is in tests/test_report.py, which shares that run with the report tests.)
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_guards_e2e.py."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.schema import load_config
from raytrain_cpu.config.training import GuardConfig
from raytrain_cpu.obs.guards import LossWindow, StabilityGuard, classify_loss, parse_inject

# ----------------------------------------------------------------------------- fakes


class FakeEngine:
    """What the guard reads from a DeepSpeed engine, with DeepSpeed's skip rule: a step whose
    back-propagated loss is not finite is skipped (invalid gradient norm)."""

    def __init__(self) -> None:
        self.skipped_steps = 0
        self.grad_norm = 1.0

    def get_global_grad_norm(self) -> float:
        return self.grad_norm

    def step_with(self, loss: torch.Tensor) -> None:
        if not math.isfinite(float(loss)):
            self.skipped_steps += 1
            self.grad_norm = float("inf")


def run_guard(losses: list[float], **cfg) -> tuple[StabilityGuard, list[dict], list[bool]]:
    """Feeds one loss per step through the guard on a single process; returns the guard, its
    events and, per step, whether the update was skipped."""
    events: list[dict] = []
    guard = StabilityGuard(
        GuardConfig(**cfg),
        reduce=lambda v: v,
        world_size=1,
        on_event=lambda e: events.append({**e.row(), "message": e.message()}),
    )
    engine, skipped = FakeEngine(), []
    for step, value in enumerate(losses, start=1):
        loss = guard.before_backward(step, [value], torch.tensor(value), last_micro=True)
        guard.before_step(step, engine)
        before = engine.skipped_steps
        engine.step_with(loss)
        guard.after_step(step, engine)
        skipped.append(engine.skipped_steps > before)
        if guard.stop_reason:
            break
    return guard, events, skipped


FLAT = [3.0, 3.1, 2.9, 3.05, 2.95, 3.0, 3.1, 2.9, 3.0, 3.0, 2.98, 3.02]  # 12 calm steps


# ----------------------------------------------------------------------------- pure decisions


def test_loss_window_needs_history_before_judging():
    w = LossWindow(50)
    assert classify_loss(100.0, w, 2.0) == (None, None)  # nothing to compare with yet
    for v in FLAT[:10]:
        w.add(v)
    event, threshold = classify_loss(7.0, w, 2.0)
    assert event == "loss_spike" and threshold == pytest.approx(2.0 * sum(FLAT[:10]) / 10)
    assert classify_loss(5.0, w, 2.0) == (None, None)
    assert classify_loss(float("nan"), w, 2.0)[0] == "nonfinite"
    assert classify_loss(float("inf"), LossWindow(5), 2.0)[0] == "nonfinite"
    assert classify_loss(7.0, w, 0.0) == (None, None)  # factor 0 disables spike detection


def test_parse_inject():
    got = parse_inject("spike@12:50, nan@20,spike@3")
    assert got[12] == 50.0 and got[3] == 100.0 and math.isnan(got[20])
    with pytest.raises(ValueError, match="spike@STEP"):
        parse_inject("boom@3")


def test_spike_is_logged_and_applied_under_log():
    guard, events, skipped = run_guard([*FLAT, 9.0, 3.0], action="log")
    assert [(e["step"], e["event"], e["action"]) for e in events] == [(13, "loss_spike", "log")]
    assert skipped == [False] * 14
    assert guard.stop_reason is None
    # The spike stays out of the running mean, so it does not raise the bar for the next one.
    assert max(guard.window.values) < 4


def test_spike_is_skipped_under_skip():
    guard, events, skipped = run_guard([*FLAT, 9.0, 3.0], action="skip")
    assert [(e["step"], e["event"], e["action"]) for e in events] == [(13, "loss_spike", "skip")]
    assert skipped[12] and not any(skipped[:12]) and not skipped[13]
    assert guard.counts == {"loss_spike": 1, "grad_norm": 0, "nonfinite": 0, "skipped_steps": 1}


def test_nan_never_continues_silently_even_under_log():
    guard, events, skipped = run_guard([3.0, float("nan"), 3.0], action="log")
    assert [(e["step"], e["event"], e["action"]) for e in events] == [(2, "nonfinite", "skip")]
    assert "step 2" in events[0]["message"] and "not finite" in events[0]["message"]
    assert skipped == [False, True, False]  # detected before the window is ready: NaN needs no history


def test_stop_names_the_step_and_the_fix():
    guard, events, _ = run_guard([*FLAT, 9.0, 3.0], action="stop")
    assert len(events) == 1 and events[0]["action"] == "stop"
    assert guard.stop_reason and "step 13" in guard.stop_reason and "guards.action=stop" in guard.stop_reason
    assert "train.lr" in guard.stop_reason


def test_too_many_skips_stop_the_run():
    guard, events, skipped = run_guard([3.0, float("nan"), float("nan"), 3.0, 3.0], action="skip", max_skips=1)
    assert skipped == [False, True, True]  # stopped after the second skip
    assert guard.stop_reason and "guards.max_skips=1" in guard.stop_reason


@pytest.mark.parametrize("action", ["log", "stop"])
def test_grad_norm_after_the_step_under_log_and_stop(action):
    events: list[dict] = []
    guard = StabilityGuard(
        GuardConfig(action=action, max_grad_norm=5.0), lambda v: v, 1, on_event=lambda e: events.append(e.row())
    )
    engine = FakeEngine()
    for step, norm in enumerate([1.0, 2.0, 50.0], start=1):
        guard.before_backward(step, [3.0], torch.tensor(3.0), last_micro=True)
        guard.before_step(step, engine)
        engine.grad_norm = norm
        guard.after_step(step, engine)
    assert [(e["step"], e["event"], e["value"]) for e in events] == [(3, "grad_norm", 50.0)]
    assert (guard.stop_reason is not None) == (action == "stop")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["guards.action=ignore"], "guards.action"),
        (["guards.loss_spike_factor=0.5"], "guards.loss_spike_factor"),
        (["guards.loss_window=0"], "guards.loss_window"),
        (["guards.max_grad_norm=-1"], "guards.max_grad_norm"),
        (["guards.inject=boom@3"], "guards.inject"),
        (["guards.action=skip", "guards.max_grad_norm=10", "deepspeed.zero_stage=2"], "guards.max_grad_norm"),
    ],
)
def test_guard_config_errors(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


# ----------------------------------------------------------------------------- early stopping


def test_early_stopping_counts_evaluations_without_improvement_and_resumes_counting():
    """train.early_stop_patience counts evaluations that do not beat the best by more than
    train.early_stop_min_delta (a diverged one among them); run.best_metric's best checkpoint is
    the lowest evaluated one, never one without an evaluation at its step; both survive a resume."""
    from raytrain_cpu.trainer.evaluation import EvalWatch

    cfg = load_config(
        None, ["run.best_metric=eval_loss", "train.early_stop_patience=2", "train.early_stop_min_delta=0.01"]
    )
    watch = EvalWatch.for_run(cfg, {})
    assert watch.state() == {
        "metric": "eval_loss",
        "best": None,
        "best_step": None,
        "evals_since_best": 0,
        "best_checkpoint": None,
    }
    watch.after_eval(100, {"eval_loss": 4.0})
    watch.checkpointed("checkpoint_000100", 100)
    # A preemption's checkpoint ranks last: scored the largest float (inf became null in Ray's record)
    assert watch.score(100) == 4.0 and watch.score(150) == sys.float_info.max
    watch.checkpointed("checkpoint_000150", 150)
    watch.after_eval(200, {"eval_loss": 3.995})  # lower, but by less than min_delta: not an improvement
    watch.checkpointed("checkpoint_000200", 200)
    assert (watch.best, watch.best_step, watch.evals_since_best, watch.stop_reason) == (4.0, 100, 1, None)
    assert watch.best_checkpoint == {"name": "checkpoint_000200", "step": 200, "value": 3.995}  # still the lowest

    resumed = EvalWatch.for_run(cfg, {"eval_watch": json.loads(json.dumps(watch.state()))})
    resumed.after_eval(300, {"eval_loss": math.nan})  # diverged
    assert resumed.score(300) == sys.float_info.max
    assert "eval_loss has not improved on its best (4.0000 at step 100) in 2 evaluations" in resumed.stop_reason
    assert resumed.best_checkpoint["step"] == 200
    resumed.after_eval(400, {"eval_loss": 3.0})  # improves again (a resume with more patience)
    assert (resumed.evals_since_best, resumed.stop_reason) == (0, None)

    other = load_config(None, ["data.mix=[{weight: 1, name: wiki}]", "run.best_metric=eval_loss/wiki"])
    fresh = EvalWatch.for_run(other, {"eval_watch": watch.state()})  # another metric: counts afresh
    assert (fresh.metric, fresh.evals_since_best, fresh.best_checkpoint) == ("eval_loss/wiki", 0, None)


def test_a_guard_stop_ends_the_job_with_a_message_and_exit_code(monkeypatch, capsys, tmp_path):
    from raytrain_cpu.launch import driver as main_mod

    reason = "guard: step 7: loss 9 is above 6 (guards.loss_spike_factor x its running mean); stopping"
    summary = {
        "steps": 7,
        "tokens_seen": 100,
        "final_loss": 9.0,
        "eval_perplexity": None,
        "tokens_per_s": 10.0,
        "world_size": 2,
        "wall_s": 1.0,
        "checkpoint_path": None,
        "run_dir": str(tmp_path),
        "guard_events": {"loss_spike": 1, "grad_norm": 0, "nonfinite": 0, "skipped_steps": 0},
        "guard_stop": reason,
    }
    monkeypatch.setattr(main_mod, "run", lambda cfg: summary)
    monkeypatch.setattr(main_mod, "validate_before_ray", lambda cfg: None)
    assert main_mod.main(["guards.action=stop"]) == 3
    out, err = capsys.readouterr()
    assert "1 loss spike" in out and f"stopped early at step 7: {reason}" in err
