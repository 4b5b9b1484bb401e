"""DPO on preference pairs: rows -> pairs, pairs packed side by side, each pair's log-likelihoods
out of a packed block, the DPO loss and its gradient, the fused output layer's log-probabilities;
then DPO runs end to end: LoRA's (the reference is the base with the adapters off) and full
fine-tuning's (a frozen copy of the starting model, kept across a resume).
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_dpo_e2e.py."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from helpers import FUSED_VOCAB, fused_llama_pair

from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.data import DataConfig
from raytrain_cpu.config.schema import load_config
from raytrain_cpu.data.prepare import Tokenize, _ExampleWriter
from raytrain_cpu.data.sft import IGNORE, row_pair
from raytrain_cpu.data.sources import DataError, SourceSpec, file_examples
from raytrain_cpu.model.chat import RowError
from raytrain_cpu.model.tokenizer import BUNDLED_SFT, BUNDLED_TOKENIZER, EOS
from raytrain_cpu.planner import plan
from raytrain_cpu.trainer import dpo


def cfg(**kw) -> DataConfig:
    return DataConfig(format="preference", source="jsonl", path="rows.jsonl", **kw)


def texts(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


# ----------------------------------------------------------------------------- rows -> pairs


def test_pair_rows_text_and_conversational():
    chosen, rejected = row_pair({"prompt": "Q?", "chosen": "Yes.", "rejected": "No."}, cfg())
    assert texts(chosen) == [("user", "Q?"), ("assistant", "Yes.")]
    assert texts(rejected) == [("user", "Q?"), ("assistant", "No.")]
    # TRL's conversational rows: the turns before the answer are the prompt, the same on both sides
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    row = {
        "chosen": [*turns, {"role": "user", "content": "Q?"}, {"role": "assistant", "content": "Yes."}],
        "rejected": [*turns, {"role": "user", "content": "Q?"}, {"role": "assistant", "content": "No."}],
    }
    chosen, rejected = row_pair(row, cfg())
    assert chosen[:-1] == rejected[:-1] and len(chosen) == 4 and chosen[-1]["content"] == "Yes."
    # UltraFeedback binarized: a prompt field that the conversations repeat is not read twice
    assert row_pair({**row, "prompt": "Q?"}, cfg()) == (chosen, rejected)
    # a prompt given as messages, a system field, other column names
    row = {"q": [{"role": "user", "content": "Q?"}], "good": "Yes.", "bad": "No.", "sys": "Be brief."}
    c = cfg(prompt_column="q", chosen_column="good", rejected_column="bad", system_column="sys")
    chosen, _ = row_pair(row, c)
    assert texts(chosen) == [("system", "Be brief."), ("user", "Q?"), ("assistant", "Yes.")]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "Q?", "chosen": "Yes."}, r"no 'rejected' field \(has \['chosen', 'prompt'\]\)"),
        ({"chosen": "Yes.", "rejected": "No."}, r"no 'prompt' field"),
        (
            {
                "chosen": [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "Y"}],
                "rejected": [{"role": "user", "content": "B?"}, {"role": "assistant", "content": "N"}],
            },
            r"differ before their answers",
        ),
        (
            {"prompt": "Q?", "chosen": [{"role": "user", "content": "Y"}], "rejected": "N"},
            r"must end with the assistant",
        ),
        ({"prompt": "Q?", "chosen": [{"role": "assistant"}], "rejected": "N"}, r"'chosen' message 0 is not"),
        ({"prompt": "Q?", "chosen": " ", "rejected": "N"}, r"the 'chosen' answer is empty"),
    ],
)
def test_bad_pair_rows_name_what_is_wrong(row, message):
    with pytest.raises(RowError, match=message):
        row_pair(row, cfg())
    _, rejected = row_pair({"prompt": "Q?", "chosen": "Yes.", "rejected": ""}, cfg())
    assert rejected[-1]["content"] == ""  # a blank rejected answer is a fair preference


def tokenize_pairs(rows: list[dict], **kw):
    from tokenizers import Tokenizer

    c = cfg(**kw)
    spec = SourceSpec("jsonl", ("rows.jsonl",), "", False, c.bad_rows, format="preference")
    payloads, skipped = file_examples("rows.jsonl", "\n".join(map(json.dumps, rows)).encode(), spec, c)
    eos = Tokenizer.from_file(str(BUNDLED_TOKENIZER / "tokenizer.json")).token_to_id(EOS)
    actor = Tokenize(str(BUNDLED_TOKENIZER / "tokenizer.json"), eos, sft=dataclasses.asdict(c))
    table = actor({"text": np.asarray(payloads, dtype=object), "skipped": np.zeros(len(payloads), dtype=np.int64)})
    return table, skipped + sum(table.column("skipped").to_pylist()), eos


def test_a_pair_tokenizes_to_both_conversations_answers_labelled():
    table, skipped, eos = tokenize_pairs([{"prompt": "What is it?", "chosen": "A poet.", "rejected": "A ship."}])
    ids, labels = (np.asarray(table.column(c)[0].as_py()) for c in ("ids", "labels"))
    split = table.column("split")[0].as_py()
    assert skipped == 0 and 0 < split < len(ids)
    chosen, rejected = (ids[:split], labels[:split]), (ids[split:], labels[split:])
    for side_ids, side_labels in (chosen, rejected):
        assert side_ids[-1] == eos and side_labels[-1] == eos  # each side ends with a trained EOS
        assert side_labels[0] == IGNORE and (side_labels != IGNORE).sum() >= 2
    n_prompt = int(np.argmax(chosen[1] != IGNORE))
    assert (chosen[0][:n_prompt] == rejected[0][:n_prompt]).all()  # the same prompt before each answer
    assert chosen[0][n_prompt:].tolist() != rejected[0][n_prompt:].tolist()


def test_a_prompt_filling_half_the_block_is_a_bad_row():
    rows = [{"prompt": "word " * 20, "chosen": "a", "rejected": "b"}]
    with pytest.raises(DataError, match=r"line 1: its prompt alone takes \d+ tokens.*a preference pair shares a block"):
        tokenize_pairs(rows, seq_len=64)  # a prompt of ~45 tokens fits 64, not half of it
    table, skipped, _ = tokenize_pairs(
        [*rows, {"prompt": "q", "chosen": "a", "rejected": "b"}], seq_len=64, bad_rows="skip"
    )
    assert skipped == 1 and table.column("ids")[0].as_py() == [] and table.column("split")[1].as_py() > 0


# ----------------------------------------------------------------------------- packing pairs


def test_pairs_share_a_block_chosen_first_and_long_pairs_are_cut_to_fit(tmp_path):
    import pyarrow.parquet as pq

    seq, pad = 32, 0
    w = _ExampleWriter(tmp_path / "train", seq, pad)
    # pair k: chosen tokens 100+k, rejected 200+k; a prompt of 2 (no label), answers labelled
    lengths = [(5, 7), (9, 4), (20, 6), (24, 30), (3, 3)]
    for k, (nc, nr) in enumerate(lengths):
        c, r = np.full(nc, 100 + k, np.int32), np.full(nr, 200 + k, np.int32)
        lab = np.concatenate([c, r]).copy()
        lab[[0, 1, nc, nc + 1]] = IGNORE
        w.add_pair(np.concatenate([c, r]), lab, nc)
    w.close()
    table = pq.read_table(tmp_path / "train")
    blocks, positions = (np.stack(table.column(c).to_pylist()) for c in ("input_ids", "position_ids"))
    seen = {}
    for ids, pos in zip(blocks, positions):
        starts = np.flatnonzero(pos == 0)
        segs = [ids[a:b] for a, b in zip(starts, [*starts[1:], seq])]
        if ids[-1] == pad:
            segs = segs[:-1]  # the padding: the last segment
        assert len(segs) % 2 == 0
        for c, r in zip(segs[0::2], segs[1::2]):  # chosen, then its rejected, in one block
            k = int(c[0]) - 100
            assert (c == 100 + k).all() and (r == 200 + k).all()
            seen[k] = (len(c), len(r))
    assert seen == {0: (5, 7), 1: (9, 4), 2: (20, 6), 3: (16, 16), 4: (3, 3)}  # 24+30 > 32: both cut to 16
    assert w.stats()["truncated_examples"] == 1


# ----------------------------------------------------------------------------- the loss


def packed_batch():
    """Two rows of 12: row 0 holds pairs (c0, r0) and (c1, r1) and padding; row 1 one pair."""
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]])
    labels = torch.full((2, 12), IGNORE)
    for row, answers in ((0, [1, 2, 4, 6, 7, 9]), (1, [2, 3, 6, 7, 8])):
        labels[row, answers] = 5
    return labels, position_ids


def test_pair_sums_read_each_pair_out_of_packed_rows():
    labels, position_ids = packed_batch()
    logps = -torch.arange(24, dtype=torch.float32).reshape(2, 12) * (labels != IGNORE)
    sums = dpo.pair_sums(logps, labels, position_ids)
    # row 0: c0 = tokens 1,2; r0 = 4; c1 = 6,7; r1 = 9; padding (10, 11) no pair. row 1: c = 2,3; r = 6,7,8
    assert sums["chosen"].tolist() == [-3.0, -13.0, -(14 + 15)]
    assert sums["rejected"].tolist() == [-4.0, -9.0, -(18 + 19 + 20)]
    assert sums["chosen_tokens"].tolist() == [2.0, 2.0, 2.0] and sums["rejected_tokens"].tolist() == [1.0, 1.0, 3.0]
    assert dpo.chosen_labels(labels, position_ids)[0].tolist() == [IGNORE, 5, 5, *[IGNORE] * 3, 5, 5, *[IGNORE] * 4]


def test_dpo_loss_is_log2_at_the_reference_and_its_gradient_prefers_the_chosen():
    labels, position_ids = packed_batch()
    logps = (-torch.rand(2, 12) * (labels != IGNORE)).requires_grad_()
    reference = {k: v.detach() for k, v in dpo.pair_sums(logps, labels, position_ids).items()}
    loss, sums = dpo.dpo_loss(dpo.pair_sums(logps, labels, position_ids), reference, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2)) and sums[1] == 3 and sums[2] == 0  # no pair won yet
    loss.backward()
    chosen = dpo.chosen_labels(labels, position_ids) != IGNORE
    rejected = (labels != IGNORE) & ~chosen
    assert (logps.grad[chosen] < 0).all() and (logps.grad[rejected] > 0).all()  # descent raises chosen
    assert (logps.grad[labels == IGNORE] == 0).all()
    assert logps.grad[chosen][0].item() == pytest.approx(-0.1 * 0.5 / 3)  # beta x sigmoid(0) / pairs
    # a better policy: chosen up by 1 nat each pair -> margin beta, loss -log sigmoid(0.1)
    better = {**reference, "chosen": reference["chosen"] + 1.0}
    loss, sums = dpo.dpo_loss(better, reference, beta=0.1)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.1))), rel=1e-6)
    m = dpo.metrics(sums)
    assert m["reward_accuracy"] == 1.0 and m["reward_margin"] == pytest.approx(0.1) and m["pairs"] == 3


@pytest.mark.parametrize(
    ("loss", "at_reference"), [("sigmoid", math.log(2)), ("ipo", (1 / (2 * 0.1)) ** 2), ("hinge", 1.0)]
)
def test_every_preference_loss_starts_where_it_should_and_prefers_the_chosen(loss, at_reference):
    labels, position_ids = packed_batch()
    logps = (-torch.rand(2, 12) * (labels != IGNORE)).requires_grad_()
    reference = {k: v.detach() for k, v in dpo.pair_sums(logps, labels, position_ids).items()}
    value, _ = dpo.dpo_loss(dpo.pair_sums(logps, labels, position_ids), reference, beta=0.1, loss=loss)
    assert value.item() == pytest.approx(at_reference)
    value.backward()
    chosen = dpo.chosen_labels(labels, position_ids) != IGNORE
    rejected = (labels != IGNORE) & ~chosen
    assert (logps.grad[chosen] < 0).all() and (logps.grad[rejected] > 0).all()


def test_ipo_compares_per_token_and_stops_at_its_margin_where_dpo_pushes_on():
    labels, position_ids = packed_batch()
    logps = -torch.rand(2, 12) * (labels != IGNORE)
    reference = dpo.pair_sums(logps, labels, position_ids)
    # Each chosen token 5 nats likelier: the chosen answers' sums rise by 5 x their 2 tokens, the
    # per-token margin is 5 = 1/(2 beta), IPO's target: its loss is 0; DPO's is still positive.
    better = reference | {"chosen": reference["chosen"] + 5 * reference["chosen_tokens"]}
    ipo, sums = dpo.dpo_loss(better, reference, beta=0.1, loss="ipo")
    assert ipo.item() == pytest.approx(0.0, abs=1e-9)
    assert dpo.metrics(sums)["reward_margin"] == pytest.approx(0.5)  # beta x 5, per token
    assert sums[dpo.SUM_NAMES.index("chosen_nll")] == pytest.approx(-float(better["chosen"].sum()))  # summed
    sigmoid, _ = dpo.dpo_loss(better, reference, beta=0.1)
    assert sigmoid.item() == pytest.approx(-math.log(1 / (1 + math.exp(-1.0))))  # beta x 10 summed nats
    # Past its target IPO pulls back: the loss grows again.
    further = reference | {"chosen": reference["chosen"] + 8 * reference["chosen_tokens"]}
    assert dpo.dpo_loss(further, reference, beta=0.1, loss="ipo")[0].item() == pytest.approx(9.0)


def test_simpo_compares_per_token_likelihoods_with_no_reference():
    """SimPO: -log sigmoid(beta x (per-token log p(chosen) - per-token log p(rejected)) - gamma);
    the reference forward is skipped (reference_free), the rewards are beta x the policy's own."""
    labels, position_ids = packed_batch()
    logps = (-torch.rand(2, 12) * (labels != IGNORE)).requires_grad_()
    policy = dpo.pair_sums(logps, labels, position_ids)
    loss, sums = dpo.dpo_loss(policy, None, beta=2.0, loss="simpo", gamma=0.5)
    avg = {side: policy[side] / policy[f"{side}_tokens"] for side in ("chosen", "rejected")}
    margin = 2.0 * (avg["chosen"] - avg["rejected"])
    expected = torch.nn.functional.softplus(-(margin - 0.5)).mean()
    assert loss.item() == pytest.approx(expected.item())
    m = dpo.metrics(sums)
    assert m["reward_chosen"] == pytest.approx(2.0 * avg["chosen"].mean().item())
    assert m["reward_accuracy"] == pytest.approx((margin > 0).float().mean().item())
    loss.backward()
    chosen = dpo.chosen_labels(labels, position_ids) != IGNORE
    rejected = (labels != IGNORE) & ~chosen
    assert (logps.grad[chosen] < 0).all() and (logps.grad[rejected] > 0).all()
    # At equal per-token likelihoods the loss is log(1 + e^gamma), not log 2.
    even = dpo.pair_losses(torch.zeros(1), 2.0, "simpo", 0.0, gamma=0.5)
    assert even.item() == pytest.approx(math.log(1 + math.exp(0.5)))

    ids = torch.randint(0, FUSED_VOCAB, labels.shape)
    inputs = {"input_ids": ids, "labels": torch.where(labels == IGNORE, IGNORE, ids), "position_ids": position_ids}
    _, model = fused_llama_pair(torch.float32)
    value, batch_sums = dpo.micro_batch_loss(model, dpo.reference_free, inputs, True, beta=2.0, loss="simpo", gamma=0.5)
    assert math.isfinite(value.item()) and batch_sums[1] == 3
    c = load_config(None, ["data.format=preference", "train.dpo_loss=simpo", "train.dpo_beta=2.0"])
    assert plan.inputs_from_config(c)["dpo_reference"] == "none"  # no reference forward, no copy
    with pytest.raises(ConfigError, match=r"train.simpo_gamma"):
        load_config(None, ["train.simpo_gamma=-1"])


