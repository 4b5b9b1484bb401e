"""Fine-tuning end to end: chat SFT with LoRA under ZeRO-3 (2 workers), full-parameter SFT under
ZeRO-2 (2 workers), export of the adapter and the merged model, generate, LoRA with whole-layer
gathers, and LoRA's bad input. (ZeRO-3 at world size 1, the edge case of its checkpoint files,
trains in tests/test_train_e2e.py's best-checkpoint test.)
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_finetune_e2e.py."""

from __future__ import annotations

import pytest


def _main_error(capsys, *overrides: str) -> str:
    from raytrain_cpu.launch.driver import main

    assert main(list(overrides)) == 2
    return capsys.readouterr().err


def test_lora_targets_matching_nothing_fail_before_ray(capsys, tmp_path):
    err = _main_error(capsys, f"run.storage_path={tmp_path}", "lora.rank=4", "lora.target_modules=[qkv_proj]")
    assert "lora.target_modules" in err and "qkv_proj" in err and "q_proj" in err  # names what exists
    assert not any(tmp_path.iterdir())  # nothing written


def test_lora_on_a_layer_peft_cannot_wrap_fails_before_ray(capsys, tmp_path):
    err = _main_error(capsys, f"run.storage_path={tmp_path}", "lora.rank=4", "lora.target_modules=[input_layernorm]")
    assert "lora.target_modules" in err and "not supported" in err and "LlamaRMSNorm" in err


def test_lora_settings_are_validated():
    from raytrain_cpu.config.checks import ConfigError
    from raytrain_cpu.config.schema import load_config

    with pytest.raises(ConfigError, match="lora.rank"):
        load_config(None, ["lora.rank=-1"])
    with pytest.raises(ConfigError, match="lora.dropout"):
        load_config(None, ["lora.dropout=1.5"])
    with pytest.raises(ConfigError, match="lora.target_modules"):
        load_config(None, ["lora.target_modules=[]"])
    load_config(None, ["lora.rank=8", "model.compile=true"])
    load_config(None, ["lora.rank=8", "deepspeed.gather_whole_layers=true"])
