"""Sharded loading, the reading half: each rank reads exactly its ZeRO-3 range of every tensor.

The end-to-end half (a real ZeRO-3 model built by transformers, checked against the file) is
tests/test_train_e2e.py::test_sharded_loading_is_exact_and_partitioned. Here: a multi-file
checkpoint's index, and partitions of awkward sizes (not divisible by the world size, smaller
than it, 1-D to 3-D, fp32 and bf16 on disk) read by two real gloo ranks.
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_model_loading_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import FakeZero3Model, loading_tensors
from safetensors.torch import save_file

from raytrain_cpu.model.loading import _checkpoint_files, _read_own_partitions

TENSORS = loading_tensors()


def test_checkpoint_files_follow_the_index(tmp_path):
    save_file({k: TENSORS[k] for k in ("a.weight", "b.weight")}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: TENSORS[k] for k in ("norm.weight", "c.bias")}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {k: f"model-0000{1 if k in ('a.weight', 'b.weight') else 2}-of-00002.safetensors" for k in TENSORS}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    files = _checkpoint_files(str(tmp_path))
    assert files == {k: str(tmp_path / v) for k, v in index.items()}
    assert _checkpoint_files(str(tmp_path / "nowhere")) is None


def test_a_parameter_missing_from_the_checkpoint_is_named(tmp_path):
    save_file({"a.weight": TENSORS["a.weight"]}, str(tmp_path / "model.safetensors"))
    model = FakeZero3Model(
        {"a.weight": TENSORS["a.weight"].shape, "lm_head.weight": torch.Size([4, 4])}, torch.float32, 1
    )
    with pytest.raises(ValueError, match="lm_head.weight"):
        _read_own_partitions(model, _checkpoint_files(str(tmp_path)))


def test_a_shape_mismatch_is_named(tmp_path):
    save_file({"a.weight": TENSORS["a.weight"]}, str(tmp_path / "model.safetensors"))
    model = FakeZero3Model({"a.weight": torch.Size([5, 7])}, torch.float32, 1)
    with pytest.raises(ValueError, match=r"a.weight: checkpoint shape \(7, 5\)"):
        _read_own_partitions(model, _checkpoint_files(str(tmp_path)))


def test_a_tiny_model_too_big_to_build_here_is_refused_first():
    """model.tiny is built whole on the driver: a size past this machine's free memory is a
    ConfigError naming the size and the way out, not minutes of swapping."""
    from raytrain_cpu.config.checks import ConfigError
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.model.loading import check_tiny_model_fits, tiny_llama_config

    check_tiny_model_fits(tiny_llama_config(load_config(), 2048, 0))  # the default tiny Llama
    shape = {"hidden_size": 32768, "intermediate_size": 131072, "num_layers": 64, "num_heads": 64, "num_kv_heads": 8}
    huge = load_config(None, [f"model.tiny.{k}={v}" for k, v in shape.items()])  # ~1T parameters
    with pytest.raises(ConfigError, match=r"model.tiny: the \d+\.\dB-parameter model .*model.name_or_path"):
        check_tiny_model_fits(tiny_llama_config(huge, 2048, 0))


# ----------------------------------------------------------------------------- issue 59, point 4: the model a run resumes with


def _model_dir(path, *, layers: int = 2, version: str = "5.0.0", shape: tuple[int, int] = (4, 4)):
    """A model directory: config.json (a small Llama) and one safetensors file."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "num_hidden_layers": layers, "max_position_embeddings": 4096}
    (path / "config.json").write_text(json.dumps({**config, "transformers_version": version}))
    save_file({"a.weight": torch.zeros(shape)}, str(path / "model.safetensors"))
    return path


def _run_with_checkpoint(storage, name: str, model: dict) -> None:
    """A run directory whose one checkpoint (in Ray Train's record) recorded `model`."""
    from raytrain_cpu.checkpoint import layout as ck_layout
    from raytrain_cpu.compat import ray as ray_compat

    ckpt = storage / name / ck_layout.checkpoint_dir_name(10)
    ckpt.mkdir(parents=True)
    manifest = {"format": ck_layout.FORMAT, "files": {}, "step": 10, "model": model}
    (ckpt / ck_layout.MANIFEST).write_text(json.dumps(manifest))
    (ckpt.parent / ray_compat.SNAPSHOT).write_text(
        json.dumps({"latest_checkpoint_result": {"checkpoint_dir_name": ckpt.name}})
    )


