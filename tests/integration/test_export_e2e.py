"""`python -m raytrain_cpu.export`: a real 2-rank ZeRO-3 checkpoint -> an ordinary Hugging Face model.

The checkpoint comes from two spawned processes (gloo, DeepSpeed ZeRO-3, bf16, no Ray) that
train the tiny Llama three steps, record their logits on a batch and save through
checkpoint.write_checkpoint, exactly as training does. (Export at the end of a Ray run,
`run.export_on_finish`, is checked in tests/test_fault_tolerance.py.)
This module's in-process tests: tests/unit/test_export.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from raytrain_cpu.config.schema import load_config

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

    from raytrain_cpu.trainer.engine import init_local_group

    torch.set_num_threads(1)
    init_local_group(rank, WORLD, port)
    import deepspeed

    from raytrain_cpu.checkpoint.save import write_checkpoint
    from raytrain_cpu.model.export import probe_logits
    from raytrain_cpu.model.loading import load_sharded
    from raytrain_cpu.model.tokenizer import resolve_tokenizer_path
    from raytrain_cpu.trainer.engine import deepspeed_config, init_deepspeed, param_groups

    init_deepspeed()
    cfg = load_config(None, CONFIG)
    ds_config = deepspeed_config(cfg, WORLD)
    model_dir = str(Path(root) / "base_model")
    model, hf_ds_config = load_sharded(model_dir, ds_config, torch.bfloat16)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, 0.1), config=ds_config, dist_init_required=False
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
    from helpers import spawn_ranks

    from raytrain_cpu.model.loading import write_tiny_model
    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path
    from raytrain_cpu.trainer.engine import free_port

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

    from raytrain_cpu.model.export import main

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
    # How this process loaded the tokenizer is not the exported tokenizer's to say (transformers 5 wrote it).
    assert not {"is_local", "local_files_only"} & json.loads((out / "tokenizer_config.json").read_text()).keys()
    assert main([str(zero3["checkpoint"]), str(out)]) == 2  # never writes over an export unasked


def test_fp32_and_sharded_export(zero3, tmp_path):
    """--dtype fp32 keeps the master weights; their bf16 rounding is the bf16 export, file split or not."""
    import torch
    from safetensors.torch import load_file

    from raytrain_cpu.model.export import export_checkpoint

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
    from raytrain_cpu.model.export import main

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
    from raytrain_cpu.model.export import main

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
    from raytrain_cpu.model.export import main

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

    from raytrain_cpu.model import export

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(export, "_write_safetensors", full)
    assert export.main([str(zero3["checkpoint"]), str(tmp_path / "out")]) == 2
    assert "out: no space left on its filesystem for the export" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_export_of_a_mistyped_checkpoint_names_the_runs_checkpoints(zero3, tmp_path, capsys):
    from raytrain_cpu.model.export import main

    typo = zero3["checkpoint"].parent / "checkpoint_000999"
    assert main([str(typo), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and zero3["checkpoint"].name in err


# ----------------------------------------------------------------------------- refusals (user testing)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None: a directory): what a refusal must leave as it was."""
    return {str(p): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def _one_error(capsys) -> str:
    """The command's stderr, checked to be one `error: ...` line, without its prefix."""
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.removeprefix("error: ").rstrip("\n")


@pytest.fixture
def no_export_work(monkeypatch):
    """Fails the test if the export gets as far as reading the shards: its checks must come first."""
    from raytrain_cpu.model import export

    def reached(ckpt_dir):
        raise AssertionError(f"the export started on {ckpt_dir} before refusing")

    monkeypatch.setattr(export, "_consolidated", reached)


def _run_with_own_model(zero3, tmp_path: Path) -> Path:
    """A copy of the checkpoint in runs/a, its base model beside it, and a manifest naming a model
    and a tokenizer of its own under tmp_path (as a run that started from a local model records them)."""
    from raytrain_cpu.model.tokenizer import BUNDLED_TOKENIZER

    ckpt = tmp_path / "runs" / "a" / zero3["checkpoint"].name
    shutil.copytree(zero3["checkpoint"], ckpt)
    base = zero3["checkpoint"].parents[1] / "base_model"
    shutil.copytree(base, ckpt.parent / "base_model")
    shutil.copytree(base, tmp_path / "models" / "start")
    shutil.copytree(BUNDLED_TOKENIZER, tmp_path / "tok")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    own = {"model_dir": str(tmp_path / "models" / "start"), "tokenizer": str(tmp_path / "tok")}
    (ckpt / "manifest.json").write_text(json.dumps(manifest | own))
    return ckpt


def test_overwrite_never_replaces_the_runs_model_tokenizer_or_the_cwd(
    zero3, tmp_path, capsys, monkeypatch, no_export_work
):
    """The model and tokenizer the manifest names (and a copied run's base_model beside its
    checkpoints) are read by a resume, DPO's reference and a LoRA adapter's base: an out_dir that
    is, holds or lies in one is refused, --overwrite or not, before any work; so is the cwd."""
    from raytrain_cpu.model.export import main

    ckpt = _run_with_own_model(zero3, tmp_path)
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path / "runs")
    before = _tree(tmp_path)
    models = tmp_path / "models"
    cases = {
        "a/base_model": "is the run's base model",  # the reported data loss: export runcopy runcopy/base_model
        str(models / "start"): "is the model the run started from",
        str(models / "start" / "sub"): "is inside the model the run started from",
        str(models): "holds the model the run started from",
        str(tmp_path / "tok"): "is the run's tokenizer",
    }
    for flags in ([], ["--overwrite"]):
        for out, where in cases.items():
            assert main([str(ckpt), out, *flags]) == 2
            err = _one_error(capsys)
            assert err.startswith(f"{out} {where} "), err
            assert err.endswith(f"choose an out_dir outside it (e.g. {ckpt.parent / 'export'}).")
    assert main([str(ckpt), "a/base_model", "--overwrite"]) == 2
    assert _one_error(capsys) == (
        f"a/base_model is the run's base model {ckpt.parent / 'base_model'}, which a resume, DPO's reference and a "
        f"LoRA adapter's base read; the export replaces out_dir whole, so choose an out_dir outside it "
        f"(e.g. {ckpt.parent / 'export'})."
    )
    # The current directory: "." once failed on its empty name, and resolved it would be emptied.
    monkeypatch.chdir(work)
    for out, where in ((".", "is"), ("..", "holds")):
        assert main([str(ckpt), out, "--overwrite"]) == 2
        assert _one_error(capsys) == (
            f"{out} {where} the current directory {work}, which the export would replace whole; choose a new "
            "directory for it (e.g. ./export)."
        )
    assert _tree(tmp_path) == before


