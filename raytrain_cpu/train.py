"""The per-worker training loop: config -> data -> model -> engine -> resume -> loop -> checkpoint.

Ray Train runs `train_loop` once per worker with a plain dict. Ray has already created the
gloo process group (TorchConfig(backend="gloo")); DeepSpeed reuses it rather than starting
its own, so there is exactly one group and one timeout to reason about.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

from raytrain_cpu import checkpoint as ckpt_io
from raytrain_cpu import export as export_io
from raytrain_cpu import metrics as obs
from raytrain_cpu.config import Config
from raytrain_cpu.guards import StabilityGuard
from raytrain_cpu.tokenizer import resolve_tokenizer_path

# ----------------------------------------------------------------------------- helpers


def lr_factor(step: int, cfg_train, max_steps: int | None = None) -> float:
    """Multiplier of train.lr after `step` optimizer steps (LambdaLR convention)."""
    total = max_steps or cfg_train.max_steps
    warmup = min(cfg_train.warmup_steps, max(1, total // 10)) if cfg_train.warmup_steps else 0
    floor = cfg_train.min_lr_ratio
    if warmup and step < warmup:
        return (step + 1) / warmup
    if cfg_train.schedule == "constant":
        return 1.0
    if cfg_train.schedule == "wsd":
        decay_start = total - max(1, int(cfg_train.decay_fraction * total))
        if step < decay_start:
            return 1.0
        t = (step - decay_start) / max(1, total - decay_start)
        return 1.0 - (1.0 - floor) * min(1.0, t)
    t = (step - warmup) / max(1, total - warmup)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


def deepspeed_config(cfg: Config, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config the engine and transformers' sharded loading both read."""
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
            "stage3_max_live_parameters": 1e9,
            "stage3_gather_16bit_weights_on_model_save": False,
        }
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": t.derive_global_batch(world_size),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.model.dtype == "bf16"},
        # torch_adam: DeepSpeed's fused CPU Adam would JIT-compile C++ on every worker.
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "betas": list(t.betas),
                "eps": t.eps,
                "weight_decay": t.weight_decay,
                "torch_adam": True,
            },
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
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


