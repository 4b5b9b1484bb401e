"""The output layer and the cross-entropy loss as one operation, a chunk of tokens at a time.

Why: Hugging Face's causal-LM loss multiplies every token by the whole output matrix, keeps the
bf16 logits, casts them to fp32, keeps log-softmax's fp32 output for the backward, and makes a
fp32 gradient of the same size there: about 12 bytes per token per vocabulary entry at the
start of the backward, when the activations peak too. For Llama-3-8B (128,256 entries) that is
3.2 GB per 2,048 tokens. Each of those passes is a fresh tensor as large as the logits, so on
CPU the step pays for their page faults and memory traffic as well.

Here the loss is the step's last operation, so its gradient can be computed in the forward:
for each chunk of at most `CHUNK_BYTES` of fp32 logits, the logits' GEMM, a log-sum-exp and the
softmax minus the one-hot target give the loss and the chunk's logit gradient, which two GEMMs
turn into the hidden states' and the weight's gradients at once. The backward only scales
them. The GEMMs are the same three as Hugging Face's, with the same dtypes (bf16 in, fp32
softmax, the logit gradient cast to bf16 before its GEMMs), so the gradients are the same to
the last bit, in any number of chunks: each row's arithmetic is its own, and the weight's
gradient is one GEMM over every token's logit gradient (kept in bf16, a seventh of what Hugging
Face's loss holds). The loss is the same bits in one chunk; over several it sums the chunks in
another order (fp32 rounding). What is kept between forward and backward is the two
gradients, which the backward would make anyway.

`install` puts it under the model's own forward for the architectures whose causal-LM head is
exactly `logits = lm_head(hidden)` followed by Hugging Face's `ForCausalLMLoss`; calls without
labels (generation, the export check's logits) run the model's forward unchanged. Under ZeRO-3
the loss runs inside the output layer's own call, so DeepSpeed's hooks gather its weight as
they would for the logits.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from raytrain_cpu.compat.torch import log_softmax_backward

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here" (padding, prompts)
# fp32 logits per chunk; a chunk holds three times this while it runs (the logits, their
# log-softmax and its gradient). Each chunk reads the whole output matrix twice, so chunks too
# short pay for it: at Llama-3-8B's head (benchmarks/loss_head.py) 256 MiB chunks run close to
# Hugging Face's time, smaller ones noticeably slower, at about a quarter of its memory.
# The ~50M bench model's 2,048-entry vocabulary fits 32,768 tokens in one chunk.
CHUNK_BYTES = 256 << 20
# Architectures whose ForCausalLM.forward is `logits = self.lm_head(hidden_states)` followed by
# self.loss_function (ForCausalLMLoss) in transformers 5.x, with no logit scaling or capping.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma")


def chunk_rows(vocab_size: int) -> int:
    """Tokens per chunk: as many as keep one chunk's fp32 logits within CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


class LinearCrossEntropy(torch.autograd.Function):
    """mean over targets != -100 of cross_entropy(hidden @ weight.T, targets), gradients computed
    in the forward. hidden (N, d), weight (V, d), targets (N,) int64.

    Each chunk runs the very kernels of Hugging Face's loss and its backward (log_softmax,
    nll_loss, nll_loss_backward with the whole batch's target count, log_softmax's backward),
    row by row the same arithmetic, so one chunk gives the same bits."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        rows: int,
        token_losses: torch.Tensor | None = None,
    ) -> torch.Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        count = (targets != IGNORE_INDEX).sum().to(torch.float32)  # nll_loss's total_weight
        one = torch.ones((), dtype=torch.float32)
        total = torch.zeros((), dtype=torch.float32)
        grad_h = torch.empty_like(hidden) if want_h else None
        # The logits' gradient in the weights' dtype, every chunk's, for the weight's gradient:
        # one GEMM over all tokens at the end, Hugging Face's own (one rounding, no re-reads of
        # a (V, d) accumulator per chunk). A seventh of the bytes its loss holds.
        grad_logits = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype) if want_w else None
        for s in range(0, hidden.shape[0], rows):
            h, t = hidden[s : s + rows], targets[s : s + rows]
            logp = torch.log_softmax(torch.mm(h, weight.t()).float(), dim=-1)
            total += torch.nn.functional.nll_loss(logp, t, ignore_index=IGNORE_INDEX, reduction="sum")
            if token_losses is not None:  # each token's loss besides (0 where ignored): its row's, its source's
                token_losses[s : s + rows] = torch.nn.functional.nll_loss(
                    logp, t, ignore_index=IGNORE_INDEX, reduction="none"
                )
            if not (want_h or want_w):
                continue
            g = torch.ops.aten.nll_loss_backward(one, logp, t, None, 1, IGNORE_INDEX, count)  # 1: mean
            g = log_softmax_backward(g, logp, -1, torch.float32)
            del logp
            g = grad_logits[s : s + rows].copy_(g) if want_w else g.to(hidden.dtype)
            if want_h:
                torch.mm(g, weight, out=grad_h[s : s + rows])
        grad_w = torch.mm(grad_logits.t(), hidden) if want_w else None
        del grad_logits
        ctx.save_for_backward(grad_h, grad_w)
        return total / count  # NaN when every target is ignored, as Hugging Face's mean

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        if not bool(grad_out == 1):  # DeepSpeed divides the loss by the accumulation steps
            grad_h = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
            grad_w = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None


class TargetLogProbs(torch.autograd.Function):
    """log p(target) of each token (0 where the target is -100) from hidden (N, d) and the output
    weight (V, d), a chunk of `rows` tokens at a time: what DPO reads of the model. Unlike the
    loss above, its gradient depends on values known only after the forward (each pair's
    weight), so the backward recomputes each chunk's logits instead of keeping (N, V) of them."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        out = torch.zeros(hidden.shape[0], dtype=torch.float32)
        safe = targets.clamp_min(0).unsqueeze(1)
        for s in range(0, hidden.shape[0], rows):
            logits = torch.mm(hidden[s : s + rows], weight.t()).float()
            out[s : s + rows] = logits.gather(1, safe[s : s + rows]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.rows = rows
        return out.masked_fill_(targets == IGNORE_INDEX, 0.0)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, targets = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = grad_out.float().masked_fill(targets == IGNORE_INDEX, 0.0)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32) if want_w else None
        for s in range(0, hidden.shape[0], ctx.rows):
            h, t = hidden[s : s + ctx.rows], targets[s : s + ctx.rows]
            # d log p(t) / d logits = onehot(t) - softmax, scaled by each token's incoming gradient
            probs = torch.softmax(torch.mm(h, weight.t()).float(), dim=-1)
            grad_logits = (-probs).scatter_add_(1, t.clamp_min(0).unsqueeze(1), torch.ones_like(probs[:, :1]))
            grad_logits = (grad_logits * g[s : s + ctx.rows].unsqueeze(1)).to(hidden.dtype)
            if want_h:
                torch.mm(grad_logits, weight, out=grad_h[s : s + ctx.rows])
            if want_w:
                grad_w.addmm_(grad_logits.t().float(), h.float())
        return grad_h, grad_w.to(weight.dtype) if want_w else None, None, None


