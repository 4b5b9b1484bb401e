"""`python -m raytrain_cpu.report RUN_DIR`: plots and a markdown summary of a run, finished or not.

Writes into the run directory (or --out):

    loss.png              train loss and eval loss over tokens seen
    eval_perplexity.png   eval perplexity over tokens seen
    lr.png                learning rate over steps
    throughput.png        tokens/s over steps (and MFU when it was logged)
    memory.png            resident memory per rank over steps (rank 0, max over ranks, peak)
    rewards.png           a DPO run's reward accuracy, train and eval, over tokens seen
    chosen_loss.png       a DPO run's chosen answers' loss per token, train and eval
    report.md             the figures that matter, guard events, restarts, and the plots

Everything comes from metrics.jsonl (read with `metrics.read_metrics`, so a resumed run shows
the history that was kept, not the steps a failed attempt repeated); summary.json and
config.yaml add context when they exist. A run still in progress has no summary.json yet: the
report says so and shows what has been logged so far. A metrics.jsonl with no readable row yet
(empty, or not JSON lines) is an error, exit code 2, that writes nothing: an earlier report.md
stays as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raytrain_cpu.obs.metrics import (
    FAILURE_FILE,
    METRICS_FILE,
    RunMetrics,
    by_source,
    count_events,
    format_duration,
    read_metrics,
)

FIGSIZE = (8.0, 4.5)  # inches
DPI = 100  # so each PNG is 800 x 450 pixels


# ----------------------------------------------------------------------------- loading


@dataclass
class Run:
    """One run directory as the report sees it."""

    run_dir: Path
    metrics: RunMetrics
    config: dict[str, Any] | None
    summary: dict[str, Any] | None
    failure: dict[str, Any] | None = None  # FAILURE_FILE: the driver run that failed last

    @property
    def name(self) -> str:
        return ((self.config or {}).get("run") or {}).get("name") or self.run_dir.name

    @property
    def preference(self) -> bool:
        """A DPO run (data.format=preference): its loss is DPO's, its eval_loss the chosen answers'."""
        fmt = ((self.config or {}).get("data") or {}).get("format")
        return fmt == "preference" or any("eval_dpo_loss" in r for r in self.metrics.eval)

    @property
    def max_steps(self) -> int | None:
        return ((self.config or {}).get("train") or {}).get("max_steps")

    @property
    def last_step(self) -> int:
        rows = self.metrics.train + self.metrics.eval
        return max((r["step"] for r in rows), default=0)

    @property
    def tokens_per_step(self) -> float | None:
        """From the train rows (tokens_seen / step), to place eval rows on the token axis."""
        for r in reversed(self.metrics.train):
            if r.get("tokens_seen") and r["step"]:
                return r["tokens_seen"] / r["step"]
        return None

    def tokens_at(self, step: int) -> float:
        per = self.tokens_per_step
        return step * per if per else float(step)

    @property
    def status(self) -> str:
        s = self.summary
        if s and s.get("steps", 0) >= self.last_step:
            if s.get("guard_stop"):
                return f"stopped by a guard at step {s['steps']}"
            if s.get("early_stop"):
                return f"stopped early at step {s['steps']}: {s['early_stop']}"
            return "finished"
        last = max((r.get("time") or 0 for r in self.metrics.train + self.metrics.eval), default=0)
        if self.failure and self.failure.get("time", 0) >= last:  # nothing logged since it failed
            return f"failed: {self.failure.get('reason')}"
        ago = f"; last row written {format_duration(time.time() - last)} ago" if last else ""
        return f"in progress or interrupted (no summary.json for this step yet{ago})"


class ReportError(ValueError):
    """A run directory or --out the report cannot use; its message names the file and the fix."""


def load_run(run_dir: str | Path) -> Run:
    """Reads metrics.jsonl (required), config.yaml and summary.json (optional)."""
    run_dir = Path(run_dir).expanduser().absolute()
    if not (run_dir / METRICS_FILE).is_file():
        raise FileNotFoundError(
            f"{run_dir} has no {METRICS_FILE}; give a run directory such as runs/tiny-local "
            "(<run.storage_path>/<run.name>) of a run that has logged at least one step."
        )
    config = _read_config(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else None
    summary, failure = None, None
    if (run_dir / "summary.json").is_file():
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except ValueError:
            summary = None  # being written right now
    with contextlib.suppress(OSError, ValueError):
        failure = json.loads((run_dir / FAILURE_FILE).read_text())
    return Run(run_dir, read_metrics(run_dir / METRICS_FILE), config, summary, failure)


def _read_config(path: Path) -> dict[str, Any] | None:
    """The run's config.yaml, which names the run and its length; a file that is not a YAML
    mapping would otherwise surface as a parser's traceback or an AttributeError in a plot."""
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ReportError(
            f"{path} is not valid YAML{where} ({getattr(e, 'problem', None) or 'parse error'}): "
            "fix it, or move it aside to report the run without its config"
        ) from None
    if config is not None and not isinstance(config, dict):
        raise ReportError(
            f"{path} holds a {type(config).__name__}, not a mapping of sections (run:, train:, ...): "
            "fix it, or move it aside to report the run without its config"
        )
    return config


