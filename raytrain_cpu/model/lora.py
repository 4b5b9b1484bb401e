"""LoRA: peft adapters on a frozen base model that stays ZeRO-3 partitioned.

On the workers, `apply_lora` wraps the sharded model with peft after the base weights are
read into their partitions: peft freezes every base parameter and adds small A (r x in) and
B (out x r) matrices beside each targeted Linear, in fp32 even beside a bf16 base (peft's
autocast_adapter_dtype: the adapters' small updates survive, and their master weights are
the weights). They are created as ordinary tensors; `deepspeed.initialize` turns them into
ZeRO-3 parameters too, and only they reach
the optimizer (`trainer.engine.param_groups` skips frozen parameters), so optimizer state and
gradient traffic scale with the adapters, not the model. The base weights are still
all-gathered layer by layer in forward and backward, as in full fine-tuning.

On the driver, `check_lora` builds the model on the meta device (no memory, no weights) and
lets peft match `lora.target_modules` against it, so a target that matches nothing or a
layer type peft cannot wrap fails before Ray starts.

Export (`export.py`) works on the consolidated checkpoint, one tensor at a time:
`adapter_state` renames the adapters the way peft's `save_pretrained` does, and
`merged_state` folds W + (alpha / r) * B @ A into the base weights.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from typing import Any

from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.model import LoraSettings
from raytrain_cpu.model.shape import param_counts

ADAPTER = "default"  # peft's adapter name; the only adapter a run trains
PEFT_PREFIX = "base_model.model."


def peft_config(lora: LoraSettings | dict[str, Any], base_model: str = ""):
    """The peft LoraConfig for these settings (also what adapter_config.json holds)."""
    from peft import LoraConfig, TaskType

    d = lora if isinstance(lora, dict) else {k: getattr(lora, k) for k in ("rank", "alpha", "dropout")}
    targets = lora["target_modules"] if isinstance(lora, dict) else lora.target_modules
    return LoraConfig(
        r=d["rank"],
        lora_alpha=d["alpha"],
        lora_dropout=d["dropout"],
        target_modules=list(targets),
        task_type=TaskType.CAUSAL_LM,
        base_model_name_or_path=base_model or None,
        bias="none",
        fan_in_fan_out=bool(d.get("fan_in_fan_out", False)) if isinstance(d, dict) else False,
    )


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """peft asks transformers a deprecated question (`is_gradient_checkpointing`) on every wrap
    and every adapter load: a FutureWarning for transformers' maintainers, not for our users."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def _wrap(model, lora: LoraSettings, where: str):
    """get_peft_model with its errors turned into ConfigErrors that name the key and the fix."""
    import torch
    from peft import get_peft_model

    linear_names = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n}
    )
    conv1d_names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Conv1D"})
    try:
        with quiet_peft():
            return get_peft_model(model, peft_config(lora))
    except ValueError as e:
        if "not found in the base model" in str(e) or "No modules were targeted" in str(e):
            raise ConfigError(
                f"lora.target_modules: {lora.target_modules} match no module of {where}; its linear layers are "
                f"named {linear_names + conv1d_names}. Set lora.target_modules to some of those."
            ) from None
        if "not supported" in str(e):
            raise ConfigError(
                f"lora.target_modules: peft cannot put LoRA adapters on {where} ({str(e).splitlines()[0]}). "
                "Target its Linear layers only, or train it without LoRA (lora.rank=0)."
            ) from None
        raise


def check_lora(model_config, lora: LoraSettings, name: str) -> dict[str, int]:
    """Driver-side check on a meta-device model: targets match and peft can wrap them.

    Returns {"trainable": adapter parameters, "total": base + adapter parameters}.
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
    except Exception as e:  # an architecture transformers can't build is named by the loader later
        raise ConfigError(f"model.name_or_path: {name} cannot be built as a causal LM ({e}).") from None
    wrapped = _wrap(model, lora, name)
    return param_counts(wrapped)


def apply_lora(model, lora: LoraSettings, name: str):
    """Wraps a (ZeRO-3 partitioned) model with LoRA adapters; the base is frozen by peft."""
    return _wrap(model, lora, name)


def resolved_settings(model, lora: LoraSettings) -> dict[str, Any]:
    """What the manifest records: the settings plus peft's resolved choices (fan_in_fan_out for
    GPT-2's Conv1D weights, stored as (in, out)), so export can merge without peft's help."""
    pc = model.peft_config[ADAPTER]
    return {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "dropout": lora.dropout,
        "target_modules": sorted(pc.target_modules) if pc.target_modules else list(lora.target_modules),
        "fan_in_fan_out": bool(pc.fan_in_fan_out),
    }


# ----------------------------------------------------------------------------- export

_LORA_KEY = re.compile(rf"^(?P<module>.+)\.lora_(?P<ab>[AB])\.{ADAPTER}\.weight$")
_BASE_KEY = re.compile(r"^(?P<module>.+)\.base_layer\.(?P<param>weight|bias)$")


def adapter_state(state: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name in adapter_model.safetensors, lazy tensor) for every adapter tensor.

    peft's save_pretrained drops the adapter name: `...q_proj.lora_A.default.weight` is saved
    as `...q_proj.lora_A.weight`; the `base_model.model.` prefix stays.
    """
    for name, t in state.items():
        m = _LORA_KEY.match(name)
        if m:
            yield f"{m['module']}.lora_{m['ab']}.weight", t


def merged_state(state: dict[str, Any], settings: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(plain Hugging Face name, tensor) of the merged model: W + (alpha / r) * B @ A, in fp32.

    Tensors are produced one at a time (the caller writes them as they come); tied weights
    keep their shared identity so the writer can still skip the second name.
    """
    scale = settings["alpha"] / settings["rank"]
    for name, t in state.items():
        if _LORA_KEY.match(name):
            continue
        plain = name.removeprefix(PEFT_PREFIX)
        m = _BASE_KEY.match(plain)
        if m is None:
            yield plain, t
            continue
        plain = f"{m['module']}.{m['param']}"
        if m["param"] != "weight":
            yield plain, t
            continue
        a = state[f"{PEFT_PREFIX}{m['module']}.lora_A.{ADAPTER}.weight"].contiguous().float()
        b = state[f"{PEFT_PREFIX}{m['module']}.lora_B.{ADAPTER}.weight"].contiguous().float()
        delta = (b @ a) * scale
        w = t.contiguous().float()
        yield plain, w + (delta.T if settings.get("fan_in_fan_out") else delta)


def is_lora_state(names) -> bool:
    return any(_LORA_KEY.match(n) for n in names)