def _param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on norms (1-D tensors); ZeRO-3 params keep their real shape in ds_shape."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        shape = getattr(p, "ds_shape", p.shape)
        (decay if len(shape) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _allreduce_sum(values: list[float]):
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def _optimizer_step(engine) -> int | None:
    """Adam's step counter as restored into the optimizer (proves its state came back)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = [int(st["step"]) for st in inner.state.values() if "step" in st]
    return max(steps) if steps else None


def evaluate(engine, shard, micro: int, max_batches: int) -> dict[str, float]:
    """Token-weighted loss over every rank's eval blocks (sums, not an average of averages)."""
    import torch

    engine.eval()
    loss_sum = tokens = 0.0
    with torch.no_grad():
        for i, batch in enumerate(shard.iter_torch_batches(batch_size=micro, dtypes=torch.long)):
            if max_batches and i >= max_batches:
                break
            x = batch["input_ids"]
            out = engine(input_ids=x, labels=x)
            n = x.numel() - x.shape[0]  # targets per block: seq_len - 1
            loss_sum += float(out.loss.detach()) * n
            tokens += n
    engine.train()
    loss_sum, tokens = _allreduce_sum([loss_sum, tokens])
    loss = loss_sum / max(tokens, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": int(tokens)}


# ----------------------------------------------------------------------------- the loop


def train_loop(loop_config: dict[str, Any]) -> None:
    # ---- config
    import ray.train
    import torch
    import torch.distributed as dist

    cfg = Config.from_dict(loop_config["config"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run_dir = Path(loop_config["run_dir"])
    t = cfg.train
    micro, accum = t.micro_batch_size, t.grad_accum_steps
    global_batch = t.derive_global_batch(world)
    seq_len = cfg.data.seq_len
    torch.manual_seed(t.seed + rank)
    is_main = rank == 0
    log = (lambda msg: obs.console(f"[rank 0] {msg}")) if is_main else (lambda msg: None)
    # torch 2.13 warns on every DeepSpeed all-gather / reduce-scatter, from every rank: a flood, not news.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)

    # ---- CPU: threads on the physical cores this worker owns, and the dtype this CPU runs fastest
    from raytrain_cpu import cpu

    # A resumed run keeps its checkpoint's dtype (an unreadable checkpoint fails in the resume section).
    restored = ray.train.get_checkpoint()
    manifest_path = Path(restored.path) / ckpt_io.MANIFEST if restored is not None else None
    resumed_dtype = (
        json.loads(manifest_path.read_text()).get("dtype") if manifest_path and manifest_path.is_file() else None
    )
    cpu_setup = cpu.setup_worker(
        cfg.model.dtype,
        loop_config["model_dir"],
        micro * seq_len,
        loop_config["threads_per_worker"],
        ctx.get_local_rank(),
        ctx.get_local_world_size(),
        cfg.scaling.pin_cores,
        agree=lambda v: [x / world for x in _allreduce_sum(v)],  # every rank takes the same decision
        resumed_dtype=resumed_dtype,
    )
    cfg.model.dtype = cpu_setup["dtype"]["dtype"]  # the DeepSpeed config, load dtype and manifests follow
    loop_config["peak_flops"] = loop_config.get("peak_flops") or cpu_setup["dtype"]["peak_flops_per_s"]
    obs.console(cpu.describe_setup(rank, cpu_setup))

    # ---- data: this rank's blocks in their global order (built on the driver)
    train_shard = ray.train.get_dataset_shard(f"train_rank{rank}")
    eval_shard = ray.train.get_dataset_shard(f"eval_rank{rank}") if loop_config["has_eval"] else None

    # ---- model: loaded straight into ZeRO-3 partitions
    import deepspeed

    from raytrain_cpu.model import load_sharded

    # DeepSpeed's shared-memory all-reduce serves inference only, and would JIT-compile C++
    # on every worker at start-up; training collectives go through gloo.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # reuses Ray's group
    ds_config = deepspeed_config(cfg, world)
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    t_load = time.perf_counter()
    log(f"[load] loading {loop_config['model_dir']} into ZeRO-{cfg.deepspeed.zero_stage} shards on {world} ranks")
    cpu.reset_peak_rss()  # so the peak below is the loading's own
    model, hf_ds_config = load_sharded(loop_config["model_dir"], ds_config, dtype)
    # Every rank's loading peak, gathered with a one-hot sum (summary.json: cpu.load_peak_rss_bytes).
    load_peaks = _allreduce_sum([float(cpu.peak_rss_bytes()) if r == rank else 0.0 for r in range(world)])
    if cfg.model.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    load_s = time.perf_counter() - t_load
    log(f"[load] sharded load done in {load_s:.1f}s; rank 0 holds {obs.process_memory()['rss'] / obs.GIB:.2f} GiB")

    # ---- engine
    max_steps = t.max_steps
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=_param_groups(model, t.weight_decay),
        config=ds_config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, t, max_steps)),
        dist_init_required=False,
    )
    # from_pretrained hands back a model in eval mode: without this, dropout and activation
    # checkpointing stay off until the first evaluation switches the model back.
    engine.train()
    if cfg.model.compile:
        cpu.compile_engine(engine, cfg.model.compile_cache_dir or str(run_dir.parent / "inductor_cache"))

    # ---- resume from the checkpoint Ray hands back (never DeepSpeed's `latest`)
    # Checkpoints live in Ray's experiment directory (the run dir) so they can be reported in place.
    ckpt_root = Path(ctx.get_storage().experiment_fs_path)
    step, resumed_from, last_ckpt = 0, None, None
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:  # shared storage: the directory itself, not a copy
            # Verified against its manifest first; incomplete or foreign checkpoints fail loudly.
            manifest = ckpt_io.load_into(engine, d, rank, world, loop_config["config_hash"])
        step = resumed_from = manifest["step"]
        last_ckpt = Path(restored.path)
        log(f"resumed from {restored.path} at step {step} (optimizer at step {_optimizer_step(engine)})")
    # After a restart inside this driver run, Ray replays each rank's stream from the driver's start.
    skip_batches = ckpt_io.batches_to_skip(loop_config["start_position"], step, global_batch, accum)
    opt_step_at_resume = _optimizer_step(engine) if resumed_from is not None else None
    # Kept open for the whole loop (flushed at each checkpoint), hence no `with`.
    block_log = open(run_dir / "block_ids" / f"rank{rank}.txt", "a") if loop_config["record_block_ids"] else None  # noqa: SIM115

    # ---- loop
    n_params = loop_config["n_params"]
    tokens_per_step = global_batch * seq_len
    batches = iter(
        train_shard.iter_torch_batches(
            batch_size=micro,
            prefetch_batches=cfg.data.prefetch_batches,
            dtypes=torch.long,
            drop_last=False,
        )
    )
    for _ in range(skip_batches):
        next(batches)
    expected_first = step * global_batch + rank * micro  # see data.StreamPlan
    t_start = time.perf_counter()
    window_t, window_tokens, window_wait = time.perf_counter(), 0, 0.0
    total_wait = 0.0
    first_batch_wait = None
    last: dict[str, Any] = {}
    eval_metrics: dict[str, Any] = {}
    steps_this_attempt = 0
    # Observability: rank 0 writes the sinks; every rank runs the guard (its decisions come
    # from all-reduced values, so all ranks skip or stop together).
    sink = obs.MetricsSink.for_run(cfg, run_dir, resume_step=step, log=log) if is_main else None

    def on_guard_event(event) -> None:
        if sink is not None:
            sink.write({**event.row(), "time": time.time()})
            log(event.message())

    guard = StabilityGuard(cfg.guards, _allreduce_sum, world, rank, cfg.deepspeed.zero_stage, on_event=on_guard_event)
    progress = obs.Progress(max_steps, start_step=step)
    peak_flops = loop_config.get("peak_flops")  # per worker; MFU is logged only when it is known
    preemption_check, saved_on_notice = cfg.run.preemption_check_every, False
    # Step-time breakdown (summary.json: step_breakdown); collectives only with train.profile_breakdown.
    clock = cpu.StepClock(cpu.CommTimer().install() if t.profile_breakdown else None)
    while step < max_steps:
        clock.start_step()
        step_losses = []
        for micro_i in range(accum):
            t_wait = time.perf_counter()
            batch = next(batches)
            wait = time.perf_counter() - t_wait
            if first_batch_wait is None:
                # The first batch waits for the Ray Data pipeline to start: reported on its own,
                # so data_wait_frac measures the steady-state stall.
                first_batch_wait, wait = wait, 0.0
                t_start += first_batch_wait
            window_wait += wait
            total_wait += wait
            clock.add("data_wait", wait)
            x = batch["input_ids"]
            if expected_first is not None:  # the stream must start at the first unconsumed block
                if int(batch["pos"][0]) != expected_first:
                    raise RuntimeError(
                        f"rank {rank}: data stream starts at position {int(batch['pos'][0])}, expected "
                        f"{expected_first} after {step} steps; the data cache changed under the run."
                    )
                expected_first = None
            if block_log is not None:
                block_log.write("\n".join(map(str, batch["block_id"].tolist())) + "\n")
            t_phase = time.perf_counter()
            loss = engine(input_ids=x, labels=x).loss
            step_losses.append(float(loss.detach()))
            clock.add("forward", time.perf_counter() - t_phase)
            last_micro = micro_i == accum - 1
            # The guard all-reduces the step's loss on the last micro batch and may poison it
            # (skip: NaN gradients make DeepSpeed drop the update on every rank).
            loss = guard.before_backward(step + 1, step_losses, loss, last_micro)
            t_phase = time.perf_counter()
            engine.backward(loss)
            clock.add("backward", time.perf_counter() - t_phase)
            if last_micro:
                guard.before_step(step + 1, engine)
            t_phase = time.perf_counter()
            engine.step()
            clock.add("optimizer_step", time.perf_counter() - t_phase)
        step += 1
        steps_this_attempt += 1
        window_tokens += tokens_per_step
        guard.after_step(step, engine, scheduler)
        clock.end_step()

        # ---- log (every rank joins the all-reduces; rank 0 writes)
        if step % t.log_every == 0 or step == max_steps or guard.stop_reason:
            dt = time.perf_counter() - window_t
            grad_norm = engine.get_global_grad_norm()
            mem = obs.process_memory()
            mem_max, peak_max = obs.allreduce_max([mem["rss"], mem["hwm"]])
            last = {
                "step": step,
                "loss": guard.step_loss,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens_seen": step * tokens_per_step,
                "tokens_per_s": window_tokens / dt,
                "data_wait_frac": window_wait / dt,
                "time": time.time(),
                "mem_rss_rank0_gib": mem["rss"] / obs.GIB,
                "mem_rss_max_gib": mem_max / obs.GIB,
                "mem_peak_max_gib": peak_max / obs.GIB,
                "skipped_steps": engine.skipped_steps,
            }
            mfu = obs.mfu(last["tokens_per_s"], n_params, seq_len, peak_flops and peak_flops * world)
            if mfu is not None:
                last["mfu"] = mfu
            if sink is not None:
                sink.write(last)
                log(progress.line(last, progress.update(step)))
            window_t, window_tokens, window_wait = time.perf_counter(), 0, 0.0
        if guard.stop_reason:
            log(f"stopping: {guard.stop_reason}")
            break  # every rank reaches this at the same step: the decision was all-reduced

        # ---- eval
        if eval_shard is not None and ((t.eval_every and step % t.eval_every == 0) or step == max_steps):
            eval_metrics = evaluate(engine, eval_shard, micro, t.eval_batches)
            if sink is not None:
                sink.write({"step": step, **eval_metrics, "time": time.time()})
                log(f"step {step} eval loss {eval_metrics['eval_loss']:.4f} ppl {eval_metrics['eval_perplexity']:.2f}")

        # ---- checkpoint: periodic, final, or at once on a spot notice (every rank saves and reports)
        reason = (
            "final"
            if step == max_steps
            else "periodic"
            if t.checkpoint_every and step % t.checkpoint_every == 0
            else None
        )
        if reason is None and preemption_check and step % preemption_check == 0 and not saved_on_notice:
            # A barrier across workers: Ray's answer for rank 0 becomes every rank's answer.
            notice = ray.train.get_preemption_info()
            if notice is not None:
                reason, saved_on_notice = "preemption", True
                log(f"spot notice: nodes {notice.preempted_node_ids} go at {notice.deadline_ms} ms; checkpointing now")
        if reason:
            manifest = {
                "step": step,
                "reason": reason,
                "world_size": world,
                "global_batch": global_batch,
                "blocks_consumed": step * global_batch,
                "tokens_seen": step * tokens_per_step,
                "config_hash": loop_config["config_hash"],
                "zero_stage": cfg.deepspeed.zero_stage,
                "dtype": cfg.model.dtype,
                "model_dir": loop_config["model_dir"],
                "tokenizer": resolve_tokenizer_path(cfg.model.tokenizer, loop_config["model_dir"]),
                "time": time.time(),
            }
            wall = time.perf_counter() - t_start
            report = {
                "step": step,
                "loss": last.get("loss"),
                "tokens_seen": step * tokens_per_step,
                "train_wall_s": wall,
                "tokens_per_s": steps_this_attempt * tokens_per_step / wall,
                "data_wait_frac": total_wait / wall,
                **eval_metrics,
            }
            if block_log is not None:
                block_log.flush()
            last_ckpt = ckpt_io.save_and_report(engine, ckpt_root, step, manifest, report, rank, world, last_ckpt)

    # ---- the trained model's logits on its last batch, to check the export against (every rank: ZeRO-3)
    export_probe = export_io.probe_logits(engine, x) if cfg.run.export_on_finish and steps_this_attempt else None

    # ---- step-time breakdown, averaged over ranks (every rank joins the all-reduce)
    breakdown = clock.summary()
    if clock.comm is not None:
        clock.comm.uninstall()
    keys = [k for k, v in breakdown.items() if isinstance(v, float)]
    breakdown |= dict(zip(keys, (v / world for v in _allreduce_sum([breakdown[k] for k in keys])), strict=True))
    breakdown["tokens_per_s"] = tokens_per_step / breakdown["step_wall_s"] if breakdown["steps"] else None

    # ---- summary (rank 0 hands the figures to the driver through the last report)
    if is_main:
        summary = {
            "steps": step,
            "tokens_seen": step * tokens_per_step,
            "final_loss": last.get("loss"),
            "eval_loss": eval_metrics.get("eval_loss"),
            "eval_perplexity": eval_metrics.get("eval_perplexity"),
            "tokens_per_s": steps_this_attempt * tokens_per_step / max(time.perf_counter() - t_start, 1e-9),
            "data_wait_frac": total_wait / max(time.perf_counter() - t_start, 1e-9),
            "first_batch_wait_s": first_batch_wait,
            "world_size": world,
            "global_batch": global_batch,
            "resumed_from_step": resumed_from,
            "optimizer_step_at_resume": opt_step_at_resume,
            "load_s": load_s,
            "n_params": n_params,
            "train_wall_s": time.perf_counter() - t_start,
            "guard_events_this_attempt": guard.counts,
            "skipped_steps": engine.skipped_steps,  # DeepSpeed's count, kept across resumes
            "guard_stop": guard.stop_reason,
            "step_breakdown": breakdown,  # seconds per optimizer step after the first, mean over ranks
            "cpu": {**cpu_setup, "load_peak_rss_bytes": load_peaks},
        }
        (run_dir / ".worker_summary.json").write_text(json.dumps(summary, indent=2))
    if sink is not None:
        sink.close(finished=guard.stop_reason is None)
    dist.barrier()
    del hf_ds_config
    if is_main and cfg.run.export_on_finish and last_ckpt is not None:
        del engine, model  # free this rank's shard before consolidating the whole model
        export_io.export_on_finish(
            last_ckpt, run_dir, export_probe if last_ckpt.name.endswith(f"_{step:06d}") else None, log
        )
