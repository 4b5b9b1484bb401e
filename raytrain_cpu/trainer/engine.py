"""The DeepSpeed engine: its config, its communication on the process group, the engine and its
LR scheduler, and the sums every rank all-reduces over that group.

Ray Train has already created the gloo process group (compat.ray_backend.GlooConfig); DeepSpeed
reuses it rather than starting its own, so there is exactly one group and one timeout to reason
about. Outside Ray (bench, planner calibration, tests) init_local_group makes the same group.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrain_cpu.compat import deepspeed_zero3
from raytrain_cpu.config.checks import ConfigError, resolve_hpz_partition
from raytrain_cpu.config.schema import Config
from raytrain_cpu.trainer.schedule import lr_factor
from raytrain_cpu.trainer.state import Worker

# ----------------------------------------------------------------------------- the process group


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a local group's rendezvous (init_local_group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_group(rank: int, world: int, port: int, timeout_s: float = 120) -> None:
    """Outside Ray (bench, planner calibration, tests): the environment Ray Train gives each
    worker, and the gloo group it creates, among processes on this machine."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world, "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in env.items()} | {"MASTER_ADDR": "127.0.0.1", "DS_ACCELERATOR": "cpu"})
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def allreduce_sum(values: list[float]) -> list[float]:
    """Each value summed over every rank (an all-reduce: every rank calls it at once)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def rank_mean(w: Worker) -> Callable[[list[float]], list[float]]:
    """Each value's mean over the ranks (an all-reduce: every rank calls it at once), so every
    rank takes the same decision or logs the same rate."""
    return lambda values: [x / w.world for x in allreduce_sum(values)]


# ----------------------------------------------------------------------------- DeepSpeed


def _node_ranks() -> int:
    """The ranks on this worker's node (Ray Train's local world size, LOCAL_WORLD_SIZE; 0 if unset),
    checked equal on every node when the process group is up: deepspeed.hpz_partition_size=0 makes
    it the hpZ group's size, and ranks that disagreed would each make other groups and hang in
    DeepSpeed's new_group. An all-reduce: every rank calls it at once, as the worker does."""
    import os

    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        seen = torch.tensor([local, -local], dtype=torch.int64)
        dist.all_reduce(seen, op=dist.ReduceOp.MIN)
        if int(seen[0]) != -int(seen[1]):
            raise ConfigError(
                f"deepspeed.hpz_partition_size: 0 takes the ranks of one node, and the nodes run from {int(seen[0])} "
                f"to {-int(seen[1])} workers; run the same number on every node or give the size."
            )
    return local


