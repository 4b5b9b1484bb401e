"""`plan --measure`: this machine's own rates for the step model (planner.steptime.Rates), timed at
the run's shapes and thread count.

- compute: the model's own decoder layer and output head, built from its shape with the kernels
  the trainers install (attention pick, fused loss, norms, rotary), forward + backward at the
  micro batch; the step's compute is the head plus `num_layers` layers. Against the GEMM time of
  the same shapes (host.gemm) it gives the share that is not GEMM.
- optimizer: PyTorch's fused AdamW and clipping over a partition-sized set of fp32 tensors.
- shared memory: a rank's collective through /dev/shm copies its payload in and the others' out,
  which runs at this machine's copy bandwidth (timed as one large tensor copy).
- loopback: gloo between two processes of this machine (TCP over 127.0.0.1), an all-gather's
  payload per second.

Each figure is timed once, after a warm-up, on a quiet machine: on a shared one they read low.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from raytrain_cpu.model.shape import ModelShape, llama_gemms
from raytrain_cpu.planner.steptime import Rates

# ----------------------------------------------------------------------------- compute


def _layers_model(shape: ModelShape, layers: int, seq_len: int):
    """A bf16 Llama of `shape` cut to `layers` decoder layers, with the trainers' kernels."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from raytrain_cpu.model.ops import attention, loss, norm, rotary
    from raytrain_cpu.planner import memory

    config = LlamaConfig(
        **(shape.llama_config() | {"num_hidden_layers": layers}),
        max_position_embeddings=max(2048, seq_len),
        rms_norm_eps=1e-5,
    )
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    return model, config, (attention, loss, norm, rotary, memory)


