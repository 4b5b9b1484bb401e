"""`python -m raytrain_cpu.export`: a real 2-rank ZeRO-3 checkpoint -> an ordinary Hugging Face model.

The checkpoint comes from two spawned processes (gloo, DeepSpeed ZeRO-3, bf16, no Ray) that
train the tiny Llama three steps, record their logits on a batch and save through
checkpoint.write_checkpoint, exactly as training does. (Export at the end of a Ray run,
`run.export_on_finish`, is checked in tests/test_fault_tolerance.py.)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from raytrain_cpu.config import load_config

CONFIG = [
    "model.dtype=bf16",
    "data.seq_len=32",
    "train.micro_batch_size=2",
    "train.warmup_steps=1",
    "train.max_steps=3",
]
WORLD = 2
STEP = 3


def _train_and_save(rank: int, root: str, port: int) -> None:
    """One rank: a few ZeRO-3 steps, the logits on its batch, then the training checkpoint save."""
    import torch
    import torch.distributed as dist

    from raytrain_cpu.train import init_local_group

    torch.set_num_threads(1)
    init_local_group(rank, WORLD, port)
    import deepspeed

    from raytrain_cpu.checkpoint import write_checkpoint
    from raytrain_cpu.export import probe_logits
    from raytrain_cpu.model import load_sharded
    from raytrain_cpu.tokenizer import resolve_tokenizer_path
    from raytrain_cpu.train import _param_groups, deepspeed_config, init_deepspeed

    init_deepspeed()
    cfg = load_config(None, CONFIG)
    ds_config = deepspeed_config(cfg, WORLD)
    model_dir = str(Path(root) / "base_model")
    model, hf_ds_config = load_sharded(model_dir, ds_config, torch.bfloat16)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=_param_groups(model, 0.1), config=ds_config, dist_init_required=False
    )
    assert "torch._inductor.compile_fx" not in sys.modules, "the engine's set-up loaded the compiler (Muon)"
    x = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
    for _ in range(STEP):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    probe = probe_logits(engine, x)
    manifest = {
        "step": STEP,
        "world_size": WORLD,
        "config_hash": "test",
        "blocks_consumed": 0,
        "dtype": "bf16",
        "model_dir": model_dir,
        "tokenizer": resolve_tokenizer_path("bundled", model_dir),
    }
    write_checkpoint(engine, Path(root) / "run", STEP, manifest, rank, WORLD)
    if rank == 0:
        torch.save(probe, Path(root) / "probe.pt")
    dist.barrier()
    dist.destroy_process_group()
    del hf_ds_config


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """{checkpoint, probe}: a 2-shard ZeRO-3 checkpoint and the trained model's logits."""
    import torch
    from conftest import spawn_ranks

    from raytrain_cpu.model import write_tiny_model
    from raytrain_cpu.tokenizer import load_tokenizer, resolve_tokenizer_path
    from raytrain_cpu.train import free_port

    root = tmp_path_factory.mktemp("zero3")
    cfg = load_config(None, CONFIG)
    write_tiny_model(cfg, load_tokenizer(resolve_tokenizer_path("bundled", "tiny")), root / "base_model")
    spawn_ranks(_train_and_save, WORLD, str(root), free_port())
    return {"checkpoint": root / "run" / f"checkpoint_{STEP:06d}", "probe": torch.load(root / "probe.pt")}


