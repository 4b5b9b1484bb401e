"""The attempt's closing figures: the step-time breakdown over the ranks, and rank 0's summary
for the driver (Ray Train v2 keeps no final metrics)."""

from __future__ import annotations

import json
from typing import Any

from raytrain_cpu.trainer.engine import allreduce_sum
from raytrain_cpu.trainer.loading import Loaded
from raytrain_cpu.trainer.state import Loop, Worker


def step_breakdown(w: Worker, clock) -> dict[str, Any]:
    """Seconds per optimizer step after the warm-up steps, averaged over ranks (every rank joins)."""
    breakdown = clock.summary()
    if clock.comm is not None:
        clock.comm.uninstall()
    keys = [k for k, v in breakdown.items() if isinstance(v, float)]
    breakdown |= dict(zip(keys, (v / w.world for v in allreduce_sum([breakdown[k] for k in keys])), strict=True))
    breakdown["tokens_per_s"] = w.tokens_per_step / breakdown["step_wall_s"] if breakdown["steps"] else None
    return breakdown


def write_worker_summary(w: Worker, st: Loop, engine, guard, loaded: Loaded, cpu_setup, breakdown) -> None:
    """Rank 0 hands its figures to the driver through a file (Ray Train v2 keeps no final metrics)."""
    summary = {
        "steps": st.step,
        "tokens_seen": st.step * w.tokens_per_step,
        "epochs": w.epochs(st.step),
        "final_loss": st.last.get("loss"),
        **{f"final_{k}": v for k, v in st.last.items() if k.startswith("loss/")},  # a mixture's: final_loss/<name>
        "eval_loss": st.eval_metrics.get("eval_loss"),
        "eval_perplexity": st.eval_metrics.get("eval_perplexity"),
        "eval_tokens": st.eval_metrics.get("eval_tokens"),  # the targets evaluated (responses only in SFT)
        **{k: v for k, v in st.eval_metrics.items() if "/" in k},  # a mixture's sources: eval_loss/<name>
        **{k: v for k, v in st.eval_metrics.items() if k.startswith(("eval_dpo", "eval_reward"))},  # DPO's
        "tokens_per_s": st.steps_this_attempt * w.tokens_per_step / st.wall(),
        "data_wait_frac": st.total_wait / st.wall(),
        "first_batch_wait_s": st.first_batch_wait,
        "world_size": w.world,
        "global_batch": w.global_batch,
        "resumed_from_step": st.resumed_from,
        "optimizer_step_at_resume": st.opt_step_at_resume,
        "load_s": loaded.load_s,
        "n_params": w.loop_config["n_params"],
        "trainable_params": loaded.params["trainable"],
        "total_params": loaded.params["total"],
        "optimizer_state_bytes": loaded.params["optimizer_state_bytes"],  # per rank
        "lora": loaded.lora,
        "dpo": w.dpo_settings,
        "reference_pass": w.reference_pass,
        "attention": loaded.attention,
        "compiled": w.cfg.model.compile is True,  # model.compile=auto as this run resolved it
        "weight_grad_kernel": w.weight_grad_kernel,  # model.weight_grad_kernel as this run resolved it
        "weight_grad_timings": w.weight_grad_timings,  # seconds a micro batch, kernel and autograd ('auto')
        "train_wall_s": st.wall(),
        "guard_events_this_attempt": guard.counts,
        "skipped_steps": engine.skipped_steps,  # DeepSpeed's count, kept across resumes
        "guard_stop": guard.stop_reason,
        "early_stop": st.watch.stop_reason if st.step < w.cfg.train.max_steps else None,  # at the end: not early
        "best_checkpoint": best_checkpoint(w, st),
        "step_breakdown": breakdown,
        "cpu": {**cpu_setup, "load_peak_rss_bytes": loaded.load_peaks},
    }
    (w.run_dir / ".worker_summary.json").write_text(json.dumps(summary, indent=2))


def best_checkpoint(w: Worker, st: Loop) -> dict[str, Any] | None:
    """run.best_metric's best checkpoint: {"path", "step", "metric", "value"}; None when not ranking."""
    best = st.watch.best_checkpoint
    if best is None:
        return None
    return {
        "path": str(w.run_dir / best["name"]),
        "step": best["step"],
        "metric": st.watch.metric,
        "value": best["value"],
    }