def test_micro_batches_divided_by_the_steps_counts_add_up_to_the_whole_batchs_loss():
    """Training divides each micro batch's sums by the step's pair and chosen-token counts
    (`per`, over every micro batch and rank), so the micro batches' losses, averaged as DeepSpeed
    does, are the whole batch's: row 0 holds 2 pairs, row 1 one (their own means weighed them
    alike, the one pair as much as the two)."""
    labels, position_ids = packed_batch()
    logps = -torch.rand(2, 12, generator=torch.Generator().manual_seed(0)) * (labels != IGNORE)
    reference = {k: v.detach() for k, v in dpo.pair_sums(torch.zeros(2, 12), labels, position_ids).items()}
    counts = [dpo.counts(labels[r : r + 1], position_ids[r : r + 1]) for r in range(2)]
    assert counts == [[2.0, 4.0], [1.0, 2.0]] and dpo.counts(labels, position_ids) == [3.0, 6.0]
    settings = {"beta": 0.1, "sft_weight": 0.5}
    whole, _ = dpo.dpo_loss(dpo.pair_sums(logps, labels, position_ids), reference, **settings)
    per = [sum(c[k] for c in counts) / 2 for k in range(2)]  # the totals / (micro batches x ranks)
    rows = [dpo.pair_sums(logps[r : r + 1], labels[r : r + 1], position_ids[r : r + 1]) for r in range(2)]
    refs = [{k: v[:2] for k, v in reference.items()}, {k: v[2:] for k, v in reference.items()}]
    parts = [dpo.dpo_loss(row, ref, **settings, per=per)[0] for row, ref in zip(rows, refs)]
    assert ((parts[0] + parts[1]) / 2).item() == pytest.approx(whole.item(), rel=1e-6)
    own = [dpo.dpo_loss(row, ref, **settings)[0] for row, ref in zip(rows, refs)]
    assert ((own[0] + own[1]) / 2).item() != pytest.approx(whole.item(), rel=1e-3)  # each micro batch's mean


