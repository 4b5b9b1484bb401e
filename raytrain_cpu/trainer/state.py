"""A worker's state: what its attempt settled at the start (Worker) and what changes as the loop
runs (Loop), with the free-page accounting (FreePages)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain_cpu.config.schema import Config
from raytrain_cpu.obs import metrics as obs


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
    # next_blocks), checked against this rank's first batch (batches.check_resumed_stream); then None.
    expected_blocks: dict[str, Any] | None = None
    data_changed: bool = False  # the packed blocks changed since that checkpoint (data_key)
    first_batch_wait: float | None = None
    total_wait: float = 0.0
    t_start: float = field(default_factory=time.perf_counter)
    step_t0: float = 0.0  # when the running step started (Trainer.step), past the first batch's wait
    window: obs.ThroughputWindow = field(default_factory=obs.ThroughputWindow)  # the log row's tokens/s
    saved_on_notice: bool = False
    growth_nodes: frozenset[str] = frozenset()  # rank 0: the nodes that had room when it last saved for growth
    last: dict[str, Any] = field(default_factory=dict)  # the latest logged row
    eval_metrics: dict[str, Any] = field(default_factory=dict)
    watch: Any = None  # the run's evaluation.EvalWatch, set by Trainer.resume
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