# ----------------------------------------------------------------------------- plots


def _series(rows: list[dict[str, Any]], x: str | Callable[[dict], float], y: str) -> tuple[list[float], list[float]]:
    """(xs, ys) of the rows that have a finite y (skipped or non-finite steps log null)."""
    xs, ys = [], []
    for r in rows:
        v = r.get(y)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(x(r) if callable(x) else r[x])
            ys.append(float(v))
    return xs, ys


def _figure(title: str, xlabel: str, ylabel: str):
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged yet", ha="center", va="center", transform=ax.transAxes, color="gray")


def _mark_restarts_and_events(run: Run, ax, on_tokens: bool) -> None:
    """Dotted lines where a resumed attempt took over, red ticks where a guard fired."""
    pos = run.tokens_at if on_tokens else float
    for i, step in enumerate(run.metrics.restarts):
        ax.axvline(pos(step), color="gray", linestyle=":", label="resumed" if i == 0 else None)
    for i, e in enumerate(run.metrics.events):
        ax.axvline(pos(e["step"]), color="tab:red", alpha=0.4, linewidth=1, label="guard event" if i == 0 else None)


def plot_loss(run: Run):
    """Train loss (per logged step) and eval loss over tokens seen."""
    fig, ax = _figure(f"{run.name}: {'DPO loss' if run.preference else 'loss'}", "tokens seen", "loss")
    # DPO: both curves are DPO's (eval_loss is the chosen answers' cross-entropy; under
    # train.dpo_sft_weight a train row's loss adds theirs, and dpo_loss is DPO's alone)
    sft_term = run.preference and any("dpo_loss" in r for r in run.metrics.train)
    xs, ys = _series(run.metrics.train, "tokens_seen", "dpo_loss" if sft_term else "loss")
    eval_key = "eval_dpo_loss" if run.preference else "eval_loss"
    exs, eys = _series(run.metrics.eval, lambda r: run.tokens_at(r["step"]), eval_key)
    if xs:
        ax.plot(xs, ys, label="train loss", color="tab:blue", linewidth=1.2)
    if exs:
        ax.plot(exs, eys, label="eval loss", color="tab:orange", marker="o", linewidth=1.5)
    for name in sorted({name for r in run.metrics.train for name in by_source(r, "loss")}):  # a mixture's
        sxs, sys_ = _series(run.metrics.train, "tokens_seen", f"loss/{name}")
        ax.plot(sxs, sys_, label=f"train loss: {name}", linewidth=0.8, alpha=0.8)
    for name in sorted({name for r in run.metrics.eval for name in by_source(r)}):  # a mixture's sources
        sxs, sys_ = _series(run.metrics.eval, lambda r: run.tokens_at(r["step"]), f"eval_loss/{name}")
        ax.plot(sxs, sys_, label=f"eval loss: {name}", marker=".", linewidth=1, linestyle="--")
    if not xs and not exs:
        _no_data(ax, "loss")
    elif max(ys + eys) > 10 * min(ys + eys):
        ax.set_yscale("log")  # a spike would flatten the rest of the curve on a linear axis
    _mark_restarts_and_events(run, ax, on_tokens=True)
    if best := (run.summary or {}).get("best_checkpoint"):  # run.best_metric
        ax.plot(
            [run.tokens_at(best["step"])],
            [best["value"]],
            marker="*",
            markersize=14,
            color="tab:red",
            linestyle="none",
            label=f"best checkpoint ({best['metric']}, step {best['step']})",
        )
    if xs or exs:
        ax.legend()
    return fig