def test_sft_weight_adds_the_chosen_answers_per_token_loss():
    labels, position_ids = packed_batch()
    logps = (-torch.rand(2, 12) * (labels != IGNORE)).requires_grad_()
    policy = dpo.pair_sums(logps, labels, position_ids)
    reference = {k: v.detach() for k, v in policy.items()}
    plain, sums = dpo.dpo_loss(policy, reference, beta=0.1)
    weighted, weighted_sums = dpo.dpo_loss(policy, reference, beta=0.1, sft_weight=0.5)
    nll = -policy["chosen"].sum() / policy["chosen_tokens"].sum()
    assert weighted.item() == pytest.approx(plain.item() + 0.5 * nll.item())
    assert weighted_sums == sums  # the logged DPO loss and rewards are DPO's alone
    assert dpo.chosen_loss(sums) == pytest.approx(nll.item())
    weighted.backward()
    chosen = dpo.chosen_labels(labels, position_ids) != IGNORE
    # at the reference DPO's gradient on a chosen token is -beta/2/pairs; SFT's adds -weight/tokens
    assert logps.grad[chosen][0].item() == pytest.approx(-0.1 * 0.5 / 3 - 0.5 / 6)


def test_the_summary_names_a_preference_loss_other_than_dpos():
    from raytrain_cpu.launch.summary import _preference_line

    s = {"eval_dpo_loss": 0.2482, "eval_reward_accuracy": 0.562}
    assert _preference_line(s) == "eval DPO         loss 0.2482, reward accuracy 56.2%\n"
    ipo = _preference_line(s | {"dpo": {"loss": "ipo"}})
    assert ipo == "eval DPO         ipo loss 0.2482, reward accuracy 56.2%\n"


