"""raytrain_cpu.attention: the causal-blocks attention against an fp64 reference and SDPA, and
its place in a transformers Llama (what it computes, what it leaves to SDPA).
This module's in-process tests: tests/unit/test_attention.py."""

import pytest
import torch

from raytrain_cpu.config.schema import load_config
from raytrain_cpu.model.loading import tiny_llama_config
from raytrain_cpu.model.ops import attention


def _tiny_llama(attn: str, seq_len: int = 96, dtype: torch.dtype = torch.float32, **overrides):
    from transformers import LlamaForCausalLM

    cfg = load_config(
        None,
        ["model.tiny.hidden_size=64", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2", "model.tiny.num_layers=2"],
    )
    config = tiny_llama_config(cfg, 256, eos_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(dtype)
    chosen, timings = attention.choose(model, attn, micro_batch=2, seq_len=seq_len, **overrides)
    return model, chosen, timings


@pytest.mark.slow
def test_compiled_decoder_layers_keep_the_blocks_without_graph_breaks():
    import torch._dynamo

    model, _, _ = _tiny_llama("causal_blocks")
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    eager = model(input_ids=ids, labels=ids).loss
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for layer in model.model.layers:
        layer.compile()
    compiled = model(input_ids=ids, labels=ids).loss
    compiled.backward()
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-5)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
