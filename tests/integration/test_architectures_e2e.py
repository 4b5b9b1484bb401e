"""Architectures other than Llama (Qwen2, Mistral, Gemma, GPT-2, Phi-3) through Ray: each but
Mistral trains on 2 workers and is exported, its logits checked against the trained model's;
GPT-2 also resumes, Qwen2's model is given as a relative path and Phi-3's as a hub id fetched
earlier. Why these legs and no more, and the in-process tests: tests/unit/test_architectures.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ARCHS, CONTEXT, build_model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {arch: build_model(arch, root / arch) for arch in ARCHS}


RESUMED = ("gpt2",)


TRAINED = ("qwen2", "gemma", "gpt2", "phi3")  # Llama in tests/test_train_e2e.py; Mistral is Llama's layout


RELATIVE = ("qwen2",)  # given as a path relative to the directory the run starts in


HUB = ("phi3",)  # given as a hub id that an earlier run fetched, with the hub offline


def offline_hub_copy(model: Path, hub_cache: Path, monkeypatch) -> str:
    """`model` as the hub id raytrain-test/<name>, in huggingface_hub's cache layout under
    `hub_cache` (as an earlier run's download leaves it), with the hub offline (HF_HUB_OFFLINE)."""
    import shutil

    import huggingface_hub.constants

    repo = hub_cache / f"models--raytrain-test--{model.name}"
    shutil.copytree(model, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return f"raytrain-test/{model.name}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", TRAINED)
def test_train_resume_and_export(arch, model_dirs, ray_session, make_config, monkeypatch):
    """2 workers train 2 steps (RESUMED: then resume to 3), exporting at the end with the logits check."""
    from raytrain_cpu.launch.driver import run
    from raytrain_cpu.launch.validate import validate_before_ray

    model = model_dirs[arch]
    if arch in RELATIVE:  # Ray Train's workers run elsewhere: the driver records it absolute
        monkeypatch.chdir(model.parent)
        model = f"./{arch}"
    if arch in HUB:
        model = offline_hub_copy(model, make_config().run.hub_cache, monkeypatch)
    common = [
        f"model.name_or_path={model}",
        "model.tokenizer=bundled",
        "scaling.num_workers=2",
        "train.checkpoint_every=0",
        "train.eval_batches=1",
        "train.lr=1e-2",
        f"run.name={arch}",
    ]
    steps = 3 if arch in RESUMED else 2
    if arch in RESUMED:
        first = run(make_config(*common, "train.max_steps=2"))
        assert first["steps"] == 2 and first["n_params"]["num_layers"] == 2

    last = make_config(*common, f"train.max_steps={steps}", "run.export_on_finish=true")
    validate_before_ray(last)  # the driver's resume check agrees with the checkpoint's hash
    summary = run(last)
    assert summary["steps"] == steps and summary["n_params"]["num_layers"] == 2
    if arch in RESUMED:
        assert summary["resumed_from_step"] == 2 and summary["optimizer_step_at_resume"] == 2
    assert summary["export"]["export_max_abs_logit_diff"] == 0.0  # the export computes as training did
    config = json.loads((Path(summary["export"]["export_dir"]) / "config.json").read_text())
    assert config["model_type"] == json.loads((model_dirs[arch] / "config.json").read_text())["model_type"]
    if arch == "gpt2":  # learned positions: a completion past them is refused up front, not an IndexError
        from raytrain_cpu.model.generate import generate

        export_dir = summary["export"]["export_dir"]
        with pytest.raises(ValueError, match=f"--max-new-tokens: .*context \\(n_positions={CONTEXT}\\); use"):
            generate(export_dir, prompt="Hello", max_new_tokens=CONTEXT)
        assert isinstance(generate(export_dir, prompt="Hello", max_new_tokens=4), str)  # within it: generates
    if arch in HUB:  # the workers loaded the cached snapshot, and checkpoints name it
        manifest = json.loads((Path(summary["checkpoint_path"]) / "manifest.json").read_text())
        assert manifest["model_dir"] == str(last.run.hub_cache / "models--raytrain-test--phi3/snapshots/0123abcd")
