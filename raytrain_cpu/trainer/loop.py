"""The per-worker training loop: config -> data -> model -> engine -> resume -> loop -> checkpoint.

Ray Train runs `train_loop` once per worker with a plain dict. Ray has already created the
gloo process group (TorchConfig(backend="gloo")); DeepSpeed reuses it rather than starting
its own, so there is exactly one group and one timeout to reason about.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from raytrain_cpu.checkpoint import store as ckpt_io
from raytrain_cpu.config.schema import Config
from raytrain_cpu.model import export as export_io
from raytrain_cpu.model.tokenizer import resolve_tokenizer_path
from raytrain_cpu.obs import metrics as obs
from raytrain_cpu.obs.guards import StabilityGuard

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


def deepspeed_config(cfg: Config, world_size: int, universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed config the engine and transformers' sharded loading both read; `universal`
    when this attempt resumes a checkpoint saved for another number of workers (checkpoint.py)."""
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


def init_deepspeed(shm: bool = False, timeout_s: float = 600, log: Callable[[str], None] = print) -> None:
    """DeepSpeed set up for an engine: its communication on the process group already set up (Ray
    Train's gloo group in the workers), which DeepSpeed must reuse, never calling a second
    init_process_group; and kept from importing its Muon optimizer (keep_muon_unimported).

    DeepSpeed's own shared-memory all-reduce serves inference only, and would JIT-compile C++
    in every process at start-up (~30 s of CPU on 2 cores). `shm` routes the training
    collectives through raytrain_cpu.trainer.collectives instead, where all ranks share one machine.
    """
    import deepspeed

    # Set without reading it first: the first read probes every DeepSpeed op, compiling test
    # programs with the C compiler in each worker; only this entry is ever read back.
    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    keep_muon_unimported()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    if shm:
        from raytrain_cpu.trainer import collectives

        collectives.install(timeout_s, log)


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def keep_muon_unimported() -> None:
    """A stand-in for DeepSpeed's Muon optimizer module, unless something imported the real one.

    Building any ZeRO engine imports it, only to ask whether the optimizer is a Muon
    (zero/utils.py is_zero_supported_optimizer, stage3.py); the module compiles its kernels with
    torch.compile at import, which loads inductor at every worker start (benchmarks/engine_setup.py:
    a fresh process reaches its engine in 0.80x the time without it). Our optimizer is always
    AdamW (deepspeed_config never passes an "optimizer" section through), so nothing is a Muon
    and the answer stays the same."""
    import sys
    import types

    if MUON_MODULE not in sys.modules:
        stand_in = types.ModuleType(MUON_MODULE, "raytrain_cpu's stand-in: runs never use Muon")
        stand_in.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})  # an instance of it: never
        sys.modules[MUON_MODULE] = stand_in


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


def model_inputs(batch) -> dict[str, Any]:
    """A forward's inputs from a batch: input_ids; labels, the cached ones (-100 where chat or
    instruction data take no loss) or the inputs themselves for plain text (the model shifts
    them: position t predicts t+1); and position_ids where data.attention_span=document put them
    in the stream. From those transformers masks attention to each document (the causal blocks
    take that mask too) and counts the rotary positions from each document's start."""
    inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"] if "labels" in batch else batch["input_ids"]}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
    return inputs


def row_targets(labels):
    """Each row's targets: its labels after the shift that are not -100."""
    return (labels[:, 1:] != -100).sum(dim=1)


def loss_tokens(labels) -> int:
    """Targets the loss is averaged over."""
    return int(row_targets(labels).sum())


def _evaluated_sums(engine, shards: dict[str, Any], micro: int, sums_of: Callable[[Any], list[float]]) -> list[float]:
    """Each source's sums (`sums_of` its batches) over this rank's eval blocks, in eval mode and
    without gradients, then summed over every rank (an all-reduce every rank joins)."""
    import torch

    engine.eval()
    with torch.no_grad():
        batches = (shard.iter_torch_batches(batch_size=micro, dtypes=torch.long) for shard in shards.values())
        sums = [x for source in batches for x in sums_of(source)]
    engine.train()
    return _allreduce_sum(sums)


def evaluate(engine, shards: dict[str, Any], micro: int, max_batches: int) -> dict[str, float]:
    """Token-weighted loss over every rank's eval targets (sums, not an average of averages);
    for chat/instruction data that is the response tokens only. A mixture's sources (the keys
    of `shards`; '' for a single source) are also reported each: eval_loss/<name>, over its own
    targets; eval_loss is over all of them together."""
    sums = _evaluated_sums(engine, shards, micro, lambda batches: eval_sums(engine, batches, max_batches))
    return eval_metrics(list(shards), sums)


def evaluate_pairs(w: Worker, engine, shards: dict[str, Any]) -> dict[str, float]:
    """DPO's evaluation over every rank's eval pairs (pair_eval_metrics). Preference data is
    never a mixture: one source."""
    t = w.cfg.train
    sums = _evaluated_sums(
        engine,
        shards,
        t.micro_batch_size,
        lambda batches: pair_eval_sums(engine, w.reference, batches, w.fused_loss, w.dpo_settings, t.eval_batches),
    )
    return pair_eval_metrics(sums)


def pair_eval_sums(
    model, reference, batches, fused: bool, loss_settings: dict[str, Any], max_batches: int = 0
) -> list[float]:
    """dpo.SUM_NAMES' sums over batches of preference eval blocks, the first `max_batches` (0:
    all); the `reference` (a dpo.Reference) runs beside the model, as in training.
    `loss_settings`: dpo.settings'."""
    from raytrain_cpu.trainer import dpo

    sums = [0.0] * len(dpo.SUM_NAMES)
    for batch in itertools.islice(batches, max_batches or None):
        _, batch_sums = dpo.micro_batch_loss(model, reference, model_inputs(batch), fused, **loss_settings)
        sums = [a + b for a, b in zip(sums, batch_sums)]
    return sums


def pair_eval_metrics(sums: list[float]) -> dict[str, float]:
    """eval_dpo_loss, eval_reward_accuracy, ... (raytrain_cpu.trainer.dpo) from pair_eval_sums' sums, and
    eval_loss / eval_perplexity / eval_tokens over the chosen answers."""
    from raytrain_cpu.trainer import dpo

    nll, tokens = sums[dpo.SUM_NAMES.index("chosen_nll")], sums[dpo.SUM_NAMES.index("chosen_tokens")]
    return eval_metrics([""], [nll, tokens]) | dpo.metrics(sums, prefix="eval_")


def eval_sums(forward, batches, max_batches: int = 0) -> list[float]:
    """[summed loss, target count] of `forward` (the engine: every rank runs it, as ZeRO-3
    gathers) over batches of one source's eval blocks, the first `max_batches` (0: all)."""
    loss_sum = tokens = 0.0
    for i, batch in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        inputs = model_inputs(batch)
        out = forward(**inputs)
        n = loss_tokens(inputs["labels"])
        if n:  # a block of prompts only has no target: its mean loss is NaN, and weight 0
            loss_sum += float(out.loss.detach()) * n
            tokens += n
    return [loss_sum, tokens]


def eval_metrics(names: list[str], sums: list[float]) -> dict[str, float]:
    """eval_loss (token-weighted over all sources), eval_perplexity and eval_tokens from each
    source's [loss sum, targets] in `sums`; for a mixture (named sources) each one's too."""
    loss_sums, token_counts = sums[0::2], sums[1::2]
    loss = sum(loss_sums) / max(sum(token_counts), 1.0)
    out = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": int(sum(token_counts))}
    for name, loss_sum, tokens in zip(names, loss_sums, token_counts):
        if name:
            out[f"eval_loss/{name}"] = loss_sum / max(tokens, 1.0)
            out[f"eval_perplexity/{name}"] = math.exp(min(out[f"eval_loss/{name}"], 50.0))
    return out


def eval_line(step: int, metrics: dict[str, float]) -> str:
    """'step 100 eval loss 4.1000 ppl 60.34', and each mixture source's loss after it."""
    per_source = ", ".join(f"{name} {v:.4f}" for name, v in obs.by_source(metrics).items())
    dpo = metrics.get("eval_dpo_loss")
    return (
        f"step {step} eval loss {metrics['eval_loss']:.4f} ppl {metrics['eval_perplexity']:.2f}"
        + (f" (by source: {per_source})" if per_source else "")
        + (
            f" | dpo loss {dpo:.4f}, reward accuracy {100 * metrics['eval_reward_accuracy']:.1f}%, margin "
            f"{metrics['eval_reward_margin']:.3f} over {metrics['eval_pairs']:,.0f} pairs"
            if dpo is not None
            else ""
        )
    )


# ----------------------------------------------------------------------------- the worker's state