def plot_eval_perplexity(run: Run):
    chosen = " (the chosen answers)" if run.preference else ""
    fig, ax = _figure(f"{run.name}: eval perplexity{chosen}", "tokens seen", "perplexity")
    xs, ys = _series(run.metrics.eval, lambda r: run.tokens_at(r["step"]), "eval_perplexity")
    if xs:
        ax.plot(xs, ys, color="tab:orange", marker="o")
        if max(ys) / max(min(ys), 1e-9) > 20:
            ax.set_yscale("log")
    else:
        _no_data(ax, "evaluation")
    return fig


def plot_lr(run: Run):
    fig, ax = _figure(f"{run.name}: learning rate", "step", "learning rate")
    xs, ys = _series(run.metrics.train, "step", "lr")
    if xs:
        ax.plot(xs, ys, color="tab:green")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    else:
        _no_data(ax, "learning rate")
    return fig


def plot_throughput(run: Run):
    fig, ax = _figure(f"{run.name}: throughput", "step", "tokens/s (all workers)")
    xs, ys = _series(run.metrics.train, "step", "tokens_per_s")
    if xs:
        ax.plot(xs, ys, color="tab:purple", label="tokens/s")
        mx, my = _series(run.metrics.train, "step", "mfu")
        if mx:
            ax2 = ax.twinx()
            ax2.plot(mx, [100 * v for v in my], color="tab:gray", linestyle="--", label="MFU")
            ax2.set_ylabel("MFU (%)")
    else:
        _no_data(ax, "throughput")
    _mark_restarts_and_events(run, ax, on_tokens=False)
    return fig


def plot_memory(run: Run):
    fig, ax = _figure(f"{run.name}: memory per rank", "step", "GiB")
    curves = [
        ("mem_rss_rank0_gib", "RSS rank 0", "-"),
        ("mem_rss_max_gib", "RSS max over ranks", "-"),
        ("mem_peak_max_gib", "peak RSS max over ranks", "--"),
    ]
    top = 0.0
    for key, label, style in curves:
        xs, ys = _series(run.metrics.train, "step", key)
        if xs:
            ax.plot(xs, ys, linestyle=style, label=label)
            top = max(top, *ys)
    if top:
        ax.set_ylim(0, top * 1.25)  # from zero, with room for the legend above the curves
        ax.legend(loc="upper left", ncols=3, fontsize=8)
    else:
        _no_data(ax, "memory")
    return fig


def _train_and_eval(run: Run, ax, train_key: str, eval_key: str, scale: float = 1.0) -> bool:
    """A metric's train curve (per logged step) and eval curve over tokens seen, times `scale`;
    whether either had data."""
    xs, ys = _series(run.metrics.train, "tokens_seen", train_key)
    exs, eys = _series(run.metrics.eval, lambda r: run.tokens_at(r["step"]), eval_key)
    if xs:
        ax.plot(xs, [scale * y for y in ys], label="train", color="tab:blue", linewidth=1.0, alpha=0.7)
    if exs:
        ax.plot(exs, [scale * y for y in eys], label="eval", color="tab:orange", marker="o", linewidth=1.5)
    return bool(xs or exs)


