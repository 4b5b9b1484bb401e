"""transformers internals the project reaches into, each where transformers offers no public route.

transformers is imported inside the functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from raytrain_cpu.compat import written_for

written_for(__name__, "transformers", "5.23")


@contextlib.contextmanager
def no_zero3_weight_init() -> Iterator[None]:
    """Skips transformers' random init of a model built under ZeRO-3, by making
    `transformers.integrations.deepspeed.initialize_weights_zero3` a no-op while inside (where
    this transformers has none, its init runs: slower, same result).

    `from_config` initialises each module by gathering its parameters, drawing them on rank 0
    and scattering them again: most of a model's load time, and a full model's worth of
    traffic, for weights the checkpoint then overwrites. Non-persistent buffers (RoPE
    frequencies) are computed at construction and stay."""
    import transformers.integrations.deepspeed as hf_deepspeed

    original = getattr(hf_deepspeed, "initialize_weights_zero3", None)
    if original is None:
        yield
        return
    hf_deepspeed.initialize_weights_zero3 = lambda model: None
    try:
        yield
    finally:
        hf_deepspeed.initialize_weights_zero3 = original


def can_set_attn_implementation(model) -> bool:
    """Whether the model's class takes an attention implementation set at run time (its
    attention goes through ALL_ATTENTION_FUNCTIONS): `PreTrainedModel._can_set_attn_implementation`,
    which set_attn_implementation checks too but only reports by raising."""
    return bool(model._can_set_attn_implementation())