def deepspeed_config(cfg: Config, world_size: int, universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed config the engine and transformers' sharded loading both read; `universal`
    when this attempt resumes a checkpoint saved for another number of workers (checkpoint.universal).
    deepspeed.hpz_partition_size=0 asks every rank for its node's rank count (an all-reduce when
    the process group is up, so every rank must build the config at once, as the worker does)."""
    t, ds = cfg.train, cfg.deepspeed
    zero: dict[str, Any] = {
        "stage": ds.zero_stage,
        "overlap_comm": ds.overlap_comm,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
    }
    if ds.zero_stage == 3:
        zero |= {
            "stage3_param_persistence_threshold": ds.param_persistence_threshold,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_max_live_parameters": ds.max_live_parameters,
            "stage3_gather_16bit_weights_on_model_save": False,
            "sub_group_size": ds.sub_group_size,
        }
        hpz = resolve_hpz_partition(
            ds.hpz_partition_size, world_size, _node_ranks() if not ds.hpz_partition_size else 0
        )
        if hpz > 1:  # DeepSpeed's default is 1; leaving it out keeps flat configs as they were
            zero["zero_hpz_partition_size"] = hpz
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": t.derive_global_batch(world_size),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.model.dtype == "bf16"},
        # torch_adam: DeepSpeed's fused CPU Adam would JIT-compile C++ on every worker;
        # PyTorch's own fused AdamW (a CPU kernel since 2.4) needs no build. DeepSpeed
        # passes "fused" through to torch.optim.AdamW.
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "betas": list(t.betas),
                "eps": t.eps,
                "weight_decay": t.weight_decay,
                "torch_adam": True,
                "fused": t.fused_adamw,
            },
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if universal:
        conf["checkpoint"] = {"load_universal": True}
    if ds.config_file:
        extra = json.loads(Path(ds.config_file).read_text())
        for k, v in extra.items():
            if k in (
                "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps",
                "train_batch_size",
                "optimizer",
                "bf16",
            ):
                continue  # owned by the raytrain config, so resume arithmetic stays right
            conf[k] = conf[k] | v if isinstance(v, dict) and isinstance(conf.get(k), dict) else v
    return conf


def init_deepspeed(
    shm: bool = False, timeout_s: float = 600, log: Callable[[str], None] = print, cross_node: str = "gloo"
) -> None:
    """DeepSpeed set up for an engine: its communication on the process group already set up (Ray
    Train's gloo group in the workers), which DeepSpeed must reuse, never calling a second
    init_process_group; and kept from importing its Muon optimizer (deepspeed_zero3.keep_muon_unimported).

    DeepSpeed's own shared-memory all-reduce serves inference only, and would JIT-compile C++
    in every process at start-up. `shm` routes the training collectives through
    raytrain_cpu.trainer.collectives instead, where all ranks share one machine; elsewhere
    `cross_node` "striped" (deepspeed.cross_node_collectives) spreads ZeRO's all-gathers and
    reduce-scatters over several gloo groups, so that more than one TCP flow crosses each node.
    """
    import deepspeed

    deepspeed_zero3.skip_shm_op_probe()
    deepspeed_zero3.keep_muon_unimported()
    deepspeed_zero3.reuse_hpz_group()  # DPO's reference is a second model under the same hpZ group
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    if shm or cross_node != "gloo":
        from raytrain_cpu.trainer import collectives

        if shm:
            collectives.install(timeout_s, log, cross_node=cross_node)
        else:
            collectives.install_cross_node(cross_node, log)


def param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on norms (1-D tensors); ZeRO-3 params keep their real shape in ds_shape."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        shape = getattr(p, "ds_shape", p.shape)
        (decay if len(shape) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_step_count(engine) -> int | None:
    """Adam's step counter as restored into the optimizer (proves its state came back)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = [int(st["step"]) for st in inner.state.values() if "step" in st]
    return max(steps) if steps else None


def optimizer_state_bytes(engine) -> int:
    """Bytes this rank's optimizer holds: fp32 master partitions and AdamW's moments (what LoRA shrinks)."""
    import torch

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    seen: set[int] = set()
    total = 0
    tensors = [p for g in inner.param_groups for p in g["params"]]
    tensors += [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def build_engine(w: Worker, model, ds_config: dict[str, Any]):
    """The DeepSpeed engine and LR scheduler; only trainable parameters reach the optimizer."""
    import deepspeed
    import torch

    from raytrain_cpu.host import memory as host_memory
    from raytrain_cpu.model.loading import decoder_layers, mark_layers_as_zero3_leaves
    from raytrain_cpu.trainer import setup as worker_setup

    t, m = w.cfg.train, w.cfg.model
    layers = decoder_layers(model)
    compile_layers = m.compile is True and m.compile_scope == "layers" and bool(layers)
    # Compiled layers need whole-layer gathers: per-module hooks would break the graph at every projection.
    if w.cfg.deepspeed.zero_stage == 3 and (w.cfg.deepspeed.gather_whole_layers or compile_layers):
        leaves = mark_layers_as_zero3_leaves(model, layers)
        w.log(f"[engine] ZeRO-3 gathers whole layers: {', '.join(leaves) or 'no layer class found, per module'}")
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, t.weight_decay),
        config=ds_config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, t, t.max_steps)),
        dist_init_required=False,
    )
    # from_pretrained hands back a model in eval mode: without this, dropout and activation
    # checkpointing stay off until the first evaluation switches the model back.
    engine.train()
    deepspeed_zero3.reuse_reduce_scatter_buffer(
        w.cfg.deepspeed.reuse_reduce_buffer, int(ds_config["zero_optimization"]["reduce_bucket_size"])
    )
    if w.cfg.deepspeed.reuse_fp32_grad_buffer:
        kept = deepspeed_zero3.reuse_fp32_grad_buffer(engine)
        if kept:
            size = f"{kept / 2**30:.2f} GiB" if kept >= 2**30 else f"{kept / 2**20:.1f} MiB"
            w.log(f"[engine] one fp32 gradient buffer of {size} per rank, reused every step")
    cache_dir = m.compile_cache_dir or str(w.run_dir.parent / "inductor_cache")
    if compile_layers:
        auto = (
            " (model.compile=auto; model.compile=false turns it off)"
            if w.loop_config["config"]["model"]["compile"] == "auto"
            else ""
        )
        w.log(
            f"[engine] torch.compile: {worker_setup.compile_layers(layers, cache_dir)} decoder layers{auto}; the first steps compile"
        )
    elif m.compile is True:
        worker_setup.compile_engine(engine, cache_dir)
        w.log("[engine] torch.compile: the whole model")
    # The load's and the set-up's free pages go back now, a checkpoint's after each save; other
    # freed pages stay for the next step (host_memory.JEMALLOC_CONF). An evaluation's stay too: it makes
    # less than a training step, which reuses them.
    host_memory.release_free_memory()
    return engine, scheduler
