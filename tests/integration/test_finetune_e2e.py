"""Fine-tuning end to end: chat SFT with LoRA under ZeRO-3 (2 workers), full-parameter SFT under
ZeRO-2 (2 workers), export of the adapter and the merged model, generate, LoRA with whole-layer
gathers, and LoRA's bad input. (ZeRO-3 at world size 1, the edge case of its checkpoint files,
trains in tests/test_train_e2e.py's best-checkpoint test.)
This module's in-process tests: tests/unit/test_finetune.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import SFT, as_stopped_at

LORA = ["lora.rank=8", "lora.alpha=16", "train.lr=2e-2"]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "event" not in r}


@pytest.mark.slow
def test_lora_sft_two_workers_resume_export_generate(ray_session, make_config, tmp_path):
    import torch
    from safetensors.torch import load_file

    from raytrain_cpu.launch.driver import run
    from raytrain_cpu.model.export import _consolidated, export_checkpoint, load_exported
    from raytrain_cpu.model.generate import generate

    # Both runs checkpoint and evaluate at step 3, so they run the same operations in the same order,
    # and a constant LR makes the 3-step leg's schedule the 6-step run's (cosine depends on max_steps).
    common = [*SFT, *LORA, "scaling.num_workers=2", "train.checkpoint_every=3", "train.eval_every=3"]
    common += ["train.schedule=constant"]
    # ---- straight: 6 steps, exported at the end (adapter and merged, both checked against the trained logits)
    straight = run(make_config(*common, "train.max_steps=6", "run.name=straight", "run.export_on_finish=true"))
    run_dir = Path(straight["run_dir"])
    losses = _losses(run_dir)
    assert losses[6] < losses[1] - 0.1, losses  # the response tokens' loss falls
    assert straight["lora"]["rank"] == 8
    assert 0 < straight["trainable_params"] < straight["total_params"] / 10
    full_optimizer = 12 * straight["total_params"] / 2  # fp32 master + 2 moments of a full run, per rank
    assert max(straight["optimizer_state_bytes"]) < full_optimizer / 5
    export = straight["export"]
    assert export["export_max_abs_logit_diff"] == 0.0  # the adapter on its base computes as training did
    assert export["merged_max_abs_logit_diff"] < 0.05  # W + BA rounded once to bf16
    out = Path(export["export_dir"])
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert (out / "merged" / "model.safetensors").is_file()
    adapter_on_base = load_exported(out)
    assert type(adapter_on_base).__name__.startswith("PeftModel")

    # ---- a hub model's adapter names its base by hub id (portable), and loads on the run's own copy
    hub_run = tmp_path / "hub_run" / Path(straight["checkpoint_path"]).name
    shutil.copytree(straight["checkpoint_path"], hub_run)
    manifest = json.loads((hub_run / "manifest.json").read_text())
    manifest["settings"]["model"]["name_or_path"] = "raytrain-test/tiny"  # as a hub model's run records it
    (hub_run / "manifest.json").write_text(json.dumps(manifest))
    export_checkpoint(hub_run, tmp_path / "hub_adapter")
    config = json.loads((tmp_path / "hub_adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "raytrain-test/tiny"
    ids = torch.randint(0, 2048, (1, 16))
    with torch.no_grad():
        same = load_exported(tmp_path / "hub_adapter")(ids).logits.equal(adapter_on_base(ids).logits)
    assert same

    # ---- only the adapters changed: every base weight is the bf16 rounding of the initial model's
    state = _consolidated(Path(straight["checkpoint_path"]))
    initial = load_file(str(run_dir / "base_model" / "model.safetensors"))
    base = {k: v for k, v in state.items() if ".lora_" not in k}
    assert len(base) == len(initial)
    for name, t in base.items():
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        expected = initial[plain].bfloat16().float()
        assert t.contiguous().float().equal(expected), name

    # ---- resume: the run as it stood after its step-3 checkpoint continues to 6 exactly (losses
    # bit-identical to the straight run's); a copy of it rather than a 3-step run of its own
    resumed_dir = as_stopped_at(run_dir, 3, run_dir.parent / "resumed")
    resumed = run(make_config(*common, "train.max_steps=6", "run.name=resumed"))
    assert resumed["resumed_from_step"] == 3 and resumed["optimizer_step_at_resume"] == 3
    again = _losses(resumed_dir)
    assert [again[s] for s in range(4, 7)] == [losses[s] for s in range(4, 7)]

    # ---- generate: from the export and from the checkpoint itself, greedy, on one process
    text = generate(out, prompt="What is the article Robert Boulter about?", max_new_tokens=12)
    assert isinstance(text, str) and text.strip()
    from_checkpoint = generate(straight["checkpoint_path"], prompt="Hello", max_new_tokens=4)
    assert from_checkpoint is not None
    # A run directory stands for its latest checkpoint, as a resume takes it.
    assert export_checkpoint(run_dir, tmp_path / "from_run")["checkpoint"] == straight["checkpoint_path"]
    assert generate(run_dir, prompt="Hello", max_new_tokens=4) == from_checkpoint


@pytest.mark.slow
def test_full_parameter_sft_under_zero2_resumes_and_exports(ray_session, make_config):
    """Chat SFT of every parameter under ZeRO-2 on 2 workers (what `plan` advises where the whole
    model fits every rank): it resumes and exports (ZeRO-3's resume and export: the LoRA test above)."""
    from raytrain_cpu.launch.driver import run

    common = [*SFT, "train.lr=1e-2", "scaling.num_workers=2", "deepspeed.zero_stage=2", "run.name=sft2"]
    common += ["train.checkpoint_every=3"]
    assert run(make_config(*common, "train.max_steps=3"))["steps"] == 3
    s = run(make_config(*common, "train.max_steps=5", "run.export_on_finish=true"))
    assert s["world_size"] == 2 and s["steps"] == 5 and s["global_batch"] == 4 * 2
    assert s["trainable_params"] == s["total_params"] and s["lora"] is None
    assert s["resumed_from_step"] == 3 and s["optimizer_step_at_resume"] == 3
    assert s["export"]["export_max_abs_logit_diff"] == 0.0  # the export computes as training did
    # Each rank's optimizer partition in the final checkpoint, and the model states once, whole.
    ds_files = {p.name for p in (Path(s["checkpoint_path"]) / "ds").iterdir()}
    assert {f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)} <= ds_files
    assert {f for f in ds_files if f.endswith("model_states.pt")} == {"mp_rank_00_model_states.pt"}
    assert not any("rank_2_" in f for f in ds_files)
    losses = _losses(Path(s["run_dir"]))
    assert losses[5] < losses[1] - 0.5, losses
    # Eval over the response tokens only: fewer targets than the blocks' tokens.
    assert 0 < s["eval_tokens"] < 2 * 2 * 4 * 127  # eval_batches x micro blocks a rank, 127 targets each
    assert s["padding_frac"] >= 0.0 and s["truncated_examples"] >= 0


