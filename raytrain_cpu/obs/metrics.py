"""Metric sinks and the progress line: metrics.jsonl (the source of truth), TensorBoard, MLflow.

Rank 0 owns a `MetricsSink`; every row goes to metrics.jsonl first, then to TensorBoard
(`<run dir>/tensorboard`) and, when `metrics.mlflow_tracking_uri` is set, to MLflow. The other
sinks are conveniences: a failure there warns once and never stops training.

metrics.jsonl holds four kinds of rows, told apart by their keys:

- train: ``{step, loss, lr, grad_norm, tokens_seen, tokens_per_s, data_wait_frac, time, ...}``
- eval: ``{step, eval_loss, eval_perplexity, eval_tokens, time}`` (a mixture adds
  ``eval_loss/<source>`` and ``eval_perplexity/<source>``)
- guard event: ``{step, event, value, threshold, action, time}``
- attempt: ``{step, attempt: {workers}, time}``, where each attempt starts (step 0, or the step
  of the checkpoint it resumed from)

A resumed run appends to the same file, so steps after its checkpoint appear twice;
`read_metrics` keeps the rows of the attempt that came last.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 2**30
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # train.sample_prompt's completions, one row per evaluation
FAILURE_FILE = "failure.json"  # {time, reason} of the driver run that failed last (main.print_failed)

# ----------------------------------------------------------------------------- reading


@dataclass
class RunMetrics:
    """The rows of one run's metrics.jsonl, one per step and kind (the newest attempt wins)."""

    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)
    """Steps at which a later attempt took over (a resume after a failure or a restart)."""


def row_kind(row: dict[str, Any]) -> str:
    if "attempt" in row:
        return "attempt"
    if "event" in row:
        return "event"
    if "eval_loss" in row:
        return "eval"
    return "train"


def _read_lines(path: Path) -> Iterable[dict[str, Any]]:
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash (or being written right now)
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                yield row


def read_metrics(path: str | os.PathLike) -> RunMetrics:
    """Reads metrics.jsonl (a file or a run directory) as it stands, even mid-write.

    An attempt row says where an attempt started: rows past its step belong to the superseded
    attempt and are dropped, so what remains is the history of the attempt that got furthest
    last; an attempt after earlier rows (or past step 0) is a restart at its checkpoint's step.
    Older files, written before attempt rows existed, tell a restart by a train row whose step is
    not past the previous one (the first row it logged, not its checkpoint's step, and none
    where it resumed at its last logged step).
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    kept: list[dict[str, Any]] = []
    restarts: list[int] = []
    last_train_step = -1
    attempts = False
    if path.is_file():
        for row in _read_lines(path):
            kind, step = row_kind(row), row["step"]
            if kind == "attempt":
                if kept or step > 0:
                    restarts.append(step)
                kept = [r for r in kept if r["step"] <= step]
                last_train_step, attempts = step, True
                continue
            if kind == "train":
                if step <= last_train_step:
                    if not attempts:
                        restarts.append(step)
                    kept = [r for r in kept if r["step"] < step]
                last_train_step = step
            kept.append(row)
    by_key: dict[tuple[str, int, str], dict[str, Any]] = {}
    for row in kept:  # later duplicates of the same step and kind win
        by_key[(row_kind(row), row["step"], row.get("event", ""))] = row
    out = RunMetrics(restarts=restarts)
    for (kind, _, _), row in sorted(by_key.items(), key=lambda kv: kv[0][1]):
        {"train": out.train, "eval": out.eval, "event": out.events}[kind].append(row)
    return out


def count_events(metrics: RunMetrics) -> dict[str, int]:
    """Guard counts for summary.json: events by kind, and how many steps were skipped."""
    counts = {"loss_spike": 0, "grad_norm": 0, "nonfinite": 0, "skipped_steps": 0}
    skipped_steps = set()
    for e in metrics.events:
        counts[e["event"]] = counts.get(e["event"], 0) + 1
        if e.get("action") == "skip":
            skipped_steps.add(e["step"])
    counts["skipped_steps"] = len(skipped_steps)
    return counts


# ----------------------------------------------------------------------------- measuring


def process_memory() -> dict[str, float]:
    """This process's resident set now and its high-water mark, in bytes (Linux /proc)."""
    out = {"rss": 0.0, "hwm": 0.0}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss"] = float(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                out["hwm"] = float(line.split()[1]) * 1024
    except OSError:  # not Linux: psutil has the current RSS, the peak is unknown
        import psutil

        out["rss"] = out["hwm"] = float(psutil.Process().memory_info().rss)
    return out