@dataclass
class Worker:
    """What every phase of this attempt reads; settled once at the start."""

    cfg: Config
    loop_config: dict[str, Any]
    rank: int
    world: int
    run_dir: Path
    global_batch: int
    log: Callable[[str], None]  # rank 0's console; a no-op elsewhere
    # The manifest of the checkpoint this attempt resumes from ({} on a fresh start): what the run
    # settled at its start by measuring (dtype, attention) stays, so a resumed run continues exactly.
    resumed: dict[str, Any] = field(default_factory=dict)
    most_workers: int = 0  # an elastic run's scaling.num_workers (cfg holds this attempt's count); 0: fixed
    # This attempt's settings as configured, before the worker settles 'auto' ones (model.dtype):
    # what a resume compares with the checkpoint's, which recorded them so too.
    settings: dict[str, Any] = field(default_factory=dict)
    # The checkpoint this attempt resumes from (checkpoint.choose_checkpoint: verified by every rank), or None.
    resume_from: Path | None = None
    # A mixture's source names, in the stream's order, where the fused loss reports each row's
    # loss (the training loss by source: loss/<name>); () otherwise.
    loss_sources: tuple[str, ...] = ()
    weight_grad_kernel: bool = False  # model.weight_grad_kernel in use (the MFU probe times its weight gradients)
    weight_grad_timings: dict[str, float] = field(default_factory=dict)  # what its 'auto' timed (summary.json)
    fused_loss: bool = False  # the fused output layer and loss are installed (raytrain_cpu.model.ops.loss)
    reference: Any = None  # DPO's reference (a dpo.Reference), set once the engine exists
    # train.dpo_precompute_reference's pass: {"blocks", "computed", "seconds"} (summary.json)
    reference_pass: dict[str, Any] | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def preference(self) -> bool:
        """DPO on preference pairs (raytrain_cpu.trainer.dpo) instead of the language-model loss."""
        return self.cfg.data.format == "preference"

    @property
    def reference_model(self) -> bool:
        """The preference loss compares a reference model (every one but SimPO's)."""
        return self.preference and self.cfg.train.dpo_reference

    @property
    def reference_each_step(self) -> bool:
        """The reference runs beside training (a forward each micro batch), not precomputed."""
        return self.preference and self.cfg.train.reference_each_step

    @property
    def dpo_settings(self) -> dict[str, Any] | None:
        """The preference loss settings (dpo.settings) a DPO run records in its manifests and
        summary, for `evaluate` and the closing summary; None for other data."""
        from raytrain_cpu.trainer import dpo

        return dpo.settings(self.cfg.train) if self.preference else None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.cfg.data.seq_len

    def epochs(self, step: int) -> float:
        """Passes over the training blocks by the end of `step` (a mixture: over all its sources' blocks)."""
        return step * self.global_batch / self.loop_config["train_blocks"]


@dataclass
class Loop:
    """What changes as the loop runs: the step, the checkpoint to resume from, the counters."""

    step: int = 0
    resumed_from: int | None = None
    opt_step_at_resume: int | None = None
    last_ckpt: Path | None = None
    steps_this_attempt: int = 0
    # The checkpoint's record of the blocks its next step trains on (save_checkpoint's
    # next_blocks), checked against this rank's first batch (check_resumed_stream); then None.
    expected_blocks: dict[str, Any] | None = None
    data_changed: bool = False  # the packed blocks changed since that checkpoint (data_key)
    first_batch_wait: float | None = None
    total_wait: float = 0.0
    t_start: float = field(default_factory=time.perf_counter)
    step_t0: float = 0.0  # when the running step started (run_step), past the first batch's wait
    window: obs.ThroughputWindow = field(default_factory=obs.ThroughputWindow)  # the log row's tokens/s
    saved_on_notice: bool = False
    growth_nodes: frozenset[str] = frozenset()  # rank 0: the nodes that had room when it last saved for growth
    last: dict[str, Any] = field(default_factory=dict)  # the latest logged row
    eval_metrics: dict[str, Any] = field(default_factory=dict)
    watch: EvalWatch | None = None  # set by `resume`
    last_input_ids: Any = None  # the export check's probe input
    # Per mixture source since the last log row: [summed loss, targets] (Worker.loss_sources).
    source_sums: Any = None
    # DPO since the last log row: dpo.SUM_NAMES' sums.
    pair_sums: list[float] | None = None

    def wall(self) -> float:
        return max(time.perf_counter() - self.t_start, 1e-9)


@dataclass
class FreePages:
    """scaling.free_memory_growth_mib: malloc's free pages go back to the OS when the resident
    memory has grown `limit` bytes past the `baseline`, the resident memory after the attempt's
    first steps (its working set made) or after the last release. A release that frees little
    (the growth was live memory) raises the baseline, so it is not repeated every step."""

    limit: float  # bytes; 0: never
    first_step: int  # the step after which the resident memory is the baseline
    baseline: float = 0.0
    releases: int = 0
    released: float = 0.0  # bytes, over all releases

    def after_step(self, step: int, rss: float, release: Callable[[], float]) -> float | None:
        """Releases through `release` (it returns the resident memory after) when due: the
        bytes that went back, else None."""
        if not self.limit or step < self.first_step:
            return None
        if step == self.first_step:
            self.baseline = rss
            return None
        if rss - self.baseline <= self.limit:
            return None
        after = release()
        freed = max(rss - after, 0.0)
        self.baseline = max(self.baseline, after)
        self.releases += 1
        self.released += freed
        return freed


@dataclass
class EvalWatch:
    """The watched eval metric (run.best_metric, else eval_loss): its best value, the evaluations
    since it improved (train.early_stop_patience) and the best checkpoint (run.best_metric).
    Every rank holds the same figures (evaluations are all-reduced), so every rank stops at the
    same step; each checkpoint's manifest carries them (`state`), so a resume goes on counting."""

    metric: str
    patience: int  # 0: never stops
    min_delta: float
    ranks_checkpoints: bool  # run.best_metric is set
    best: float = math.inf
    best_step: int | None = None
    evals_since_best: int = 0
    best_checkpoint: dict[str, Any] | None = None  # {"name", "step", "value"}; names a dir of the run
    value: float | None = None  # the latest evaluation's
    value_step: int | None = None

    @classmethod
    def for_run(cls, cfg: Config, manifest: dict[str, Any]) -> EvalWatch:
        watch = cls(
            cfg.watched_metric,
            cfg.train.early_stop_patience,
            cfg.train.early_stop_min_delta,
            bool(cfg.run.best_metric),
        )
        saved = manifest.get("eval_watch") or {}
        if saved.get("metric") == watch.metric:  # the same metric: its count goes on
            for k in ("best_step", "evals_since_best", "best_checkpoint"):
                setattr(watch, k, saved[k])
            watch.best = math.inf if saved["best"] is None else saved["best"]
        return watch

    def state(self) -> dict[str, Any]:
        """What a checkpoint's manifest records (plain JSON: no best yet is null, not Infinity)."""
        best = self.best if math.isfinite(self.best) else None
        return {
            "metric": self.metric,
            "best": best,
            **{k: getattr(self, k) for k in ("best_step", "evals_since_best", "best_checkpoint")},
        }

    def after_eval(self, step: int, metrics: dict[str, float]) -> None:
        value = metrics.get(self.metric)
        if value is None:  # not evaluated (too few eval blocks for this many workers)
            return
        value = value if math.isfinite(value) else math.inf  # diverged: no improvement, ranked last
        self.value, self.value_step = value, step
        if value < self.best - self.min_delta:
            self.best, self.best_step, self.evals_since_best = value, step, 0
        else:
            self.evals_since_best += 1

    def score(self, step: int) -> float:
        """The checkpoint at `step`'s rank for Ray Train (lower is better): its evaluation's value,
        or the largest float where none was made at that step (a preemption's) or it diverged,
        which ranks it last (not inf: Ray's record writes that as null, and a run resumed with
        run.best_metric then failed ranking it, at every retry)."""
        return min(self.value, ckpt_io.UNSCORED) if self.value_step == step else ckpt_io.UNSCORED

    def checkpointed(self, name: str, step: int) -> None:
        if self.ranks_checkpoints and self.score(step) < (self.best_checkpoint or {}).get("value", math.inf):
            self.best_checkpoint = {"name": name, "step": step, "value": self.value}

    @property
    def stop_reason(self) -> str | None:
        if not self.patience or self.evals_since_best < self.patience:
            return None
        return (
            f"{self.metric} has not improved on its best ({self.best:.4f} at step {self.best_step}) "
            f"in {self.evals_since_best} evaluations (train.early_stop_patience={self.patience})"
        )


@dataclass
class Sampler:
    """train.sample_prompt: its token ids (rendered as `generate` renders a prompt), the tokenizer
    that decodes the completion, and how many new tokens it may have."""

    prompt: str
    ids: list[int]
    tokenizer: Any
    max_new: int

    @classmethod
    def for_run(cls, w: Worker) -> Sampler | None:
        from raytrain_cpu.model.generate import prompt_ids
        from raytrain_cpu.model.tokenizer import load_tokenizer

        t = w.cfg.train
        if not t.sample_prompt:
            return None
        tokenizer = load_tokenizer(resolve_tokenizer_path(w.cfg.model.tokenizer, w.loop_config["model_dir"]))
        ids = prompt_ids(tokenizer, {"data": w.cfg.to_dict()["data"]}, t.sample_prompt, None)
        # Its end kept: prompt and completion fit the positions the model trains on.
        return cls(t.sample_prompt, ids[-(w.cfg.data.seq_len - t.sample_tokens) :], tokenizer, t.sample_tokens)

    def complete(self, engine) -> str:
        """The greedy completion; every rank runs each forward (ZeRO-3 gathers) and takes rank 0's
        token, so all stop at the same one even where their arithmetic could differ. No KV cache:
        each new token runs the whole sequence, which is short."""
        import torch
        import torch.distributed as dist

        seq, new = torch.tensor([self.ids]), []
        engine.eval()
        with torch.no_grad():
            for _ in range(self.max_new):
                logits = engine(input_ids=seq, use_cache=False, logits_to_keep=1).logits[:, -1]
                token = logits.argmax(-1, keepdim=True)
                dist.broadcast(token, src=0)
                if token.item() == self.tokenizer.eos_token_id:
                    break
                new.append(token.item())
                seq = torch.cat([seq, token], dim=1)
        engine.train()
        return self.tokenizer.decode(new, skip_special_tokens=True)


# ----------------------------------------------------------------------------- phases: set up


