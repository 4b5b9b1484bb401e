"""Evaluation: token-weighted eval losses (and DPO's pair metrics) summed over every rank, the
watched metric that early stopping and the best checkpoint follow (EvalWatch), and the sample
completion of train.sample_prompt."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raytrain_cpu.checkpoint import record as ckpt_record
from raytrain_cpu.config.schema import Config
from raytrain_cpu.model.tokenizer import resolve_tokenizer_path
from raytrain_cpu.obs import metrics as obs
from raytrain_cpu.trainer.batches import loss_tokens, model_inputs, torch_batches
from raytrain_cpu.trainer.engine import allreduce_sum
from raytrain_cpu.trainer.state import Worker

# ----------------------------------------------------------------------------- sums and metrics


def _evaluated_sums(engine, streams: dict[str, Any], micro: int, sums_of: Callable[[Any], list[float]]) -> list[float]:
    """Each source's sums (`sums_of` its batches) over this rank's eval blocks (`streams`:
    data.stream.EvalStream by source), in eval mode and without gradients, then summed over
    every rank (an all-reduce every rank joins)."""
    import torch

    engine.eval()
    with torch.no_grad():
        batches = (torch_batches(stream.batches(micro)) for stream in streams.values())
        sums = [x for source in batches for x in sums_of(source)]
    engine.train()
    return allreduce_sum(sums)


def evaluate(engine, streams: dict[str, Any], micro: int, max_batches: int) -> dict[str, float]:
    """Token-weighted loss over every rank's eval targets (sums, not an average of averages);
    for chat/instruction data that is the response tokens only. A mixture's sources (the keys
    of `streams`; '' for a single source) are also reported each: eval_loss/<name>, over its own
    targets; eval_loss is over all of them together."""
    sums = _evaluated_sums(engine, streams, micro, lambda batches: eval_sums(engine, batches, max_batches))
    return eval_metrics(list(streams), sums)


def evaluate_pairs(w: Worker, engine, streams: dict[str, Any]) -> dict[str, float]:
    """DPO's evaluation over every rank's eval pairs (pair_eval_metrics). Preference data is
    never a mixture: one source."""
    t = w.cfg.train
    sums = _evaluated_sums(
        engine,
        streams,
        t.micro_batch_size,
        lambda batches: pair_eval_sums(engine, w.reference, batches, w.fused_loss, w.dpo_settings, t.eval_batches),
    )
    return pair_eval_metrics(sums)


def pair_eval_sums(
    model, reference, batches, fused: bool, loss_settings: dict[str, Any], max_batches: int = 0
) -> list[float]:
    """dpo.SUM_NAMES' sums over batches of preference eval blocks, the first `max_batches` (0:
    all); the `reference` (a dpo.Reference) runs beside the model, as in training.
    `loss_settings`: dpo.settings'."""
    from raytrain_cpu.trainer import dpo

    sums = [0.0] * len(dpo.SUM_NAMES)
    for batch in itertools.islice(batches, max_batches or None):
        _, batch_sums = dpo.micro_batch_loss(model, reference, model_inputs(batch), fused, **loss_settings)
        sums = [a + b for a, b in zip(sums, batch_sums)]
    return sums


def pair_eval_metrics(sums: list[float]) -> dict[str, float]:
    """eval_dpo_loss, eval_reward_accuracy, ... (raytrain_cpu.trainer.dpo) from pair_eval_sums' sums, and
    eval_loss / eval_perplexity / eval_tokens over the chosen answers."""
    from raytrain_cpu.trainer import dpo

    nll, tokens = sums[dpo.SUM_NAMES.index("chosen_nll")], sums[dpo.SUM_NAMES.index("chosen_tokens")]
    return eval_metrics([""], [nll, tokens]) | dpo.metrics(sums, prefix="eval_")


def eval_sums(forward, batches, max_batches: int = 0) -> list[float]:
    """[summed loss, target count] of `forward` (the engine: every rank runs it, as ZeRO-3
    gathers) over batches of one source's eval blocks, the first `max_batches` (0: all)."""
    loss_sum = tokens = 0.0
    for i, batch in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        inputs = model_inputs(batch)
        out = forward(**inputs)
        n = loss_tokens(inputs["labels"])
        if n:  # a block of prompts only has no target: its mean loss is NaN, and weight 0
            loss_sum += float(out.loss.detach()) * n
            tokens += n
    return [loss_sum, tokens]


def eval_metrics(names: list[str], sums: list[float]) -> dict[str, float]:
    """eval_loss (token-weighted over all sources), eval_perplexity and eval_tokens from each
    source's [loss sum, targets] in `sums`; for a mixture (named sources) each one's too."""
    loss_sums, token_counts = sums[0::2], sums[1::2]
    loss = sum(loss_sums) / max(sum(token_counts), 1.0)
    out = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": int(sum(token_counts))}
    for name, loss_sum, tokens in zip(names, loss_sums, token_counts):
        if name:
            out[f"eval_loss/{name}"] = loss_sum / max(tokens, 1.0)
            out[f"eval_perplexity/{name}"] = math.exp(min(out[f"eval_loss/{name}"], 50.0))
    return out


def eval_line(step: int, metrics: dict[str, float]) -> str:
    """'step 100 eval loss 4.1000 ppl 60.34', and each mixture source's loss after it."""
    per_source = ", ".join(f"{name} {v:.4f}" for name, v in obs.by_source(metrics).items())
    dpo = metrics.get("eval_dpo_loss")
    return (
        f"step {step} eval loss {metrics['eval_loss']:.4f} ppl {metrics['eval_perplexity']:.2f}"
        + (f" (by source: {per_source})" if per_source else "")
        + (
            f" | dpo loss {dpo:.4f}, reward accuracy {100 * metrics['eval_reward_accuracy']:.1f}%, margin "
            f"{metrics['eval_reward_margin']:.3f} over {metrics['eval_pairs']:,.0f} pairs"
            if dpo is not None
            else ""
        )
    )