def test_label_smoothing_mixes_in_the_reversed_pair():
    margin = torch.tensor([0.0, 0.7, -1.3])
    plain = dpo.pair_losses(margin, 0.1, "sigmoid", 0.0)
    reversed_pair = dpo.pair_losses(-margin, 0.1, "sigmoid", 0.0)
    smoothed = dpo.pair_losses(margin, 0.1, "sigmoid", 0.2)
    assert torch.allclose(smoothed, 0.8 * plain + 0.2 * reversed_pair)
    assert torch.allclose(dpo.pair_losses(margin, 0.1, "hinge", 0.0), torch.tensor([1.0, 0.3, 2.3]))
    c = load_config(None, ["train.dpo_loss=ipo", "train.dpo_beta=0.5"]).train
    assert dpo.settings(c) == {"beta": 0.5, "loss": "ipo", "label_smoothing": 0.0, "sft_weight": 0.0, "gamma": 0.5}
    with pytest.raises(ConfigError, match=r"train.dpo_sft_weight"):
        load_config(None, ["train.dpo_sft_weight=-1"])
    with pytest.raises(ConfigError, match=r"train.dpo_loss"):
        load_config(None, ["train.dpo_loss=kto"])
    with pytest.raises(ConfigError, match=r"train.dpo_label_smoothing.*\[0, 0.5\)"):
        load_config(None, ["train.dpo_label_smoothing=0.5"])
    with pytest.raises(ConfigError, match=r"train.dpo_label_smoothing.*sigmoid only, not 'ipo'"):
        load_config(None, ["train.dpo_loss=ipo", "train.dpo_label_smoothing=0.1"])


