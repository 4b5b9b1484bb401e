"""The model as a worker loads it: straight into ZeRO-3 partitions, LoRA adapters on top when
asked, then the attention, the fused loss and layer operations and the weight-gradient kernel
it runs with."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raytrain_cpu.checkpoint import identity as ckpt_identity
from raytrain_cpu.obs import metrics as obs
from raytrain_cpu.trainer import engine as eng
from raytrain_cpu.trainer.state import Worker


@dataclass
class Loaded:
    model: Any
    hf_ds_config: Any  # must stay referenced while the model lives (transformers holds it weakly)
    load_s: float
    load_peaks: list[float]  # every rank's peak RSS while loading
    params: dict[str, int]  # {"trainable", "total"}
    lora: dict[str, Any] | None  # the resolved LoRA settings, None for full fine-tuning
    attention: str  # the attention the model runs: 'sdpa' or attention.impl_name(block)
    # Full fine-tuning DPO: (the frozen starting model, its HfDeepSpeedConfig, kept as the model's).
    reference: tuple[Any, Any] | None = None


def load_model(w: Worker, ds_config: dict[str, Any]) -> Loaded:
    """The model, loaded straight into ZeRO-3 partitions; LoRA adapters on top when asked."""
    import torch

    from raytrain_cpu.host import memory as host_memory
    from raytrain_cpu.model import lora
    from raytrain_cpu.model import shape as model_shape
    from raytrain_cpu.model.loading import load_sharded

    cfg, model_dir = w.cfg, w.loop_config["model_dir"]
    ckpt_identity.check_model_dir(model_dir, w.loop_config.get("model"))  # as the run found it at its start
    eng.init_deepspeed(
        cfg.deepspeed.shm_collectives, cfg.run.gloo_timeout_s, w.log, cfg.deepspeed.cross_node_collectives
    )
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    t0 = time.perf_counter()
    w.log(f"[load] loading {model_dir} into ZeRO-{cfg.deepspeed.zero_stage} shards on {w.world} ranks")
    host_memory.reset_peak_rss()  # so the peak below is the loading's own
    model, hf_ds_config = load_sharded(model_dir, ds_config, dtype)
    settings = None
    if cfg.lora.enabled:
        # After the base weights are in their partitions (their names change under peft).
        model = lora.apply_lora(model, cfg.lora, model_dir)
        settings = lora.resolved_settings(model, cfg.lora)
    reference = None
    if w.reference_each_step and not cfg.lora.enabled:
        # DPO's reference for full fine-tuning: the starting model, which training changes. From
        # model_dir on every attempt, so a resumed run compares with the start, not its checkpoint.
        reference = load_sharded(model_dir, ds_config, dtype)
        w.log("[load] and a frozen copy of it: DPO's reference")
    # Every rank's loading peak, gathered with a one-hot sum (summary.json: cpu.load_peak_rss_bytes).
    peaks = eng.allreduce_sum([float(host_memory.peak_rss_bytes()) if r == w.rank else 0.0 for r in range(w.world)])
    attn = choose_attention(w, model)  # after the peak: its timing's tensors are not the loading's
    install_fused_loss(w, model)  # after LoRA: an adapted output layer keeps Hugging Face's loss
    install_fused_layer_ops(w, model)
    w.weight_grad_kernel = install_weight_grad_kernel(w, model)
    if cfg.model.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    load_s = time.perf_counter() - t0
    params = model_shape.param_counts(model)
    w.log(
        f"[load] sharded load done in {load_s:.1f}s; rank 0 holds {obs.process_memory()['rss'] / obs.GIB:.2f} GiB; "
        f"{params['trainable']:,} of {params['total']:,} parameters trainable"
        + (f" (LoRA rank {cfg.lora.rank} on {', '.join(settings['target_modules'])})" if settings else "")
    )
    return Loaded(model, hf_ds_config, load_s, peaks, params, settings, attn, reference)


def choose_attention(w: Worker, model) -> str:
    """model.attention on this model: 'auto' times SDPA, the causal blocks and the fused kernel here
    and every rank takes the fastest by the summed timings (raytrain_cpu.model.ops.attention); a resumed
    'auto' run keeps the attention (and block size) its checkpoint trained with, so its losses
    continue bit for bit, unless that was the fused kernel and it does not build here."""
    from raytrain_cpu.model.ops import attention
    from raytrain_cpu.planner import memory as plan

    m = w.cfg.model
    resumed = w.resumed.get("attention")
    # The fused kernel is kept only where it builds on every rank (a resumed run may have moved to
    # other hosts), which the ranks agree on: a rank that kept it while another timed afresh would
    # leave the other's all-reduce waiting.
    fused_here = resumed != attention.FUSED or not sum(
        eng.allreduce_sum([float(attention.fused_attention.kernel() is None)])
    )
    kept = (
        fused_here
        and m.attention == "auto"
        and (resumed in ("sdpa", attention.FUSED) or attention.block_of(resumed) is not None)
    )
    # model.attention_probs, per block size (the same bits either way)
    keep_probs = plan.probs_keeper(model.config, w.cfg.data.seq_len, m.activation_checkpointing, m.attention_probs)

    chosen, timings = attention.choose(
        model,
        resumed if kept else m.attention,
        w.cfg.train.micro_batch_size,
        w.cfg.data.seq_len,
        eng.rank_mean(w),
        keep_probs,
    )
    measured = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in timings.items())
    why = f" (forward + backward, mean of ranks: {measured})" if measured else ""
    if kept:
        why = f" (auto: kept from the checkpoint at step {w.resumed.get('step')})"
    elif not fused_here:
        here = attention.fused_attention.why_unavailable()
        why += f"; the checkpoint's fused kernel does not build on every rank{f' ({here})' if here else ''}"
    block = attention.block_of(chosen)
    probs = "" if block is None else f"; probabilities {'kept' if keep_probs(block) else 'recomputed'} for the backward"
    span = "; within each document" if w.cfg.data.attention_span == "document" else ""
    if span and block is not None and m.compile is True:  # the blocks take no mask while traced (attention.py)
        span += " (SDPA in the compiled layers: the blocks take no mask under torch.compile)"
    w.log(f"[model] attention: {chosen}{why}{probs}{span}")
    return chosen


def install_fused_loss(w: Worker, model) -> None:
    """model.fused_loss: the output layer and the loss as one chunked operation (raytrain_cpu.model.ops.loss)."""
    from raytrain_cpu.model.loading import unwrapped
    from raytrain_cpu.model.ops import loss

    if not w.cfg.model.fused_loss:
        w.log("[model] loss: Hugging Face's (model.fused_loss=false)")
        return
    causal_lm = unwrapped(model)
    why_not = loss.install(causal_lm)
    if why_not:
        w.log(f"[model] loss: Hugging Face's, not fused: {why_not}")
    else:
        rows = loss.chunk_rows(causal_lm.config.vocab_size)
        w.fused_loss = True
        w.log(f"[model] loss: fused with the output layer, up to {rows:,} tokens per chunk")
        if sum(e.weight > 0 for e in w.cfg.data.mix) > 1:  # it also hands back each row's loss: by source
            w.loss_sources = tuple(e.name for e in w.cfg.data.mix)


def install_fused_layer_ops(w: Worker, model, log: Callable[[str], None] | None = None) -> None:
    """model.fused_norm, model.fused_rotary, model.fused_mlp: Llama-style RMSNorms
    (raytrain_cpu.model.ops.norm), rotary embeddings (raytrain_cpu.model.ops.rotary) and SwiGLU activations
    (raytrain_cpu.model.ops.mlp) as one autograd operation each; compiled models keep Hugging Face's,
    which inductor fuses itself. `log`: w.log unless given."""
    from raytrain_cpu.model.ops import mlp, norm, rotary

    m, log = w.cfg.model, log or w.log
    for what, on, setting, install, kind in (
        ("norms", m.fused_norm, "model.fused_norm", norm.install, "RMSNorms"),
        ("rotary embeddings", m.fused_rotary, "model.fused_rotary", rotary.install, "rotary embeddings"),
        ("MLP activations", m.fused_mlp, "model.fused_mlp", mlp.install, "SwiGLU activations"),
    ):
        if not on or m.compile is True:
            why = f"{setting}=false" if not on else "inductor fuses them in compiled code"
            log(f"[model] {what}: Hugging Face's ({why})")
            continue
        n = install(model)
        log(f"[model] {what}: {n} fused {kind}" if n else f"[model] {what}: Hugging Face's (no Llama-style {kind})")


def install_weight_grad_kernel(w: Worker, model) -> bool:
    """model.weight_grad_kernel: the bf16 linear layers' weight gradients on raytrain_cpu.model.ops.linear's
    kernel (linear.choose: 'auto' on AMX for models of 20M parameters or more where it times faster
    than autograd's at the worker's threads and the model's shapes). Whether it is in use."""
    from raytrain_cpu.model.ops import linear

    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3: the whole size
    tokens = w.cfg.train.micro_batch_size * w.cfg.data.seq_len
    shapes = linear.linear_shapes(model)
    choice = linear.choose(
        w.cfg.model.weight_grad_kernel, w.cfg.model.dtype, n_params, shapes, tokens, eng.rank_mean(w)
    )
    w.weight_grad_timings = {**choice.timings, "threads": choice.threads} if choice.timings else {}
    if not choice.on:
        if choice.why:
            w.log(f"[model] weight gradients: autograd's ({choice.why})")
        return False
    n = linear.install(model)
    timed = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in choice.timings.items())
    why = f" (auto, mean of ranks at {choice.threads} threads: {timed})" if timed else " (model.weight_grad_kernel)"
    w.log(f"[model] weight gradients: the kernel on {n} bf16 linear layers{why}")
    return n > 0
