"""One optimizer step's pieces: the weights of its micro batches' losses, DPO's loss and a
mixture's loss by source (summed for the next log row), and the profiler around one step."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from raytrain_cpu.obs import metrics as obs
from raytrain_cpu.trainer.batches import loss_tokens, row_targets
from raytrain_cpu.trainer.engine import allreduce_sum
from raytrain_cpu.trainer.state import Loop, Worker


def step_counts(w: Worker, micro_batches: list[dict[str, Any]]) -> tuple[list[list[float]], list[float] | None]:
    """(each micro batch's counts, the step's totals over every rank per micro batch) that weigh
    each micro batch's loss, so the step's loss is the mean over all of its targets (DPO: pairs;
    and the chosen answers' tokens for train.dpo_sft_weight) whatever the micro batch,
    accumulation and worker count. DeepSpeed averages the micro batches' losses, each a mean over
    its own targets: a micro batch of short chat answers weighed as much as one of long ones, a
    different objective for each split of the same batch.

    A loss divided by the totals per micro batch (the totals / (accumulation x workers)) comes
    out of DeepSpeed's averaging as the step's. Text blocks hold seq_len - 1 targets each, so
    their weights are all 1: totals None, and no all-reduce (every rank's stream has the same
    columns, so every rank skips it alike)."""
    if w.preference:
        from raytrain_cpu.trainer import dpo

        counts = [dpo.counts(b["labels"], b["position_ids"]) for b in micro_batches]
    elif any("labels" in b for b in micro_batches):
        counts = [[float(loss_tokens(b["labels"]))] for b in micro_batches]
    else:
        return [], None
    totals = allreduce_sum([sum(c[k] for c in counts) for k in range(len(counts[0]))])
    if not totals[0]:  # no target anywhere: the losses are NaN, and the guard skips the step
        return counts, None
    share = len(micro_batches) * w.world
    return counts, [t / share for t in totals]


def preference_loss(w: Worker, st: Loop, engine, inputs: dict[str, Any], per: list[float] | None = None):
    """A micro batch's DPO loss (the reference forward first), its sums divided by `per`
    (`step_counts`' totals); its sums go to the next log row."""
    from raytrain_cpu.trainer import dpo

    loss, sums = dpo.micro_batch_loss(engine, w.reference, inputs, w.fused_loss, **w.dpo_settings, per=per)
    st.pair_sums = [a + b for a, b in zip(st.pair_sums, sums)] if st.pair_sums else sums
    return loss


def pair_metrics(w: Worker, st: Loop) -> dict[str, float]:
    """reward_accuracy, reward_margin, reward_chosen, reward_rejected, pairs and chosen_loss (the
    chosen answers' per-token loss) since the last log row, over every rank (an all-reduce every
    rank joins); {} for other data. The row's loss is DPO's, or with train.dpo_sft_weight the sum
    (and dpo_loss is logged beside it)."""
    from raytrain_cpu.trainer import dpo

    if not w.preference:
        return {}
    sums = allreduce_sum(st.pair_sums or [0.0] * len(dpo.SUM_NAMES))
    st.pair_sums = None
    out = dpo.metrics(sums)
    if out:  # {} over no pair
        out["chosen_loss"] = dpo.chosen_loss(sums)
    if not w.cfg.train.dpo_sft_weight:
        out.pop("dpo_loss", None)  # the row's loss is DPO's
    return out


def add_by_source(w: Worker, st: Loop, source, row_losses, labels) -> None:
    """Adds a micro batch's rows' summed losses and target counts to their sources' sums."""
    import torch

    if st.source_sums is None:
        st.source_sums = torch.zeros(len(w.loss_sources), 2, dtype=torch.float64)
    sums = torch.stack([row_losses.detach(), row_targets(labels)], dim=1).double()
    st.source_sums.index_add_(0, source, sums)


def loss_by_source(w: Worker, st: Loop) -> dict[str, float]:
    """loss/<name>: each mixture source's mean loss over its targets in the logged step, over
    every rank (an all-reduce every rank joins); sources without targets there are left out."""
    if st.source_sums is None:
        return {}
    sums = allreduce_sum(st.source_sums.flatten().tolist())  # Trainer.step zeroes them at each step
    return {f"loss/{name}": sums[2 * i] / sums[2 * i + 1] for i, name in enumerate(w.loss_sources) if sums[2 * i + 1]}


@contextlib.contextmanager
def profiled(w: Worker, step: int):
    """train.profile_step: torch.profiler around that step, a trace and a table per rank."""
    if step != w.cfg.train.profile_step:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    from raytrain_cpu.obs import timing as obs_timing

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield
    wall = time.perf_counter() - t0
    out = w.run_dir / "profile"
    out.mkdir(exist_ok=True)
    prof.export_chrome_trace(str(out / f"rank{w.rank}.json"))
    averages = prof.key_averages()
    kinds = obs_timing.op_time_by_kind(prof.events(), wall)
    top = averages.table(sort_by="self_cpu_time_total", row_limit=25)
    title = f"# Step {step}, rank {w.rank}: {wall:.3f} s under the profiler"
    (out / f"rank{w.rank}.md").write_text("\n".join([title, "", obs.markdown_table(kinds), "", "```", top, "```", ""]))
    w.log(f"[profile] step {step}: " + ", ".join(f"{k['kind']} {k['share']:.0%}" for k in kinds) + f" -> {out}")