def time_compute(
    shape: ModelShape,
    micro_batch: int,
    seq_len: int,
    activation_checkpointing: bool = False,
    lora_rank: int = 0,
    reps: int = 3,
) -> dict[str, float]:
    """Seconds of forward + backward for one micro batch: the output head and embeddings, and one
    decoder layer (a 2-layer model less a 1-layer one). `lora_rank`: the project's LoRA adapters
    on the default projections, the base frozen (no weight gradients; the adapters' own products
    and casts run)."""
    import torch

    times, picks = {}, {}
    for layers in (1, 2):
        model, config, (attention, loss, norm, rotary, memory) = _layers_model(shape, layers, seq_len)
        if lora_rank:  # as the trainers: the adapters first, then the kernels on the wrapped model
            from raytrain_cpu.config.model import LoraSettings
            from raytrain_cpu.model.lora import apply_lora

            model = apply_lora(model, LoraSettings(rank=lora_rank), "planner.measure")
        keep = memory.probs_keeper(config, seq_len, activation_checkpointing, "auto")
        picks[layers], _ = attention.choose(model, "auto", micro_batch, seq_len, keep_probs=keep)
        loss.install(model.get_base_model() if lora_rank else model)
        norm.install(model)
        rotary.install(model)
        if activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(0, shape.vocab_size, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
        best = float("inf")
        for i in range(reps + 1):
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
            if i:  # the first call allocates and warms oneDNN's kernels
                best = min(best, time.perf_counter() - t0)
        times[layers] = best
    layer = max(times[2] - times[1], 1e-9)
    return {"layer_s": layer, "head_s": max(times[1] - layer, 0.0), "attention": picks[2]}


# ----------------------------------------------------------------------------- optimizer and copies


def time_optimizer(params: int = 20_000_000) -> float:
    """Seconds per parameter of a ZeRO bf16 optimizer step over a rank's partition, as DeepSpeed
    runs it: the bf16 gradients cast into an fp32 buffer, their norm and clipping, PyTorch's
    fused AdamW on the fp32 master copy and moments, the master copied back into the bf16
    weights (in chunks of ~4M elements, as its sub groups)."""
    import torch

    chunk = 4_000_000
    sizes = [min(chunk, params - i) for i in range(0, params, chunk)]
    master = [torch.zeros(n, requires_grad=True) for n in sizes]
    weights = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    grads = [torch.full((n,), 1e-3, dtype=torch.bfloat16) for n in sizes]
    for m in master:
        m.grad = torch.empty_like(m)
    opt = torch.optim.AdamW(master, lr=1e-4, fused=True)
    best = float("inf")
    for i in range(4):
        t0 = time.perf_counter()
        for m, g in zip(master, grads):
            m.grad.copy_(g)
        torch.nn.utils.clip_grad_norm_(master, 1.0, foreach=True)
        opt.step()
        with torch.no_grad():
            for w, m in zip(weights, master):
                w.copy_(m)
        if i:
            best = min(best, time.perf_counter() - t0)
    return best / params


def time_copy(nbytes: int = 64 << 20) -> float:
    """Bytes per second of one large tensor copy (what a shared-memory collective runs at)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        if i:
            best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _gloo_rank(rank: int, port: int, nbytes: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(nbytes // 4, dtype=torch.bfloat16)
    y = torch.empty(x.numel() * 2, dtype=torch.bfloat16)
    best = float("inf")
    for i in range(4):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(y, x)
        if i:
            best = min(best, time.perf_counter() - t0)
    if rank == 0:
        out.put(nbytes / 2 / best)  # (g-1)/g of the payload crossed the link: Collective.link_bytes
    dist.destroy_process_group()


def time_loopback(nbytes: int = 32 << 20) -> float:
    """Payload bytes per second of a 2-rank gloo all-gather over TCP loopback."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, nbytes, out)) for r in range(2)]
    for p in procs:
        p.start()
    rate = out.get(timeout=120)
    for p in procs:
        p.join(60)
    return rate


# ----------------------------------------------------------------------------- all of it


def _rank_timings(
    rank: int, shape: ModelShape, micro_batch: int, seq_len: int, ac: bool, lora_rank: int, threads: int, out
) -> None:
    """One of the run's ranks on this machine: its compute, GEMM rate and optimizer, timed while
    the others time theirs (they share the memory bandwidth and caches, as in the run)."""
    import torch

    from raytrain_cpu.host import gemm as host_gemm

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    compute = time_compute(shape, micro_batch, seq_len, ac, lora_rank)
    probe = host_gemm.gemm_probe(_gemm_mix(shape, micro_batch * seq_len), torch.bfloat16, min_time_s=0.1)
    out.put((rank, compute | {"flops_per_s": probe["flops_per_s"], "optimizer_s_per_param": time_optimizer()}))


def _timings(shape: ModelShape, micro_batch: int, seq_len: int, ac: bool, lora_rank: int, threads: int, ranks: int):
    """Every local rank's timings, measured at once in `ranks` processes (spawned: a fresh torch
    each, as the workers have); the slowest rank's, which sets a synchronous step's pace."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (shape, micro_batch, seq_len, ac, lora_rank, threads, out)
    procs = [ctx.Process(target=_rank_timings, args=(r, *args)) for r in range(ranks)]
    for p in procs:
        p.start()
    results = [out.get(timeout=1800)[1] for _ in procs]
    for p in procs:
        p.join(60)
    return max(results, key=lambda r: r["head_s"] + shape.num_layers * r["layer_s"])


def _gemm_mix(shape: ModelShape, tokens: int) -> list:
    """One decoder layer's and the output head's training GEMMs (forward, input and weight
    gradients), the token dimension capped and the largest operands left out as the start-up
    probe does (an 8B head's would take GBs): their rate, not their count, is what is timed."""
    from raytrain_cpu.host.gemm import PROBE_MAX_BYTES, fp32_operand_bytes

    gemms = llama_gemms(
        shape.hidden_size,
        shape.intermediate_size,
        shape.num_heads,
        shape.num_kv_heads,
        shape.vocab_size,
        1,
        min(tokens, 2048),
        head_dim=shape.attention_head_dim,
    )
    return [g for g in gemms if fp32_operand_bytes(g.m, g.k, g.n) <= PROBE_MAX_BYTES]


def measure_rates(
    shape: ModelShape,
    micro_batch: int,
    seq_len: int,
    activation_checkpointing: bool = False,
    lora_rank: int = 0,
    threads: int = 0,
    loopback: bool = True,
    host: str = "",
    ranks: int = 1,
) -> tuple[Rates, dict[str, Any]]:
    """This machine's Rates at `threads` intra-op threads (0: torch's current), and the raw timings;
    `ranks` > 1 times that many ranks at once (the run's ranks on this machine), each at `threads`.

    The non-GEMM share is what the measured forward + backward (head plus every layer) spends
    beyond the model's weight GEMMs at the timed GEMM rate, so the step model gives back the
    measured compute at this shape, and scales it by FLOPs elsewhere."""
    import torch

    from raytrain_cpu.planner.steptime import gemm_flops_per_rank

    threads = threads or torch.get_num_threads()
    tokens = micro_batch * seq_len
    if ranks > 1:
        timed = _timings(shape, micro_batch, seq_len, activation_checkpointing, lora_rank, threads, ranks)
    else:
        from multiprocessing import Queue

        q: Any = Queue()
        _rank_timings(0, shape, micro_batch, seq_len, activation_checkpointing, lora_rank, threads, q)
        timed = q.get()[1]
    compute = {k: timed[k] for k in ("layer_s", "head_s", "attention")}
    flops_per_s = timed["flops_per_s"]
    measured_s = compute["head_s"] + shape.num_layers * compute["layer_s"]
    gemm_s = gemm_flops_per_rank(shape, tokens, activation_checkpointing, lora_rank > 0) / flops_per_s
    non_gemm = min(max(1.0 - gemm_s / measured_s, 0.0), 0.95)
    copy = time_copy()
    lo = time_loopback() if loopback else 0.0
    rates = Rates(
        source=f"measured on {host or 'this machine'}",
        threads=threads,
        gemm_flops_per_s=flops_per_s,
        non_gemm_share=non_gemm,
        optimizer_s_per_param=timed["optimizer_s_per_param"],
        shm_bytes_per_s=copy / 2,  # each byte written into the slot, then read out of the others'
        loopback_bytes_per_s=lo or copy / 8,
        flow_bytes_per_s=lo or copy / 8,
        nic_bytes_per_s=lo or copy / 8,
    )
    raw = compute | {
        "compute_s_per_micro_batch": measured_s,
        "gemm_s_per_micro_batch": gemm_s,
        "copy_bytes_per_s": copy,
        "loopback_bytes_per_s": lo,
    }
    return rates, raw
