"""Stability guards: loss spikes, gradient-norm spikes and non-finite losses, the same on every rank.

Each optimizer step passes three points of the training loop:

1. `before_backward` (last micro batch, after its forward): one all-reduce of the step's
   loss and a non-finite flag, so every rank sees the same mean loss and takes the same
   decision. A NaN/inf on any rank, or a loss above `loss_spike_factor` x its running mean,
   is detected here, before anything is applied.
2. `before_step` (after the last backward): with `action=skip` and `max_grad_norm`, the
   global gradient norm is computed from each rank's ZeRO-3 gradient shard
   (`deepspeed.utils.safe_get_local_grad`, one more all-reduce), before the update.
3. `after_step`: reads DeepSpeed's gradient norm (for `log` / `stop` on the norm), counts
   skipped steps and decides whether the run stops.

How a step is skipped: every rank still runs the same forward, backward and `engine.step()`
(the same collectives in the same order), but the gradients are made non-finite: the
loss is multiplied by NaN before the backward, or one gradient shard is filled with NaN
after it. DeepSpeed's optimizers (ZeRO-1/2/3, bf16 and fp32) then find an invalid global
gradient norm and take their overflow path: no parameter or optimizer-state update, the
gradients are zeroed, `engine.skipped_steps` counts it (and is saved in checkpoints), and
the learning-rate scheduler is not advanced, which `after_step` makes up for so that the
learning rate stays a function of the step number.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_cpu.config.training import GuardConfig

Reduce = Callable[[list[float]], list[float]]
"""Sums a short list of floats over all ranks (an all-reduce; the identity on one process)."""

MIN_HISTORY = 10  # losses the running mean needs before spikes are judged against it


@dataclass
class Event:
    """One guard finding, written to metrics.jsonl as ``{step, event, value, threshold, action}``."""

    step: int
    event: str  # loss_spike | grad_norm | nonfinite
    value: float
    threshold: float | None
    action: str  # log | skip | stop

    def row(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "event": self.event,
            "value": self.value,
            "threshold": self.threshold,
            "action": self.action,
        }

    def message(self) -> str:
        if self.event == "loss_spike":
            what = f"loss {self.value:.4g} is above {self.threshold:.4g} (guards.loss_spike_factor x its running mean)"
        elif self.event == "grad_norm":
            what = f"gradient norm {self.value:.4g} is above guards.max_grad_norm={self.threshold:g}"
        else:
            what = f"the loss or the gradient norm is {self.value} (not finite)"
        did = {"log": "logged, update applied", "skip": "update skipped on every rank", "stop": "stopping"}[self.action]
        return f"guard: step {self.step}: {what}; {did}"


# ----------------------------------------------------------------------------- pure decisions


class LossWindow:
    """Running mean of the last `size` accepted step losses (spikes and skipped steps stay out,
    so one bad step does not raise the bar for the next)."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.needed = min(size, MIN_HISTORY)

    @property
    def ready(self) -> bool:
        return len(self.values) >= self.needed

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    def add(self, loss: float) -> None:
        self.values.append(loss)


def classify_loss(loss: float, window: LossWindow, factor: float) -> tuple[str | None, float | None]:
    """(event, threshold) for a step's mean loss: 'nonfinite', 'loss_spike' or None."""
    if not math.isfinite(loss):
        return "nonfinite", None
    if factor > 0 and window.ready:
        threshold = factor * window.mean
        if loss > threshold:
            return "loss_spike", threshold
    return None, None


def action_for(event: str, configured: str) -> str:
    """A non-finite value is never applied: 'log' becomes 'skip' for it."""
    if event == "nonfinite" and configured == "log":
        return "skip"
    return configured


def parse_inject(spec: str) -> dict[int, float]:
    """'spike@12:50,nan@20' -> {12: 50.0, 20: nan}: the factor rank 0's loss is multiplied by."""
    out: dict[int, float] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        m = re.fullmatch(r"(spike|nan)@(\d+)(?::([0-9.eE+-]+))?", item)
        if not m:
            raise ValueError(f"guards.inject: {item!r}: write spike@STEP[:FACTOR] or nan@STEP")
        kind, step, factor = m.groups()
        out[int(step)] = float("nan") if kind == "nan" else float(factor or 100.0)
    return out


# ----------------------------------------------------------------------------- the guard in the loop


