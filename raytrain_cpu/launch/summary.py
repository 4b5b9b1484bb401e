"""The end of a run on the console: the summary, an interruption, a failure, and where it resumes."""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import time
from typing import Any

from raytrain_cpu.config.schema import Config
from raytrain_cpu.launch.resume import where_it_resumes
from raytrain_cpu.obs.console import (
    failure_reason,
)


def print_summary(s: dict[str, Any]) -> None:
    from raytrain_cpu.checkpoint.layout import workers

    def num(key: str, spec: str) -> str:  # a finished run's summary may lack a figure
        return "n/a" if s.get(key) is None else format(s[key], spec)

    resumed = f" (resumed from step {s['resumed_from_step']})" if s.get("resumed_from_step") else ""
    print(
        "\n== raytrain_cpu summary ==\n"
        f"steps            {s['steps']}{resumed}\n"
        f"tokens seen      {num('tokens_seen', ',')}\n"
        f"final loss       {num('final_loss', '.4f')}{_by_source(s, 'final_loss', '.4f')}\n"
        f"eval perplexity  {num('eval_perplexity', '.2f')}{_by_source(s, 'eval_perplexity', '.2f')}\n"
        f"{_preference_line(s)}"
        f"tokens/s         {num('tokens_per_s', ',.0f')} on {workers(s['world_size'])}\n"
        f"wall time        {num('wall_s', '.0f')}s\n"
        f"checkpoint       {s['checkpoint_path']}\n"
        f"{_best_line(s)}"
        f"run directory    {s['run_dir']} (metrics.jsonl, summary.json; run.log: which kernel and path each choice took)\n"
        f"guards           {_guard_line(s)}\n"
        f"report           python -m raytrain_cpu.report {shlex.quote(str(s['run_dir']))}\n",
        flush=True,
    )
    if s.get("early_stop"):
        print(f"[raytrain] stopped early at step {s['steps']}: {s['early_stop']}", flush=True)
    if s.get("guard_stop"):
        print(f"error: the run stopped early at step {s['steps']}: {s['guard_stop']}", file=sys.stderr, flush=True)


def _preference_line(s: dict[str, Any]) -> str:
    """'eval DPO         loss 0.6687, reward accuracy 56.2%' for a preference run, else ''; a
    loss other than DPO's sigmoid is named: 'eval DPO         ipo loss 0.2482, ...'."""
    if s.get("eval_dpo_loss") is None:
        return ""
    kind = (s.get("dpo") or {}).get("loss", "sigmoid")
    name = "" if kind == "sigmoid" else f"{kind} "
    return f"eval DPO         {name}loss {s['eval_dpo_loss']:.4f}, reward accuracy {100 * s['eval_reward_accuracy']:.1f}%\n"


def _best_line(s: dict[str, Any]) -> str:
    """'best checkpoint  <path> (eval_loss 4.0123 at step 300)' under run.best_metric, else ''."""
    best = s.get("best_checkpoint")
    if not best:
        return ""
    return f"best checkpoint  {best['path']} ({best['metric']} {best['value']:.4f} at step {best['step']})\n"


def _by_source(s: dict[str, Any], metric: str, fmt: str) -> str:
    """' (wiki 62.10, notes 18.40)': a mixture's `metric` of each source (final_loss/<name>, ...)."""
    from raytrain_cpu.obs.metrics import by_source

    each = [f"{name} {v:{fmt}}" for name, v in by_source(s, metric).items()]
    return f" ({', '.join(each)})" if each else ""


def _guard_line(s: dict[str, Any]) -> str:
    g = s.get("guard_events") or {}
    if not any(g.values()):
        return "no loss spikes, gradient-norm spikes or non-finite losses"
    return ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in g.items()) + " (event rows in metrics.jsonl)"


def print_interrupted(cfg: Config) -> None:
    print(
        f"\n[raytrain] interrupted: run {cfg.run.name!r} stopped before "
        f"{f'the end of train.epochs={cfg.train.epochs:g}' if cfg.train.epochs else f'step {cfg.train.max_steps}'}; "
        f"{where_it_resumes(cfg)}",
        file=sys.stderr,
        flush=True,
    )


def print_failed(cfg: Config, error: Exception) -> None:
    """The end of a run whose workers failed past run.max_failures: the cause in one line (every
    rank's traceback stays in Ray's logs, or on the console with run.verbose) and where it resumes."""
    failures = getattr(error, "worker_failures", None)
    if failures:
        reason, _ = failure_reason(failures)
    else:  # the controller's own error
        reason = next((line for line in str(error).splitlines()[1:] if line.strip()), str(error)).strip()
    from raytrain_cpu.obs.metrics import FAILURE_FILE

    with contextlib.suppress(OSError):  # for the report, which otherwise sees a run still in progress
        (cfg.run.run_dir / FAILURE_FILE).write_text(json.dumps({"time": time.time(), "reason": reason}))
    print(
        f"\nerror: run {cfg.run.name!r} failed ({reason}); {where_it_resumes(cfg, failed=True)} Ray's logs (named at the top, "
        "on each node) hold every rank's traceback; run.verbose=true prints them here too.",
        file=sys.stderr,
        flush=True,
    )