def test_a_micro_batch_without_a_pair_still_reaches_the_graph():
    labels = torch.full((1, 8), IGNORE)
    logps = torch.zeros(1, 8, requires_grad=True)
    sums = dpo.pair_sums(logps, labels, torch.arange(8).unsqueeze(0))
    loss, counts = dpo.dpo_loss(sums, {k: v.detach() for k, v in sums.items()}, 0.1)
    loss.backward()
    assert loss.item() == 0.0 and counts[1] == 0 and dpo.metrics(counts) == {}


def test_a_frozen_copy_scores_the_starting_model_and_takes_no_gradient():
    """Full fine-tuning's reference: at the start the policy (fused output layer) and its frozen
    copy (Hugging Face's) agree, so the loss is log 2; the backward reaches the policy only."""
    reference, policy = fused_llama_pair(torch.float32)
    reference.requires_grad_(False)
    labels, position_ids = packed_batch()
    ids = torch.randint(0, FUSED_VOCAB, labels.shape)
    inputs = {"input_ids": ids, "labels": torch.where(labels == IGNORE, IGNORE, ids), "position_ids": position_ids}
    loss, sums = dpo.micro_batch_loss(policy, dpo.frozen_copy(reference, fused=False), inputs, True, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-5) and sums[1] == 3
    loss.backward()
    assert all(p.grad is not None for p in policy.parameters() if p.requires_grad)
    assert all(p.grad is None for p in reference.parameters())


