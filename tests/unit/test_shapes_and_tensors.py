"""No silent wrong shapes or tensors: a config's own head_dim everywhere a shape is derived, a
safetensors tensor read whole (past 2 GiB too) in every dtype torch has, a tiny base_model
never reused from other settings, and DPO's kept reference rows keyed by the model too."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from benchmarks.bench import common
from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.model import loading as model
from raytrain_cpu.model import shape as model_shape
from raytrain_cpu.planner import tables as plan_tables
from raytrain_cpu.trainer import dpo

# google/gemma-7b's config.json (its head_dim is not hidden // heads = 192; it ties its head).
GEMMA_7B = {
    "model_type": "gemma",
    "architectures": ["GemmaForCausalLM"],
    "hidden_size": 3072,
    "num_attention_heads": 16,
    "head_dim": 256,
    "num_key_value_heads": 16,
    "intermediate_size": 24576,
    "vocab_size": 256000,
    "num_hidden_layers": 28,
}


# ----------------------------------------------------------------------------- head_dim


def test_gemma_7b_shapes_use_its_own_head_dim(tmp_path):
    """hidden // heads made Gemma-7B's q_proj 3072x3072 and the planner count 8.19B parameters."""
    from transformers import GemmaConfig, GemmaForCausalLM

    shape = model_shape.shape_from_hf_config(GEMMA_7B)
    assert shape.head_dim == 256 and shape.tie_word_embeddings  # tied: transformers' Gemma default
    assert shape.projection_shapes()["q_proj"] == (4096, 3072) and shape.projection_shapes()["o_proj"] == (3072, 4096)
    assert shape.projection_shapes()["k_proj"] == (4096, 3072)
    with torch.device("meta"):  # transformers' own count, no memory
        hf = GemmaForCausalLM(GemmaConfig(**{k: v for k, v in GEMMA_7B.items() if k != "architectures"}))
    assert shape.num_params == sum(p.numel() for p in hf.parameters())
    assert round(shape.num_params / 1e9, 2) == 8.54
    assert tuple(hf.model.layers[0].self_attn.q_proj.weight.shape) == shape.projection_shapes()["q_proj"]
    assert model_shape.shape_of_model_config(hf.config).num_params == shape.num_params

    (tmp_path / "config.json").write_text(json.dumps(GEMMA_7B))
    assert plan_tables.resolve_shape(str(tmp_path)).num_params == shape.num_params
    assert model_shape.model_dims(str(tmp_path))["head_dim"] == 256
    gemms = {g.name: g for g in model_shape.gemms_for_model(str(tmp_path), tokens=8)}
    assert gemms["fwd 3072->4096"].count == 3 * 28  # q, and k and v (16 kv heads x 256 = 4096 too)
    assert gemms["fwd 4096->3072"].count == 28  # o_proj reads heads x head_dim
    assert "fwd 3072->3072" not in gemms
    counts = common.n_params(
        {
            **{k: GEMMA_7B[k] for k in ("hidden_size", "intermediate_size", "head_dim")},
            "num_layers": 28,
            "num_heads": 16,
            "num_kv_heads": 16,
        },
        vocab=256000,
    )
    assert counts["total"] == shape.num_params + 256000 * 3072  # bench's models are untied


def test_a_config_without_head_dim_keeps_hidden_over_heads():
    llama = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "num_hidden_layers": 32,
        "model_type": "llama",
    }
    shape = model_shape.shape_from_hf_config(llama, name="meta-llama/Meta-Llama-3-8B")
    assert shape == plan_tables.KNOWN_SHAPES["meta-llama/meta-llama-3-8b"]
    assert shape.head_dim == 128 and shape.q_dim == 4096
    assert model_shape.llama_gemms(64, 176, 4, 2, 2048, 2, tokens=64) == model_shape.llama_gemms(
        64, 176, 4, 2, 2048, 2, 64, head_dim=16
    )


# ----------------------------------------------------------------------------- safetensors reads