def allreduce_max(values: list[float]) -> list[float]:
    """Element-wise maximum over all ranks (every rank must call it at the same point)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def flops_per_token(n_params: dict[str, int | None], seq_len: int) -> float | None:
    """Training FLOPs per token: 6N for the matmuls (N = model.count_parameters' non_embedding:
    all but the input embeddings) plus 12·L·d·seq for attention scores and values (forward +
    backward), as in the PaLM paper, d being the attention's width (heads x head_dim: Gemma's is
    wider than its hidden size). None when the model's config names no layer count or width."""
    if not n_params.get("num_layers") or not n_params.get("hidden_size"):
        return None
    width = n_params.get("attention_width") or n_params["hidden_size"]
    return 6.0 * n_params["non_embedding"] + 12.0 * n_params["num_layers"] * width * seq_len


def mfu(tokens_per_s: float, n_params: dict[str, int | None], seq_len: int, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak FLOP/s of all workers.

    None when the peak or the model's shape is unknown, so no made-up number is ever logged.
    """
    fpt = flops_per_token(n_params, seq_len)
    if not peak_flops or fpt is None:
        return None
    return tokens_per_s * fpt / peak_flops


@dataclass
class ThroughputWindow:
    """A log row's tokens/s and data_wait_frac, over the training steps since the last row and
    their seconds alone. What runs between steps (an evaluation, a checkpoint's save, the MFU
    probe, the row's own all-reduces) and the first batch's wait for the data pipeline to start
    are no part of it: a window that held one read as a slow-down of training that never was.
    The data waits within the steps are, and data_wait_frac is their share of the steps' time."""

    seconds: float = 0.0  # the steps' own
    tokens: int = 0
    wait: float = 0.0  # of `seconds`: waiting for the next batch

    def add_step(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens

    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def data_wait_frac(self) -> float:
        return self.wait / max(self.seconds, 1e-9)


# ----------------------------------------------------------------------------- progress line


CONSOLE_LINE = re.compile(r"^\[(?:rank \d+|raytrain)\] ")
"""How every line raytrain prints inside Ray's processes starts. Of all that Ray forwards from
its workers and actors, the driver's default console shows only lines like these
(main.quiet_ray_console); run.verbose=true shows the rest too."""


CHOICE_LINE = re.compile(r"^\[rank \d+\] (?:cpu: |collectives: |\[(?:model|engine)\] |\[load\] loading )")
"""A worker's line saying which kernel or path a choice took (CPU, dtype, threads, allocator,
collectives, attention, loss, norms, weight gradients, compile, ZeRO-3 gathers): once the worker
knows its run directory (log_choices), these go to its run.log rather than the console, which
keeps progress, evaluation and the summary."""

RUN_LOG = "run.log"
_choice_log: list[Path] = []  # this process's run.log, once log_choices named it


def log_choices(run_dir: str | Path) -> None:
    """From now on this process's CHOICE_LINEs go to <run_dir>/run.log instead of stdout."""
    _choice_log[:] = [Path(run_dir) / RUN_LOG]


def read_choices(run_dir: str | Path, start: int = 0) -> list[str]:
    """The choice lines written to <run_dir>/run.log from byte `start` on, each once (a restarted
    worker group writes its own again), for summary.json."""
    try:
        with open(Path(run_dir) / RUN_LOG, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return list(dict.fromkeys(line for line in text.splitlines() if line))


def run_log_size(run_dir: str | Path) -> int:
    """run.log's size now: where this attempt's choices start (read_choices)."""
    try:
        return (Path(run_dir) / RUN_LOG).stat().st_size
    except OSError:
        return 0


def console(msg: str) -> None:
    """Flushed line(s) on stdout, each starting "[rank N] " or "[raytrain] " (CONSOLE_LINE; a line
    with neither gets the first line's prefix, or "[raytrain] "), so the driver's console shows them;
    a choice line (CHOICE_LINE) goes to run.log instead, once log_choices has named it.

    Written to the stream, not with print(): Ray Train patches print() in its workers to also
    log through the root logger, so the driver (and `ray job logs`) would show every line twice.
    """
    lines = msg.split("\n")
    head = CONSOLE_LINE.match(lines[0])
    prefix = head.group(0) if head else "[raytrain] "
    lines = [line if CONSOLE_LINE.match(line) else prefix + line for line in lines]
    if _choice_log and CHOICE_LINE.match(lines[0]):
        try:
            with open(_choice_log[0], "a") as f:
                f.write("".join(f"{line}\n" for line in lines))
            return
        except OSError:
            pass  # no run directory here after all: the console still has it
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    sys.stdout.flush()


def ray_console_handlers() -> list[logging.Handler]:
    """The handlers through which Ray's Python loggers ("ray", and "ray.data" with its own) print
    on this process's console, as opposed to their log files."""
    return [
        h
        for name in ("ray", "ray.data")
        for h in logging.getLogger(name).handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]


def format_duration(seconds: float | None) -> str:
    """1h02m, 4m05s, 37s: short enough for one progress line."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Progress:
    """Step/total and an ETA for the progress line.

    The ETA divides the wall time since the first measured step by the steps done since, so
    evaluations and checkpoints are priced in at their real share, and one slow window moves
    it only a little. Start-up (loading, the first step's warm-up) is left out.
    """

    def __init__(self, total_steps: int, start_step: int = 0, show_epoch: bool = False) -> None:
        self.total = total_steps
        self.show_epoch = show_epoch  # train.epochs: the line says which pass over the data a step is in
        self._origin: tuple[int, float] = (start_step, time.perf_counter())
        self._first_update = True

    def update(self, step: int, now: float | None = None) -> float | None:
        """Records reaching `step`; returns the estimated seconds left."""
        now = time.perf_counter() if now is None else now
        step0, t0 = self._origin
        if step <= step0:
            return None
        sec_per_step = (now - t0) / (step - step0)
        if self._first_update:  # later estimates start from here, past the start-up cost
            self._origin, self._first_update = (step, now), False
        return sec_per_step * (self.total - step)

    def line(self, row: dict[str, Any], eta_s: float | None) -> str:
        """One line for the terminal and `ray job logs`, e.g.
        ``step 120/2000 (6%) | loss 3.2145 | lr 2.95e-04 | 1,234 tok/s | mem 3.1 GiB | eta 2h05m``."""
        step = row["step"]
        epoch = f", epoch {row['epoch']:.2f}" if self.show_epoch and row.get("epoch") is not None else ""
        parts = [f"step {step}/{self.total} ({100 * step / self.total:.0f}%{epoch})"]
        if row.get("loss") is not None:
            each = ", ".join(f"{name} {v:.4f}" for name, v in by_source(row, "loss").items())
            parts.append(f"loss {row['loss']:.4f}" + (f" ({each})" if each else ""))
        if row.get("reward_accuracy") is not None:  # DPO: how often the chosen answer gained more
            parts.append(f"reward acc {100 * row['reward_accuracy']:.0f}% margin {row['reward_margin']:.3f}")
        if row.get("lr") is not None:
            parts.append(f"lr {row['lr']:.2e}")
        if row.get("grad_norm") is not None:
            parts.append(f"gnorm {row['grad_norm']:.2f}")
        if row.get("tokens_per_s") is not None:
            parts.append(f"{row['tokens_per_s']:,.0f} tok/s")
        if row.get("mfu") is not None:
            parts.append(f"mfu {100 * row['mfu']:.1f}%")
        if row.get("mem_rss_max_gib") is not None:
            parts.append(f"mem {row['mem_rss_max_gib']:.2f} GiB")
        parts.append(f"eta {format_duration(eta_s)}")
        return " | ".join(parts)


# ----------------------------------------------------------------------------- tables


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return "" if v is None else str(v)


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A markdown table of `rows` (columns: every key, in first-seen order); floats rounded."""
    if not rows:
        return ""
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- sinks


def _finite_or_none(row: dict[str, Any]) -> dict[str, Any]:
    """NaN and inf become null: plain JSON (jq, pandas) cannot read Python's NaN literal."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


# TensorBoard tag of each metrics.jsonl key; keys not listed are not sent to TensorBoard.
TB_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_seen": "train/tokens_seen",
    "epoch": "train/epoch",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "data_wait_frac": "perf/data_wait_frac",
    "mem_rss_rank0_gib": "memory/rss_rank0_gib",
    "mem_rss_max_gib": "memory/rss_max_gib",
    "mem_peak_max_gib": "memory/peak_max_gib",
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
    # DPO (data.format=preference)
    "reward_accuracy": "train/reward_accuracy",
    "reward_margin": "train/reward_margin",
    "reward_chosen": "train/reward_chosen",
    "reward_rejected": "train/reward_rejected",
    "dpo_loss": "train/dpo_loss",
    "chosen_loss": "train/chosen_loss",
    "eval_dpo_loss": "eval/dpo_loss",
    "eval_reward_accuracy": "eval/reward_accuracy",
    "eval_reward_margin": "eval/reward_margin",
}


def by_source(row: dict[str, Any], metric: str = "eval_loss") -> dict[str, float]:
    """A mixture's figure of each source in a metrics row or a summary ({name: row[metric/name]});
    {} for a single source."""
    prefix = f"{metric}/"
    return {k.removeprefix(prefix): v for k, v in row.items() if k.startswith(prefix) and v is not None}


def tb_tag(key: str) -> str | None:
    """The TensorBoard tag of a metrics.jsonl key: TB_TAGS's, and eval/<source>/loss for a
    mixture's eval_loss/<source> (eval_perplexity likewise), train/<source>/loss for its
    loss/<source>; None: not sent."""
    metric, _, source = key.partition("/")
    if source and metric in ("eval_loss", "eval_perplexity"):
        return f"eval/{source}/{metric.removeprefix('eval_')}"
    if source and metric == "loss":
        return f"train/{source}/loss"
    return TB_TAGS.get(key)


class MetricsSink:
    """Rank 0's writer: metrics.jsonl always, TensorBoard and MLflow when configured."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        mlflow_tracking_uri: str = "",
        mlflow_experiment: str = "raytrain_cpu",
        run_name: str = "",
        params: dict[str, Any] | None = None,
        resume_step: int = 0,
        log=print,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.log = log
        self.tb = self._open_tensorboard(resume_step) if tensorboard else None
        self.mlflow = None
        if mlflow_tracking_uri:
            self.mlflow = self._open_mlflow(mlflow_tracking_uri, mlflow_experiment, run_name, params or {})

    @classmethod
    def for_run(cls, cfg, run_dir: str | os.PathLike, resume_step: int = 0, log=print) -> MetricsSink:
        """The sinks a run config asks for (cfg: raytrain_cpu.config.schema.Config)."""
        m = cfg.metrics
        return cls(
            run_dir,
            tensorboard=m.tensorboard,
            mlflow_tracking_uri=m.mlflow_tracking_uri,
            mlflow_experiment=m.mlflow_experiment,
            run_name=cfg.run.name,
            params=cfg.to_dict(),
            resume_step=resume_step,
            log=log,
        )

    # ---- opening

    def _open_tensorboard(self, resume_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.log("[metrics] tensorboard is not installed; writing metrics.jsonl only (pip install tensorboard)")
            return None
        # purge_step hides what a failed attempt logged past the checkpoint this one resumed from.
        return SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)

    def _open_mlflow(self, uri: str, experiment: str, run_name: str, params: dict[str, Any]):
        try:
            import mlflow
        except ImportError:
            self.log("[metrics] metrics.mlflow_tracking_uri is set but mlflow is not installed (pip install mlflow)")
            return None
        try:
            mlflow.set_tracking_uri(uri)
            mlflow.set_experiment(experiment)
            # A resumed run continues the MLflow run it started, found through the id it left here.
            id_file = self.run_dir / ".mlflow_run_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else None
            run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name)
            if not run_id:
                id_file.write_text(run.info.run_id)
                flat = {k: str(v)[:500] for k, v in _flatten(params).items()}
                mlflow.log_params(flat)
            return mlflow
        except Exception as e:  # an unreachable server must not stop a three-day run
            self.log(f"[metrics] MLflow at {uri} is unavailable ({e.__class__.__name__}: {e}); continuing without it")
            return None

    # ---- writing

    def write(self, row: dict[str, Any]) -> None:
        """Appends one row to metrics.jsonl, then mirrors its numbers to TensorBoard / MLflow."""
        row = _finite_or_none(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        step = row["step"]
        if "attempt" in row:  # where an attempt started: for read_metrics, not a figure
            return
        if "event" in row:  # a guard event: its value under guards/<kind>, at its step
            tags = {f"guards/{row['event']}": float("nan") if row.get("value") is None else float(row["value"])}
        else:
            tags = {tb_tag(k): float(v) for k, v in row.items() if tb_tag(k) and isinstance(v, (int, float))}
        if self.tb is not None:
            for tag, v in tags.items():
                self.tb.add_scalar(tag, v, step)
            self.tb.flush()  # a crash or a reader of a running job should see it now
        if self.mlflow is not None:
            try:
                self.mlflow.log_metrics(
                    {t.replace("/", "_"): v for t, v in tags.items() if math.isfinite(v)}, step=step
                )
            except Exception as e:
                self.log(f"[metrics] MLflow logging failed ({e.__class__.__name__}: {e}); continuing without it")
                self.mlflow = None

    def write_sample(self, step: int, prompt: str, completion: str) -> None:
        """train.sample_prompt's completion at `step`: a samples.jsonl row and TensorBoard text."""
        with open(self.run_dir / SAMPLES_FILE, "a") as f:
            f.write(json.dumps({"step": step, "prompt": prompt, "completion": completion, "time": time.time()}) + "\n")
        if self.tb is not None:
            self.tb.add_text("sample", f"**{prompt}** {completion}", step)
            self.tb.flush()

    def close(self, finished: bool = True) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.mlflow is not None:
            with contextlib.suppress(Exception):  # closing must not mask how the run ended
                self.mlflow.end_run(status="FINISHED" if finished else "FAILED")