def test_kept_reference_rows_are_found_by_what_a_block_holds(tmp_path):
    """train.dpo_precompute_reference's store: kept rows score the policy as the frozen copy they
    came from does; a micro batch finds them by content (whatever the order, or the rank that kept
    them), a half-written part is not read, and a block no pass covered fails rather than scoring
    against nothing."""
    reference, policy = fused_llama_pair(torch.float32)
    labels, position_ids = packed_batch()
    ids = torch.randint(0, FUSED_VOCAB, labels.shape)
    inputs = {"input_ids": ids, "labels": torch.where(labels == IGNORE, IGNORE, ids), "position_ids": position_ids}
    digests = dpo.block_digests(inputs)
    assert len(set(digests)) == len(digests) == len(ids) and all(len(d) == 16 for d in digests)
    moved = dict(inputs, position_ids=torch.roll(position_ids, 1, dims=1))  # the same tokens placed otherwise
    assert not set(dpo.block_digests(moved)) & set(digests)
    with torch.no_grad():
        logps = dpo.forward_logps(reference, inputs, fused=False).numpy()
    dpo.keep_logps(tmp_path, "a-rank0", digests[:1], logps[:1])
    dpo.keep_logps(tmp_path, "b-rank1", digests[1:], logps[1:])
    (tmp_path / "c-rank0.logps.npy").write_bytes(b"interrupted")  # its keys never written: not read
    kept = dpo.KeptLogps(tmp_path)
    assert len(kept) == len(ids) and not list(tmp_path.glob(".*.tmp"))
    flipped = {k: v.flip(0) for k, v in inputs.items()}
    assert np.array_equal(dpo.precomputed(kept)(flipped).numpy(), logps[::-1])
    policy_loss = {
        name: dpo.micro_batch_loss(policy, ref, inputs, True, beta=0.1)[1]
        for name, ref in (("kept", dpo.precomputed(kept)), ("copy", dpo.frozen_copy(reference, fused=False)))
    }
    assert policy_loss["kept"] == policy_loss["copy"]
    with pytest.raises(RuntimeError, match=r"^2 of a micro batch's 2 blocks have no reference row kept in"):
        dpo.precomputed(kept)({k: v.clone().fill_(7) for k, v in inputs.items()})