class _Param:
    """What model._read_own_partitions reads of a ZeRO-3 parameter: its shape and this rank's
    flat partition (ceil(numel / world) elements, the last rank's padded)."""

    def __init__(self, shape: tuple[int, ...], world: int, dtype: torch.dtype) -> None:
        self.ds_shape, self.ds_numel, self.ds_process_group = shape, math.prod(shape), None
        self.ds_tensor = torch.full((-(-self.ds_numel // world),), -1.0, dtype=dtype)
        self.ds_tensor.ds_numel = len(self.ds_tensor)


class _Model:
    def __init__(self, params: dict[str, _Param]) -> None:
        self.params = params

    def named_parameters(self):
        return iter(self.params.items())


def _read(path, tensors: dict[str, torch.Tensor], dtype: torch.dtype, world: int, monkeypatch) -> dict:
    """Each rank's partitions of `tensors` as _read_own_partitions fills them, joined again."""
    out = {}
    for rank in range(world):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=rank: r)
        params = {name: _Param(tuple(t.shape), world, dtype) for name, t in tensors.items()}
        model._read_own_partitions(_Model(params), dict.fromkeys(tensors, str(path)))
        for name, p in params.items():
            out.setdefault(name, []).append(p.ds_tensor)
    return {name: torch.cat(parts)[: tensors[name].numel()].reshape(tensors[name].shape) for name, parts in out.items()}


def test_fp8_and_unsigned_tensors_load(tmp_path, monkeypatch):
    """F8_E4M3, F8_E5M2, U16, U32 and U64 were a KeyError; each converts into the parameter's
    dtype as the other types do (files written by the safetensors package itself)."""
    from safetensors.torch import save_file

    values = torch.tensor([[0.5, -1.0, 2.0], [4.0, 0.0, -8.0], [1.5, 3.0, -0.25]])
    fp8 = {"e4m3": values.to(torch.float8_e4m3fn), "e5m2": values.to(torch.float8_e5m2)}
    save_file(fp8, tmp_path / "fp8.safetensors")
    header, _ = model._safetensors_header(str(tmp_path / "fp8.safetensors"))
    assert {m["dtype"] for m in header.values()} == {"F8_E4M3", "F8_E5M2"}
    for name, got in _read(tmp_path / "fp8.safetensors", fp8, torch.bfloat16, 2, monkeypatch).items():
        assert torch.equal(got, values.to(torch.bfloat16)), name

    big = 2**40 + 7  # past float32's and int32's range: read exactly into float64
    ints = torch.tensor([[0, 1, 65535], [3, 2, 1]])
    unsigned = {
        "u16": ints.to(torch.uint16),
        "u32": (ints * 65537).to(torch.uint32),
        "u64": (ints * big).to(torch.uint64),
    }
    save_file(unsigned, tmp_path / "uint.safetensors")
    for name, got in _read(tmp_path / "uint.safetensors", unsigned, torch.float64, 3, monkeypatch).items():
        assert torch.equal(got, unsigned[name].to(torch.float64)), name


def test_a_dtype_it_cannot_load_is_refused_by_name(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2, 2, dtype=torch.complex64)}, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match=r"c.safetensors: tensor w is stored as 'C64', which raytrain_cpu does not"):
        _read(tmp_path / "c.safetensors", {"w": torch.ones(2, 2)}, torch.float32, 1, monkeypatch)


def test_short_reads_are_read_on_until_the_tensor_is_whole(tmp_path, monkeypatch):
    """One preadv returns at most 2 GiB less a page: a tensor past that came back short and was
    refused as truncated. Reads now loop, each asking at most _MAX_READ bytes."""
    from safetensors.torch import save_file

    tensors = {"w": torch.arange(1000, dtype=torch.float32).reshape(40, 25), "b": torch.arange(7.0)}
    save_file(tensors, tmp_path / "m.safetensors")
    preadv, asked = model.os.preadv, []

    def short(fd, buffers, offset):  # the kernel's cap, scaled down, and a shorter read still
        asked.append(len(buffers[0]))
        return preadv(fd, [buffers[0][:61]], offset)

    monkeypatch.setattr(model, "_MAX_READ", 100)
    monkeypatch.setattr(model.os, "preadv", short)
    for name, got in _read(tmp_path / "m.safetensors", tensors, torch.float32, 2, monkeypatch).items():
        assert torch.equal(got, tensors[name]), name
    assert max(asked) == 100 and len(asked) > 20

    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-100])  # the file ends inside tensor w
    with pytest.raises(ValueError, match=r"cut.safetensors: w is truncated \(read \d+ of 2000 bytes\)"):
        _read(tmp_path / "cut.safetensors", tensors, torch.float32, 2, monkeypatch)


