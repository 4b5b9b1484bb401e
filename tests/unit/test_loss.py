"""The fused output layer + cross-entropy (raytrain_cpu.model.ops.loss) against Hugging Face's loss: the same
loss and gradients on a tiny Llama, in one process and under ZeRO-3 on 2 ranks.
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_loss_e2e.py."""

from __future__ import annotations

import pytest
import torch
from aten_threads import aten_threads
from helpers import FUSED_VOCAB, fused_llama_pair

from raytrain_cpu.model.ops import loss as fused


def _batch():
    ids = torch.randint(0, FUSED_VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :10] = -100  # a prompt that takes no loss
    return ids, labels


def _loss_and_grads(model, ids, labels, scale: float = 1.0):
    model.zero_grad()
    loss = model(input_ids=ids, labels=labels).loss
    (loss * scale).backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_one_chunk_matches_hugging_face_bit_for_bit():
    """bf16, every token in one chunk: the same loss and the same gradients to the last bit."""
    hf, ours = fused_llama_pair()
    ids, labels = _batch()
    loss_hf, grads_hf = _loss_and_grads(hf, ids, labels)
    loss_ours, grads_ours = _loss_and_grads(ours, ids, labels)
    assert torch.equal(loss_hf, loss_ours)
    assert all(torch.equal(a, b) for a, b in zip(grads_hf, grads_ours, strict=True))


def test_scaled_backward_matches():
    """DeepSpeed divides the loss by the accumulation steps: the kept gradients are scaled."""
    hf, ours = fused_llama_pair()
    ids, labels = _batch()
    _, grads_hf = _loss_and_grads(hf, ids, labels, scale=0.5)
    _, grads_ours = _loss_and_grads(ours, ids, labels, scale=0.5)
    assert all(torch.equal(a, b) for a, b in zip(grads_hf, grads_ours, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunks_match_hugging_face(monkeypatch, dtype):
    """16 tokens a chunk (8 chunks): every gradient to the last bit (each row's arithmetic is its
    own, the weight's gradient one GEMM over all rows); the loss sums its chunks in another order,
    so to fp32 rounding."""
    monkeypatch.setattr(fused, "CHUNK_BYTES", 4 * FUSED_VOCAB * 16)
    assert fused.chunk_rows(FUSED_VOCAB) == 16
    hf, ours = fused_llama_pair(dtype)
    ids, labels = _batch()
    loss_hf, grads_hf = _loss_and_grads(hf, ids, labels)
    loss_ours, grads_ours = _loss_and_grads(ours, ids, labels)
    assert float(loss_ours) == pytest.approx(float(loss_hf), rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(grads_hf, grads_ours, strict=True))


def test_at_two_threads_chunks_match_hugging_face(monkeypatch):
    """At 2 threads (each chunk's GEMMs, log-softmax and its backward split among them by ATen,
    the chunks in turn), 16 tokens a chunk: Hugging Face's gradients to the last bit, its loss to
    fp32 rounding."""
    monkeypatch.setattr(fused, "CHUNK_BYTES", 4 * FUSED_VOCAB * 16)
    hf, ours = fused_llama_pair()
    ids, labels = _batch()
    with aten_threads(2):
        loss_hf, grads_hf = _loss_and_grads(hf, ids, labels)
        loss_ours, grads_ours = _loss_and_grads(ours, ids, labels)
    assert float(loss_ours) == pytest.approx(float(loss_hf), rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(grads_hf, grads_ours, strict=True))


@pytest.mark.parametrize("chunk", [16, None])
def test_row_losses_are_each_rows_summed_loss_and_change_nothing_else(monkeypatch, chunk):
    """row_losses=True (a mixture's training loss by source): output.row_losses holds each row's
    summed loss over its targets, as cross_entropy gives it row by row; the loss and the
    gradients keep their bits."""
    if chunk:
        monkeypatch.setattr(fused, "CHUNK_BYTES", 4 * FUSED_VOCAB * chunk)
    _, ours = fused_llama_pair(torch.float32)
    ids, labels = _batch()
    loss, grads = _loss_and_grads(ours, ids, labels)
    ours.zero_grad()
    out = ours(input_ids=ids, labels=labels, row_losses=True)
    out.loss.backward()
    assert torch.equal(out.loss.detach(), loss)
    assert all(torch.equal(p.grad, g) for p, g in zip(ours.parameters(), grads, strict=True))
    with torch.no_grad():
        logits = ours.lm_head(ours.model(input_ids=ids).last_hidden_state)
    each = [
        torch.nn.functional.cross_entropy(logits[r, :-1], labels[r, 1:], ignore_index=-100, reduction="sum")
        for r in range(len(ids))
    ]
    assert torch.allclose(out.row_losses, torch.stack(each), rtol=1e-5)
    targets = (labels[:, 1:] != -100).sum()
    assert float(out.row_losses.sum() / targets) == pytest.approx(float(loss), rel=1e-6)


def test_no_targets_means_nan_loss_and_no_gradient():
    """Every label ignored: Hugging Face's mean is NaN (0/0); the fused loss says the same and
    sends no gradient."""
    hf, ours = fused_llama_pair()
    ids, _ = _batch()
    labels = torch.full_like(ids, -100)
    assert torch.isnan(hf(input_ids=ids, labels=labels).loss)
    out = ours(input_ids=ids, labels=labels)
    assert torch.isnan(out.loss)
    out.loss.backward()
    assert float(ours.lm_head.weight.grad.abs().max()) == 0.0


def test_calls_without_labels_run_the_model_unchanged():
    """Generation and the export check read logits: without labels nothing changes."""
    hf, ours = fused_llama_pair()
    ids, labels = _batch()
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, ours(input_ids=ids).logits)
        assert torch.equal(hf(input_ids=ids, logits_to_keep=1).logits, ours(input_ids=ids, logits_to_keep=1).logits)
        # Evaluation: a loss, no gradients made, no logits returned.
        out = ours(input_ids=ids, labels=labels)
        assert out.logits is None
        assert torch.equal(out.loss, hf(input_ids=ids, labels=labels).loss)


def test_under_peft_the_fused_loss_still_runs():
    """peft's wrapper calls the model with return_dict=None and None for inputs it does not use:
    the fused loss (no logits, row_losses) still runs under it, with Hugging Face's loss's bits."""
    from peft import LoraConfig, get_peft_model

    hf, ours = fused_llama_pair()
    ids, labels = _batch()
    # As raytrain's LoRA wraps a model (lora.peft_config): a causal-LM task, whose wrapper passes them.
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    wrapped_hf, wrapped = get_peft_model(hf, config), get_peft_model(ours, config)
    wrapped.load_state_dict(wrapped_hf.state_dict())
    out = wrapped(input_ids=ids, labels=labels, row_losses=True)
    assert out.logits is None and out.row_losses.shape == (len(ids),)
    assert torch.equal(out.loss, wrapped_hf(input_ids=ids, labels=labels).loss)
    assert wrapped(input_ids=ids, labels=labels, return_dict=False)[0].shape == ()  # a tuple asked for: HF's


def test_other_heads_keep_hugging_face_loss():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=FUSED_VOCAB))
    assert "gpt2" in fused.install(gpt2)
    assert "forward" not in vars(gpt2)  # untouched
    _, ours = fused_llama_pair()
    ours.lm_head = torch.nn.Linear(64, FUSED_VOCAB, bias=True)
    assert "bias" in fused.supported(ours)