def setup_worker(loop_config: dict[str, Any]) -> Worker:
    import ray.train
    import torch

    cfg = Config.from_dict(loop_config["config"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    log = (lambda msg: obs.console(f"[rank 0] {msg}")) if rank == 0 else (lambda msg: None)
    most = cfg.scaling.num_workers if cfg.elastic else 0
    if cfg.elastic:  # this attempt's own worker count, accumulating what keeps the global batch
        s = cfg.scaling
        train = replace(cfg.train, grad_accum_steps=cfg.accumulation_for(world))
        log(
            f"elastic: {world} of {s.min_workers} to {s.num_workers} workers, grad_accum_steps {train.grad_accum_steps}"
        )
        cfg = replace(cfg, train=train, scaling=replace(s, num_workers=world, min_workers=0))
    torch.manual_seed(cfg.train.seed + rank)
    # torch 2.13 warns on every DeepSpeed all-gather / reduce-scatter, from every rank: a flood, not news.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    restored = ray.train.get_checkpoint()
    # Ray Train's latest, or the newest before it that verifies on every rank (a damaged one is renamed).
    handed = Path(restored.path) if restored else None
    resume_from, resumed = ckpt_io.choose_checkpoint(handed, rank, world, log, loop_config.get("hashed_checkpoint"))
    return Worker(
        cfg,
        loop_config,
        rank,
        world,
        Path(loop_config["run_dir"]),
        cfg.train.derive_global_batch(world),
        log,
        resumed,
        most,
        cfg.to_dict(),
        resume_from=resume_from,
    )


def universal_checkpoint(w: Worker) -> None:
    """The checkpoint this attempt resumes from was saved by another number of workers: it loads
    from its universal form (checkpoint.to_universal). The driver makes that before a run that
    starts on a new count; in an elastic run the count changes inside the run, so rank 0 makes
    it here and the other ranks wait for its directory to appear. Not in a gloo barrier: the
    conversion can outlast run.gloo_timeout_s, and if rank 0 fails Ray Train stops the others."""
    path = w.resume_from
    if ckpt_io.universal_ready(path):
        return
    w.log(
        f"{Path(path).name} holds ZeRO shards for {ckpt_io.workers(w.resumed['world_size'])}; converting it for {w.world}"
    )
    if w.is_main:
        w.log(f"universal checkpoint: {ckpt_io.to_universal(path, verified=True)}")
        return
    while not ckpt_io.universal_ready(path):
        time.sleep(1)


def setup_cpu(w: Worker) -> dict[str, Any]:
    """Threads on the physical cores this worker owns, and the dtype this CPU runs fastest."""
    import ray.train

    from raytrain_cpu.host import cpu

    ctx = ray.train.get_context()
    setup = cpu.setup_worker(
        w.cfg.model.dtype,
        w.loop_config["model_dir"],
        w.cfg.train.micro_batch_size * w.cfg.data.seq_len,
        w.loop_config["threads_per_worker"],
        ctx.get_local_rank(),
        ctx.get_local_world_size(),
        w.cfg.scaling.pin_cores,
        agree=_rank_mean(w),
        resumed_dtype=w.resumed.get("dtype"),
    )
    w.cfg.model.dtype = setup["dtype"]["dtype"]  # the DeepSpeed config, load dtype and manifests follow
    obs.console(cpu.describe_setup(w.rank, setup))
    return setup


def resolve_compile(w: Worker) -> None:
    """model.compile=auto as this run's true or false (cpu.compile_auto: where compiling pays),
    once the dtype is known; rank 0 says why not where only the data, the dtype or this
    machine keep a model of that size uncompiled."""
    from raytrain_cpu.host import cpu

    m = w.cfg.model
    if m.compile != "auto":
        return
    n = w.loop_config["n_params"]["total"]
    m.compile, why_not = cpu.compile_auto(n, m.dtype, w.cfg.data.attention_span, cpu.cpp_compiler())
    if why_not:
        w.log(f"[model] not compiled (model.compile=auto, {n / 1e6:.0f}M parameters): {why_not}")


def time_mfu_peak(w: Worker, cpu_setup: dict[str, Any]) -> None:
    """MFU's denominator: the faster of the start-up probe and a second timing now that every
    rank is set up and Ray's start-up is over (cpu.time_peak_flops).

    Whatever else runs on the cores only slows a timing, so the faster one is nearer the peak.
    Each alone has read about half of it on a 2-core host: the start-up probe beside Ray's
    start-up (the logged MFU then read 120-147%), and the second timing while the host ran at
    half speed for a while (429 GFLOP/s against the start-up probe's 782 and `bench train`'s
    780: the console's MFU read 46-73% in a run whose MFU was 0.39)."""
    from raytrain_cpu.host import cpu

    d = cpu_setup["dtype"]
    d["start_probe_flops_per_s"] = d["peak_flops_per_s"]
    d["retimed_flops_per_s"] = cpu.time_peak_flops(_model_gemms(w), d["dtype"], agree=_rank_mean(w))
    d["peak_flops_per_s"] = max(d["start_probe_flops_per_s"], d["retimed_flops_per_s"])
    w.loop_config["peak_flops"] = d["peak_flops_per_s"]
    w.log(
        f"[engine] MFU against {d['dtype']} GEMMs at {d['peak_flops_per_s'] / 1e9:.1f} GFLOP/s per worker at the "
        f"model's shapes (the faster of two timings: {d['start_probe_flops_per_s'] / 1e9:.1f} at start-up, "
        f"{d['retimed_flops_per_s'] / 1e9:.1f} once set up)"
    )


def _model_gemms(w: Worker) -> list:
    """The model's GEMMs at one micro batch's tokens (cpu.gemms_for_model)."""
    from raytrain_cpu.host import cpu

    return cpu.gemms_for_model(w.loop_config["model_dir"], w.cfg.train.micro_batch_size * w.cfg.data.seq_len)


def _rank_mean(w: Worker) -> Callable[[list[float]], list[float]]:
    """Each value's mean over the ranks (an all-reduce: every rank calls it at once), so every
    rank takes the same decision or logs the same rate."""
    return lambda values: [x / w.world for x in _allreduce_sum(values)]


def retime_mfu_peak(w: Worker, st: Loop, dtype: str, clock) -> None:
    """train.mfu_probe_every: the GEMM rate again, right after a step and outside its clock and
    the console's tokens/s, so MFU reads against the host's rate at the time (the console's from
    this step's line on; the step-time breakdown's weighs each timed step by the timing after
    it). The whole training mix, timed as `bench train`'s peak is; the summary keeps its mean
    rate too (cpu.time_training_mix says why)."""
    from raytrain_cpu.host import cpu

    kernel = None
    if w.weight_grad_kernel:  # the mix as the model runs it
        from raytrain_cpu.model.ops.linear import weight_grad as kernel
    peak, mean = cpu.time_training_mix(_model_gemms(w), dtype, agree=_rank_mean(w), weight_grad=kernel)
    w.loop_config["peak_flops"] = peak
    clock.peak(peak, mean)


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

    from raytrain_cpu.host import cpu
    from raytrain_cpu.model import lora
    from raytrain_cpu.model.loading import load_sharded

    cfg, model_dir = w.cfg, w.loop_config["model_dir"]
    ckpt_io.check_model_dir(model_dir, w.loop_config.get("model"))  # as the run found it at its start
    init_deepspeed(cfg.deepspeed.shm_collectives, cfg.run.gloo_timeout_s, w.log)
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    t0 = time.perf_counter()
    w.log(f"[load] loading {model_dir} into ZeRO-{cfg.deepspeed.zero_stage} shards on {w.world} ranks")
    cpu.reset_peak_rss()  # so the peak below is the loading's own
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
    peaks = _allreduce_sum([float(cpu.peak_rss_bytes()) if r == w.rank else 0.0 for r in range(w.world)])
    attn = choose_attention(w, model)  # after the peak: its timing's tensors are not the loading's
    install_fused_loss(w, model)  # after LoRA: an adapted output layer keeps Hugging Face's loss
    install_fused_layer_ops(w, model)
    w.weight_grad_kernel = install_weight_grad_kernel(w, model)
    if cfg.model.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    load_s = time.perf_counter() - t0
    params = lora.param_counts(model)
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
        _allreduce_sum([float(attention.fused_attention.kernel() is None)])
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
        _rank_mean(w),
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
    choice = linear.choose(w.cfg.model.weight_grad_kernel, w.cfg.model.dtype, n_params, shapes, tokens, _rank_mean(w))
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


def build_engine(w: Worker, model, ds_config: dict[str, Any]):
    """The DeepSpeed engine and LR scheduler; only trainable parameters reach the optimizer."""
    import deepspeed
    import torch

    from raytrain_cpu.host import cpu
    from raytrain_cpu.model.loading import decoder_layers, mark_layers_as_zero3_leaves

    t, m = w.cfg.train, w.cfg.model
    layers = decoder_layers(model)
    compile_layers = m.compile is True and m.compile_scope == "layers" and bool(layers)
    # Compiled layers need whole-layer gathers: per-module hooks would break the graph at every projection.
    if w.cfg.deepspeed.zero_stage == 3 and (w.cfg.deepspeed.gather_whole_layers or compile_layers):
        leaves = mark_layers_as_zero3_leaves(model, layers)
        w.log(f"[engine] ZeRO-3 gathers whole layers: {', '.join(leaves) or 'no layer class found, per module'}")
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=_param_groups(model, t.weight_decay),
        config=ds_config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, t, t.max_steps)),
        dist_init_required=False,
    )
    # from_pretrained hands back a model in eval mode: without this, dropout and activation
    # checkpointing stay off until the first evaluation switches the model back.
    engine.train()
    reuse_reduce_scatter_buffer(
        w.cfg.deepspeed.reuse_reduce_buffer, int(ds_config["zero_optimization"]["reduce_bucket_size"])
    )
    if w.cfg.deepspeed.reuse_fp32_grad_buffer:
        kept = reuse_fp32_grad_buffer(engine)
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
            f"[engine] torch.compile: {cpu.compile_layers(layers, cache_dir)} decoder layers{auto}; the first steps compile"
        )
    elif m.compile is True:
        cpu.compile_engine(engine, cache_dir)
        w.log("[engine] torch.compile: the whole model")
    # The load's and the set-up's free pages go back now, a checkpoint's after each save; other
    # freed pages stay for the next step (cpu.JEMALLOC_CONF). An evaluation's stay too: it makes
    # less than a training step, which reuses them.
    cpu.release_free_memory()
    return engine, scheduler