def label_logps_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, T) log p(labels[t]) from the logits at t-1; 0 at t = 0 and where the label is -100
    (models whose loss is not fused hand back logits)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = labels[:, 1:]
    picked = logp.gather(2, target.clamp_min(0).unsqueeze(2)).squeeze(2).masked_fill(target == IGNORE_INDEX, 0.0)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Position t predicts label t+1; the last position predicts nothing (ForCausalLMLoss's shift)."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1).reshape(-1)


def _head_forward(
    self,
    hidden: torch.Tensor,
    targets: torch.Tensor | None = None,
    token_losses: torch.Tensor | None = None,
    logps: bool = False,
) -> torch.Tensor:
    """The output layer: logits as nn.Linear makes them, or with targets the mean loss (and each
    token's into `token_losses` when given), or with `logps` each target's log-probability."""
    if targets is None:
        return torch.nn.Linear.forward(self, hidden)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if logps:
        return TargetLogProbs.apply(flat, self.weight, targets, chunk_rows(self.weight.shape[0]))
    return LinearCrossEntropy.apply(flat, self.weight, targets, chunk_rows(self.weight.shape[0]), token_losses)


def _causal_lm_forward(
    self, input_ids=None, labels=None, logits_to_keep=0, row_losses=False, label_logps=False, **kwargs: Any
):
    """The model's forward; with labels, the loss without logits (output.logits is None), and
    with `row_losses` also output.row_losses: each row's summed loss over its targets (the
    training loop adds them up by mixture source). With `label_logps`, no loss but
    output.label_logps: (B, T) log p(labels[t]) given the tokens before t, 0 at t = 0 and where
    the label is -100 (DPO's sums)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    plain = isinstance(logits_to_keep, int) and logits_to_keep == 0
    # peft's wrapper always passes return_dict (None): only a tuple asked for needs Hugging Face's forward.
    as_tuple = kwargs.get("return_dict") is False
    if labels is None or not plain or kwargs.get("num_items_in_batch") is not None or as_tuple:
        return type(self).forward(self, input_ids=input_ids, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    kwargs.pop("return_dict", None)
    out = self.model(input_ids=input_ids, **kwargs)
    extras = dict(past_key_values=out.past_key_values, hidden_states=out.hidden_states, attentions=out.attentions)
    if label_logps:
        shifted = self.lm_head(out.last_hidden_state, targets=shifted_targets(labels), logps=True).view(labels.shape)
        by_label = torch.cat([torch.zeros_like(shifted[:, :1]), shifted[:, :-1]], dim=1)
        result = CausalLMOutputWithPast(loss=None, **extras)
        result["label_logps"] = by_label
        return result
    tokens = torch.zeros(labels.numel(), dtype=torch.float32) if row_losses else None
    loss = self.lm_head(out.last_hidden_state, targets=shifted_targets(labels), token_losses=tokens)
    result = CausalLMOutputWithPast(loss=loss, **extras)
    if tokens is not None:
        result["row_losses"] = tokens.view(labels.shape).sum(dim=1)
    return result


def supported(model) -> str | None:
    """None when the fused loss can replace this model's, else why not."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} (fused for {', '.join(SUPPORTED_MODEL_TYPES)})"
    head = getattr(model, "lm_head", None)
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return f"its output layer is a {type(head).__name__}, not a plain bias-free Linear"
    return None


def install(model) -> str | None:
    """Puts the fused loss under `model` (the causal LM itself, not a peft wrapper); returns None,
    or why the model keeps Hugging Face's loss."""
    why_not = supported(model)
    if why_not is None:
        # Instance attributes: nn.Module.__call__ (and DeepSpeed's hooks around it) still runs.
        model.forward = types.MethodType(_causal_lm_forward, model)
        model.lm_head.forward = types.MethodType(_head_forward, model.lm_head)
    return why_not
