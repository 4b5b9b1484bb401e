"""The rotary position embedding of q and k as one autograd operation, a chunk of rows at a time.

Why: Hugging Face's `apply_rotary_pos_emb` is `q * cos + rotate_half(q) * sin`, five eager
operators a tensor (a negated half, a concatenation, two products and a sum), and autograd's
backward of them makes two zero-filled copies (the slices' gradients) and sums three gradients:
about a dozen passes over q and as many over k, per layer, each from memory. Here the forward
is two products and two in-place half sums, and so is the backward, run over chunks of
CHUNK_ELEMENTS a thread (norm.chunk_elements: ATen splits each pass over the rank's threads)
so that each product is still in the core's cache when the sums read it: one pass from memory
and one to it. The products and sums are Hugging Face's, rounded in the same order,
so the output and the gradients are the same bits. Alone (q and k of one layer, forward and
backward, caches flushed between calls, one thread) it takes about half Hugging
Face's time, at the bench model's shape and at Llama-3-8B's.

`install` swaps the forward of every attention module whose class runs exactly Llama's with
Llama's forward calling this (the rest line for line Hugging Face's); others keep theirs.
"""

from __future__ import annotations

import sys

import torch

from raytrain_cpu.model.ops.norm import chunk_elements


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forward: bool) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (forward) or its gradient's transpose (backward: rotate_half
    reversed) for x (B, H, S, D) and cos, sin broadcast from (B, 1, S, D): in the forward `sin`
    comes with its halves swapped, so that each product pairs the half it multiplies.

    The rows are (B * S) tokens of H x D in the layout of the projections' output (x is a
    transposed view of it, as transformers hands it over); the result is laid out the same."""
    b, h, s, d = x.shape
    half = d // 2
    rows = x.transpose(1, 2).reshape(b * s, h, d)  # a view in the projections' layout, else a copy
    cos = cos.expand(b, 1, s, d).reshape(b * s, 1, d)
    sin = sin.expand(b, 1, s, d).reshape(b * s, 1, d)
    out = torch.empty_like(rows, memory_format=torch.contiguous_format)
    n = max(1, chunk_elements() // (h * d))  # CHUNK_ELEMENTS a thread: each product's share stays in cache
    buf = rows.new_empty(min(n, b * s), h, d)
    for i in range(0, b * s, n):
        o, tmp = out[i : i + n], buf[: min(n, b * s - i)]
        torch.mul(rows[i : i + n], cos[i : i + n], out=o)
        torch.mul(rows[i : i + n], sin[i : i + n], out=tmp)
        if forward:  # rotate_half(x) = (-x2, x1): out1 = x1 c - x2 s, out2 = x2 c + x1 s
            o[..., :half].sub_(tmp[..., half:])
            o[..., half:].add_(tmp[..., :half])
        else:  # its transpose (g2, -g1): dx1 = g1 c + g2 s, dx2 = g2 c - g1 s
            o[..., :half].add_(tmp[..., half:])
            o[..., half:].sub_(tmp[..., :half])
    return out.view(b, s, h, d).transpose(1, 2)


class RotaryFunction(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin as Hugging Face computes it, for one of q and k."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, swapped_sin: torch.Tensor) -> torch.Tensor:
        # One (B, 1, S, D) pair for every layer of the model, as autograd keeps for Hugging Face's.
        ctx.save_for_backward(cos, sin)
        return _rotated(x, cos, swapped_sin, forward=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotated(grad, cos, sin, forward=False), None, None, None


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """transformers' apply_rotary_pos_emb: (q, k) rotated; the fused operation where it computes the
    same ((B, H, S, D) q and k in cos's dtype, an even head size), else Hugging Face's own."""
    from transformers.models.llama import modeling_llama

    if unsqueeze_dim != 1 or q.dim() != 4 or q.shape[-1] % 2 or not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = q.shape[-1] // 2
    swapped = torch.cat((sin[..., half:], sin[..., :half]), -1)  # small: (B, 1, S, D)
    return RotaryFunction.apply(q, cos, sin, swapped), RotaryFunction.apply(k, cos, sin, swapped)


def _llama_attention_forward(
    self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs
):
    """transformers' LlamaAttention.forward (5.x) line for line, but for the rotary embedding (the
    names it reads from its module's globals read from the module of the class it replaces)."""
    llama = sys.modules[type(self).__module__]

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

    attention_interface = llama.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, llama.eager_attention_forward
    )

    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


def install(model) -> int:
    """Swaps in the fused rotary embedding on every module of `model` that runs Llama's attention
    with Llama's rotary embedding; how many."""
    from transformers.models.llama import modeling_llama

    from raytrain_cpu.model.loading import install_forward, same_forward, same_source

    def runs_llama_attention(m) -> bool:
        module = sys.modules[type(m).__module__]
        return same_forward(type(m), modeling_llama.LlamaAttention) and same_source(
            getattr(module, "apply_rotary_pos_emb", None), modeling_llama.apply_rotary_pos_emb
        )

    return install_forward(model, runs_llama_attention, _llama_attention_forward)