def _uneven_chat(path: Path) -> Path:
    """Chat rows whose answers are a word or a paragraph: packed blocks of one long answer (~120
    targets) and blocks of many short ones (a few targets each)."""
    from raytrain_cpu.model.tokenizer import BUNDLED_WIKITEXT

    paragraphs = [p for p in (BUNDLED_WIKITEXT / "test.txt").read_text().splitlines() if len(p) > 600]
    rows = []
    for i in range(96):
        answer = paragraphs[i] if i % 8 == 0 else "Yes."
        rows.append(
            {"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": answer}]}
        )
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.slow
def test_a_step_is_the_mean_over_its_targets_however_the_batch_is_split(ray_session, make_config, tmp_path):
    """Each micro batch's loss is a mean over its own targets; DeepSpeed averaged those, so a micro
    batch of short answers weighed as much as one long answer, and the same global batch split
    another way (micro batches, accumulation, workers) trained another objective: 3.1x the
    gradient norm in the report. train.step_counts weighs each by its share of the step's targets."""
    from raytrain_cpu.launch.driver import run

    data = _uneven_chat(tmp_path / "uneven.jsonl")
    common = [*SFT, "data.source=jsonl", f"data.path={data}", "model.dtype=fp32", "train.max_steps=1"]
    common += ["train.warmup_steps=0", "train.log_every=1"]
    steps = {}
    for name, split in {
        "whole": ["scaling.num_workers=1", "train.micro_batch_size=4", "train.grad_accum_steps=1"],
        "split": ["scaling.num_workers=2", "train.micro_batch_size=1", "train.grad_accum_steps=2"],
    }.items():
        s = run(make_config(*common, *split, f"run.name={name}", "train.record_block_ids=true"))
        rows = [json.loads(line) for line in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        steps[name] = next(r for r in rows if r.get("step") == 1 and "loss" in r and "event" not in r)
        steps[name]["blocks"] = sorted(
            int(b) for f in (Path(s["run_dir"]) / "block_ids").glob("rank*.txt") for b in f.read_text().split()
        )
    whole, split = steps["whole"], steps["split"]
    print(f"\n[step weights] loss {whole['loss']:.6f} / {split['loss']:.6f}, grad_norm {whole['grad_norm']:.5f} / "
          f"{split['grad_norm']:.5f} (1 worker x micro 4 / 2 workers x micro 1 x accum 2)")  # fmt: skip
    assert whole["blocks"] == split["blocks"]  # the same 4 blocks
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)