def plot_rewards(run: Run):
    """A DPO run's reward accuracy: the share of pairs whose chosen answer gained more likelihood
    over the reference than the rejected one, train (per logged step) and eval."""
    fig, ax = _figure(f"{run.name}: DPO reward accuracy", "tokens seen", "reward accuracy (%)")
    if _train_and_eval(run, ax, "reward_accuracy", "eval_reward_accuracy", scale=100):
        ax.set_ylim(0, 100)
        ax.axhline(50, color="gray", linestyle=":", linewidth=1)
        ax.legend()
    else:
        _no_data(ax, "reward accuracy")
    return fig


def plot_chosen_loss(run: Run):
    """A DPO run's chosen answers' per-token loss, train (chosen_loss) and eval (eval_loss): DPO
    asks the chosen answer to gain on the rejected one, and may lower both (train.dpo_sft_weight
    holds it up)."""
    fig, ax = _figure(f"{run.name}: the chosen answers' loss", "tokens seen", "loss per token")
    if _train_and_eval(run, ax, "chosen_loss", "eval_loss"):
        ax.legend()
    else:
        _no_data(ax, "chosen answers' loss")
    return fig


PLOTS: dict[str, Callable[[Run], Any]] = {
    "loss.png": plot_loss,
    "eval_perplexity.png": plot_eval_perplexity,
    "lr.png": plot_lr,
    "throughput.png": plot_throughput,
    "memory.png": plot_memory,
}


PREFERENCE_PLOTS: dict[str, Callable[[Run], Any]] = {  # DPO runs add these
    "rewards.png": plot_rewards,
    "chosen_loss.png": plot_chosen_loss,
}


# ----------------------------------------------------------------------------- markdown


