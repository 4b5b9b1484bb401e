"""The real entry point end to end on a tiny Llama: 2 workers, ZeRO-3, gloo, bf16 (model.dtype=auto
where set: bf16 or fp32 by host, or as RAYTRAIN_DTYPE_AUTO forces it); then resume."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import (
    BF16_LOSS_TOL,
    STEPS,
    fast_overrides,
    run_losses,
    spawn_two_ranks_on_tiny_model,
    straight_overrides,
)

pytestmark = pytest.mark.slow


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_workers_train_checkpoint_and_resume(ray_session, make_config, tmp_path, capsys):
    from raytrain_cpu.data.stream import global_order, read_meta
    from raytrain_cpu.launch.driver import run
    from raytrain_cpu.trainer.schedule import lr_factor

    overrides = [
        "scaling.num_workers=2",
        "train.checkpoint_every=6",
        "train.record_block_ids=true",
        "train.eval_every=6",
        "train.eval_on_start=true",  # a baseline at step 0, not again on the resume
        "train.lr=1e-2",
        "run.num_to_keep=2",
        "train.profile_step=3",
        "model.attention=auto",  # the default, which the suite's FAST settings pin
        "model.dtype=auto",  # likewise: the worker settles it, and a resume must still match (it once did not)
        "model.weight_grad_kernel=true",  # auto leaves it off below 20M parameters
    ]
    cfg = make_config(*overrides, "train.max_steps=12")
    sigterm = signal.getsignal(signal.SIGTERM)
    # the first leg only times its GEMMs (train.mfu_probe_every), once: ~7 s a timing at 0.2 s a shape
    first = run(make_config(*overrides, "train.max_steps=6", "train.mfu_probe_every=6"))
    assert signal.getsignal(signal.SIGTERM) is sigterm  # the run's own handler goes with it

    # ---- the first leg: loss falls, outputs written, both ranks' shards in the checkpoint
    run_dir = cfg.run.run_dir
    steps = [m for m in _metrics(run_dir) if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 7))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, steps
    for m in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s"} <= set(m)
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "steps",
        "tokens_seen",
        "final_loss",
        "eval_loss",
        "eval_perplexity",
        "tokens_per_s",
        "wall_s",
        "world_size",
        "resumed_from_step",
        "checkpoint_path",
    ):
        assert key in summary, key
    assert summary == {**summary, "steps": 6, "world_size": 2, "resumed_from_step": None}
    # bf16 (model.dtype=auto's pick where bf16 GEMMs are faster) trains on the kernel where it builds
    from raytrain_cpu.model.ops import linear

    bf16 = summary["cpu"]["dtype"]["dtype"] == "bf16"
    assert summary["weight_grad_kernel"] == (bf16 and linear.kernel() is not None)
    # the GEMMs timed after step 6 (tests/test_cpu.py checks the weighting over several)
    bd = summary["step_breakdown"]
    assert bd["peak_timings"] == 1 and bd["peak_flops_per_s"] >= bd["mean_gemm_flops_per_s"] > 0
    assert summary["eval_perplexity"] == pytest.approx(np.exp(summary["eval_loss"]))
    assert first["checkpoint_path"] == str(run_dir / "checkpoint_000006")
    ds_files = sorted(p.name for p in (run_dir / "checkpoint_000006" / "ds").iterdir())
    optim = "bf16_" if bf16 else ""  # DeepSpeed names the optimizer shards by the dtype auto picked
    for r in (0, 1):
        assert f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" in ds_files
        assert f"{optim}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" in ds_files
    assert (run_dir / "config.yaml").is_file()
    for r in (0, 1):  # train.profile_step: a trace and a table from every rank
        assert json.loads((run_dir / "profile" / f"rank{r}.json").read_text())["traceEvents"]
        table = (run_dir / "profile" / f"rank{r}.md").read_text()
        assert table.startswith(f"# Step 3, rank {r}") and "| GEMM |" in table and "| collectives |" in table

    # ---- 'auto' attention: the checkpoint records the pick, and a resumed run keeps it rather than
    # timing again; the manifest is made to name the other one, as if this host had timed it faster.
    manifest_path = run_dir / "checkpoint_000006" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["attention"] == summary["attention"] in ("sdpa", "causal_blocks", "fused")
    other = "sdpa" if manifest["attention"] == "causal_blocks" else "causal_blocks"
    # ... and the data it trained on: made to differ, as if the files had changed since (more text).
    assert manifest["data_key"] == read_meta(Path(summary["data_cache"]))["key"]
    manifest_path.write_text(json.dumps({**manifest, "attention": other, "data_key": "0123456789abcdef"}))
    capsys.readouterr()

    # ---- resume: the same command with more steps continues at step 7; how a step runs may
    # change on the way (activation checkpointing on, as to fit in memory): the workers accept it
    second = run(make_config(*overrides, "train.max_steps=12", "model.activation_checkpointing=true"))
    assert second["attention"] == other
    changed = "[raytrain] the training data changed since checkpoint_000006 (packed blocks 0123456789abcdef then"
    assert changed in capsys.readouterr().out
    assert second["resumed_from_step"] == 6 and second["steps"] == 12
    assert second["optimizer_step_at_resume"] == 6  # Adam's state came back, not a fresh optimizer
    steps = [m for m in _metrics(run_dir) if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 13))
    assert [m["step"] for m in _metrics(run_dir) if "eval_loss" in m] == [0, 6, 12]
    for m in steps[6:]:  # the LR schedule continues where it stopped
        assert m["lr"] == pytest.approx(cfg.train.lr * lr_factor(m["step"], cfg.train, 12), rel=1e-6)
    assert steps[-1]["loss"] < steps[6]["loss"] + 0.2

    # ---- the data continued exactly: every block once, in the seeded order, none skipped
    trained, by_rank = [], []
    for r in (0, 1):
        by_rank.append([int(x) for x in (run_dir / "block_ids" / f"rank{r}.txt").read_text().split()])
        trained += by_rank[-1]
    # The checkpoint recorded what step 7 trained on (the resume checked each rank's first batch
    # against it): rank r's first micro batch of the step holds its positions r x 4 ... + 4.
    assert manifest["next_blocks"] == {"position": 6 * 8, "block_ids": by_rank[0][24:28] + by_rank[1][24:28]}
    meta = read_meta(Path(summary["data_cache"]))
    expected = global_order(meta["blocks"], cfg.train.seed, 0, cfg.data.shuffle_window)[: 12 * 8]
    assert len(trained) == 12 * 8 and sorted(trained) == sorted(expected.tolist())
    assert len(set(trained)) == len(trained)
    kept = sorted(p.name for p in run_dir.glob("checkpoint_0*"))
    assert kept == ["checkpoint_000006", "checkpoint_000012"]


def test_the_best_checkpoint_is_kept_and_a_run_stops_early(ray_session, make_config, tmp_path, capsys):
    """run.best_metric keeps the best checkpoint beside the newest, names it and exports it;
    train.early_stop_patience stops a run whose eval loss stopped improving, counted across a
    resume (which trains with the config's new learning rate); running the stopped run again
    trains nothing; `evaluate` measures the best checkpoint as the run did. One worker: ZeRO-3's
    edge case, whose checkpoints hold one rank's partitions."""
    from raytrain_cpu.launch.driver import run
    from raytrain_cpu.launch.evaluate import main as evaluate_main
    from raytrain_cpu.launch.summary import print_summary
    from raytrain_cpu.model.export import main as export_main
    from raytrain_cpu.trainer.schedule import lr_factor

    overrides = [
        "scaling.num_workers=1",
        "train.eval_every=2",
        "train.checkpoint_every=2",
        "run.best_metric=eval_loss",
        "run.num_to_keep=1",
        "train.early_stop_patience=2",
    ]
    first = run(make_config(*overrides, "train.max_steps=4", "train.lr=1e-2"))
    run_dir = Path(first["run_dir"])
    evals = {m["step"]: m["eval_loss"] for m in _metrics(run_dir) if "eval_loss" in m}
    assert evals[4] < evals[2]  # training: the newest is the best
    best = {"path": str(run_dir / "checkpoint_000004"), "step": 4, "metric": "eval_loss", "value": evals[4]}
    assert first["best_checkpoint"] == best
    assert first["early_stop"] is None

    # The resume trains with a learning rate that wrecks the model: the eval loss rises.
    capsys.readouterr()
    second = run(make_config(*overrides, "train.max_steps=12", "train.lr=1.0"))
    capsys.readouterr()
    print_summary(second)  # what the command line prints at the end
    out = capsys.readouterr().out
    evals = {m["step"]: m["eval_loss"] for m in _metrics(run_dir) if "eval_loss" in m}
    assert sorted(evals) == [2, 4, 6, 8] and min(evals.values()) == evals[4]
    # The resume trains with the config's learning rate, not the one the checkpoint's optimizer held,
    # on the schedule's new length from its first step on.
    lrs = {m["step"]: m["lr"] for m in _metrics(run_dir) if "lr" in m}
    cfg = make_config(*overrides, "train.max_steps=12", "train.lr=1.0")
    assert lrs[5] == pytest.approx(lr_factor(5, cfg.train, 12), rel=1e-6)
    assert second["steps"] == 8 and second["resumed_from_step"] == 4
    assert (
        "eval_loss has not improved on its best" in second["early_stop"] and "in 2 evaluations" in second["early_stop"]
    )
    assert f"best checkpoint  {run_dir / 'checkpoint_000004'} (eval_loss {evals[4]:.4f} at step 4)" in out
    assert "[raytrain] stopped early at step 8: eval_loss has not improved" in out
    assert second["best_checkpoint"]["step"] == 4
    # Ray Train kept the best (4) and the newest (8), which a resume loads; 2 and 6 are gone.
    assert sorted(p.name for p in run_dir.glob("checkpoint_0*")) == ["checkpoint_000004", "checkpoint_000008"]
    # ZeRO-3 at world size 1, the edge case: one rank's optimizer and model-state partitions, no more.
    ds_files = {p.name for p in (run_dir / "checkpoint_000008" / "ds").iterdir()}
    assert {"bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"} <= ds_files
    assert not any("rank_1_" in f for f in ds_files)

    # The same command again: already stopped, nothing trains (Ray is not started).
    again = run(make_config(*overrides, "train.max_steps=12", "train.lr=1.0"))
    assert (
        again["steps"] == 8
        and "where it stopped early (train.early_stop_patience=2): nothing to train" in capsys.readouterr().out
    )

    # export --best writes the best checkpoint's model
    assert export_main([str(run_dir), str(tmp_path / "best"), "--best"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(run_dir / "checkpoint_000004")

    # `python -m raytrain_cpu.evaluate`, one process: on the blocks the run's evaluation covered (its
    # first 1 worker x train.eval_batches x micro batch), the best checkpoint and its export give the
    # eval loss the run measured at step 4; a file of one's own is packed alone and evaluated.
    blocks = cfg.train.eval_batches * cfg.train.micro_batch_size
    assert evaluate_main([str(run_dir), "--best", f"--max-blocks={blocks}"]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert ours["model"] == str(run_dir / "checkpoint_000004") and ours["eval_blocks"] == blocks
    assert ours["eval_loss"] == pytest.approx(evals[4], abs=2e-2)  # bf16: the engine's forward against HF's
    assert evaluate_main([str(tmp_path / "best"), f"--max-blocks={blocks}"]) == 0
    assert json.loads(capsys.readouterr().out)["eval_loss"] == pytest.approx(ours["eval_loss"], abs=1e-6)
    notes = tmp_path / "notes.txt"
    root = Path(__file__).parents[2]
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    notes.write_text("\n".join(p.read_text() for p in docs)[:20000])
    assert evaluate_main([str(run_dir), "--best", f"data.eval_path={notes}"]) == 0
    out = capsys.readouterr()
    assert "packing its evaluation text, not its training text" in out.err
    theirs = json.loads(out.out)
    assert theirs["eval_blocks"] > 20 and theirs["eval_loss"] != ours["eval_loss"]
    assert evaluate_main([str(run_dir), "train.lr=1"]) == 2
    assert (
        "train.lr: evaluate takes data.* settings (the data to evaluate on) and model.tokenizer"
        in capsys.readouterr().err
    )


def test_epochs_train_every_block_each_pass_and_a_resume_adds_passes(ray_session, make_config, tmp_path, capsys):
    """train.epochs: the steps come from the packed blocks (ceil, so one epoch trains every block);
    the same command again has nothing to train, and train.epochs=2 resumes for the second pass.
    One worker accumulating twice: the global batch of 2 workers (how ranks split a step's blocks:
    test_two_workers_train_checkpoint_and_resume), a worker's start-up less."""
    from raytrain_cpu.data.stream import read_meta
    from raytrain_cpu.launch.driver import run
    from raytrain_cpu.model.tokenizer import BUNDLED_WIKITEXT

    lines = (BUNDLED_WIKITEXT / "valid.txt").read_text().splitlines(keepends=True)
    (tmp_path / "short.txt").write_text("".join(lines[:40]))
    overrides = [f"data.path={tmp_path / 'short.txt'}", "train.record_block_ids=true", "train.eval_batches=1"]
    overrides += ["scaling.num_workers=1", "train.grad_accum_steps=2"]
    first = run(make_config(*overrides, "train.epochs=1"))
    blocks = read_meta(Path(first["data_cache"]))["blocks"]
    steps = -(-blocks // 8)  # 2 micro batches x 4 blocks a step
    assert 3 <= steps <= 8 and first["steps"] == steps, (blocks, first["steps"])
    out = capsys.readouterr().out
    assert f"[raytrain] train.epochs=1: {blocks:,} training blocks, 8 a step: {steps} steps" in out
    assert f"step {steps}/{steps} (100%, epoch {steps * 8 / blocks:.2f}) | loss" in out  # just past 1: ceil
    assert first["epochs"] == pytest.approx(steps * 8 / blocks)
    run_dir = Path(first["run_dir"])
    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
    assert (recorded["max_steps"], recorded["epochs"]) == (steps, 1.0)  # the workers' steps, the user's epochs

    def trained() -> list[int]:
        return [int(b) for b in (run_dir / "block_ids" / "rank0.txt").read_text().split()]

    assert len(trained()) == steps * 8 and set(trained()) == set(range(blocks))  # every block, a few twice

    again = run(make_config(*overrides, "train.epochs=1"))
    assert again["checkpoint_path"] == first["checkpoint_path"] and again["steps"] == steps
    assert (
        f"train.epochs=1 ({steps} steps): nothing to train. Raise train.epochs to train on" in capsys.readouterr().out
    )

    second = run(make_config(*overrides, "train.epochs=2"))
    assert second["resumed_from_step"] == steps and second["steps"] == -(-2 * blocks // 8)
    rows = [m for m in _metrics(run_dir) if "loss" in m]
    assert [m["epoch"] for m in rows] == pytest.approx([m["step"] * 8 / blocks for m in rows])
    assert [m["step"] for m in rows] == list(range(1, second["steps"] + 1))
    counts = np.bincount(trained(), minlength=blocks)
    assert counts.sum() == second["steps"] * 8 and counts.min() == 2  # the second pass trained each block again


def test_a_data_mixture_trains_by_weight_and_evaluates_each_source(ray_session, make_config, tmp_path, capsys):
    """data.mix: chat fine-tuning on the bundled examples with a small text corpus kept in, 1:3,
    and the bundled wikitext watched at weight 0. The blocks trained on follow the weights
    exactly, each source is evaluated on its own eval data (also before the first step), and the
    sinks, the summary and the console name each source, with each trained source's training loss
    (from the fused loss's rows) beside the evaluations. With chat in it, data.attention_span=auto
    keeps every document and example to itself: the chat blocks' positions come from their
    cache, the text's from its EOS tokens."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from raytrain_cpu.launch.driver import run
    from raytrain_cpu.model.tokenizer import BUNDLED_WIKITEXT
    from raytrain_cpu.obs.report import key_figures, load_run, plot_loss

    lines = (BUNDLED_WIKITEXT / "valid.txt").read_text().splitlines(keepends=True)
    (tmp_path / "notes.txt").write_text("".join(lines[:300]))
    (tmp_path / "notes_eval.txt").write_text("".join(lines[300:400]))
    notes = f"{{path: {tmp_path / 'notes.txt'}, eval_path: {tmp_path / 'notes_eval.txt'}, format: text, weight: 3}}"
    watched = "{source: bundled, format: text, name: wiki, weight: 0}"  # evaluated, not trained on
    mix = f"data.mix=[{{source: bundled, name: chat, weight: 1}}, {notes}, {watched}]"
    sft = ["data.format=chat", "data.seq_len=128"]  # as tests/test_finetune.py: the prompts fit
    steps = ["train.max_steps=6", "train.eval_batches=2", "train.eval_on_start=true", "train.record_block_ids=true"]
    sample = ["train.sample_prompt=What is the article Du Fu about?", "train.sample_tokens=8"]
    cfg = make_config(*sft, mix, *steps, *sample)
    summary = run(cfg)

    out = capsys.readouterr().out
    assert "[data] a mixture of 3 sources: chat 25.0%" in out and "notes 75.0%" in out and "wiki evaluated only" in out
    assert "epochs of each source: chat 0." in out and "wiki 0" not in out
    assert "eval loss" in out and "(by source: chat " in out
    assert re.search(r"step 6/6 \(100%\) \| loss [0-9.]+ \(chat [0-9.]+, notes [0-9.]+\) \|", out)
    assert [(s["name"], s["data_format"], s["share"]) for s in summary["data_mix"]] == [
        ("chat", "chat", 0.25),
        ("notes", "text", 0.75),
        ("wiki", "text", 0.0),
    ]
    assert summary["data_format"] == "mixed"
    wiki = summary["data_mix"][2]
    assert wiki["blocks"] == 0 and wiki["eval_blocks"] > 0  # weight 0: only its evaluation text was packed
    run_dir = Path(summary["run_dir"])
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["attention_span"] == "document"
    trained = [int(b) for r in (0, 1) for b in (run_dir / "block_ids" / f"rank{r}.txt").read_text().split()]
    assert len(trained) == 6 * 8 and len(set(trained)) == len(trained)
    chat_blocks, notes_blocks = (s["blocks"] for s in summary["data_mix"][:2])
    assert sum(b >= chat_blocks for b in trained) == 36  # 3 of every 4 blocks: the notes'
    assert max(trained) < chat_blocks + notes_blocks  # none of wiki's
    trains = [m for m in _metrics(run_dir) if "loss" in m and "event" not in m]
    assert {"loss/chat", "loss/notes"} <= set(trains[-1]) and "loss/wiki" not in trains[-1]  # wiki: not trained on
    for row in trains:  # the step's loss over all its targets, each source's over its own in that step
        by_source = [row["loss/chat"], row["loss/notes"]]
        assert min(by_source) - 1e-3 <= row["loss"] <= max(by_source) + 1e-3, row
    assert summary["final_loss/notes"] == trains[-1]["loss/notes"]
    evals = [m for m in _metrics(run_dir) if "eval_loss" in m]
    assert [m["step"] for m in evals] == [0, 6]  # train.eval_on_start: the starting model's, then the end's
    assert {"eval_loss/chat", "eval_loss/notes", "eval_loss/wiki", "eval_perplexity/notes"} <= set(evals[-1])
    for key in ("eval_loss", "eval_loss/chat", "eval_loss/notes"):
        assert evals[1][key] < evals[0][key], key  # each source improved on its baseline
    losses = [evals[-1][f"eval_loss/{name}"] for name in ("chat", "notes", "wiki")]
    assert min(losses) <= evals[-1]["eval_loss"] <= max(losses)  # over all the sources' targets together
    assert summary["eval_loss/notes"] == evals[-1]["eval_loss/notes"]
    figures = key_figures(load_run(run_dir))
    assert (
        figures["eval loss by source (step 6)"].startswith("chat ")
        and ", notes " in figures["eval loss by source (step 6)"]
    )
    lines = [line.get_label() for line in plot_loss(load_run(run_dir)).axes[0].get_lines()]
    assert {"eval loss", "eval loss: chat", "eval loss: notes", "train loss: chat", "train loss: notes"} <= set(lines)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"eval/loss", "eval/chat/loss", "eval/notes/loss", "eval/notes/perplexity", "train/notes/loss"} <= tags

    # train.sample_prompt: completed at each evaluation by both ranks together, shown and kept
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    prompt = "What is the article Du Fu about?"
    assert [(s["step"], s["prompt"]) for s in samples] == [(0, prompt), (6, prompt)]
    assert all(isinstance(s["completion"], str) for s in samples)
    assert f"[sample] step 6: {prompt!r} -> {samples[1]['completion']!r}" in out
    assert any(tag.startswith("sample") for tag in events.Tags()["tensors"])

    # `evaluate` measures each source as the run's last evaluation did (its blocks: 2 workers x 2 x 4)
    from raytrain_cpu.launch.evaluate import main as evaluate_main

    capsys.readouterr()
    assert evaluate_main([str(run_dir), "--max-blocks=16"]) == 0
    again = json.loads(capsys.readouterr().out)
    for key in ("eval_loss/chat", "eval_loss/notes", "eval_loss/wiki"):
        assert again[key] == pytest.approx(evals[-1][key], abs=2e-2), key


def test_compiled_layers_train_as_eager_does(straight, tmp_path, shared_cache):
    """model.compile: each decoder layer compiled, gathered whole by ZeRO-3; the losses follow the
    eager straight run's (conftest.py), checkpoints included. One worker accumulating twice (the
    straight run's global batch): each worker compiles the layers itself, the costliest part of
    this test on a small host, and the compiled code is the same at any worker count."""
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.launch.driver import run

    extra = ["model.compile=true", f"model.compile_cache_dir={tmp_path / 'ic'}"]
    extra += ["scaling.num_workers=1", "train.grad_accum_steps=2"]
    summary = run(load_config(None, straight_overrides("compiled", tmp_path, shared_cache, *extra)))
    losses, eager = run_losses(summary["run_dir"]), straight["losses"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[1] == pytest.approx(eager[1], abs=1e-3)  # same weights, same batch
    assert max(abs(losses[s] - eager[s]) for s in range(1, 21)) < BF16_LOSS_TOL  # bf16 kernels fused differently
    assert any((tmp_path / "ic").rglob("*.py")), "inductor wrote no compiled code"


def _sharded_load_rank(rank: int, port: int, root: str, overrides: list[str]) -> None:
    """One of 2 spawned ranks on a real gloo group (no Ray: the loader only needs the group, which
    init_deepspeed reuses as it reuses Ray Train's): the tiny model loaded as the workers load it,
    checked against its file, its resident sizes written for the test."""
    import deepspeed
    import torch
    from safetensors.torch import load_file

    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.model.loading import load_sharded
    from raytrain_cpu.trainer.engine import deepspeed_config, init_deepspeed, init_local_group

    world = 2
    init_local_group(rank, world, port)
    init_deepspeed()
    cfg = load_config(None, overrides)
    model_dir = Path(root) / "model"
    model, hf_ds = load_sharded(str(model_dir), deepspeed_config(cfg, world), torch.bfloat16)
    params = dict(model.named_parameters())
    total = sum(p.ds_numel for p in params.values())
    resident = sum(p.ds_tensor.numel() for p in params.values())
    assert all(p.numel() == 0 for p in params.values()), "a parameter is materialised whole on this rank"
    assert resident <= total / world + 64 * len(params), (resident, total)
    assert resident >= total / world
    reference = load_file(str(model_dir / "model.safetensors"))
    with deepspeed.zero.GatheredParameters(list(params.values())):
        for name, p in params.items():
            assert torch.equal(p.data, reference[name].to(p.dtype)), name
    # Buffers (RoPE frequencies) as a plainly built model has them: the loader skips only the
    # random init of weights it then reads.
    from transformers import AutoConfig, LlamaForCausalLM

    plain = LlamaForCausalLM(AutoConfig.from_pretrained(str(model_dir)))
    plain_buffers = dict(plain.named_buffers())
    for name, b in model.named_buffers():
        assert torch.allclose(b.float(), plain_buffers[name].float()), name
    Path(root, f"rank{rank}.json").write_text(json.dumps({"resident": resident, "total": total}))
    del hf_ds


def test_sharded_loading_is_exact_and_partitioned(tmp_path, shared_cache):
    """ZeRO-3 sharded loading on 2 ranks: every parameter partitioned (none whole on a rank), each
    rank holding its share, the gathered weights equal to the file's, the buffers as built."""
    spawn_two_ranks_on_tiny_model(_sharded_load_rank, tmp_path, fast_overrides(tmp_path / "runs", shared_cache))
    for r in (0, 1):
        m = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert m["total"] / 2 <= m["resident"] <= m["total"] / 2 + 64 * 20