def test_a_local_model_changed_in_place_is_named_on_resume(tmp_path):
    """Its config and safetensors headers, hashed when the run starts and recorded in each
    manifest: a resume (the driver) and every restart (each worker) compare and name the files."""
    from raytrain_cpu.checkpoint import identity as ck_identity
    from raytrain_cpu.checkpoint import layout as ck_layout
    from raytrain_cpu.config.checks import ConfigError
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.launch.resume import check_model_unchanged, newest_checkpoint

    model = _model_dir(tmp_path / "model")
    identity = ck_identity.model_identity(str(model), model, None)
    assert set(identity["fingerprint"]) == {"config.json", "model.safetensors"} and identity["revision"] is None
    _run_with_checkpoint(tmp_path / "runs", "r", identity)
    cfg = load_config(None, [f"model.name_or_path={model}", f"run.storage_path={tmp_path / 'runs'}", "run.name=r"])
    latest = newest_checkpoint(cfg.run.run_dir)
    assert check_model_unchanged(cfg, str(model), latest) == identity
    _model_dir(model, version="5.9.9")  # re-saved by a newer transformers: the same model
    assert check_model_unchanged(cfg, str(model), latest) == identity

    _model_dir(model, layers=3, shape=(4, 8))  # another model put in its place
    (model / "extra.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError) as e:
        check_model_unchanged(cfg, str(model), latest)
    assert str(e.value) == (
        f"model.name_or_path: {model} changed in place since the run started (checkpoint_000010, step 10, was saved "
        "from it): config.json changed; model.safetensors changed; extra.safetensors is new. Put the model "
        f"directory back as it was, or export the checkpoint (python -m raytrain_cpu.export {latest['path']} <dir>) "
        "and start a new run.name with model.name_or_path=<dir>."
    )
    with pytest.raises(
        ck_layout.CheckpointError, match=r"changed in place since this run started: config.json changed;"
    ):
        ck_identity.check_model_dir(model, identity)  # a worker's check on every restart
    ck_identity.check_model_dir(model, None)  # the tiny model: built from model.tiny on every start


def test_a_hub_model_resumes_at_the_commit_its_checkpoint_recorded(tmp_path, monkeypatch):
    """The hub id alone does not pin the weights: the run's start records the commit it
    resolved, and a resume downloads exactly that one (the resolver injected: no network)."""
    import huggingface_hub

    from raytrain_cpu.checkpoint import identity as ck_identity
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.launch.driver import fetch_from_hub
    from raytrain_cpu.launch.resume import check_model_unchanged, newest_checkpoint
    from raytrain_cpu.model.hub import snapshot_revision

    old, new = "a" * 40, "b" * 40
    asked = []

    def snapshot_download(repo, revision=None, cache_dir=None, allow_patterns=None):
        asked.append(revision)
        return str(_model_dir(Path(cache_dir) / "models--owner--model" / "snapshots" / (revision or new)))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    runs = tmp_path / "runs"
    overrides = ["model.name_or_path=owner/model", "model.tokenizer=bundled", f"run.storage_path={runs}"]
    cfg = load_config(None, [*overrides, "run.name=fresh"])
    model_dir = fetch_from_hub(cfg)  # a new run: the hub's newest commit
    assert asked == [None] and snapshot_revision(model_dir) == new
    assert check_model_unchanged(cfg, model_dir, None)["revision"] == new

    started = ck_identity.model_identity("owner/model", _model_dir(tmp_path / "hub" / "snapshots" / old), old)
    _run_with_checkpoint(runs, "resumed", started)
    cfg = load_config(None, [*overrides, "run.name=resumed"])
    model_dir = fetch_from_hub(cfg)
    assert asked == [None, old] and snapshot_revision(model_dir) == old
    assert check_model_unchanged(cfg, model_dir, newest_checkpoint(cfg.run.run_dir)) == started
    with pytest.raises(ValueError, match="not a hub cache snapshot"):
        snapshot_revision(tmp_path)