def build_reference(w: Worker, loaded: Loaded, engine, ds_config: dict[str, Any]):
    """DPO's reference (a dpo.Reference; None for other data): under LoRA the engine with the
    adapters off; for full fine-tuning the frozen copy load_model made, computing as the trained
    model did at the start (its attention, fused loss and layer ops; uncompiled), run by an
    engine of its own under ZeRO-3 (no optimizer: DeepSpeed only gathers its partitions);
    SimPO's none (dpo.reference_free)."""
    import deepspeed
    from deepspeed.utils import set_z3_leaf_module

    from raytrain_cpu.model.loading import decoder_layers, unwrapped
    from raytrain_cpu.model.ops import loss
    from raytrain_cpu.trainer import dpo

    if not w.preference:
        return None
    if not w.reference_model:
        w.log(f"[engine] no reference model: train.dpo_loss={w.cfg.train.dpo_loss} compares none")
        return dpo.reference_free
    if w.cfg.train.dpo_precompute_reference:
        return precompute_reference(w, engine)
    if loaded.reference is None:
        return dpo.adapters_off(engine, engine.module, w.fused_loss)
    model = loaded.reference[0].requires_grad_(False)
    model.set_attn_implementation(unwrapped(loaded.model).config._attn_implementation)
    fused = w.fused_loss and loss.install(model) is None
    install_fused_layer_ops(w, model, log=lambda _: None)
    zero3 = w.cfg.deepspeed.zero_stage == 3
    if zero3:
        if w.cfg.deepspeed.gather_whole_layers:  # as the trained model gathers
            for layer in decoder_layers(model):
                set_z3_leaf_module(layer, True)
        inference = {k: v for k, v in ds_config.items() if k != "optimizer"}
        model, *_ = deepspeed.initialize(model=model, config=inference, dist_init_required=False)
    model.eval()
    w.log(f"[engine] DPO's reference: the frozen starting model, {'its own ZeRO-3 engine' if zero3 else 'whole'}")
    return dpo.frozen_copy(model, fused)