def _fmt(v: Any, spec: str = ".4f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return format(v, spec)


def key_figures(run: Run) -> dict[str, str]:
    """The table at the top of report.md (also handy in a notebook)."""
    m, s = run.metrics, run.summary or {}
    train = [r for r in m.train if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    best_eval = min((r for r in m.eval if "eval_loss" in r), key=lambda r: r["eval_loss"], default=None)
    tps = [r["tokens_per_s"] for r in m.train[1:] if r.get("tokens_per_s")]  # window 1: warm-up steps
    mfus = [r["mfu"] for r in m.train if r.get("mfu") is not None]
    peak = max((r.get("mem_peak_max_gib") or 0 for r in m.train), default=0)
    steps = f"{run.last_step}" + (f" / {run.max_steps}" if run.max_steps else "")
    out = {
        "status": run.status,
        "steps": steps,
        "tokens seen": f"{int(run.tokens_at(run.last_step)):,}",
        "last train loss": _fmt(train[-1]["loss"]) if train else "n/a",
        f"best eval loss (perplexity){' of the chosen answers' if run.preference else ''}": (
            f"{best_eval['eval_loss']:.4f} ({best_eval['eval_perplexity']:.2f}) at step {best_eval['step']}"
            if best_eval
            else "n/a"
        ),
        "tokens/s (median over log windows)": f"{statistics.median(tps):,.0f}" if tps else "n/a",
        "MFU (median)": f"{100 * statistics.median(mfus):.1f}%" if mfus else "n/a (no peak FLOP/s known)",
        "peak RSS per rank (max over ranks)": f"{peak:.2f} GiB" if peak else "n/a",
        "resumed at steps": ", ".join(map(str, m.restarts)) or "none",
    }
    if best := s.get("best_checkpoint"):  # run.best_metric
        out["best checkpoint"] = (
            f"{Path(best['path']).name} ({best['metric']} {_fmt(best['value'])} at step {best['step']})"
        )
    if run.preference and m.eval and "eval_dpo_loss" in m.eval[-1]:
        e = m.eval[-1]
        out[f"eval DPO loss, reward accuracy (step {e['step']})"] = (
            f"{_fmt(e['eval_dpo_loss'])}, {100 * e['eval_reward_accuracy']:.1f}% of {e['eval_pairs']:,.0f} pairs"
        )
    if m.eval and (last := by_source(m.eval[-1])):  # a mixture
        out[f"eval loss by source (step {m.eval[-1]['step']})"] = ", ".join(f"{k} {_fmt(v)}" for k, v in last.items())
    if counts := worker_counts(m.train):
        out["workers"] = counts
    elif s.get("world_size"):
        out["workers"] = str(s["world_size"])
    if s.get("wall_s") and s.get("steps", 0) >= run.last_step:  # a summary.json of an earlier attempt: not this one's
        out["wall time (last attempt)"] = f"{s['wall_s']:.0f}s"
    return out


def worker_counts(train: list[dict[str, Any]]) -> str:
    """'2 (to step 20) → 1 (from step 21)', by the logged steps, when a resume changed the worker
    count; '2' when none did; '' for rows that predate the "workers" key."""
    spans: list[list[int]] = []  # [workers, first logged step, last logged step]
    for r in train:
        if not r.get("workers"):
            continue
        if spans and spans[-1][0] == r["workers"]:
            spans[-1][2] = r["step"]
        else:
            spans.append([r["workers"], r["step"], r["step"]])
    if len(spans) < 2:
        return str(spans[0][0]) if spans else ""
    parts = [f"{spans[0][0]} (to step {spans[0][2]})"]
    parts += [f"{n} (steps {a}–{b})" for n, a, b in spans[1:-1]]
    return " → ".join([*parts, f"{spans[-1][0]} (from step {spans[-1][1]})"])


def render_markdown(run: Run, images: list[str]) -> str:
    lines = [f"# Run report: {run.name}", "", f"Run directory: `{run.run_dir}`", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in key_figures(run).items()]
    counts = count_events(run.metrics)
    lines += ["", "## Stability guards", ""]
    if not run.metrics.events:
        lines.append("No loss spikes, gradient-norm spikes or non-finite losses were logged.")
    else:
        lines.append(", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items()) + ".")
        lines += ["", "| step | event | value | threshold | action |", "|---|---|---|---|---|"]
        for e in run.metrics.events[:50]:
            lines.append(
                f"| {e['step']} | {e['event']} | {_fmt(e.get('value'), '.4g')} | "
                f"{_fmt(e.get('threshold'), '.4g')} | {e.get('action')} |"
            )
        if len(run.metrics.events) > 50:
            lines.append(f"| ... | {len(run.metrics.events) - 50} more in metrics.jsonl | | | |")
    lines += ["", "## Plots", ""]
    lines += [f"![{Path(name).stem}]({name})" for name in images]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- entry points


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> dict[str, Path]:
    """Writes the PNGs and report.md; returns {file name: path}."""
    run = load_run(run_dir)
    _require_rows(run)
    out = _output_dir(out_dir) if out_dir else run.run_dir
    written: dict[str, Path] = {}
    plots = PLOTS | (PREFERENCE_PLOTS if run.preference else {})
    for name, plot in plots.items():
        fig = plot(run)
        fig.savefig(out / name)
        written[name] = out / name
    (out / "report.md").write_text(render_markdown(run, list(plots)))
    written["report.md"] = out / "report.md"
    return written


def _require_rows(run: Run) -> None:
    """An empty or unreadable metrics.jsonl would give a report of nothing ("steps 0") in place
    of an earlier, good report.md: stop before anything is written instead."""
    if not run.metrics.train and not run.metrics.eval:
        raise ReportError(
            f"{run.run_dir / METRICS_FILE} holds no readable train or eval rows (empty, or no line is a "
            "JSON object with an integer 'step'); nothing was written: report the run once it has logged a step"
        )


def _output_dir(out_dir: str | Path) -> Path:
    """--out: a directory, made if missing."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} is a file: give a directory (made if missing), or drop --out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m raytrain_cpu.report",
        description="Plot a run (finished, resumed or still running) and write report.md next to its metrics.",
    )
    ap.add_argument("run_dir", help="the run directory: <run.storage_path>/<run.name>, e.g. runs/tiny-local")
    ap.add_argument("--out", default=None, help="write the report here instead of into the run directory")
    args = ap.parse_args(argv)
    try:
        written = write_report(args.run_dir, args.out)
    except (ReportError, OSError) as e:  # OSError: --out or the run directory not writable, and the like
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[report] {written['report.md']} and {len(written) - 1} plots in {written['report.md'].parent}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