def test_out_dir_model_dir_and_tokenizer_are_checked_before_the_work(zero3, tmp_path, capsys, no_export_work):
    """A file as out_dir, a file above it, an unwritable place, a --model-dir or --tokenizer that
    is not there: one line naming it, exit 2, before the shards are read and with nothing written."""
    from raytrain_cpu.model.export import main

    ckpt = str(zero3["checkpoint"])
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    (tmp_path / "empty").mkdir()
    cases = [
        ([str(afile)], f"{afile} is a file; the export is a directory: choose another out_dir."),
        ([str(afile), "--overwrite"], f"{afile} is a file; the export is a directory: choose another out_dir."),
        (
            [str(afile / "x")],
            f"{afile / 'x'}: {afile} is a file, so nothing can go under it; choose another out_dir.",
        ),
        (
            [str(tmp_path / "out"), "--model-dir", "/nonexistent"],
            "--model-dir: '/nonexistent' does not exist; give a copy of the model directory the run trained (its "
            "config.json is read) or its hub id, e.g. meta-llama/Meta-Llama-3-8B",
        ),
        (
            [str(tmp_path / "out"), "--model-dir", str(tmp_path / "empty")],
            f"--model-dir: '{tmp_path / 'empty'}' has no config.json; give a copy of the model directory the run "
            "trained (its config.json is read) or its hub id, e.g. meta-llama/Meta-Llama-3-8B",
        ),
        (
            [str(tmp_path / "out"), "--tokenizer", "/nonexistent"],
            "--tokenizer: '/nonexistent' does not exist; give a directory holding the run's tokenizer (a model "
            "directory will do) or its hub id",
        ),
    ]
    for args, message in cases:
        assert main([ckpt, *args]) == 2
        assert _one_error(capsys) == message
    # /proc takes no new directory (root: ENOENT, anyone else: EACCES); the reason is the OS's.
    assert main([ckpt, "/proc/x"]) == 2
    err = _one_error(capsys)
    assert err.startswith("/proc/x: can't write in /proc (") and err.endswith("choose an out_dir in a writable place.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "empty"] and afile.read_text() == "keep me"


def _damaged_copy(zero3, tmp_path: Path) -> Path:
    """The checkpoint with a rank's optimizer shard overwritten at its start: its size, which is
    all the manifest check reads without --checksums, stays right."""
    ckpt = tmp_path / "damaged" / zero3["checkpoint"].name
    shutil.copytree(zero3["checkpoint"], ckpt)
    shard = ckpt / "ds" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[:64] = bytes(64)
    shard.write_bytes(bytes(data))
    return ckpt


def test_a_damaged_shard_is_named_by_export_and_evaluate(zero3, tmp_path, capsys):
    from raytrain_cpu.launch.evaluate import main as evaluate_main
    from raytrain_cpu.model.export import main

    ckpt = _damaged_copy(zero3, tmp_path)
    message = (
        f"checkpoint {ckpt} is damaged: ds/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt does not match its "
        "sha256: DeepSpeed can't read it; use an earlier checkpoint"
    )
    assert main([str(ckpt), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: {message}"  # after DeepSpeed's progress lines
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["damaged"]
    assert evaluate_main([str(ckpt)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: {message}"
    assert main([str(ckpt), str(tmp_path / "out"), "--checksums"]) == 2  # found before DeepSpeed reads anything
    assert "optim_states.pt does not match its sha256" in _one_error(capsys)


def test_merge_on_a_run_without_lora_says_it_is_ignored(zero3, tmp_path, capsys):
    from raytrain_cpu.model.export import main

    assert main([str(zero3["checkpoint"]), str(tmp_path / "out"), "--merge"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "--merge" in line]
    assert notes == [
        f"note: --merge ignored: {zero3['checkpoint']} is not a LoRA run, so the export is already the whole model"
    ]
    assert (tmp_path / "out" / "model.safetensors").is_file() and not (tmp_path / "out" / "merged").exists()


def test_generate_and_evaluate_name_what_a_path_is_not(zero3, tmp_path, capsys, no_export_work):
    """An empty directory, a storage path of runs, a directory with only a readme, a checkpoint
    without its manifest: one line each, not a tokenizer loader's guess about sentencepiece."""
    from raytrain_cpu.launch.evaluate import main as evaluate_main
    from raytrain_cpu.model.generate import main as generate_main

    (tmp_path / "empty").mkdir()
    (tmp_path / "readme").mkdir()
    (tmp_path / "readme" / "README.md").write_text("hi")
    shutil.copytree(zero3["checkpoint"], tmp_path / "runs" / "base" / zero3["checkpoint"].name)
    no_manifest = tmp_path / "nomanifest"
    shutil.copytree(zero3["checkpoint"], no_manifest)
    (no_manifest / "manifest.json").unlink()
    not_a_model = (
        "{} is not a model directory (no config.json), a checkpoint (no manifest.json) or a run directory (no "
        "checkpoints): pass one of those, e.g. runs/<name> or an export"
    )
    runs = tmp_path / "runs"
    cases = [
        (generate_main, tmp_path / "empty", not_a_model.format(tmp_path / "empty")),
        (evaluate_main, tmp_path / "readme", not_a_model.format(tmp_path / "readme")),
        (
            generate_main,
            runs,
            f"{runs} is a storage path of runs (base), not one model: pass a run directory (e.g. {runs / 'base'}) "
            "or one of its checkpoints",
        ),
        (
            generate_main,
            runs / "base",
            f"{runs / 'base'} holds checkpoints but no checkpoint_manager_snapshot.json to say which is its latest: "
            f"pass one, e.g. {runs / 'base' / zero3['checkpoint'].name}",
        ),
        (  # export's own words for it
            generate_main,
            no_manifest,
            f"checkpoint {no_manifest} has no manifest.json: it is incomplete or not a raytrain_cpu checkpoint",
        ),
    ]
    for cli, path, message in cases:
        args = [str(path), "--prompt", "hi"] if cli is generate_main else [str(path)]
        assert cli(args) == 2
        assert _one_error(capsys) == message


def test_generate_refuses_bad_options_before_the_work(zero3, tmp_path, capsys, no_export_work):
    from raytrain_cpu.model.generate import main

    ckpt = str(zero3["checkpoint"])
    cases = [
        (["--prompt", ""], "--prompt is empty; give the text to complete (for chat and instruction runs: the message)"),
        (
            ["--prompt", "hi", "--temperature", "nan"],
            "--temperature must be a finite number >= 0 (0 = greedy); got nan",
        ),
        (
            ["--prompt", "hi", "--temperature", "inf"],
            "--temperature must be a finite number >= 0 (0 = greedy); got inf",
        ),
        (
            ["--chat", str(tmp_path)],
            f"--chat: '{tmp_path}' is a directory; give a JSON file with a list of {{role, content}}",
        ),
    ]
    for args, message in cases:
        assert main([ckpt, *args]) == 2
        assert _one_error(capsys) == message


def test_evaluate_names_a_missing_eval_path_before_the_export(zero3, tmp_path, capsys, no_export_work):
    """data.eval_path alone stands in for the training text too, but the error names the key the
    user set, and comes before the checkpoint is exported."""
    from raytrain_cpu.launch.evaluate import main

    missing = tmp_path / "nonexistent.txt"
    assert main([str(zero3["checkpoint"]), f"data.eval_path={missing}"]) == 2
    assert _one_error(capsys) == (
        f"data.eval_path: '{missing}' does not exist. Point it at a text file, a directory or a glob."
    )
