"""DPO (Direct Preference Optimization) on preference pairs, for data.format=preference.

A pair is a prompt with a chosen and a rejected answer. DPO raises the model's log-likelihood
of the chosen answer against the rejected one, measured relative to a frozen reference model:

    loss = -log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))))

with log pi(y) summed over the answer's tokens (Rafailov et al., 2023). beta is train.dpo_beta.
train.dpo_loss picks another loss of the same margin x (the bracket above): 'ipo',
(x - 1/(2 beta))^2 over log-likelihoods averaged per answer token (Azar et al., 2023), which stops
pushing a pair once its margin reaches 1/(2 beta); 'hinge', max(0, 1 - beta x) (SLiC, Zhao et al.,
2023); 'simpo', -log sigmoid(beta x - gamma) with x the difference of the answers'
log-likelihoods averaged per token and no reference at all (SimPO, Meng et al., 2024; gamma is
train.simpo_gamma): no reference forward and no copy of the model. train.dpo_label_smoothing
makes the sigmoid loss conservative (cDPO): each pair counts as mislabelled with that
probability, (1 - e) x its loss + e x the loss of the pair reversed.
train.dpo_sft_weight adds that weight times the chosen answers' per-token loss, SFT's (RPO, Pang
et al., 2024; TRL's rpo_alpha): DPO alone may lower both answers' likelihoods as long as the
rejected one falls faster; the added term holds the chosen one up.

**The reference** is the model as training started, one more forward per micro batch (no
backward, no gradients); SimPO has none (`reference_free`). Under LoRA it is the frozen base
with the adapters switched off (peft's `disable_adapter`: `adapters_off`), which costs no
memory. Full fine-tuning keeps a
frozen copy of the starting model beside the trained one (`frozen_copy`), partitioned by ZeRO-3
like the trained weights: its bf16 weights only, 2 bytes a parameter over the ranks (an 8B model
on 4 ranks: 4 GiB a rank, against the ~30 GiB of weights, master copy, moments and gradients a
full fine-tuning rank holds). A resumed run loads it again from the model the run started from,
so it never becomes the resumed weights. train.dpo_precompute_reference runs neither: the
reference's rows are computed once before training (raytrain_cpu.trainer.reference.precompute_reference) and read back
by what each block holds (`precomputed`).

**The blocks**: the data layer packs each pair's two conversations (prompt + chosen answer, then
prompt + rejected answer) side by side into one block, several pairs to a block, padding at its
end; each token's position counts from its conversation's start, and data.attention_span=document
keeps each conversation to itself. So the conversations in a row are its position-0 segments in
order: segment 2k is pair k's chosen, 2k + 1 its rejected (the padding, a last segment with no
target, pairs with nothing).

**What is logged**: the DPO loss as `loss`; reward_accuracy (the share of pairs whose chosen
answer gains more than the rejected one, relative to the reference), reward_margin (the mean of
that gain's difference, times beta), reward_chosen and reward_rejected (beta x each gain). Each
evaluation reports the same over the eval pairs (eval_dpo_loss, eval_reward_accuracy, ...), and
eval_loss / eval_perplexity over the chosen answers' tokens: how likely the preferred answers
are, as an SFT run would measure them, so a run can watch that DPO does not unlearn them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raytrain_cpu.model.ops.loss import IGNORE_INDEX, label_logps_from_logits

# What a rank adds up between log rows / over an evaluation (all-reduced, then divided).
SUM_NAMES = ("loss", "pairs", "correct", "margin", "chosen", "rejected", "chosen_nll", "chosen_tokens")


def _segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's conversation in its row, 0, 1, ... (a new one at each position 0): even ones
    are chosen answers' conversations, odd ones rejected ones, the last may be padding."""
    return (position_ids == 0).long().cumsum(dim=1) - 1


