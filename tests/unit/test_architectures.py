"""Architectures other than Llama, built from configs with the bundled tokenizer (vocab 2048):
Qwen2 (biases, tied embeddings), Mistral, Gemma (tied, scaled embeddings), GPT-2 (Conv1D
weights, learned positions, tied) and Phi-3 (fused projections). Each one's parameters are
counted and its decoder layers found. Each but Mistral (Llama's modules and weight names, its
sliding window aside) trains on 2 workers and is exported at the end, its logits checked
against the trained model's. GPT-2, the layout furthest from Llama's, also resumes with more
steps first: resuming restores DeepSpeed's partitions by parameter, whatever the
architecture, so one resume covers what the others would (each leg costs a Ray Train start,
~20 s on 2 cores). Qwen2's model is given as a relative path, as users type one, and Phi-3's as
a hub id that an earlier run fetched, trained with the hub offline. Tiny Llama, the default, is
covered by tests/test_train_e2e.py.
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_architectures_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ARCHS, build_model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {arch: build_model(arch, root / arch) for arch in ARCHS}


def test_count_parameters_is_exact_for_every_architecture(model_dirs):
    """count_parameters (safetensors headers) = the parameters transformers' model holds."""
    from transformers import AutoModelForCausalLM

    from raytrain_cpu.model.loading import count_parameters

    for arch, d in model_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(d)
        n = count_parameters(str(d))
        held = sum(p.numel() for p in model.parameters())  # a tied weight once
        assert n["total"] == held, arch
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        positions = model.transformer.wpe.weight.numel() if arch == "gpt2" else 0
        embedding = 0 if tied else model.get_input_embeddings().weight.numel()
        assert n["non_embedding"] == held - positions - embedding, arch  # a tied head's matmul still counts
        assert (n["num_layers"], n["hidden_size"]) == (2, 64), arch
        assert tied == (arch in ("qwen2", "gemma", "gpt2")), arch


def test_decoder_layers_are_found_for_every_architecture(model_dirs):
    """What ZeRO-3 gathers whole and model.compile compiles, for any architecture and under peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from raytrain_cpu.model.loading import decoder_layers

    for arch, d in model_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(d)
        layers = decoder_layers(model)
        assert len(layers) == 2 and all(type(x).__name__ in model._no_split_modules for x in layers), arch
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["qkv_proj"]))  # the last one: phi3
    assert decoder_layers(wrapped) == layers
