"""The run's configuration: the root Config over its sections, the checks across sections, and
load_config, which builds it from defaults, a YAML file and dotted overrides.

Every field has a docstring (the string literal under it); ``--help`` prints them.
Validation happens in ``__post_init__`` so a bad value fails on the driver, before Ray
starts. Only plain dicts (``Config.to_dict()``) cross the Ray boundary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain_cpu.config.checks import ConfigError, check_hpz_partition, choice, require
from raytrain_cpu.config.data import DataConfig
from raytrain_cpu.config.load import build, raw_config
from raytrain_cpu.config.model import LoraSettings, ModelConfig
from raytrain_cpu.config.run import MetricsConfig, RunSettings
from raytrain_cpu.config.scaling import DeepSpeedSettings, ScalingConfig
from raytrain_cpu.config.training import GuardConfig, TrainConfig


@dataclass
class Config:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA fine-tuning (off by default: full fine-tuning)."""
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    """Workers and resources."""
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)
    """DeepSpeed."""
    run: RunSettings = field(default_factory=RunSettings)
    """Run directory, recovery."""
    guards: GuardConfig = field(default_factory=GuardConfig)
    """Stability guards."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metric sinks."""

    def __post_init__(self) -> None:
        if self.model.is_tiny:
            require(
                self.model.tiny.max_position_embeddings >= self.data.seq_len,
                "data.seq_len",
                f"{self.data.seq_len} exceeds model.tiny.max_position_embeddings="
                f"{self.model.tiny.max_position_embeddings}; lower seq_len or raise the other.",
            )
        if self.guards.action == "skip" and self.guards.max_grad_norm > 0:
            # Skipping on the gradient norm reads each rank's gradient shard before the update,
            # which DeepSpeed exposes for ZeRO-3 partitions only.
            require(
                self.deepspeed.zero_stage == 3,
                "guards.max_grad_norm",
                "skipping steps on the gradient norm needs deepspeed.zero_stage=3; use guards.action=log "
                "or stop, or guards.max_grad_norm=0.",
            )

        if self.run.best_metric or self.train.early_stop_patience:
            _check_watched_metric(self)
        if self.train.dpo_precompute_reference:
            require(
                self.data.format == "preference" and self.train.dpo_reference,
                "train.dpo_precompute_reference",
                "precomputes a DPO reference model's log-likelihoods, and "
                + (
                    f"train.dpo_loss={self.train.dpo_loss} compares no reference; leave it false."
                    if self.data.format == "preference"
                    else f"data.format={self.data.format} trains on no preference pairs; leave it false."
                ),
            )
        require(
            not self.train.sample_prompt or self.train.sample_tokens < self.data.seq_len,
            "train.sample_tokens",
            f"{self.train.sample_tokens} leaves no room for the prompt in data.seq_len={self.data.seq_len} (the "
            "positions the model trains on); lower it.",
        )
        check_hpz_partition(
            self.deepspeed.hpz_partition_size,
            self.deepspeed.zero_stage,
            self.worker_counts if self.scaling.num_workers else (),
        )
        if self.deepspeed.config_file:
            _check_deepspeed_file(self)
        if self.elastic:
            _check_elastic_batch(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def watched_metric(self) -> str:
        """The eval metric run.best_metric ranks by and train.early_stop_patience watches."""
        return self.run.best_metric or "eval_loss"

    @property
    def elastic(self) -> bool:
        return 0 < self.scaling.min_workers < self.scaling.num_workers

    @property
    def worker_counts(self) -> range:
        """The worker counts the run may have: scaling.min_workers..num_workers when elastic."""
        s = self.scaling
        return range(s.min_workers if self.elastic else s.num_workers, s.num_workers + 1)

    def accumulation_for(self, world: int) -> int:
        """grad_accum_steps for `world` workers in an elastic run: the global batch stays the one
        of scaling.num_workers workers (it is what the LR schedule and the data position count)."""
        t = self.train
        return t.derive_global_batch(self.scaling.num_workers) // (world * t.micro_batch_size)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        return build(cls, d, prefix="")


def _or(items: list[Any]) -> str:
    return " or ".join(map(str, items)) if len(items) < 3 else f"{', '.join(map(str, items[:-1]))} or {items[-1]}"


def _check_watched_metric(cfg: Config) -> None:
    """run.best_metric and train.early_stop_patience need an eval metric the run reports, and
    evaluations to read it from; ranking checkpoints needs one at each checkpoint's step."""
    t, key = cfg.train, "run.best_metric" if cfg.run.best_metric else "train.early_stop_patience"
    names = [m.name for m in cfg.data.mix]
    metrics = ["eval_loss", *(f"eval_loss/{n}" for n in names)]
    if cfg.data.format == "preference":
        metrics.append("eval_dpo_loss")
    choice(cfg.watched_metric, "run.best_metric", tuple(metrics))
    require(
        t.eval_every > 0,
        key,
        "needs evaluations during the run, and train.eval_every=0 evaluates only at the end; set "
        "train.eval_every (e.g. 100).",
    )
    if cfg.run.best_metric:
        require(
            t.checkpoint_every > 0 and t.checkpoint_every % t.eval_every == 0,
            "run.best_metric",
            f"ranks each checkpoint by the evaluation at its step, and train.checkpoint_every="
            f"{t.checkpoint_every} is not a multiple of train.eval_every={t.eval_every}; set "
            f"train.checkpoint_every={max(t.checkpoint_every // t.eval_every, 1) * t.eval_every}.",
        )


def _check_elastic_batch(cfg: Config) -> None:
    """Every worker count of an elastic range must split the global batch into whole micro
    batches; else the error names a grad_accum_steps or micro_batch_size that does."""
    t, s = cfg.train, cfg.scaling
    batch = t.derive_global_batch(s.num_workers)
    odd = [w for w in cfg.worker_counts if batch % (w * t.micro_batch_size)]
    if not odd:
        return
    lcm = math.lcm(*cfg.worker_counts)
    accum = t.grad_accum_steps * lcm // math.gcd(lcm, s.num_workers * t.grad_accum_steps)
    fixes = [f"train.grad_accum_steps={accum} (a global batch of {s.num_workers * t.micro_batch_size * accum})"]
    if batch % lcm == 0:  # every count divides the batch: a smaller micro batch keeps it
        micro = math.gcd(*(batch // w for w in cfg.worker_counts))
        fixes.append(f"train.micro_batch_size={micro} with train.grad_accum_steps={batch // (s.num_workers * micro)}")
    raise ConfigError(
        f"scaling.min_workers: the global batch of {batch} blocks ({s.num_workers} workers x micro_batch_size "
        f"{t.micro_batch_size} x grad_accum_steps {t.grad_accum_steps}) does not split into micro batches of "
        f"{t.micro_batch_size} over {_or(odd)} workers, which the elastic range "
        f"{s.min_workers}..{s.num_workers} allows. Use {' or '.join(fixes)}."
    )


def _check_deepspeed_file(cfg: Config) -> None:
    """deepspeed.config_file must be a JSON object, and must not set what a raytrain key sets to
    another value: the run would train with the file's value while the manifest, the resume
    checks and the planner read the key's (a file's stage 2 under deepspeed.zero_stage=3)."""
    path = cfg.deepspeed.config_file
    try:
        extra = json.loads(Path(path).read_text())
    except ValueError as e:
        raise ConfigError(f"deepspeed.config_file: {path} is not valid JSON ({e}).") from None
    require(isinstance(extra, dict), "deepspeed.config_file", f"{path} must hold a JSON object of DeepSpeed keys.")
    ds, zero = cfg.deepspeed, extra.get("zero_optimization") or {}
    owned = {
        "zero_optimization.stage": (zero.get("stage"), "deepspeed.zero_stage", ds.zero_stage),
        "zero_optimization.sub_group_size": (zero.get("sub_group_size"), "deepspeed.sub_group_size", ds.sub_group_size),
        "zero_optimization.overlap_comm": (zero.get("overlap_comm"), "deepspeed.overlap_comm", ds.overlap_comm),
        "zero_optimization.stage3_param_persistence_threshold": (
            zero.get("stage3_param_persistence_threshold"),
            "deepspeed.param_persistence_threshold",
            ds.param_persistence_threshold,
        ),
        "zero_optimization.stage3_max_live_parameters": (
            zero.get("stage3_max_live_parameters"),
            "deepspeed.max_live_parameters",
            ds.max_live_parameters,
        ),
        "zero_optimization.zero_hpz_partition_size": (
            zero.get("zero_hpz_partition_size"),
            "deepspeed.hpz_partition_size",
            ds.hpz_partition_size,
        ),
        "gradient_clipping": (extra.get("gradient_clipping"), "train.grad_clip", cfg.train.grad_clip),
    }
    for name, (value, key, ours) in owned.items():
        require(
            value in (None, "auto") or value == ours,
            "deepspeed.config_file",
            f"{path} sets {name}={value!r}, and {key}={ours!r} sets it too: set {key}={value} instead (the manifest, "
            "resume checks and planner read that) and leave it out of the file.",
        )
    require(
        not (extra.get("checkpoint") or {}).get("load_universal"),
        "deepspeed.config_file",
        f"{path} sets checkpoint.load_universal: raytrain sets it for a resume on another number of workers "
        "(and only then: every other checkpoint is not universal); leave it out of the file.",
    )


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- overrides, validated. Raises ConfigError."""
    return Config.from_dict(raw_config(path, overrides))