def reference_batches(w: Worker) -> list[tuple[int, str, np.ndarray]]:
    """(rank, cache split directory, block ids) of every micro batch that first
    trains on each block (the stream's positions, data.StreamPlan: rank r's j-th micro batch
    holds positions (j W + r) m ... + m, up to the end of the first pass over the blocks or of
    the run), then of every evaluation's (data.eval_stream: rank r evaluates r, r + W, ..., each
    rank ceil(n/W) rows, the last one padding where W does not divide n), in that order, each as
    the run composes it."""
    from raytrain_cpu.data.stream import eval_blocks_per_rank, global_order, read_meta

    cfg, t, world, m = w.cfg, w.cfg.train, w.world, w.cfg.train.micro_batch_size
    cache = Path(w.loop_config["data_cache"])
    meta = read_meta(cache)
    n, rounds = meta["blocks"], world * m
    # The first pass's last round of micro batches may reach into the second (pairs with its first blocks).
    end = min(t.max_steps * w.global_batch, -(-n // rounds) * rounds)
    ids = np.concatenate([global_order(n, t.seed, e, cfg.data.shuffle_window) for e in range(-(-end // n))])[:end]
    train = str(cache / "train")
    batches = [(j % world, train, ids[j * m : (j + 1) * m]) for j in range(end // m)]
    if meta["eval_blocks"] >= world:  # a source with fewer eval blocks than workers is not evaluated
        per_rank = eval_blocks_per_rank(meta["eval_blocks"], world, t.eval_batches * m)
        evals = str(cache / "eval")
        for lo in range(0, per_rank, m):
            batches += [(r, evals, np.arange(lo, min(lo + m, per_rank)) * world + r) for r in range(world)]
    return batches


KEPT_ROWS_PER_PART = 512  # a part on the run's storage every 512 blocks: an interrupted pass keeps them


def precompute_reference(w: Worker, engine):
    """train.dpo_precompute_reference: the reference's log p(label) of every block the run trains
    and evaluates on, computed by the engine itself before resume() loads a checkpoint into it:
    it still is the starting model (under LoRA its adapters are still zero), so no copy is ever
    loaded. Each block's row comes from the micro batch that first holds it, composed as the run
    composes it (reference_batches; a GEMM's last bits can depend on its batch-mates), so it is
    the forward the reference would have run there. Kept in <run dir>/reference_logps/<model
    key>/ (dpo.KeptLogps, dpo.reference_key: rows of another starting model under the same
    run.name are never read); a block an earlier attempt kept (an interrupted pass's parts too)
    is not computed again."""
    import torch.distributed as dist

    from raytrain_cpu.trainer import dpo

    t0 = time.perf_counter()
    key = dpo.reference_key(w.cfg.model.name_or_path, w.loop_config["model_dir"])
    directory = dpo.reference_directory(w.run_dir, key)
    read = _block_reader(w)
    kept = dpo.KeptLogps(directory)
    batches = reference_batches(w)
    owner: dict[bytes, tuple[int, int]] = {}  # each block's first (micro batch, row)
    rows: dict[int, list[tuple[int, bytes]]] = {}  # the micro batches to run, each with the (row, block) they keep
    for b, (_, split, ids) in enumerate(batches):
        for row, digest in enumerate(dpo.block_digests(read(split, ids))):
            if owner.setdefault(digest, (b, row)) == (b, row) and digest not in kept:
                rows.setdefault(b, []).append((row, digest))
    computed = sum(len(r) for r in rows.values())
    dist.barrier()  # every rank has read what is kept (so plans the same batches) before any adds to it
    if rows:
        _compute_reference_rows(w, engine, batches, rows, read, directory)
        kept = dpo.KeptLogps(directory)
    w.reference_pass = {"blocks": len(owner), "computed": computed, "seconds": time.perf_counter() - t0}
    w.log(
        f"[reference] DPO's reference log-likelihoods of {len(owner):,} blocks: {computed:,} computed by the "
        f"starting model in {w.reference_pass['seconds']:.1f}s, {len(owner) - computed:,} kept from before "
        f"({directory}); training runs no reference forward"
    )
    return dpo.precomputed(kept)


def _block_reader(w: Worker) -> Callable[[str, np.ndarray], dict[str, Any]]:
    """(cache split, block ids) -> their rows as one batch of int64 tensors, as the streams give
    (the eval split's ids past its end: eval_stream's padding rows)."""
    import torch

    from raytrain_cpu.data.prepare import documents_eos
    from raytrain_cpu.data.stream import read_blocks, read_eval_blocks, read_meta

    eos = documents_eos(w.cfg)
    n_eval = read_meta(Path(w.loop_config["data_cache"]))["eval_blocks"]

    def read(split: str, ids: np.ndarray) -> dict[str, Any]:
        if Path(split).name == "eval":
            rows = read_eval_blocks(split, ids, n_eval, True, eos)
        else:
            rows = read_blocks(split, ids, True, eos)
        return {k: torch.from_numpy(v.astype(np.int64)) for k, v in rows.items() if k != "block_id"}

    return read


def _compute_reference_rows(
    w: Worker, engine, batches, rows: dict[int, list[tuple[int, bytes]]], read, directory: Path
) -> None:
    """This rank's micro batches among `rows` through the engine in eval mode, their kept rows
    written a part at a time. Every rank runs as many forwards (ZeRO-3 gathers the weights for
    each): the busiest rank's count, the others repeating a batch whose rows they drop. Every
    rank knows every batch's rank, so the counts need no collective; the barrier at the end
    puts every part in place before any rank reads them."""
    import torch
    import torch.distributed as dist

    from raytrain_cpu.trainer import dpo

    mine = [b for b in sorted(rows) if batches[b][0] == w.rank]
    forwards = max(Counter(batches[b][0] for b in rows).values())
    digests, logps, last_note = [], [], time.perf_counter()

    def keep() -> None:
        if digests:
            dpo.keep_logps(directory, f"{uuid.uuid4().hex[:12]}-rank{w.rank}", digests, np.concatenate(logps))
        digests.clear()
        logps.clear()

    engine.eval()
    with torch.no_grad():
        for k in range(forwards):
            b = mine[k] if k < len(mine) else next(iter(rows))  # past its own: a forward for the gathers only
            out = dpo.forward_logps(engine, model_inputs(read(*batches[b][1:])), w.fused_loss).float().numpy()
            if k < len(mine):  # the digests the plan made of this batch's blocks: not hashed again
                digests.extend(d for _, d in rows[b])
                logps.append(out[[row for row, _ in rows[b]]])
            if len(digests) >= KEPT_ROWS_PER_PART:
                keep()
            if time.perf_counter() - last_note > 30:
                w.log(f"[reference] {k + 1:,} of {forwards:,} micro batches a rank")
                last_note = time.perf_counter()
    keep()
    engine.train()
    dist.barrier()


def reuse_fp32_grad_buffer(engine) -> int:
    """Casts ZeRO-3's gradient partitions into one fp32 buffer kept between steps; its bytes
    (0 where DeepSpeed's step is left as it is: ZeRO-1/2, optimizer offload).

    DeepSpeed's step makes each sub group's fp32 gradient anew: it flattens the bf16
    partitions into a new tensor, casts that into another, and frees both after the update.
    Their pages are new each step, and every 4 KiB page faults on first touch: on the ~50M
    bench model that was 0.06-0.07 s of a 0.15 s optimizer phase. Sub groups are updated one
    after another, so one buffer the size of the largest serves them all. The arithmetic is
    DeepSpeed's: the same bits.
    """
    import torch

    opt = engine.optimizer
    flats = getattr(opt, "fp32_partitioned_groups_flat", None)
    if not flats or getattr(opt, "offload_optimizer", True) or not hasattr(opt, "_prepare_fp32_grad_for_sub_group"):
        return 0
    # Pages are touched (resident) from the first step on, as the planner counts them.
    buffer = torch.empty(max(f.numel() for f in flats), dtype=flats[0].dtype)

    def prepare(sub_group_id: int) -> None:
        fp32 = opt.fp32_partitioned_groups_flat[sub_group_id]
        grad, offset = buffer[: fp32.numel()], 0
        for g in opt.averaged_gradients[sub_group_id]:
            grad[offset : offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        if offset != fp32.numel():
            raise RuntimeError(f"sub group {sub_group_id}: {offset} gradient elements for {fp32.numel()} parameters")
        fp32.grad = grad.view_as(fp32)
        opt.averaged_gradients[sub_group_id] = None  # as DeepSpeed's own: the partitions are read

    prepare.buffer = buffer  # type: ignore[attr-defined]  (kept_fp32_grad_buffer_bytes reads it)
    opt._prepare_fp32_grad_for_sub_group = prepare
    return kept_fp32_grad_buffer_bytes(engine)


def kept_fp32_grad_buffer_bytes(engine) -> int:
    """The bytes of the fp32 gradient buffer reuse_fp32_grad_buffer keeps, 0 if none."""
    buffer = getattr(getattr(engine.optimizer, "_prepare_fp32_grad_for_sub_group", None), "buffer", None)
    return 0 if buffer is None else buffer.numel() * buffer.element_size()


_KEPT_REDUCE_BUFFERS: dict = {}  # dtype -> the flat reduce-scatter buffer, grown to the largest bucket


def _reduce_scatter_into_kept_buffer(tensors, group=None, *, limit: int):
    """DeepSpeed's reduce_scatter_coalesced with its flat buffer kept (up to `limit` elements):
    the same interleaving, pre-division and reduce-scatter, so the same bits; the outputs view
    the buffer until the next bucket (ZeRO-3 copies them into its gradient partitions first)."""
    import math

    import torch
    from deepspeed import comm as dist
    from deepspeed.runtime.comm.coalesced_collectives import _torch_reduce_scatter_fn

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    chunks = [math.ceil(t.numel() / world) for t in tensors]
    total = sum(chunks) * world
    dtype = tensors[0].dtype
    if len(tensors) == 1 and tensors[0].numel() == total:
        flat = tensors[0].view(-1)  # as DeepSpeed: one unpadded tensor reduces in place
    else:
        if total > limit:
            flat = torch.empty(total, dtype=dtype)  # a lone parameter over the bucket size: not kept
        else:
            kept = _KEPT_REDUCE_BUFFERS.get(dtype)
            if kept is None or kept.numel() < total:
                kept = _KEPT_REDUCE_BUFFERS[dtype] = torch.empty(total, dtype=dtype)
            flat = kept[:total]
        parts = []
        for r in range(world):  # rank r's piece of every tensor, each padded to its chunk
            for t, c in zip(tensors, chunks, strict=True):
                piece = t.view(-1)[r * c : r * c + c]
                parts += [piece] if piece.numel() == c else [piece, flat.new_empty(c - piece.numel())]
        torch.cat(parts, out=flat)
    flat.div_(world)
    mine = flat.chunk(world)[rank]
    _torch_reduce_scatter_fn(flat, mine, group=group)
    out, offset = [], 0
    for t, c in zip(tensors, chunks, strict=True):
        out.append(mine.narrow(0, offset, max(0, min(c, t.numel() - rank * c))))  # this rank's unpadded piece
        offset += c
    return out


def reuse_reduce_scatter_buffer(on: bool, bucket_elements: int) -> None:
    """ZeRO-3 flattens each gradient bucket (up to reduce_bucket_size elements) into a new
    tensor before its reduce-scatter and frees it after: new pages, each faulting on first touch.
    On the AMD host a 107 MB bf16 flatten took 69-78 ms into new memory, 12-14 ms into a kept
    buffer. With `on`, ZeRO-3 flattens into one kept buffer per dtype of at most
    `bucket_elements`; off restores DeepSpeed's."""
    import functools

    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero import stage3

    stage3.reduce_scatter_coalesced = (
        functools.partial(_reduce_scatter_into_kept_buffer, limit=bucket_elements)
        if on
        else coalesced_collectives.reduce_scatter_coalesced
    )


def resume(w: Worker, engine, scheduler) -> Loop:
    """Restores the checkpoint setup_worker chose (never DeepSpeed's `latest`), verified first."""
    st = Loop()
    manifest: dict[str, Any] = {}
    if w.resume_from is not None:
        # Hashed by every rank in choose_checkpoint; settings that may not change fail loudly here.
        manifest = ckpt_io.load_into(engine, w.resume_from, w.rank, w.world, w.settings, verified=True)
        st.step = st.resumed_from = manifest["step"]
        st.last_ckpt = w.resume_from
        st.opt_step_at_resume = _optimizer_step(engine)
        w.log(f"resumed from {w.resume_from} at step {st.step} (optimizer at step {st.opt_step_at_resume})")
        lr_saved = engine.optimizer.param_groups[0]["lr"]  # the checkpoint's schedule's at this step
        for change in apply_optimizer_settings(engine, scheduler, w.cfg.train):
            w.log(f"[resume] {change}")
        if math.isclose(engine.optimizer.param_groups[0]["lr"], lr_saved, rel_tol=1e-6):  # else named above
            w.log(f"[resume] {lr_held_line(st.step, lr_saved, w.cfg.train)}")
        st.expected_blocks = manifest.get("next_blocks")  # checkpoints made before it recorded them: none
        st.data_changed = manifest.get("data_key") != w.loop_config.get("data_key")
    st.watch = EvalWatch.for_run(w.cfg, manifest)
    return st


def lr_held_line(step: int, lr: float, t) -> str:
    """What a resume says of a learning rate the config's schedule keeps at the restored step (a
    changed one, from a changed train.max_steps or schedule setting, apply_optimizer_settings
    names with both values): every resume names the LR it goes on with."""
    return (
        f"the learning rate at step {step}: {lr:.3g}, as in the checkpoint "
        f"(the {t.schedule} schedule of train.max_steps={t.max_steps})"
    )


def apply_optimizer_settings(engine, scheduler, t) -> list[str]:
    """A checkpoint brings back the optimizer settings it was saved with: torch's load_state_dict
    restores each group's lr, betas, eps and weight decay, LambdaLR its base LR. The config's go
    back in, so a resume may change them as it may the schedule's length; the next step's LR is
    the schedule's at this step (it was the old schedule's). Returns 'key: old → new' for each
    that changed. Groups as _param_groups made them: the first decays, the others do not."""
    groups = engine.optimizer.param_groups
    saved = {
        "train.lr": scheduler.base_lrs[0],
        "train.betas": [float(b) for b in groups[0]["betas"]],
        "train.eps": groups[0]["eps"],
        "train.weight_decay": groups[0]["weight_decay"],
    }
    now = {"train.lr": t.lr, "train.betas": list(t.betas), "train.eps": t.eps, "train.weight_decay": t.weight_decay}
    lr_before = groups[0]["lr"]  # the saved schedule's at this step
    scheduler.base_lrs = [t.lr] * len(groups)
    for i, group in enumerate(groups):
        group.update(betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay if i == 0 else 0.0)
        group["initial_lr"] = t.lr
        group["lr"] = t.lr * lr_factor(scheduler.last_epoch, t, t.max_steps)
    changes = [f"{k}: {saved[k]} in the checkpoint → {now[k]}" for k in now if saved[k] != now[k]]
    if not math.isclose(groups[0]["lr"], lr_before, rel_tol=1e-6):  # a longer run's schedule (train.max_steps)
        changes.append(
            f"the learning rate at step {scheduler.last_epoch}: {lr_before:.3g} → {groups[0]['lr']:.3g}, "
            f"the {t.schedule} schedule of train.max_steps={t.max_steps} from here"
        )
    return changes


def open_batches(w: Worker, st: Loop, shard):
    """This rank's micro batches, positioned at the first block the run has not trained on."""
    import torch

    t = w.cfg.train
    batches = iter(
        shard.iter_torch_batches(
            batch_size=t.micro_batch_size, prefetch_batches=w.cfg.data.prefetch_batches, dtypes=torch.long
        )
    )
    # After a restart inside this driver run, Ray replays each rank's stream from the driver's start.
    for _ in range(
        ckpt_io.batches_to_skip(w.loop_config["start_position"], st.step, w.global_batch, t.grad_accum_steps)
    ):
        next(batches)
    return batches


# ----------------------------------------------------------------------------- phases: one step


def next_batch(w: Worker, st: Loop, batches, clock, block_log) -> dict[str, Any]:
    t0 = time.perf_counter()
    batch = next(batches)
    wait = time.perf_counter() - t0
    if st.first_batch_wait is None:
        # The first batch waits for the Ray Data pipeline to start: reported on its own, so
        # data_wait_frac measures the steady-state stall, and left out of the step's time.
        st.first_batch_wait, wait = wait, 0.0
        st.t_start += st.first_batch_wait
        st.step_t0 += st.first_batch_wait
    st.window.wait += wait
    st.total_wait += wait
    clock.add("data_wait", wait)
    if st.expected_blocks is not None:  # a resume: the stream must go on with the blocks the checkpoint recorded
        mismatch = check_resumed_stream(w.rank, st.step, st.expected_blocks, batch["pos"], batch["block_id"])
        if mismatch and not st.data_changed:
            raise RuntimeError(mismatch)
        if mismatch:  # the driver said the blocks changed: a new order from here, as it said
            w.log("[resume] the first batch is not the one the checkpoint recorded: the changed data's new order")
        st.expected_blocks = None
    if block_log is not None:
        block_log.write("\n".join(map(str, batch["block_id"].tolist())) + "\n")
    return batch


def run_step(w: Worker, st: Loop, engine, scheduler, batches, guard: StabilityGuard, clock, block_log) -> None:
    """One step as the loop runs it (profiled when train.profile_step asks), its seconds and
    tokens added to the log window: what runs between steps (evaluations, checkpoints, the MFU
    probe, the log row) and the first batch's wait for the data pipeline stay out of tokens/s."""
    st.step_t0 = time.perf_counter()
    with profiled(w, st.step + 1):
        train_step(w, st, engine, batches, guard, clock, block_log)
    guard.after_step(st.step, engine, scheduler)
    clock.end_step()
    st.window.add_step(time.perf_counter() - st.step_t0, w.tokens_per_step)


def train_step(w: Worker, st: Loop, engine, batches, guard: StabilityGuard, clock, block_log) -> None:
    """One optimizer step: grad_accum_steps micro batches of forward and backward, then the update."""
    accum = w.cfg.train.grad_accum_steps
    clock.start_step()
    # The step's micro batches first: their targets, counted over every rank, weigh each one's
    # loss before the first backward (`step_counts`).
    micro_batches = [next_batch(w, st, batches, clock, block_log) for _ in range(accum)]
    counts, totals = step_counts(w, micro_batches)
    if st.source_sums is not None:  # loss/<name> is the logged step's, as loss is (loss_by_source)
        st.source_sums.zero_()
    step_losses = []
    for micro_i, batch in enumerate(micro_batches):
        st.last_input_ids = batch["input_ids"]
        t0 = time.perf_counter()
        inputs = model_inputs(batch)
        if w.preference:
            loss = preference_loss(w, st, engine, inputs, per=totals)
        else:
            out = engine(**inputs, row_losses=True) if w.loss_sources else engine(**inputs)
            loss = out.loss if totals is None else out.loss * (counts[micro_i][0] / totals[0])
            if w.loss_sources:
                add_by_source(w, st, batch["source"], out.row_losses, inputs["labels"])
        step_losses.append(float(loss.detach()))
        clock.add("forward", time.perf_counter() - t0)
        last_micro = micro_i == accum - 1
        # The guard all-reduces the step's loss on the last micro batch and may poison it
        # (skip: NaN gradients make DeepSpeed drop the update on every rank).
        loss = guard.before_backward(st.step + 1, step_losses, loss, last_micro)
        t0 = time.perf_counter()
        engine.backward(loss)
        clock.add("backward", time.perf_counter() - t0)
        if last_micro:
            guard.before_step(st.step + 1, engine)
        t0 = time.perf_counter()
        engine.step()
        clock.add("optimizer_step", time.perf_counter() - t0)
    st.step += 1
    st.steps_this_attempt += 1


def step_counts(w: Worker, micro_batches: list[dict[str, Any]]) -> tuple[list[list[float]], list[float] | None]:
    """(each micro batch's counts, the step's totals over every rank per micro batch) that weigh
    each micro batch's loss, so the step's loss is the mean over all of its targets (DPO: pairs;
    and the chosen answers' tokens for train.dpo_sft_weight) whatever the micro batch,
    accumulation and worker count. DeepSpeed averages the micro batches' losses, each a mean over
    its own targets: a micro batch of short chat answers weighed as much as one of long ones, a
    different objective for each split of the same batch (3.1x the gradient norm in one case).

    A loss divided by the totals per micro batch (the totals / (accumulation x workers)) comes
    out of DeepSpeed's averaging as the step's. Text blocks hold seq_len - 1 targets each, so
    their weights are all 1: totals None, and no all-reduce (every rank's stream has the same
    columns, so every rank skips it alike)."""
    if w.preference:
        from raytrain_cpu.trainer import dpo

        counts = [dpo.counts(b["labels"], b["position_ids"]) for b in micro_batches]
    elif any("labels" in b for b in micro_batches):
        counts = [[float(loss_tokens(b["labels"]))] for b in micro_batches]
    else:
        return [], None
    totals = _allreduce_sum([sum(c[k] for c in counts) for k in range(len(counts[0]))])
    if not totals[0]:  # no target anywhere: the losses are NaN, and the guard skips the step
        return counts, None
    share = len(micro_batches) * w.world
    return counts, [t / share for t in totals]


def preference_loss(w: Worker, st: Loop, engine, inputs: dict[str, Any], per: list[float] | None = None):
    """A micro batch's DPO loss (the reference forward first), its sums divided by `per`
    (`step_counts`' totals); its sums go to the next log row."""
    from raytrain_cpu.trainer import dpo

    loss, sums = dpo.micro_batch_loss(engine, w.reference, inputs, w.fused_loss, **w.dpo_settings, per=per)
    st.pair_sums = [a + b for a, b in zip(st.pair_sums, sums)] if st.pair_sums else sums
    return loss


def pair_metrics(w: Worker, st: Loop) -> dict[str, float]:
    """reward_accuracy, reward_margin, reward_chosen, reward_rejected, pairs and chosen_loss (the
    chosen answers' per-token loss) since the last log row, over every rank (an all-reduce every
    rank joins); {} for other data. The row's loss is DPO's, or with train.dpo_sft_weight the sum
    (and dpo_loss is logged beside it)."""
    from raytrain_cpu.trainer import dpo

    if not w.preference:
        return {}
    sums = _allreduce_sum(st.pair_sums or [0.0] * len(dpo.SUM_NAMES))
    st.pair_sums = None
    out = dpo.metrics(sums)
    if out:  # {} over no pair
        out["chosen_loss"] = dpo.chosen_loss(sums)
    if not w.cfg.train.dpo_sft_weight:
        out.pop("dpo_loss", None)  # the row's loss is DPO's
    return out


def add_by_source(w: Worker, st: Loop, source, row_losses, labels) -> None:
    """Adds a micro batch's rows' summed losses and target counts to their sources' sums."""
    import torch

    if st.source_sums is None:
        st.source_sums = torch.zeros(len(w.loss_sources), 2, dtype=torch.float64)
    sums = torch.stack([row_losses.detach(), row_targets(labels)], dim=1).double()
    st.source_sums.index_add_(0, source, sums)


def loss_by_source(w: Worker, st: Loop) -> dict[str, float]:
    """loss/<name>: each mixture source's mean loss over its targets in the logged step, over
    every rank (an all-reduce every rank joins); sources without targets there are left out."""
    if st.source_sums is None:
        return {}
    sums = _allreduce_sum(st.source_sums.flatten().tolist())  # train_step zeroes them at each step
    return {f"loss/{name}": sums[2 * i] / sums[2 * i + 1] for i, name in enumerate(w.loss_sources) if sums[2 * i + 1]}


@contextlib.contextmanager
def profiled(w: Worker, step: int):
    """train.profile_step: torch.profiler around that step, a trace and a table per rank."""
    if step != w.cfg.train.profile_step:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    from raytrain_cpu.host import cpu

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield
    wall = time.perf_counter() - t0
    out = w.run_dir / "profile"
    out.mkdir(exist_ok=True)
    prof.export_chrome_trace(str(out / f"rank{w.rank}.json"))
    averages = prof.key_averages()
    kinds = cpu.op_time_by_kind(prof.events(), wall)
    top = averages.table(sort_by="self_cpu_time_total", row_limit=25)
    title = f"# Step {step}, rank {w.rank}: {wall:.3f} s under the profiler"
    (out / f"rank{w.rank}.md").write_text("\n".join([title, "", obs.markdown_table(kinds), "", "```", top, "```", ""]))
    w.log(f"[profile] step {step}: " + ", ".join(f"{k['kind']} {k['share']:.0%}" for k in kinds) + f" -> {out}")


def log_step(w: Worker, st: Loop, engine, scheduler, guard: StabilityGuard, sink, progress, lora_on: bool) -> None:
    """A metrics row every train.log_every steps (every rank joins the all-reduces; rank 0 writes)."""
    grad_norm = engine.get_global_grad_norm()
    mem = obs.process_memory()
    mem_max, peak_max = obs.allreduce_max([mem["rss"], mem["hwm"]])
    st.last = {
        "step": st.step,
        "loss": guard.step_loss,
        "lr": scheduler.get_last_lr()[0],
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
        st.last["mfu"] = mfu * (
            (LORA_FLOPS_FRACTION if lora_on else 1.0) + (REFERENCE_FLOPS_FRACTION if w.reference_each_step else 0.0)
        )
    if sink is not None:
        sink.write(st.last)
        w.log(progress.line(st.last, progress.update(st.step)))
    st.window = obs.ThroughputWindow()


def evaluate_and_log(w: Worker, st: Loop, engine, shards: dict[str, Any], sink, sampler: Sampler | None) -> None:
    """Every rank evaluates (each source of a mixture) and completes train.sample_prompt; rank 0
    writes the rows and the lines."""
    if w.preference:
        st.eval_metrics = evaluate_pairs(w, engine, shards)
    else:
        st.eval_metrics = evaluate(engine, shards, w.cfg.train.micro_batch_size, w.cfg.train.eval_batches)
    st.watch.after_eval(st.step, st.eval_metrics)
    if sink is not None:
        sink.write({"step": st.step, **st.eval_metrics, "time": time.time()})
        w.log(eval_line(st.step, st.eval_metrics))
    if sampler is not None:
        completion = sampler.complete(engine)
        if sink is not None:
            sink.write_sample(st.step, sampler.prompt, completion)
            w.log(f"[sample] step {st.step}: {sampler.prompt!r} -> {completion!r}")


def release_free_pages(w: Worker, st: Loop, free_pages: FreePages) -> None:
    """scaling.free_memory_growth_mib, on this rank alone (no collective: a release costs the
    next step its page faults, nothing else)."""
    from raytrain_cpu.host import cpu

    if not free_pages.limit:  # off: not even the /proc read
        return

    def release() -> float:
        cpu.release_free_memory()
        return obs.process_memory()["rss"]

    freed = free_pages.after_step(st.step, obs.process_memory()["rss"], release)
    if freed is not None and free_pages.releases in (1, 10, 100, 1000):
        w.log(
            f"[memory] step {st.step}: resident memory {free_pages.limit / 2**20:.0f}+ MiB past the first steps'; "
            f"malloc's free pages handed back ({freed / 2**20:.0f} MiB; {free_pages.releases} time(s) so far, "
            "scaling.free_memory_growth_mib)"
        )


def checkpoint_reason(w: Worker, st: Loop) -> str | None:
    """'final', 'early_stop', 'periodic', 'preemption' (a spot notice: at once), 'growth' (an
    elastic run's cluster has room for more workers: at once) or None."""
    import ray.train

    t = w.cfg.train
    if st.step == t.max_steps:
        return "final"
    if st.watch.stop_reason:
        return "early_stop"
    if t.checkpoint_every and st.step % t.checkpoint_every == 0:
        return "periodic"
    every = w.cfg.run.preemption_check_every
    if every and st.step % every == 0 and not st.saved_on_notice:
        # A barrier across workers: Ray's answer for rank 0 becomes every rank's answer.
        notice = ray.train.get_preemption_info()
        if notice is not None:
            st.saved_on_notice = True
            w.log(spot_notice_line(notice.preempted_node_ids, notice.deadline_ms, time.time()))
            return "preemption"
        if room_to_grow(w, st):
            return "growth"
    return None


def spot_notice_line(node_ids: list[str], deadline_ms: int, now: float) -> str:
    """What rank 0 says when Ray tells of a coming preemption (a drained node)."""
    if deadline_ms:
        when = (
            f"at {time.strftime('%H:%M:%S', time.gmtime(deadline_ms / 1000))} UTC (in {deadline_ms / 1000 - now:.0f} s)"
        )
    else:
        when = "with no deadline"
    nodes = ", ".join(n[:12] for n in node_ids)
    return (
        f"spot notice: node(s) {nodes} go {when}; checkpointing now. Ray Train then restarts the workers "
        "without them, from this checkpoint (not counted in run.max_failures)"
    )


def room_to_grow(w: Worker, st: Loop) -> bool:
    """Whether an elastic run below its most workers now has room for more, on nodes other than
    those it last checkpointed for. Ray Train then restarts the workers at the larger size from
    the latest checkpoint once its own view of the cluster has caught up (up to
    scaling.resize_check_s plus Ray's 20 s refresh): a checkpoint taken at once keeps the steps
    trained until then. Once per set of nodes, since a node that just died may still be listed
    for a moment. Rank 0 counts; every rank follows."""
    import ray

    from raytrain_cpu.planner.sizing import workers_that_fit

    if w.world >= w.most_workers:  # fixed (0), or at its most already
        return False
    grow = 0.0
    if w.is_main:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        room = min(workers_that_fit(alive, w.loop_config["worker_bundle"]), w.most_workers)
        nodes = frozenset(n["NodeID"] for n in alive)
        if room > w.world and nodes != st.growth_nodes:
            st.growth_nodes, grow = nodes, 1.0
            w.log(f"the cluster now holds {room} workers; checkpointing before Ray Train grows the run")
    return _allreduce_sum([grow])[0] > 0


def save_checkpoint(w: Worker, st: Loop, engine, reason: str, loaded: Loaded, block_log) -> None:
    """Every rank saves its shard; rank 0 writes the manifest; all report to Ray Train."""
    from raytrain_cpu.host import cpu

    cfg = w.cfg
    st.watch.checkpointed(ckpt_io.free_checkpoint_name(Path(ray_storage_path()), st.step), st.step)
    manifest = {
        "step": st.step,
        "reason": reason,
        "world_size": w.world,
        "global_batch": w.global_batch,
        "blocks_consumed": st.step * w.global_batch,
        "tokens_seen": st.step * w.tokens_per_step,
        "config_hash": w.loop_config["config_hash"],
        "settings": ckpt_io.hashed_settings(w.loop_config["config"]),  # names what changed on a bad resume
        **{k: getattr(cfg.deepspeed, k) for k in ckpt_io.LAYOUT_SETTINGS},  # how the shards are laid out
        "dtype": cfg.model.dtype,
        "attention": loaded.attention,  # an 'auto' run resumes with it
        "model_dir": w.loop_config["model_dir"],
        "model": w.loop_config.get("model"),  # its hub commit and fingerprint: a resume loads exactly it
        "tokenizer": resolve_tokenizer_path(cfg.model.tokenizer, w.loop_config["model_dir"]),
        "lora": loaded.lora,  # export writes an adapter (and merges it) when set
        "data": cfg.to_dict()["data"],  # format and template: how export and generate render prompts
        "dpo": w.dpo_settings,  # how `evaluate` scores its pairs
        "data_key": w.loop_config["data_key"],  # the packed blocks trained on (their files' fingerprints)
        # What the next step trains on, which a resume checks its stream against (check_resumed_stream);
        # rank 0's alone is written.
        "next_blocks": {"position": st.step * w.global_batch, "block_ids": next_block_ids(w, st.step)}
        if w.is_main
        else None,
        "eval_watch": st.watch.state(),  # the best so far and the evaluations since: a resume goes on counting
        "time": time.time(),
    }
    report = {
        "step": st.step,
        "loss": st.last.get("loss"),
        "tokens_seen": st.step * w.tokens_per_step,
        "train_wall_s": st.wall(),
        "tokens_per_s": st.steps_this_attempt * w.tokens_per_step / st.wall(),
        "data_wait_frac": st.total_wait / st.wall(),
        **st.eval_metrics,
        "checkpoint_score": st.watch.score(st.step),  # what Ray Train ranks by under run.best_metric
    }
    if block_log is not None:
        block_log.flush()
    run_root = Path(ray_storage_path())
    st.last_ckpt = ckpt_io.save_and_report(engine, run_root, st.step, manifest, report, w.rank, w.world, st.last_ckpt)
    cpu.release_free_memory()  # the save's buffers: see build_engine


def next_block_ids(w: Worker, step: int) -> list[int]:
    """The block ids of the global batch after `step` steps (stream positions step x G ... + G),
    from the data cache's block counts, train.seed and data.shuffle_window as they are now."""
    from raytrain_cpu.data.stream import mixture_sources, read_meta

    cache = Path(w.loop_config["data_cache"])
    meta = read_meta(cache)
    n_blocks = tuple(source_meta["blocks"] for _, _, source_meta in mixture_sources(cache, meta))
    start = step * w.global_batch
    positions = np.arange(start, start + w.global_batch, dtype=np.int64)
    pattern = tuple(meta.get("pattern", (0,)))
    return stream_block_ids(positions, n_blocks, pattern, w.cfg.train.seed, w.cfg.data.shuffle_window).tolist()


def stream_block_ids(
    positions: np.ndarray, n_blocks: tuple[int, ...], pattern: tuple[int, ...], seed: int, window: int
) -> np.ndarray:
    """The block ids at global stream `positions`, as data.StreamPlan.fetch composes them (a
    mixture's sources by `pattern`, each through seeded epochs of its own, ids counted on from
    the sources before it); only the ids, no block read. Each epoch's order is made afresh and
    dropped (global_order's uncached function): at a checkpoint now and then, a large corpus's
    order (8 bytes a block) is not worth keeping in the training process."""
    from raytrain_cpu.data.stream import global_order, mix_positions, source_block_ids

    src, src_pos = mix_positions(positions, pattern)
    first_id = np.cumsum((0, *n_blocks))
    out = np.empty_like(positions)
    for s, sel, ids in source_block_ids(src, src_pos, n_blocks, seed, window, order=global_order.__wrapped__):
        out[sel] = first_id[s] + ids
    return out


def check_resumed_stream(rank: int, step: int, recorded: dict[str, Any], pos, block_ids) -> str | None:
    """Why rank `rank`'s first batch after resuming at `step` is not what the checkpoint recorded
    for those stream positions (`recorded`: its next_blocks, the global batch after it); None
    when it is. Its positions must lie in that batch (the global batch cannot change across a
    resume) and its blocks must be the ones recorded there: a stream planned from another
    position, seed, shuffle window or set of blocks gives others."""
    start, ids = int(recorded["position"]), [int(b) for b in recorded["block_ids"]]
    pos, got = [int(p) for p in pos], [int(b) for b in block_ids]
    if any(not start <= p < start + len(ids) for p in pos):
        return (
            f"rank {rank}: the data stream resumed at positions {pos[0]}-{pos[-1]}, but the checkpoint at step "
            f"{step} recorded the next step's blocks at positions {start}-{start + len(ids) - 1}: the stream does "
            "not go on where the checkpoint stopped"
        )
    want = [ids[p - start] for p in pos]
    if got != want:
        return (
            f"rank {rank}: the first batch after resuming at step {step} holds blocks {got} at positions "
            f"{pos[0]}-{pos[-1]}, where the checkpoint recorded {want}: the data stream does not go on where it "
            "stopped (the packed blocks, train.seed or data.shuffle_window differ from the checkpoint's)"
        )
    return None


def ray_storage_path() -> str:
    """Checkpoints live in Ray's experiment directory (the run dir) so they can be reported in place."""
    import ray.train

    return ray.train.get_context().get_storage().experiment_fs_path


# ----------------------------------------------------------------------------- phases: the end


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


def step_breakdown(w: Worker, clock) -> dict[str, Any]:
    """Seconds per optimizer step after the warm-up steps, averaged over ranks (every rank joins)."""
    breakdown = clock.summary()
    if clock.comm is not None:
        clock.comm.uninstall()
    keys = [k for k, v in breakdown.items() if isinstance(v, float)]
    breakdown |= dict(zip(keys, (v / w.world for v in _allreduce_sum([breakdown[k] for k in keys])), strict=True))
    breakdown["tokens_per_s"] = w.tokens_per_step / breakdown["step_wall_s"] if breakdown["steps"] else None
    return breakdown


def write_worker_summary(w: Worker, st: Loop, engine, guard, loaded: Loaded, cpu_setup, breakdown) -> None:
    """Rank 0 hands its figures to the driver through a file (Ray Train v2 keeps no final metrics)."""
    summary = {
        "steps": st.step,
        "tokens_seen": st.step * w.tokens_per_step,
        "epochs": w.epochs(st.step),
        "final_loss": st.last.get("loss"),
        **{f"final_{k}": v for k, v in st.last.items() if k.startswith("loss/")},  # a mixture's: final_loss/<name>
        "eval_loss": st.eval_metrics.get("eval_loss"),
        "eval_perplexity": st.eval_metrics.get("eval_perplexity"),
        "eval_tokens": st.eval_metrics.get("eval_tokens"),  # the targets evaluated (responses only in SFT)
        **{k: v for k, v in st.eval_metrics.items() if "/" in k},  # a mixture's sources: eval_loss/<name>
        **{k: v for k, v in st.eval_metrics.items() if k.startswith(("eval_dpo", "eval_reward"))},  # DPO's
        "tokens_per_s": st.steps_this_attempt * w.tokens_per_step / st.wall(),
        "data_wait_frac": st.total_wait / st.wall(),
        "first_batch_wait_s": st.first_batch_wait,
        "world_size": w.world,
        "global_batch": w.global_batch,
        "resumed_from_step": st.resumed_from,
        "optimizer_step_at_resume": st.opt_step_at_resume,
        "load_s": loaded.load_s,
        "n_params": w.loop_config["n_params"],
        "trainable_params": loaded.params["trainable"],
        "total_params": loaded.params["total"],
        "optimizer_state_bytes": loaded.params["optimizer_state_bytes"],  # per rank
        "lora": loaded.lora,
        "dpo": w.dpo_settings,
        "reference_pass": w.reference_pass,
        "attention": loaded.attention,
        "compiled": w.cfg.model.compile is True,  # model.compile=auto as this run resolved it
        "weight_grad_kernel": w.weight_grad_kernel,  # model.weight_grad_kernel as this run resolved it
        "weight_grad_timings": w.weight_grad_timings,  # seconds a micro batch, kernel and autograd ('auto')
        "train_wall_s": st.wall(),
        "guard_events_this_attempt": guard.counts,
        "skipped_steps": engine.skipped_steps,  # DeepSpeed's count, kept across resumes
        "guard_stop": guard.stop_reason,
        "early_stop": st.watch.stop_reason if st.step < w.cfg.train.max_steps else None,  # at the end: not early
        "best_checkpoint": best_checkpoint(w, st),
        "step_breakdown": breakdown,
        "cpu": {**cpu_setup, "load_peak_rss_bytes": loaded.load_peaks},
    }
    (w.run_dir / ".worker_summary.json").write_text(json.dumps(summary, indent=2))


def best_checkpoint(w: Worker, st: Loop) -> dict[str, Any] | None:
    """run.best_metric's best checkpoint: {"path", "step", "metric", "value"}; None when not ranking."""
    best = st.watch.best_checkpoint
    if best is None:
        return None
    return {
        "path": str(w.run_dir / best["name"]),
        "step": best["step"],
        "metric": st.watch.metric,
        "value": best["value"],
    }


# ----------------------------------------------------------------------------- the loop


LORA_FLOPS_FRACTION = 4 / 6  # forward (2) + input gradients (2) of full training's 6 FLOPs per parameter
REFERENCE_FLOPS_FRACTION = 2 / 6  # DPO's reference model: one more forward


def train_loop(loop_config: dict[str, Any]) -> None:
    """One worker's whole attempt: set up → load → engine → resume → steps (log, eval, checkpoint) → finish."""
    import ray.train
    import torch.distributed as dist

    from raytrain_cpu.data.stream import eval_dataset
    from raytrain_cpu.host import cpu

    # ---- config and CPU
    w = setup_worker(loop_config)
    cfg, t = w.cfg, w.cfg.train
    cpu_setup = setup_cpu(w)
    resolve_compile(w)  # model.compile=auto reads the dtype setup_cpu resolved

    # ---- data: this rank's blocks in their global order (planned on the driver for each worker count)
    train_shard = ray.train.get_dataset_shard(f"train_w{w.world}_rank{w.rank}")
    eval_shards = {
        name: ray.train.get_dataset_shard(eval_dataset(w.world, w.rank, name))
        for name, n_eval in loop_config["eval_sources"].items()
        if n_eval >= w.world  # fewer blocks than workers: that source is not evaluated
    }

    # ---- model and engine
    rescaled = bool(w.resumed) and w.resumed["world_size"] != w.world
    if rescaled:
        universal_checkpoint(w)
    ds_config = deepspeed_config(cfg, w.world, universal=rescaled)
    loaded = load_model(w, ds_config)
    engine, scheduler = build_engine(w, loaded.model, ds_config)
    w.reference = build_reference(w, loaded, engine, ds_config)
    time_mfu_peak(w, cpu_setup)

    # ---- resume
    st = resume(w, engine, scheduler)
    batches = open_batches(w, st, train_shard)
    # Kept open for the whole loop (flushed at each checkpoint), hence no `with`.
    block_log = open(w.run_dir / "block_ids" / f"rank{w.rank}.txt", "a") if loop_config["record_block_ids"] else None  # noqa: SIM115

    # ---- observability: rank 0 writes the sinks; every rank runs the guard (its decisions
    # come from all-reduced values, so all ranks skip or stop together)
    sink = obs.MetricsSink.for_run(cfg, w.run_dir, resume_step=st.step, log=w.log) if w.is_main else None
    if sink is not None:  # where this attempt starts: the report's restarts (metrics.read_metrics)
        sink.write({"step": st.step, "attempt": {"workers": w.world}, "time": time.time()})

    def on_guard_event(event) -> None:
        if sink is not None:
            sink.write({**event.row(), "time": time.time()})
            w.log(event.message())

    guard = StabilityGuard(
        cfg.guards, _allreduce_sum, w.world, w.rank, cfg.deepspeed.zero_stage, on_event=on_guard_event
    )
    progress = obs.Progress(t.max_steps, start_step=st.step, show_epoch=t.epochs > 0)
    # Step-time breakdown (summary.json: step_breakdown); collectives only with train.profile_breakdown.
    # A short run (or a resumed one near its end) still times its last step.
    warmup = min(cpu.WARMUP_STEPS, max(t.max_steps - st.step - 1, 0))
    clock = cpu.StepClock(cpu.CommTimer().install() if t.profile_breakdown else None, warmup)
    free_pages = FreePages(cfg.scaling.free_memory_growth_mib * 2**20, st.step + cpu.WARMUP_STEPS + 1)

    # ---- loop
    sampler = Sampler.for_run(w)
    if eval_shards and t.eval_on_start and st.step == 0:  # the starting model's loss: the baseline
        evaluate_and_log(w, st, engine, eval_shards, sink, sampler)
    if st.watch.stop_reason:  # resumed from the checkpoint an early stop took (a restart after it)
        w.log(f"stopped early at step {st.step}: {st.watch.stop_reason}")
    while st.step < t.max_steps and not st.watch.stop_reason:
        run_step(w, st, engine, scheduler, batches, guard, clock, block_log)
        if t.mfu_probe_every and st.step % t.mfu_probe_every == 0:
            retime_mfu_peak(w, st, cpu_setup["dtype"]["dtype"], clock)
        release_free_pages(w, st, free_pages)
        if st.step % t.log_every == 0 or st.step == t.max_steps or guard.stop_reason:
            log_step(w, st, engine, scheduler, guard, sink, progress, cfg.lora.enabled)
        if guard.stop_reason:
            w.log(f"stopping: {guard.stop_reason}")
            break  # every rank reaches this at the same step: the decision was all-reduced
        if eval_shards and ((t.eval_every and st.step % t.eval_every == 0) or st.step == t.max_steps):
            evaluate_and_log(w, st, engine, eval_shards, sink, sampler)
        reason = checkpoint_reason(w, st)
        if reason:
            save_checkpoint(w, st, engine, reason, loaded, block_log)
        if reason == "early_stop":
            w.log(f"stopping early at step {st.step}: {st.watch.stop_reason}")

    # ---- finish: the export check's probe, the step-time breakdown, the summary, the export
    export_probe = (
        export_io.probe_logits(engine, st.last_input_ids)
        if cfg.run.export_on_finish and st.steps_this_attempt
        else None
    )
    breakdown = step_breakdown(w, clock)
    # Every rank's optimizer bytes, gathered with a one-hot sum (summary.json: optimizer_state_bytes).
    opt_bytes = _allreduce_sum([float(optimizer_state_bytes(engine)) if r == w.rank else 0.0 for r in range(w.world)])
    loaded.params["optimizer_state_bytes"] = [int(b) for b in opt_bytes]
    cpu_setup["free_pages_released"] = {"times": free_pages.releases, "mib": free_pages.released / 2**20}  # rank 0's
    if w.is_main:
        write_worker_summary(w, st, engine, guard, loaded, cpu_setup, breakdown)
    if sink is not None:
        sink.close(finished=guard.stop_reason is None)
    dist.barrier()
    if w.is_main and cfg.run.export_on_finish and st.last_ckpt is not None:
        del engine, loaded  # free this rank's shard before consolidating the whole model
        w.reference = None  # and full fine-tuning DPO's reference copy (its engine)
        best = st.watch.best_checkpoint  # run.best_metric: the best checkpoint, else the final one
        exported = w.run_dir / best["name"] if best else st.last_ckpt
        probe = export_probe if exported.name == ckpt_io.free_checkpoint_name(w.run_dir, st.step) else None
        export_io.export_on_finish(exported, w.run_dir, probe, w.log)
