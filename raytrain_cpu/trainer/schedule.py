"""The learning-rate schedule, and the optimizer settings a resume puts back from the config."""

from __future__ import annotations

import math


def lr_factor(step: int, cfg_train, max_steps: int | None = None) -> float:
    """Multiplier of train.lr after `step` optimizer steps (LambdaLR convention)."""
    total = max_steps or cfg_train.max_steps
    warmup = min(cfg_train.warmup_steps, max(1, total // 10)) if cfg_train.warmup_steps else 0
    floor = cfg_train.min_lr_ratio
    if warmup and step < warmup:
        return (step + 1) / warmup
    if cfg_train.schedule == "constant":
        return 1.0
    if cfg_train.schedule == "wsd":
        decay_start = total - max(1, int(cfg_train.decay_fraction * total))
        if step < decay_start:
            return 1.0
        t = (step - decay_start) / max(1, total - decay_start)
        return 1.0 - (1.0 - floor) * min(1.0, t)
    t = (step - warmup) / max(1, total - warmup)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


def lr_held_line(step: int, lr: float, t) -> str:
    """What a resume says of a learning rate the config's schedule keeps at the restored step (a
    changed one, from a changed train.max_steps or schedule setting, apply_optimizer_settings
    names with both values): every resume names the LR it goes on with."""
    return (
        f"the learning rate at step {step}: {lr:.3g}, as in the checkpoint "
        f"(the {t.schedule} schedule of train.max_steps={t.max_steps})"
    )


def apply_optimizer_settings(engine, scheduler, t) -> list[str]:
    """A checkpoint brings back the optimizer settings it was saved with: torch's load_state_dict
    restores each group's lr, betas, eps and weight decay, LambdaLR its base LR. The config's go
    back in, so a resume may change them as it may the schedule's length; the next step's LR is
    the schedule's at this step (it was the old schedule's). Returns 'key: old → new' for each
    that changed. Groups as engine.param_groups made them: the first decays, the others do not."""
    groups = engine.optimizer.param_groups
    saved = {
        "train.lr": scheduler.base_lrs[0],
        "train.betas": [float(b) for b in groups[0]["betas"]],
        "train.eps": groups[0]["eps"],
        "train.weight_decay": groups[0]["weight_decay"],
    }
    now = {"train.lr": t.lr, "train.betas": list(t.betas), "train.eps": t.eps, "train.weight_decay": t.weight_decay}
    lr_before = groups[0]["lr"]  # the saved schedule's at this step
    scheduler.base_lrs = [t.lr] * len(groups)
    for i, group in enumerate(groups):
        group.update(betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay if i == 0 else 0.0)
        group["initial_lr"] = t.lr
        group["lr"] = t.lr * lr_factor(scheduler.last_epoch, t, t.max_steps)
    changes = [f"{k}: {saved[k]} in the checkpoint → {now[k]}" for k in now if saved[k] != now[k]]
    if not math.isclose(groups[0]["lr"], lr_before, rel_tol=1e-6):  # a longer run's schedule (train.max_steps)
        changes.append(
            f"the learning rate at step {scheduler.last_epoch}: {lr_before:.3g} → {groups[0]['lr']:.3g}, "
            f"the {t.schedule} schedule of train.max_steps={t.max_steps} from here"
        )
    return changes