class StabilityGuard:
    """Per-rank guard state; every decision comes from all-reduced values, so it is identical
    on all ranks and they keep issuing the same collectives."""

    def __init__(
        self,
        cfg: GuardConfig,
        reduce: Reduce,
        world_size: int,
        rank: int = 0,
        zero_stage: int = 3,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.reduce = reduce
        self.world = world_size
        self.rank = rank
        self.zero_stage = zero_stage
        self.on_event = on_event or (lambda e: None)
        self.window = LossWindow(cfg.loss_window)
        self.inject = parse_inject(cfg.inject)
        self.counts = {"loss_spike": 0, "grad_norm": 0, "nonfinite": 0, "skipped_steps": 0}
        self.stop_reason: str | None = None
        # The last step's: the mean over ranks and micro batches of their losses, which the training
        # loop weighs by their targets (train.step_counts), so the mean over the step's targets.
        self.step_loss: float | None = None
        self._skip = False  # this step's update is being skipped
        self._skips_before = 0  # DeepSpeed's skipped_steps before this step

    # ---- 1. after the last micro batch's forward

    def before_backward(self, step: int, micro_losses: Sequence[float], loss, last_micro: bool):
        """Returns the loss to back-propagate: unchanged, injected (testing) or poisoned (skip).

        `step` is the step being computed (1-based); `micro_losses` this rank's losses of the
        step so far, the current one included. Only the last micro batch decides.
        """
        factor = self.inject.get(step) if (self.rank == 0 and last_micro) else None
        if factor is not None:
            loss = loss * factor
            micro_losses = [*micro_losses[:-1], float(loss.detach())]
        if not last_micro:
            return loss
        local = sum(micro_losses) / len(micro_losses)
        finite = math.isfinite(local)
        total, bad = self.reduce([local if finite else 0.0, 0.0 if finite else 1.0])
        self.step_loss = total / self.world if bad == 0 else float("nan")
        event, threshold = classify_loss(self.step_loss, self.window, self.cfg.loss_spike_factor)
        self._skip = False
        if event is None:
            self.window.add(self.step_loss)
            return loss
        action = action_for(event, self.cfg.action)
        self._record(Event(step, event, self.step_loss, threshold, action))
        if action in ("skip", "stop") or event == "nonfinite":
            # Nothing of this step may be applied: poison the gradients on every rank, and
            # DeepSpeed's overflow path leaves parameters and optimizer state as they were.
            self._skip = True
            return loss * float("nan")
        return loss

    # ---- 2. after the last backward, before engine.step()

    def before_step(self, step: int, engine) -> None:
        """With action=skip and max_grad_norm, judges the gradient norm before the update."""
        self._skips_before = engine.skipped_steps
        if self._skip or not self.cfg.max_grad_norm or self.cfg.action != "skip":
            return
        norm = zero3_grad_norm(engine, self.reduce)
        if math.isfinite(norm) and norm <= self.cfg.max_grad_norm:
            return
        event = "grad_norm" if math.isfinite(norm) else "nonfinite"
        self._record(Event(step, event, norm, self.cfg.max_grad_norm, "skip"))
        self._skip = True
        poison_gradients(engine)

    # ---- 3. after engine.step()

    def after_step(self, step: int, engine, scheduler=None) -> None:
        """Counts what DeepSpeed skipped, judges the norm it reports, decides whether to stop."""
        skipped = engine.skipped_steps > self._skips_before
        if skipped:
            self.counts["skipped_steps"] += 1
            if scheduler is not None:
                scheduler.step()  # DeepSpeed holds the schedule on a skipped step; keep lr = f(step)
            if not self._skip:  # DeepSpeed found non-finite gradients from a finite loss
                self._record(
                    Event(
                        step,
                        "nonfinite",
                        float(engine.get_global_grad_norm() or float("nan")),
                        None,
                        "stop" if self.cfg.action == "stop" else "skip",
                    )
                )
        elif self.cfg.max_grad_norm and self.cfg.action != "skip":
            norm = engine.get_global_grad_norm()
            if norm is not None and float(norm) > self.cfg.max_grad_norm:
                self._record(Event(step, "grad_norm", float(norm), self.cfg.max_grad_norm, self.cfg.action))
        self._skip = False
        if self.stop_reason is None and engine.skipped_steps > self.cfg.max_skips:
            self.stop_reason = (
                f"guard: {engine.skipped_steps} steps skipped so far, more than guards.max_skips="
                f"{self.cfg.max_skips}; the run is not recovering. Resume from the last checkpoint with a "
                "lower train.lr (or check the data around these steps: see the event rows in metrics.jsonl)."
            )

    # ---- bookkeeping

    def _record(self, event: Event) -> None:
        self.counts[event.event] += 1
        self.on_event(event)
        if event.action == "stop" and self.stop_reason is None:
            self.stop_reason = (
                f"{event.message()} (guards.action=stop). The last checkpoint predates this step; resume from it "
                "with a lower train.lr, or set guards.action=skip to step over such steps."
            )


def zero3_grad_norm(engine, reduce: Reduce) -> float:
    """The global L2 norm of the gradients from each rank's ZeRO-3 shards, before the update.

    Uses DeepSpeed's public per-parameter accessor; only valid after the backward of the
    last micro batch of a step (the shards hold the reduced gradients until engine.step()).
    """
    from deepspeed.utils import safe_get_local_grad

    sq = 0.0
    for p in engine.module.parameters():
        if p.requires_grad:
            g = safe_get_local_grad(p)
            if g is not None:
                sq += float(g.float().pow(2).sum())
    (total,) = reduce([sq])
    return math.sqrt(total) if math.isfinite(total) else float("nan")


def poison_gradients(engine) -> None:
    """Makes the global gradient norm NaN (one shard element on this rank is enough, since
    DeepSpeed all-reduces the norm), so `engine.step()` skips the update on every rank."""
    import torch
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

    for p in engine.module.parameters():
        g = safe_get_local_grad(p) if p.requires_grad else None
        if g is not None and g.numel():
            safe_set_local_grad(p, torch.full_like(g, float("nan")))
            return