def _logits(model_dir: Path, input_ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float(), model


def test_export_gives_the_trained_models_logits(zero3, tmp_path, capsys):
    from transformers import AutoTokenizer

    from raytrain_cpu.export import main

    out = tmp_path / "hf"
    capsys.readouterr()
    assert main([str(zero3["checkpoint"]), str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["export_dir"] == str(out)  # stdout is the result only: it pipes
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    logits, model = _logits(out, zero3["probe"]["input_ids"])
    assert str(model.dtype) == "torch.bfloat16"  # the training dtype, recorded in config.json
    # bf16 export = the bf16 rounding of the fp32 master weights = what the ZeRO-3 model computed with.
    assert (logits - zero3["probe"]["logits"]).abs().max().item() == 0.0
    assert AutoTokenizer.from_pretrained(str(out)).decode([0]) is not None
    assert main([str(zero3["checkpoint"]), str(out)]) == 2  # never writes over an export unasked


def test_fp32_and_sharded_export(zero3, tmp_path):
    """--dtype fp32 keeps the master weights; their bf16 rounding is the bf16 export, file split or not."""
    import torch
    from safetensors.torch import load_file

    from raytrain_cpu.export import export_checkpoint

    bf16 = export_checkpoint(zero3["checkpoint"], tmp_path / "bf16")
    fp32 = export_checkpoint(zero3["checkpoint"], tmp_path / "fp32", dtype="fp32", max_shard_bytes=300_000)
    assert bf16["files"] == 1 and fp32["files"] > 1
    index = json.loads((tmp_path / "fp32" / "model.safetensors.index.json").read_text())
    fp32_weights = {}
    for name in set(index["weight_map"].values()):
        fp32_weights |= load_file(str(tmp_path / "fp32" / name))
    bf16_weights = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert fp32_weights.keys() == bf16_weights.keys()
    assert all(torch.equal(fp32_weights[k].to(torch.bfloat16), bf16_weights[k]) for k in bf16_weights)
    logits, model = _logits(tmp_path / "fp32", zero3["probe"]["input_ids"])
    assert model.dtype == torch.float32
    gap = (logits - zero3["probe"]["logits"]).abs().max().item()
    print(f"\n[export] fp32 master weights vs the bf16-trained model: max |logit diff| {gap:.3g}")
    assert gap < 0.05  # bf16 compute and weights vs fp32: a bf16-sized difference (measured 0.005)


def test_export_refuses_an_incomplete_checkpoint(zero3, tmp_path, capsys):
    from raytrain_cpu.export import main

    broken = tmp_path / "broken"
    shutil.copytree(zero3["checkpoint"], broken)
    (broken / "ds" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert main([str(broken), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "rank 1" in err and "is missing" in err
    assert not (tmp_path / "out").exists()


def test_a_run_copied_to_another_machine_still_exports(zero3, tmp_path, capsys):
    """The manifest's paths are where the run trained (FSx, another install): a tiny run's own
    base model is found beside the checkpoint and the bundled tokenizer in this install; a model
    that is truly elsewhere is named with the option that replaces it, before anything is written."""
    from raytrain_cpu.export import main

    ckpt = tmp_path / "run" / zero3["checkpoint"].name
    shutil.copytree(zero3["checkpoint"], ckpt)
    shutil.copytree(zero3["checkpoint"].parents[1] / "base_model", tmp_path / "run" / "base_model")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    elsewhere = {
        "model_dir": "/fsx/runs/x/base_model",
        "tokenizer": "/opt/venv/site-packages/raytrain_cpu/assets/tokenizer",
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest | elsewhere))
    assert main([str(ckpt), str(tmp_path / "hf")]) == 0
    logits, _ = _logits(tmp_path / "hf", zero3["probe"]["input_ids"])
    assert (logits - zero3["probe"]["logits"]).abs().max().item() == 0.0

    (ckpt / "manifest.json").write_text(json.dumps(manifest | {"model_dir": "/fsx/models/llama"}))
    assert main([str(ckpt), str(tmp_path / "out")]) == 2
    assert "/fsx/models/llama" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert main([str(ckpt), str(tmp_path / "out"), "--model-dir", str(tmp_path / "run" / "base_model")]) == 0
    (ckpt / "manifest.json").write_text(json.dumps(manifest | {"data": {"chat_template": "/fsx/t.j2"}}))
    assert main([str(ckpt), str(tmp_path / "out2")]) == 2 and "/fsx/t.j2" in capsys.readouterr().err


def test_overwrite_never_replaces_a_checkpoint_or_a_run(zero3, tmp_path, capsys):
    """--overwrite replaces an earlier export whole, so it refuses training state: the checkpoint
    itself, its run directory, a directory inside it, the storage path or another run."""
    from raytrain_cpu.export import main

    ckpt = tmp_path / "runs" / "a" / zero3["checkpoint"].name
    other = tmp_path / "runs" / "b"
    shutil.copytree(zero3["checkpoint"], ckpt)
    shutil.copytree(zero3["checkpoint"], other / ckpt.name)
    before = sorted(tmp_path.rglob("*"))
    for out in (ckpt, ckpt.parent, ckpt / "hf", tmp_path / "runs", other):
        assert main([str(ckpt), str(out), "--overwrite"]) == 2
        assert "choose" in capsys.readouterr().err
    assert sorted(tmp_path.rglob("*")) == before
    assert main([str(ckpt), str(tmp_path / "hf")]) == 0
    assert main([str(ckpt), str(tmp_path / "hf"), "--overwrite"]) == 0  # an earlier export it does replace


def test_a_full_filesystem_is_named_and_leaves_nothing(zero3, tmp_path, capsys, monkeypatch):
    """No space left while the weights are written (safetensors wraps the OSError in its own
    error): one line naming out_dir, exit 2, and no partial export left beside it."""
    from safetensors import SafetensorError

    from raytrain_cpu import export

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(export, "_write_safetensors", full)
    assert export.main([str(zero3["checkpoint"]), str(tmp_path / "out")]) == 2
    assert "out: no space left on its filesystem for the export" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_export_of_a_mistyped_checkpoint_names_the_runs_checkpoints(zero3, tmp_path, capsys):
    from raytrain_cpu.export import main

    typo = zero3["checkpoint"].parent / "checkpoint_000999"
    assert main([str(typo), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and zero3["checkpoint"].name in err


def test_writer_skips_ties_not_reused_ids(tmp_path, monkeypatch):
    """A tied weight (one tensor, two names) is written once; a new tensor that got a freed one's id
    is not a tie. The merged LoRA weights are such temporaries, and an id set dropped some of them
    (CI: a merged export 1.3 off in its logits). CPython reuses ids when its allocator says so; here
    every tensor gets the same id, so the test does not depend on the allocator."""
    import torch
    from safetensors.torch import load_file

    from raytrain_cpu import export

    def temporaries():
        embed = torch.ones(4, 4)
        yield "embed_tokens.weight", embed
        yield "lm_head.weight", embed  # tied
        for i in range(4):
            yield f"layers.{i}.weight", torch.full((4, 4), float(i)) + 0  # freed once written

    monkeypatch.setattr(export, "id", lambda obj: 7, raising=False)
    written = export._write_safetensors(temporaries(), tmp_path, torch.bfloat16, max_shard_bytes=1 << 20)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert written["tensors"] == 5
    assert sorted(state) == ["embed_tokens.weight"] + [f"layers.{i}.weight" for i in range(4)]
    assert all(state[f"layers.{i}.weight"].eq(i).all() for i in range(4))
