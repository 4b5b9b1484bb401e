"""raytrain_cpu.attention: the causal-blocks attention against an fp64 reference and SDPA, and
its place in a transformers Llama (what it computes, what it leaves to SDPA).
This module's in-process tests: tests/unit/test_attention.py."""

import pytest
from helpers import tiny_llama_choosing


@pytest.mark.slow
def test_compiled_decoder_layers_keep_the_blocks_without_graph_breaks():
    import torch._dynamo

    model, _, _ = tiny_llama_choosing("causal_blocks")
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
