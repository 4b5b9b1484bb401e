"""DPO on preference pairs: rows -> pairs, pairs packed side by side, each pair's log-likelihoods
out of a packed block, the DPO loss and its gradient, the fused output layer's log-probabilities;
then DPO runs end to end: LoRA's (the reference is the base with the adapters off) and full
fine-tuning's (a frozen copy of the starting model, kept across a resume).
This module's in-process tests: tests/unit/test_dpo.py."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from raytrain_cpu.model.tokenizer import BUNDLED_SFT
from raytrain_cpu.trainer import dpo

# ----------------------------------------------------------------------------- end to end


def seen_pairs(tmp_path: Path) -> list[str]:
    """Overrides for 16 of the bundled pairs, trained on and evaluated on themselves: a random tiny
    model learns no meaning in a minute, but a preference loss must make it prefer the chosen
    answers it saw."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join((BUNDLED_SFT / "preference_train.jsonl").read_text().splitlines(True)[:16]))
    # a bundled pair takes ~140 tokens
    return ["data.format=preference", f"data.path={pairs}", f"data.eval_path={pairs}", "data.seq_len=256"]


def metric_rows(summary: dict) -> list[dict]:
    return [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_lora_dpo_run_learns_to_prefer_the_chosen_answers(ray_session, make_config, tmp_path):
    from raytrain_cpu.launch.driver import run
    from raytrain_cpu.launch.evaluate import evaluate_model
    from raytrain_cpu.model.export import export_checkpoint

    summary = run(
        make_config(
            *seen_pairs(tmp_path),  # 4 epochs of them
            "lora.rank=8",
            "scaling.num_workers=1",
            "train.lr=2e-2",
            "train.dpo_beta=0.2",  # not the default: `evaluate` scores pairs with the run's own
            "train.max_steps=16",
            "train.eval_every=8",
            "train.checkpoint_every=8",
            "train.eval_on_start=true",
            "run.best_metric=eval_dpo_loss",
        )
    )
    run_dir, rows = Path(summary["run_dir"]), metric_rows(summary)
    train = [r for r in rows if "reward_accuracy" in r]
    evals = [r for r in rows if "eval_dpo_loss" in r]
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # the policy starts as the reference
    assert train[0]["reward_margin"] == 0.0 and train[0]["pairs"] == 4
    assert [e["step"] for e in evals] == [0, 8, 16] and evals[0]["eval_pairs"] == 16
    assert evals[0]["eval_dpo_loss"] == pytest.approx(math.log(2), abs=1e-4) and evals[0]["eval_reward_margin"] == 0
    assert evals[-1]["eval_dpo_loss"] < 0.6 and evals[-1]["eval_reward_accuracy"] >= 0.9, evals
    assert evals[-1]["eval_reward_chosen"] > evals[-1]["eval_reward_rejected"]
    assert summary["best_checkpoint"]["metric"] == "eval_dpo_loss" and summary["best_checkpoint"]["step"] == 16
    assert summary["dpo"] == {"beta": 0.2, "loss": "sigmoid", "label_smoothing": 0.0, "sft_weight": 0.0, "gamma": 0.5}
    # evaluate measures what the run's evaluation did, on the blocks it covered (1 worker x
    # train.eval_batches x micro batch): the chosen answers' eval_loss, and DPO's metrics with the
    # adapters off for the reference.
    measured = evaluate_model(run_dir, max_blocks=4 * 4)
    assert measured["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], abs=2e-2)  # bf16: engine vs HF forward
    assert measured["eval_pairs"] == 16
    assert measured["eval_dpo_loss"] == pytest.approx(evals[-1]["eval_dpo_loss"], abs=2e-2)
    assert measured["eval_reward_margin"] == pytest.approx(evals[-1]["eval_reward_margin"], rel=0.1)
    assert measured["eval_reward_accuracy"] >= 0.9
    export_checkpoint(run_dir, tmp_path / "export", merge=True)
    # A merged export scores its pairs against the model its run started from (the run's base).
    merged = evaluate_model(tmp_path / "export" / "merged", max_blocks=4 * 4)
    assert merged["eval_loss"] == pytest.approx(measured["eval_loss"], abs=2e-2)
    assert merged["eval_dpo_loss"] == pytest.approx(measured["eval_dpo_loss"], abs=2e-2)
    # Moved where its starting model is not: the chosen answers' loss only, unless --reference
    # says where that model is now (the same numbers then).
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "export" / "merged", moved)
    info = json.loads((moved / "raytrain.json").read_text())
    (moved / "raytrain.json").write_text(json.dumps(info | {"model_dir": str(tmp_path / "gone")}))
    assert "eval_dpo_loss" not in evaluate_model(moved, max_blocks=4 * 4)
    again = evaluate_model(moved, max_blocks=4 * 4, reference=info["model_dir"])
    assert again == merged | {"model": str(moved)}
    with pytest.raises(ValueError, match=r"^--reference: '.*gone' is not a directory; give the model"):
        evaluate_model(moved, reference=str(tmp_path / "gone"))


@pytest.mark.slow
def test_full_dpo_keeps_the_starting_model_as_its_reference_across_a_resume(ray_session, make_config, tmp_path, capsys):
    """Both ways of keeping it: the first leg precomputes the reference's log-likelihoods
    (train.dpo_precompute_reference: no copy of the model); the second resumes with a frozen copy
    loaded from the starting model; the third precomputes again and finds every block kept.
    (`evaluate` on a fully fine-tuned DPO model, against its run's starting model: the merged
    export in test_lora_dpo_run_learns_to_prefer_the_chosen_answers takes the same way.)"""
    from raytrain_cpu.launch.driver import run

    overrides = [
        *seen_pairs(tmp_path),
        "scaling.num_workers=2",  # both models partitioned by ZeRO-3, each its own engine
        "train.lr=1e-3",
        "train.dpo_beta=0.2",
        "train.eval_every=3",
        "train.checkpoint_every=3",
        "train.eval_on_start=true",
    ]
    precompute = "train.dpo_precompute_reference=true"
    run(make_config(*overrides, "train.max_steps=3", precompute))
    out = capsys.readouterr().out
    assert "frozen copy" not in out and "DPO's reference: the frozen starting model" not in out
    kept = re.search(r"reference log-likelihoods of (\d+) blocks: (\d+) computed by the starting model", out)
    assert kept and int(kept[1]) == int(kept[2]) > 8, out  # every block the run trains and evaluates on
    summary = run(make_config(*overrides, "train.max_steps=6", "run.export_on_finish=true"))  # resumes at step 3
    assert "[load] and a frozen copy of it: DPO's reference" in capsys.readouterr().out
    assert summary["resumed_from_step"] == 3
    assert summary["export"]["export_max_abs_logit_diff"] == 0.0  # the trained model, not its reference
    summary = run(make_config(*overrides, "train.max_steps=8", precompute))
    assert f"of {kept[1]} blocks: 0 computed by the starting model" in capsys.readouterr().out
    rows = metric_rows(summary)
    train = {r["step"]: r for r in rows if "reward_accuracy" in r}
    evals = [r for r in rows if "eval_dpo_loss" in r]
    # The kept reference is the model's own forward at the start, to the bit.
    assert train[1]["loss"] == pytest.approx(math.log(2), abs=1e-4) and train[1]["reward_margin"] == 0.0
    assert evals[0]["step"] == 0 and evals[0]["eval_dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)
    # Each resumed attempt compared with the starting model, not with its checkpoint: the policy
    # is still ahead of it (were it the checkpoint, steps 4 and 7 would start at log 2).
    for step in (4, 7):
        assert train[step]["reward_margin"] > 0.5 and train[step]["loss"] < 0.5, train[step]
    assert [e["step"] for e in evals] == [0, 3, 6, 8]
    assert evals[2]["eval_dpo_loss"] < 0.2 and evals[2]["eval_reward_accuracy"] >= 0.9, evals
    assert evals[3]["eval_dpo_loss"] <= evals[2]["eval_dpo_loss"] + 0.02  # the kept rows score as the copy did
    # Kept under the starting model's identity: another model under this run.name reads none of them.
    run_dir = make_config(*overrides).run.run_dir
    identity = dpo.reference_key("tiny", run_dir / "base_model")
    assert [p.name for p in (run_dir / "reference_logps").iterdir()] == [identity]


@pytest.mark.slow
def test_simpo_trains_with_no_reference_model(ray_session, make_config, tmp_path):
    from raytrain_cpu.launch.driver import run
    from raytrain_cpu.launch.evaluate import evaluate_model

    summary = run(
        make_config(
            *seen_pairs(tmp_path),
            "scaling.num_workers=1",
            "train.lr=1e-3",
            "train.dpo_loss=simpo",
            "train.dpo_beta=2.0",
            "train.max_steps=6",
        )
    )
    run_dir = Path(summary["run_dir"])
    train = [r for r in metric_rows(summary) if "reward_accuracy" in r]
    # No reference: the first step's loss is SimPO's at the random model's own margins, not log 2.
    assert train[0]["loss"] == pytest.approx(math.log(1 + math.exp(0.5)), abs=0.1) and train[0]["reward_margin"] != 0
    assert summary["dpo"]["loss"] == "simpo" and summary["eval_reward_accuracy"] >= 0.9
    measured = evaluate_model(run_dir)  # no reference model loaded there either
    assert measured["eval_dpo_loss"] == pytest.approx(summary["eval_dpo_loss"], abs=2e-2)