def test_fused_label_logps_match_the_logits_and_their_gradients():
    from raytrain_cpu.model.ops import loss as fused

    plain, model = fused_llama_pair(torch.float32)
    fused.CHUNK_BYTES, chunk = 4 * FUSED_VOCAB * 5, fused.CHUNK_BYTES  # 5 tokens a chunk: several chunks
    try:
        ids = torch.randint(0, FUSED_VOCAB, (2, 12))
        labels, position_ids = packed_batch()
        labels = torch.where(labels == IGNORE, IGNORE, ids)
        got = model(input_ids=ids, labels=labels, position_ids=position_ids, label_logps=True)["label_logps"]
        ref = fused.label_logps_from_logits(plain(input_ids=ids, position_ids=position_ids).logits, labels)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        weights = torch.randn(2, 12)
        (got * weights).sum().backward()
        (ref * weights).sum().backward()
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    finally:
        fused.CHUNK_BYTES = chunk


# ----------------------------------------------------------------------------- config


def test_preference_settings_are_checked():
    with pytest.raises(ConfigError, match=r"data.attention_span.*each\s+must see only its own prompt"):
        cfg(attention_span="block")
    with pytest.raises(ConfigError, match=r"data.train_on_prompt"):
        cfg(train_on_prompt=True)
    with pytest.raises(ConfigError, match=r"data.format.*not a mixture"):
        DataConfig(mix=[{"source": "bundled", "format": "preference", "weight": 1}])
    with pytest.raises(ConfigError, match=r"train.dpo_beta"):
        load_config(None, ["data.format=preference", "lora.rank=8", "train.dpo_beta=0"])
    c = load_config(None, ["data.format=preference", "lora.rank=8", "run.best_metric=eval_dpo_loss"])
    assert c.data.attention_span == "document" and c.data.source == "bundled"
    with pytest.raises(ConfigError, match=r"run.best_metric.*eval_dpo_loss"):
        load_config(None, ["run.best_metric=eval_dpo_loss"])  # text data has no DPO loss
    precompute = "train.dpo_precompute_reference=true"
    with pytest.raises(ConfigError, match=r"^train.dpo_precompute_reference: .*data.format=text trains on no"):
        load_config(None, [precompute])
    with pytest.raises(ConfigError, match=r"^train.dpo_precompute_reference: .*dpo_loss=simpo compares no reference"):
        load_config(None, ["data.format=preference", "train.dpo_loss=simpo", precompute])
    assert not load_config(None, ["data.format=preference", precompute]).train.reference_each_step
    assert (BUNDLED_SFT / "preference_train.jsonl").is_file() and (BUNDLED_SFT / "preference_eval.jsonl").is_file()