def _lora_gathers_rank(rank: int, port: int, root: str) -> None:
    """One of 2 ranks, no Ray: LoRA under ZeRO-3 through the workers' own load_model and
    build_engine, 3 steps with per-module gathers, then 3 from the same start with whole layers."""
    import torch

    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.trainer.engine import build_engine, deepspeed_config, init_local_group
    from raytrain_cpu.trainer.loading import load_model
    from raytrain_cpu.trainer.state import Worker

    init_local_group(rank, 2, port)
    losses = {}
    for whole in (False, True):
        cfg = load_config(
            None,
            [*LORA, "model.dtype=bf16", "model.attention=causal_blocks", "train.micro_batch_size=2", "data.seq_len=32"]
            + [f"deepspeed.gather_whole_layers={whole}"],
        )
        batch = cfg.train.derive_global_batch(2)
        w = Worker(cfg, {"model_dir": f"{root}/base_model"}, rank, 2, Path(root), batch, lambda msg: None)
        ds_config = deepspeed_config(cfg, 2)
        torch.manual_seed(cfg.train.seed + rank)  # as setup_worker does: the same adapters' init
        loaded = load_model(w, ds_config)
        engine, _ = build_engine(w, loaded.model, ds_config)
        vocab = loaded.model.config.vocab_size
        x = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(rank))
        losses[str(whole)] = []
        for _ in range(3):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses[str(whole)].append(float(loss))
        del engine, loaded
    (Path(root) / f"losses{rank}.json").write_text(json.dumps(losses))


@pytest.mark.slow
def test_lora_trains_with_whole_layer_gathers(tmp_path):
    """Whole-layer gathers (and so per-layer compile) under LoRA: DeepSpeed reduces a leaf layer's
    gradients from a hook that fired too early behind frozen embeddings; build_engine makes the
    embeddings' output require grad, and the adapters train as with per-module gathers."""
    from helpers import spawn_ranks

    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.model.loading import write_tiny_model
    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path
    from raytrain_cpu.trainer.engine import free_port

    tok = load_tokenizer(resolve_tokenizer_path("bundled", "tiny"))
    write_tiny_model(load_config(None, ["model.dtype=bf16"]), tok, tmp_path / "base_model")
    spawn_ranks(_lora_gathers_rank, 2, free_port(), str(tmp_path))
    for r in range(2):
        losses = json.loads((tmp_path / f"losses{r}.json").read_text())
        per_module, whole = losses["False"], losses["True"]
        assert per_module[0] == whole[0]  # the same model and batch before any update
        assert per_module[2] < per_module[0] and whole[2] < whole[0], losses  # the adapters learn
        assert max(abs(a - b) for a, b in zip(per_module, whole, strict=True)) < 1e-2, losses  # bf16 order