# ----------------------------------------------------------------------------- the tiny base_model


@pytest.fixture
def tiny_tokenizer():
    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path

    return load_tokenizer(resolve_tokenizer_path("bundled", "tiny"))


def test_a_tiny_base_model_from_other_settings_is_rebuilt_or_refused(tmp_path, tiny_tokenizer):
    """A base_model left in the run directory was reused whatever model.tiny said (asked for
    hidden 128, trained the old 64, no word)."""
    from raytrain_cpu.config.schema import load_config

    out, lines = tmp_path / "run" / "base_model", []
    model.write_tiny_model(load_config(None, []), tiny_tokenizer, out, log=lines.append)
    first = (out / "model.safetensors").stat().st_mtime_ns
    model.write_tiny_model(load_config(None, []), tiny_tokenizer, out, log=lines.append)
    assert (out / "model.safetensors").stat().st_mtime_ns == first and not lines  # the same settings: reused

    wider = load_config(None, ["model.tiny.hidden_size=128"])
    model.write_tiny_model(wider, tiny_tokenizer, out, log=lines.append)  # no checkpoint: rebuilt
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 128
    assert len(lines) == 1 and "hidden_size: 64 → 128" in lines[0] and "rebuilding it" in lines[0]
    assert sorted(p.name for p in out.parent.iterdir()) == ["base_model"]

    model.write_tiny_model(
        load_config(None, ["model.tiny.hidden_size=128", "train.seed=7"]), tiny_tokenizer, out, log=lines.append
    )
    assert lines[-1].count("→") == 1 and "train.seed: 1234 → 7" in lines[-1]  # other weights too

    (out.parent / "checkpoint_000003").mkdir()
    (out.parent / "checkpoint_000003" / "manifest.json").write_text("{}")
    with pytest.raises(
        ConfigError,
        match=r"^model.tiny: .*base_model was built from other settings \(hidden_size: "
        r"128 → 64.*checkpoint_000003 was trained from it",
    ):
        model.write_tiny_model(load_config(None, ["train.seed=7"]), tiny_tokenizer, out)
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 128  # kept as it is


def test_a_base_model_written_before_the_record_is_compared_by_its_config(tmp_path, tiny_tokenizer):
    from raytrain_cpu.config.schema import load_config

    out = tmp_path / "base_model"
    model.write_tiny_model(load_config(None, []), tiny_tokenizer, out)
    (out / model.TINY_RECORD).unlink()  # as written before it: config.json is all there is
    assert (
        model.tiny_model_differences(
            out,
            model._tiny_settings(
                model.tiny_llama_config(load_config(None, []), len(tiny_tokenizer), tiny_tokenizer.eos_token_id), 1
            ),
        )
        == []
    )
    wanted = model._tiny_settings(
        model.tiny_llama_config(
            load_config(None, ["model.tiny.num_layers=3"]), len(tiny_tokenizer), tiny_tokenizer.eos_token_id
        ),
        1,
    )
    assert model.tiny_model_differences(out, wanted) == ["num_hidden_layers: 2 → 3"]


# ----------------------------------------------------------------------------- DPO's kept reference


def test_the_reference_rows_are_keyed_by_the_model(tmp_path, tiny_tokenizer):
    """reference_logps/ was keyed by block content only: another model.name_or_path under the
    same run.name read the old model's log-probabilities."""
    from raytrain_cpu.config.schema import load_config

    base = tmp_path / "a"
    model.write_tiny_model(load_config(None, []), tiny_tokenizer, base)
    key = dpo.reference_key("tiny", base)
    assert dpo.reference_key("tiny", base) == key and len(key) == 16
    copy = tmp_path / "elsewhere" / "a"
    shutil.copytree(base, copy)  # another node's copy: other path and times, the same model
    assert dpo.reference_key("tiny", copy) == key
    assert dpo.reference_key(str(base), base) != key  # another name_or_path
    reseeded = tmp_path / "b"  # the same architecture, so the same headers: other weights
    model.write_tiny_model(load_config(None, ["train.seed=1"]), tiny_tokenizer, reseeded)
    assert dpo.reference_key("tiny", reseeded) != key
    assert dpo.reference_directory(tmp_path / "run", key) == tmp_path / "run" / "reference_logps" / key
