"""One worker's attempt as phases: set up → load → engine → resume → steps (log, eval, checkpoint) → finish.

Ray Train runs raytrain_cpu.trainer.loop.train_loop once per worker with a plain dict; it builds
a Trainer from it (Trainer.from_ray) and calls `fit`, which runs the phases in order. The
Trainer holds the attempt's state: what it settled at the start (`w`, a state.Worker), what
changes as the loop runs (`st`, a state.Loop), and the engine, data and sinks between them.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint.damaged import choose_checkpoint, free_checkpoint_name
from raytrain_cpu.checkpoint.load import load_into
from raytrain_cpu.checkpoint.save import save_and_report
from raytrain_cpu.config.schema import Config
from raytrain_cpu.model import export as export_io
from raytrain_cpu.obs import metrics as obs
from raytrain_cpu.obs.guards import StabilityGuard
from raytrain_cpu.trainer.batches import model_inputs, next_batch, open_batches
from raytrain_cpu.trainer.engine import (
    allreduce_sum,
    build_engine,
    deepspeed_config,
    optimizer_state_bytes,
    optimizer_step_count,
    rank_mean,
)
from raytrain_cpu.trainer.evaluation import EvalWatch, Sampler, eval_line, evaluate, evaluate_pairs
from raytrain_cpu.trainer.loading import Loaded, load_model
from raytrain_cpu.trainer.mfu import retime_mfu_peak, time_mfu_peak
from raytrain_cpu.trainer.reference import build_reference
from raytrain_cpu.trainer.saving import (
    checkpoint_manifest,
    checkpoint_reason,
    checkpoint_report,
    ray_storage_path,
    universal_checkpoint,
)
from raytrain_cpu.trainer.schedule import apply_optimizer_settings, lr_held_line
from raytrain_cpu.trainer.state import FreePages, Loop, Worker
from raytrain_cpu.trainer.step import (
    add_by_source,
    loss_by_source,
    pair_metrics,
    preference_loss,
    profiled,
    step_counts,
)
from raytrain_cpu.trainer.summary import step_breakdown, write_worker_summary

LORA_FLOPS_FRACTION = 4 / 6  # forward (2) + input gradients (2) of full training's 6 FLOPs per parameter
REFERENCE_FLOPS_FRACTION = 2 / 6  # DPO's reference model: one more forward


class Trainer:
    """One worker's attempt. Every rank runs the same phases and joins the same collectives."""

    def __init__(self, w: Worker) -> None:
        self.w = w
        self.st = Loop()
        self.cpu_setup: dict[str, Any] = {}
        self.train_plan: Any = None  # data.stream.StreamPlan
        self.eval_streams: dict[str, Any] = {}  # data.stream.EvalStream by source
        self.ds_config: dict[str, Any] = {}
        self.loaded: Loaded | None = None
        self.engine: Any = None
        self.scheduler: Any = None
        self.batches: Any = None
        self.block_log: Any = None  # train.record_block_ids: this rank's block ids, a line each
        self.sink: obs.MetricsSink | None = None  # rank 0's
        self.guard: StabilityGuard | None = None
        self.progress: obs.Progress | None = None
        self.clock: Any = None  # the step-time breakdown (obs_timing.StepClock)
        self.free_pages: FreePages | None = None
        self.sampler: Sampler | None = None

    @classmethod
    def from_ray(cls, loop_config: dict[str, Any]) -> Trainer:
        """This worker's rank and config from Ray Train, and the checkpoint it resumes from."""
        import ray.train
        import torch

        cfg = Config.from_dict(loop_config["config"])
        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
        obs.log_choices(loop_config["run_dir"])  # which kernel and path each choice took: run.log, not the console
        log = (lambda msg: obs.console(f"[rank 0] {msg}")) if rank == 0 else (lambda msg: None)
        most = cfg.scaling.num_workers if cfg.elastic else 0
        if cfg.elastic:  # this attempt's own worker count, accumulating what keeps the global batch
            s = cfg.scaling
            train = replace(cfg.train, grad_accum_steps=cfg.accumulation_for(world))
            log(
                f"elastic: {world} of {s.min_workers} to {s.num_workers} workers, "
                f"grad_accum_steps {train.grad_accum_steps}"
            )
            cfg = replace(cfg, train=train, scaling=replace(s, num_workers=world, min_workers=0))
        torch.manual_seed(cfg.train.seed + rank)
        # torch warns on every DeepSpeed all-gather / reduce-scatter, from every rank: a flood, not news.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        restored = ray.train.get_checkpoint()
        # Ray Train's latest, or the newest before it that verifies on every rank (a damaged one is renamed).
        handed = Path(restored.path) if restored else None
        resume_from, resumed = choose_checkpoint(handed, rank, world, log, loop_config.get("hashed_checkpoint"))
        run_dir, global_batch = Path(loop_config["run_dir"]), cfg.train.derive_global_batch(world)
        settings = cfg.to_dict()  # as configured, before the worker settles 'auto' ones
        return cls(
            Worker(cfg, loop_config, rank, world, run_dir, global_batch, log, resumed, most, settings, resume_from)
        )

    # ------------------------------------------------------------------------- phases: set up

    def setup(self) -> None:
        """Threads on this worker's cores, its training dtype and model.compile=auto settled, and
        this rank's data streams. The process group is Ray Train's (gloo), which the engine reuses."""
        self.cpu_setup = self._setup_cpu()
        self._resolve_compile()  # model.compile=auto reads the dtype _setup_cpu resolved
        self._open_streams()

    def _setup_cpu(self) -> dict[str, Any]:
        """Threads on the physical cores this worker owns, and the dtype this CPU runs fastest."""
        import ray.train

        from raytrain_cpu.trainer import setup as worker_setup

        w, ctx = self.w, ray.train.get_context()
        setup = worker_setup.setup_worker(
            w.cfg.model.dtype,
            w.loop_config["model_dir"],
            w.cfg.train.micro_batch_size * w.cfg.data.seq_len,
            w.loop_config["threads_per_worker"],
            ctx.get_local_rank(),
            ctx.get_local_world_size(),
            w.cfg.scaling.pin_cores,
            agree=rank_mean(w),
            resumed_dtype=w.resumed.get("dtype"),
        )
        w.cfg.model.dtype = setup["dtype"]["dtype"]  # the DeepSpeed config, load dtype and manifests follow
        obs.console(worker_setup.describe_setup(w.rank, setup))
        return setup

    def _resolve_compile(self) -> None:
        """model.compile=auto as this run's true or false (worker_setup.compile_auto: where
        compiling pays), once the dtype is known; rank 0 says why not where only the data, the
        dtype or this machine keep a model of that size uncompiled."""
        from raytrain_cpu.host import features as host_features
        from raytrain_cpu.trainer import setup as worker_setup

        w, m = self.w, self.w.cfg.model
        if m.compile != "auto":
            return
        n = w.loop_config["n_params"]["total"]
        m.compile, why_not = worker_setup.compile_auto(
            n, m.dtype, w.cfg.data.attention_span, host_features.cpp_compiler()
        )
        if why_not:
            w.log(f"[model] not compiled (model.compile=auto, {n / 1e6:.0f}M parameters): {why_not}")

    def _open_streams(self) -> None:
        """This rank's training plan and eval streams, from the driver's spec for every rank."""
        from raytrain_cpu.data.stream import rank_streams

        w = self.w
        self.train_plan, self.eval_streams = rank_streams(w.loop_config["streams"], w.world, w.rank)

    def load(self) -> None:
        """The model in ZeRO-3 partitions (loading.load_model), with the DeepSpeed config it and
        the engine read; a checkpoint of another worker count is converted to its universal form first."""
        w = self.w
        rescaled = bool(w.resumed) and w.resumed["world_size"] != w.world
        if rescaled:
            universal_checkpoint(w)
        self.ds_config = deepspeed_config(w.cfg, w.world, universal=rescaled)
        self.loaded = load_model(w, self.ds_config)

    def build_engine(self) -> None:
        """The DeepSpeed engine and LR scheduler, DPO's reference, and MFU's denominator."""
        w = self.w
        self.engine, self.scheduler = build_engine(w, self.loaded.model, self.ds_config)
        w.reference = build_reference(w, self.loaded, self.engine, self.ds_config)
        time_mfu_peak(w, self.cpu_setup)

    def resume(self) -> None:
        """The checkpoint from_ray chose restored (never DeepSpeed's `latest`), this rank's batches
        positioned after it, and the attempt's sinks, guard and clocks opened."""
        self.st = self._restore()
        self.batches = open_batches(self.w, self.st, self.train_plan)
        self._open_observability()
        self.sampler = Sampler.for_run(self.w)

    def _restore(self) -> Loop:
        """The loop's state at the checkpoint, loaded into the engine (verified first), or a fresh start."""
        w, engine, st = self.w, self.engine, Loop()
        manifest: dict[str, Any] = {}
        if w.resume_from is not None:
            # Hashed by every rank in choose_checkpoint; settings that may not change fail loudly here.
            manifest = load_into(engine, w.resume_from, w.rank, w.world, w.settings, verified=True)
            st.step = st.resumed_from = manifest["step"]
            st.last_ckpt = w.resume_from
            st.opt_step_at_resume = optimizer_step_count(engine)
            w.log(f"resumed from {w.resume_from} at step {st.step} (optimizer at step {st.opt_step_at_resume})")
            lr_saved = engine.optimizer.param_groups[0]["lr"]  # the checkpoint's schedule's at this step
            for change in apply_optimizer_settings(engine, self.scheduler, w.cfg.train):
                w.log(f"[resume] {change}")
            if math.isclose(engine.optimizer.param_groups[0]["lr"], lr_saved, rel_tol=1e-6):  # else named above
                w.log(f"[resume] {lr_held_line(st.step, lr_saved, w.cfg.train)}")
            st.expected_blocks = manifest.get("next_blocks")  # checkpoints made before it recorded them: none
            st.data_changed = manifest.get("data_key") != w.loop_config.get("data_key")
        st.watch = EvalWatch.for_run(w.cfg, manifest)
        return st

    def _open_observability(self) -> None:
        """Rank 0 writes the sinks; every rank runs the guard (its decisions come from all-reduced
        values, so all ranks skip or stop together) and the step-time clock."""
        from raytrain_cpu.obs import timing as obs_timing

        w, st, cfg, t = self.w, self.st, self.w.cfg, self.w.cfg.train
        # Kept open for the whole loop (flushed at each checkpoint), hence no `with`.
        if w.loop_config["record_block_ids"]:
            self.block_log = open(w.run_dir / "block_ids" / f"rank{w.rank}.txt", "a")  # noqa: SIM115
        self.sink = obs.MetricsSink.for_run(cfg, w.run_dir, resume_step=st.step, log=w.log) if w.is_main else None
        if self.sink is not None:  # where this attempt starts: the report's restarts (metrics.read_metrics)
            self.sink.write({"step": st.step, "attempt": {"workers": w.world}, "time": time.time()})
        self.guard = StabilityGuard(
            cfg.guards, allreduce_sum, w.world, w.rank, cfg.deepspeed.zero_stage, on_event=self._on_guard_event
        )
        self.progress = obs.Progress(t.max_steps, start_step=st.step, show_epoch=t.epochs > 0)
        # Step-time breakdown (summary.json: step_breakdown); collectives only with train.profile_breakdown.
        # A short run (or a resumed one near its end) still times its last step.
        warmup = min(obs_timing.WARMUP_STEPS, max(t.max_steps - st.step - 1, 0))
        self.clock = obs_timing.StepClock(obs_timing.CommTimer().install() if t.profile_breakdown else None, warmup)
        self.free_pages = FreePages(cfg.scaling.free_memory_growth_mib * 2**20, st.step + obs_timing.WARMUP_STEPS + 1)

    def _on_guard_event(self, event) -> None:
        if self.sink is not None:
            self.sink.write({**event.row(), "time": time.time()})
            self.w.log(event.message())

    # ------------------------------------------------------------------------- phases: one step

    def step(self) -> None:
        """One optimizer step (profiled when train.profile_step asks), its seconds and tokens
        added to the log window: what runs between steps (evaluations, checkpoints, the MFU
        probe, the log row) and the first batch's wait for the data pipeline stay out of tokens/s."""
        st = self.st
        st.step_t0 = time.perf_counter()
        with profiled(self.w, st.step + 1):
            self._micro_batches()
        self.guard.after_step(st.step, self.engine, self.scheduler)
        self.clock.end_step()
        st.window.add_step(time.perf_counter() - st.step_t0, self.w.tokens_per_step)

    def _micro_batches(self) -> None:
        """grad_accum_steps micro batches of forward and backward, then the update."""
        w, st, clock = self.w, self.st, self.clock
        accum = w.cfg.train.grad_accum_steps
        clock.start_step()
        # The step's micro batches first: their targets, counted over every rank, weigh each one's
        # loss before the first backward (`step_counts`).
        micro_batches = [next_batch(w, st, self.batches, clock, self.block_log) for _ in range(accum)]
        counts, totals = step_counts(w, micro_batches)
        if st.source_sums is not None:  # loss/<name> is the logged step's, as loss is (loss_by_source)
            st.source_sums.zero_()
        step_losses: list[float] = []
        for micro_i, batch in enumerate(micro_batches):
            st.last_input_ids = batch["input_ids"]
            t0 = time.perf_counter()
            loss = self._forward(batch, None if totals is None else counts[micro_i], totals)
            step_losses.append(float(loss.detach()))
            clock.add("forward", time.perf_counter() - t0)
            self._backward_and_update(loss, step_losses, last_micro=micro_i == accum - 1)
        st.step += 1
        st.steps_this_attempt += 1

    def _forward(self, batch: dict[str, Any], counts: list[float] | None, totals: list[float] | None):
        """A micro batch's loss, weighed by its share of the step's targets (`step_counts`)."""
        w, st, engine = self.w, self.st, self.engine
        inputs = model_inputs(batch)
        if w.preference:
            return preference_loss(w, st, engine, inputs, per=totals)
        out = engine(**inputs, row_losses=True) if w.loss_sources else engine(**inputs)
        loss = out.loss if totals is None else out.loss * (counts[0] / totals[0])
        if w.loss_sources:
            add_by_source(w, st, batch["source"], out.row_losses, inputs["labels"])
        return loss

    def _backward_and_update(self, loss, step_losses: list[float], last_micro: bool) -> None:
        """The backward, then DeepSpeed's step (an update on the last micro batch only)."""
        engine, guard, clock, step = self.engine, self.guard, self.clock, self.st.step + 1
        # The guard all-reduces the step's loss on the last micro batch and may poison it
        # (skip: NaN gradients make DeepSpeed drop the update on every rank).
        loss = guard.before_backward(step, step_losses, loss, last_micro)
        t0 = time.perf_counter()
        engine.backward(loss)
        clock.add("backward", time.perf_counter() - t0)
        if last_micro:
            guard.before_step(step, engine)
        t0 = time.perf_counter()
        engine.step()
        clock.add("optimizer_step", time.perf_counter() - t0)

    def _release_free_pages(self) -> None:
        """scaling.free_memory_growth_mib, on this rank alone (no collective: a release costs the
        next step its page faults, nothing else)."""
        from raytrain_cpu.host import memory as host_memory

        w, st, free_pages = self.w, self.st, self.free_pages
        if not free_pages.limit:  # off: not even the /proc read
            return

        def release() -> float:
            host_memory.release_free_memory()
            return obs.process_memory()["rss"]

        freed = free_pages.after_step(st.step, obs.process_memory()["rss"], release)
        if freed is not None and free_pages.releases in (1, 10, 100, 1000):
            w.log(
                f"[memory] step {st.step}: resident memory {free_pages.limit / 2**20:.0f}+ MiB past the first steps'; "
                f"malloc's free pages handed back ({freed / 2**20:.0f} MiB; {free_pages.releases} time(s) so far, "
                "scaling.free_memory_growth_mib)"
            )

    def _log_row(self) -> None:
        """A metrics row every train.log_every steps (every rank joins the all-reduces; rank 0 writes)."""
        w, st, engine = self.w, self.st, self.engine
        grad_norm = engine.get_global_grad_norm()
        mem = obs.process_memory()
        mem_max, peak_max = obs.allreduce_max([mem["rss"], mem["hwm"]])
        st.last = {
            "step": st.step,
            "loss": self.guard.step_loss,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_seen": st.step * w.tokens_per_step,
            "epoch": w.epochs(st.step),
            "tokens_per_s": st.window.tokens_per_s(),  # over the steps' time: no evaluation or save in it
            "workers": w.world,  # a resume may change it: the report shows when
            "data_wait_frac": st.window.data_wait_frac(),
            "time": time.time(),
            "mem_rss_rank0_gib": mem["rss"] / obs.GIB,
            "mem_rss_max_gib": mem_max / obs.GIB,
            "mem_peak_max_gib": peak_max / obs.GIB,
            "skipped_steps": engine.skipped_steps,
            **loss_by_source(w, st),
            **pair_metrics(w, st),
        }
        peak = w.loop_config.get("peak_flops")  # per worker; MFU is logged only when it is known
        mfu = obs.mfu(st.last["tokens_per_s"], w.loop_config["n_params"], w.cfg.data.seq_len, peak and peak * w.world)
        if mfu is not None:
            # LoRA computes no weight gradients for the frozen base: ~4 of full training's 6 FLOPs a
            # parameter; DPO adds the reference's forward (2).
            lora_on, reference = w.cfg.lora.enabled, w.reference_each_step
            st.last["mfu"] = mfu * (
                (LORA_FLOPS_FRACTION if lora_on else 1.0) + (REFERENCE_FLOPS_FRACTION if reference else 0.0)
            )
        if self.sink is not None:
            self.sink.write(st.last)
            w.log(self.progress.line(st.last, self.progress.update(st.step)))
        st.window = obs.ThroughputWindow()

    # ------------------------------------------------------------------------- phases: evaluate, save

    def evaluate(self) -> None:
        """Every rank evaluates (each source of a mixture) and completes train.sample_prompt; rank 0
        writes the rows and the lines."""
        w, st, engine, sink, sampler = self.w, self.st, self.engine, self.sink, self.sampler
        if w.preference:
            st.eval_metrics = evaluate_pairs(w, engine, self.eval_streams)
        else:
            st.eval_metrics = evaluate(
                engine, self.eval_streams, w.cfg.train.micro_batch_size, w.cfg.train.eval_batches
            )
        st.watch.after_eval(st.step, st.eval_metrics)
        if sink is not None:
            sink.write({"step": st.step, **st.eval_metrics, "time": time.time()})
            w.log(eval_line(st.step, st.eval_metrics))
        if sampler is not None:
            completion = sampler.complete(engine)
            if sink is not None:
                sink.write_sample(st.step, sampler.prompt, completion)
                w.log(f"[sample] step {st.step}: {sampler.prompt!r} -> {completion!r}")

    def save(self, reason: str) -> None:
        """Every rank saves its shard; rank 0 writes the manifest; all report to Ray Train."""
        from raytrain_cpu.host import memory as host_memory

        w, st, run_root = self.w, self.st, Path(ray_storage_path())
        st.watch.checkpointed(free_checkpoint_name(run_root, st.step), st.step)
        manifest = checkpoint_manifest(w, st, reason, self.loaded)
        report = checkpoint_report(w, st)
        if self.block_log is not None:
            self.block_log.flush()
        st.last_ckpt = save_and_report(self.engine, run_root, st.step, manifest, report, w.rank, w.world, st.last_ckpt)
        host_memory.release_free_memory()  # the save's buffers: see engine.build_engine

    # ------------------------------------------------------------------------- the loop

    def fit(self) -> None:
        """The whole attempt: set up → load → engine → resume → steps (log, eval, checkpoint) → finish."""
        from raytrain_cpu.host.memory import freeze_gc_objects

        w, t = self.w, self.w.cfg.train
        freeze_gc_objects()  # Ray's and torch's modules: see freeze_gc_objects
        self.setup()
        self.load()
        freeze_gc_objects()  # transformers, DeepSpeed, the model: before the engine's own gc.collect()
        self.build_engine()
        self.resume()
        freeze_gc_objects()  # the engine and its partitions, for the steps' collections
        st = self.st
        if self.eval_streams and t.eval_on_start and st.step == 0:  # the starting model's loss: the baseline
            self.evaluate()
        if st.watch.stop_reason:  # resumed from the checkpoint an early stop took (a restart after it)
            w.log(f"stopped early at step {st.step}: {st.watch.stop_reason}")
        while st.step < t.max_steps and not st.watch.stop_reason:
            self.step()
            if t.mfu_probe_every and st.step % t.mfu_probe_every == 0:
                retime_mfu_peak(w, self.cpu_setup["dtype"]["dtype"], self.clock)
            self._release_free_pages()
            if st.step % t.log_every == 0 or st.step == t.max_steps or self.guard.stop_reason:
                self._log_row()
            if self.guard.stop_reason:
                w.log(f"stopping: {self.guard.stop_reason}")
                break  # every rank reaches this at the same step: the decision was all-reduced
            if self.eval_streams and ((t.eval_every and st.step % t.eval_every == 0) or st.step == t.max_steps):
                self.evaluate()
            reason = checkpoint_reason(w, st)
            if reason:
                self.save(reason)
            if reason == "early_stop":
                w.log(f"stopping early at step {st.step}: {st.watch.stop_reason}")
        self.finish()

    # ------------------------------------------------------------------------- phases: the end

    def finish(self) -> None:
        """The export check's probe, the step-time breakdown, rank 0's summary, and the export."""
        import torch.distributed as dist

        w, st, cfg = self.w, self.st, self.w.cfg
        export_probe = (
            export_io.probe_logits(self.engine, st.last_input_ids)
            if cfg.run.export_on_finish and st.steps_this_attempt
            else None
        )
        breakdown = step_breakdown(w, self.clock)
        # Every rank's optimizer bytes, gathered with a one-hot sum (summary.json: optimizer_state_bytes).
        mine = float(optimizer_state_bytes(self.engine))
        opt_bytes = allreduce_sum([mine if r == w.rank else 0.0 for r in range(w.world)])
        self.loaded.params["optimizer_state_bytes"] = [int(b) for b in opt_bytes]
        self.cpu_setup["free_pages_released"] = {  # rank 0's
            "times": self.free_pages.releases,
            "mib": self.free_pages.released / 2**20,
        }
        if w.is_main:
            write_worker_summary(w, st, self.engine, self.guard, self.loaded, self.cpu_setup, breakdown)
        if self.sink is not None:
            self.sink.close(finished=self.guard.stop_reason is None)
        dist.barrier()
        if w.is_main and cfg.run.export_on_finish and st.last_ckpt is not None:
            self._export(export_probe)

    def _export(self, export_probe) -> None:
        """Rank 0 exports run.best_metric's best checkpoint, else the final one, with this
        rank's shard freed first; the probe checks the export where it is this step's checkpoint."""
        w, st = self.w, self.st
        self.engine = self.loaded = None  # free this rank's shard before consolidating the whole model
        w.reference = None  # and full fine-tuning DPO's reference copy (its engine)
        best = st.watch.best_checkpoint  # run.best_metric: the best checkpoint, else the final one
        exported = w.run_dir / best["name"] if best else st.last_ckpt
        probe = export_probe if exported.name == free_checkpoint_name(w.run_dir, st.step) else None
        export_io.export_on_finish(exported, w.run_dir, probe, w.log)