def pair_sums(label_logps: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each pair's summed log-likelihood of its chosen and its rejected answer ('chosen',
    'rejected', differentiable) and the chosen answer's target count ('chosen_tokens'), for the
    pairs of a batch of blocks; (B, T) inputs, label_logps as loss.label_logps_from_logits."""
    b, t = labels.shape
    segment = _segments(position_ids)
    slot = (torch.arange(b).unsqueeze(1) * t + segment // 2).reshape(-1)  # one slot per (row, pair)
    is_chosen = (segment % 2 == 0).reshape(-1)
    target = (labels != IGNORE_INDEX).reshape(-1).float()
    target[::t] = 0.0  # a row's first label is no target (nothing before it)
    logps = label_logps.reshape(-1) * target  # the answers' tokens only
    sums = {}
    for side, sel in (("chosen", is_chosen), ("rejected", ~is_chosen)):
        sums[side] = torch.zeros(b * t, dtype=logps.dtype).index_add(0, slot[sel], logps[sel])
        sums[f"{side}_tokens"] = torch.zeros(b * t).index_add(0, slot[sel], target[sel])
    keep = (sums["chosen_tokens"] > 0) & (sums["rejected_tokens"] > 0)  # the padding pairs with nothing
    return {k: v[keep] for k, v in sums.items()}


def settings(train) -> dict[str, Any]:  # noqa: ANN001 - config.TrainConfig
    """dpo_loss's keyword arguments from the run's train settings."""
    return {
        "beta": train.dpo_beta,
        "loss": train.dpo_loss,
        "label_smoothing": train.dpo_label_smoothing,
        "sft_weight": train.dpo_sft_weight,
        "gamma": train.simpo_gamma,
    }


def pair_losses(
    margin: torch.Tensor, beta: float, loss: str, label_smoothing: float, gamma: float = 0.0
) -> torch.Tensor:
    """Each pair's loss from its margin (beta x the log-likelihood gain of the chosen answer over
    the rejected one, relative to the reference; SimPO's: beta x the per-token log-likelihood
    difference); `loss` as train.dpo_loss."""
    logsigmoid = torch.nn.functional.logsigmoid
    if loss == "sigmoid":
        return -(1 - label_smoothing) * logsigmoid(margin) - label_smoothing * logsigmoid(-margin)
    if loss == "ipo":
        return (margin / beta - 1 / (2 * beta)) ** 2
    if loss == "hinge":
        return torch.relu(1 - margin)
    if loss == "simpo":
        return -logsigmoid(margin - gamma)
    raise ValueError(f"unknown DPO loss {loss!r}")


def dpo_loss(
    policy: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor] | None,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    sft_weight: float = 0.0,
    gamma: float = 0.0,
    per: Sequence[float] | None = None,
):
    """(mean loss over the pairs, plus sft_weight x the chosen answers' per-token loss; the sums
    this batch adds to SUM_NAMES, whose 'loss' is the pairs' alone); a batch with no pair gives a
    zero loss that still reaches the graph (every rank must run the backward). IPO and SimPO
    compare each answer's log-likelihood per token, and their rewards are those too; SimPO's
    `reference` is None (its rewards are beta x the policy's own).

    `per` (pairs, chosen tokens): what the sums are divided by instead of this batch's own counts;
    training gives the step's (`step_counts`), so the step's loss is the mean over all its pairs."""
    per_token = loss in ("ipo", "simpo")
    mine, ref = (_per_token(s) if per_token and s is not None else s for s in (policy, reference))
    gain_chosen, gain_rejected = (
        beta * (mine[side] - (ref[side] if ref is not None else 0.0)) for side in ("chosen", "rejected")
    )
    margin = gain_chosen - gain_rejected
    losses = pair_losses(margin, beta, loss, label_smoothing, gamma)
    n = len(losses)
    pairs, tokens = per or (n, policy["chosen_tokens"].sum())
    loss = losses.sum() / pairs if n else policy["chosen"].sum() * 0.0
    if sft_weight and n:
        loss = loss - sft_weight * policy["chosen"].sum() / tokens
    totals = [losses, margin > 0, margin, gain_chosen, gain_rejected, -policy["chosen"], policy["chosen_tokens"]]
    loss_sum, correct, *rest = (float(x.detach().sum()) for x in totals)
    return loss, [loss_sum, n, correct, *rest]  # in SUM_NAMES' order


def _per_token(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """pair_sums' log-likelihoods averaged over each answer's tokens (the counts kept)."""
    return sums | {side: sums[side] / sums[f"{side}_tokens"] for side in ("chosen", "rejected")}


def forward_logps(engine, inputs: dict[str, Any], fused: bool) -> torch.Tensor:
    """(B, T) log p(label) of the model `engine` runs: the fused output layer's, or from logits."""
    if fused:
        return engine(**inputs, label_logps=True, use_cache=False)["label_logps"]
    plain = {k: v for k, v in inputs.items() if k != "labels"}
    return label_logps_from_logits(engine(**plain, use_cache=False).logits, inputs["labels"])


# A reference: a micro batch's model inputs -> the reference model's (B, T) log p(label), or
# None where the loss compares none (reference_free).
Reference = Callable[[dict[str, Any]], torch.Tensor | None]


def adapters_off(model, peft_model, fused: bool) -> Reference:
    """LoRA's reference: `model`'s forward with `peft_model`'s adapters switched off (`model`
    runs the forwards: the DeepSpeed engine in training, whose module is `peft_model`; the
    PeftModel itself in `evaluate`)."""

    def logps(inputs: dict[str, Any]) -> torch.Tensor:
        with peft_model.disable_adapter():
            return forward_logps(model, inputs, fused)

    return logps


def frozen_copy(model, fused: bool) -> Reference:
    """Full fine-tuning's reference: a frozen copy of the starting model (its own DeepSpeed
    engine under ZeRO-3, in eval mode) run as it is."""
    return functools.partial(forward_logps, model, fused=fused)


def reference_free(inputs: dict[str, Any]) -> None:
    """SimPO's reference: none (no forward)."""
    return None


# ----------------------------------------------------------------------------- a precomputed reference
# train.dpo_precompute_reference: the reference's log p(label) of each block, computed once and
# kept on the run's storage, found again by what the block holds (its tokens, labels and
# positions), so a block keeps its row whatever its id, split, rank or worker count.


# Bytes of each weight file's data region sampled into reference_key, at its start and its end:
# two trainings of one architecture share every safetensors header, not their weights' bytes.
IDENTITY_SAMPLE_BYTES = 1 << 16


def reference_key(name_or_path: str, model_dir: str | Path) -> str:
    """A 16-hex key of the model a reference is computed with, the same on every rank and node:
    what a checkpoint's manifest records of it (checkpoint.model_identity: model.name_or_path,
    the hub commit, config.json and the safetensors headers) and the first and last
    IDENTITY_SAMPLE_BYTES of each safetensors file's data, which a model written over under
    the same path (another fine-tune of one architecture) changes. Not paths or modification
    times: each node's copy of a model may have its own. A sample, not the whole file, keeps
    this a few reads at any model size."""
    from raytrain_cpu.checkpoint.identity import model_identity
    from raytrain_cpu.model.hub import is_hub_id, snapshot_revision

    revision = None
    if is_hub_id(name_or_path):
        with contextlib.suppress(ValueError):  # not a hub cache snapshot: its fingerprint alone
            revision = snapshot_revision(model_dir)
    h = hashlib.sha256(json.dumps(model_identity(name_or_path, model_dir, revision), sort_keys=True).encode())
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            start = 8 + int.from_bytes(fh.read(8), "little")
            fh.seek(start)
            h.update(fh.read(IDENTITY_SAMPLE_BYTES))
            fh.seek(max(start, size - IDENTITY_SAMPLE_BYTES))
            h.update(fh.read())
    return h.hexdigest()[:16]


def reference_directory(run_dir: Path, identity: str) -> Path:
    """Where a run keeps its reference rows: <run dir>/reference_logps/<reference_key>. Rows are
    found by what a block holds, so the model must be in the key too: another model under the
    same run.name (model.name_or_path changed before the first checkpoint) computes its own."""
    return Path(run_dir) / "reference_logps" / identity


def block_digests(inputs: dict[str, Any]) -> list[bytes]:
    """A 16-byte key for each row of a micro batch's inputs (int64 tensors, as the streams give)."""
    cols = [inputs[k].to(torch.long).numpy() for k in ("input_ids", "labels", "position_ids") if k in inputs]
    return [
        hashlib.blake2b(b"".join(c[i].tobytes() for c in cols), digest_size=16).digest() for i in range(len(cols[0]))
    ]


class KeptLogps:
    """The reference log-likelihood rows kept in `directory` (memory-mapped), by block digest:
    parts <name>.logps.npy ((N, T) float32) and <name>.keys.npy ((N, 16) bytes), the keys written
    last, so a part an interrupted attempt left half-written is not read."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.index: dict[bytes, tuple[int, int]] = {}
        self.parts: list[np.ndarray] = []
        for keys_file in sorted(Path(directory).glob("*.keys.npy")):
            keys = np.load(keys_file)
            self.parts.append(np.load(str(keys_file).removesuffix(".keys.npy") + ".logps.npy", mmap_mode="r"))
            for row, key in enumerate(keys):
                self.index.setdefault(key.tobytes(), (len(self.parts) - 1, row))

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.index

    def __len__(self) -> int:
        return len(self.index)

    def rows(self, digests: list[bytes]) -> np.ndarray:
        missing = sum(d not in self.index for d in digests)
        if missing:  # the pass covers every block the run reads: a bug, not bad input
            raise RuntimeError(
                f"{missing} of a micro batch's {len(digests)} blocks have no reference row kept in {self.directory}"
            )
        return np.stack([self.parts[p][r] for p, r in (self.index[d] for d in digests)])


def keep_logps(directory: Path, name: str, digests: list[bytes], logps: np.ndarray) -> None:
    """Adds a part to `directory` (KeptLogps), each file written whole then renamed into place."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), 16)
    for suffix, array in ((".logps.npy", logps.astype(np.float32)), (".keys.npy", keys)):
        tmp = directory / f".{name}{suffix}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, array)
        tmp.rename(directory / f"{name}{suffix}")


def precomputed(kept: KeptLogps) -> Reference:
    """The reference as kept rows: no forward."""

    def logps(inputs: dict[str, Any]) -> torch.Tensor:
        return torch.from_numpy(kept.rows(block_digests(inputs)))

    return logps


def counts(labels: torch.Tensor, position_ids: torch.Tensor) -> list[float]:
    """[pairs, chosen answers' targets] of a batch of preference blocks, before any forward: what
    dpo_loss's `per` divides by, summed over a step's micro batches and ranks."""
    sums = pair_sums(torch.zeros(labels.shape), labels, position_ids)
    return [float(len(sums["chosen_tokens"])), float(sums["chosen_tokens"].sum())]


def micro_batch_loss(model, reference: Reference, inputs: dict[str, Any], fused: bool, **loss_settings: Any):
    """The DPO loss of a micro batch (the policy's graph: `model`'s forward) and its sums
    (SUM_NAMES): the `reference` runs first, without gradients (`reference_free`: none).
    `loss_settings`: dpo_loss's (`settings`)."""
    with torch.no_grad():
        logps = reference(inputs)
        ref = None if logps is None else pair_sums(logps, inputs["labels"], inputs["position_ids"])
    policy = pair_sums(forward_logps(model, inputs, fused), inputs["labels"], inputs["position_ids"])
    return dpo_loss(policy, ref, **loss_settings)


def chosen_loss(sums: list[float]) -> float | None:
    """The chosen answers' per-token loss (SFT's) from all-reduced SUM_NAMES sums; None over none."""
    s = dict(zip(SUM_NAMES, sums))
    return s["chosen_nll"] / s["chosen_tokens"] if s["chosen_tokens"] else None


def metrics(sums: list[float], prefix: str = "") -> dict[str, float]:
    """The rates from all-reduced SUM_NAMES sums: dpo_loss, reward_accuracy, reward_margin,
    reward_chosen, reward_rejected (per pair), with `prefix` ('eval_'); {} over no pair."""
    s = dict(zip(SUM_NAMES, sums))
    if not s["pairs"]:
        return {}
    per_pair = {"dpo_loss": "loss", "reward_accuracy": "correct", "reward_margin": "margin"}
    per_pair |= {"reward_chosen": "chosen", "reward_rejected": "rejected"}
    return {f"{prefix}{name}": s[key] / s["pairs"] for name, key in per_pair.items()} | {f"{prefix}pairs": s["pairs"]}


def chosen_labels(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The labels of the chosen answers only (the rejected ones -100): what `evaluate` measures
    of preference blocks, the chosen answers' loss, without a reference model."""
    return labels.masked_fill(_segments(position_ids) % 2 == 1, IGNORE_INDEX)