# ----------------------------------------------------------------------------- the watched metric, the sample


@dataclass
class EvalWatch:
    """The watched eval metric (run.best_metric, else eval_loss): its best value, the evaluations
    since it improved (train.early_stop_patience) and the best checkpoint (run.best_metric).
    Every rank holds the same figures (evaluations are all-reduced), so every rank stops at the
    same step; each checkpoint's manifest carries them (`state`), so a resume goes on counting."""

    metric: str
    patience: int  # 0: never stops
    min_delta: float
    ranks_checkpoints: bool  # run.best_metric is set
    best: float = math.inf
    best_step: int | None = None
    evals_since_best: int = 0
    best_checkpoint: dict[str, Any] | None = None  # {"name", "step", "value"}; names a dir of the run
    value: float | None = None  # the latest evaluation's
    value_step: int | None = None

    @classmethod
    def for_run(cls, cfg: Config, manifest: dict[str, Any]) -> EvalWatch:
        watch = cls(
            cfg.watched_metric,
            cfg.train.early_stop_patience,
            cfg.train.early_stop_min_delta,
            bool(cfg.run.best_metric),
        )
        saved = manifest.get("eval_watch") or {}
        if saved.get("metric") == watch.metric:  # the same metric: its count goes on
            for k in ("best_step", "evals_since_best", "best_checkpoint"):
                setattr(watch, k, saved[k])
            watch.best = math.inf if saved["best"] is None else saved["best"]
        return watch

    def state(self) -> dict[str, Any]:
        """What a checkpoint's manifest records (plain JSON: no best yet is null, not Infinity)."""
        best = self.best if math.isfinite(self.best) else None
        return {
            "metric": self.metric,
            "best": best,
            **{k: getattr(self, k) for k in ("best_step", "evals_since_best", "best_checkpoint")},
        }

    def after_eval(self, step: int, metrics: dict[str, float]) -> None:
        value = metrics.get(self.metric)
        if value is None:  # not evaluated (too few eval blocks for this many workers)
            return
        value = value if math.isfinite(value) else math.inf  # diverged: no improvement, ranked last
        self.value, self.value_step = value, step
        if value < self.best - self.min_delta:
            self.best, self.best_step, self.evals_since_best = value, step, 0
        else:
            self.evals_since_best += 1

    def score(self, step: int) -> float:
        """The checkpoint at `step`'s rank for Ray Train (lower is better): its evaluation's value,
        or the largest float where none was made at that step (a preemption's) or it diverged,
        which ranks it last (not inf: Ray's record writes that as null, and a run resumed with
        run.best_metric then failed ranking it, at every retry)."""
        return min(self.value, ckpt_record.UNSCORED) if self.value_step == step else ckpt_record.UNSCORED

    def checkpointed(self, name: str, step: int) -> None:
        if self.ranks_checkpoints and self.score(step) < (self.best_checkpoint or {}).get("value", math.inf):
            self.best_checkpoint = {"name": name, "step": step, "value": self.value}

    @property
    def stop_reason(self) -> str | None:
        if not self.patience or self.evals_since_best < self.patience:
            return None
        return (
            f"{self.metric} has not improved on its best ({self.best:.4f} at step {self.best_step}) "
            f"in {self.evals_since_best} evaluations (train.early_stop_patience={self.patience})"
        )


@dataclass
class Sampler:
    """train.sample_prompt: its token ids (rendered as `generate` renders a prompt), the tokenizer
    that decodes the completion, and how many new tokens it may have."""

    prompt: str
    ids: list[int]
    tokenizer: Any
    max_new: int

    @classmethod
    def for_run(cls, w: Worker) -> Sampler | None:
        from raytrain_cpu.model.generate import prompt_ids
        from raytrain_cpu.model.tokenizer import load_tokenizer

        t = w.cfg.train
        if not t.sample_prompt:
            return None
        tokenizer = load_tokenizer(resolve_tokenizer_path(w.cfg.model.tokenizer, w.loop_config["model_dir"]))
        ids = prompt_ids(tokenizer, {"data": w.cfg.to_dict()["data"]}, t.sample_prompt, None)
        # Its end kept: prompt and completion fit the positions the model trains on.
        return cls(t.sample_prompt, ids[-(w.cfg.data.seq_len - t.sample_tokens) :], tokenizer, t.sample_tokens)

    def complete(self, engine) -> str:
        """The greedy completion; every rank runs each forward (ZeRO-3 gathers) and takes rank 0's
        token, so all stop at the same one even where their arithmetic could differ. No KV cache:
        each new token runs the whole sequence, which is short."""
        import torch
        import torch.distributed as dist

        seq, new = torch.tensor([self.ids]), []
        engine.eval()
        with torch.no_grad():
            for _ in range(self.max_new):
                logits = engine(input_ids=seq, use_cache=False, logits_to_keep=1).logits[:, -1]
                token = logits.argmax(-1, keepdim=True)
                dist.broadcast(token, src=0)
                if token.item() == self.tokenizer.eos_token_id:
                    break
                new.append(token.item())
                seq = torch.cat([seq, token], dim=1)
        engine.train()
        return self.tokenizer.decode(new, skip_special_tokens=True)
