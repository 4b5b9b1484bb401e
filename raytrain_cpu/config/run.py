"""run: and metrics: settings: where the run lives, how it recovers, and its metric sinks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from raytrain_cpu.config.checks import absolute, require, require_filesystem

# ----------------------------------------------------------------------------- run


@dataclass
class RunSettings:
    """Where the run lives and how it recovers."""

    name: str = "tiny-local"
    """Run name; re-running with the same name and storage path resumes the run."""
    storage_path: str = "./runs"
    """Directory for runs (shared by all nodes on a cluster, e.g. /fsx/runs)."""
    ray_address: str = ""
    """'' starts a local Ray (or joins RAY_ADDRESS when set, as under `ray job submit`);
    'auto' joins a running cluster; or host:port."""
    num_to_keep: int = 2
    """Checkpoints kept on storage: the newest ones, or with run.best_metric the best ones (and
    the newest beside them, which a resume loads)."""
    best_metric: str = ""
    """Rank the checkpoints by an eval metric, lowest best: 'eval_loss', or 'eval_loss/<name>'
    for one source of a mixture. run.num_to_keep then keeps the best, summary.json names the best,
    and run.export_on_finish (and `export --best`) exports it. '': keep the newest."""
    max_failures: int = 0
    """Times Ray Train restarts the worker group after a failure (a worker or node lost); each restart
    resumes from the latest checkpoint; -1 retries forever. Spot preemptions Ray announced are
    retried without limit and not counted here."""
    gloo_timeout_s: int = 600
    """Seconds a collective may wait on a peer before the attempt fails (Ray's default is 1800); also
    bounds Ray Train's own barriers and worker health checks, so a dead or hung peer ends the
    attempt within about this time."""
    poll_interval_s: float = 0.5
    """Seconds between Ray Train's polls of the workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S): each
    poll collects their reports (so registers checkpoints) and notices an attempt that finished or
    failed. Ray's default, 2 s, kept every run seconds longer past its workers' end (the controller
    polls twice before it lets them go; benchmarks/poll_interval.py); a poll is one small call to
    each worker."""
    placement_group_cleaner: bool = True
    """Start Ray Train's placement-group cleaner beside each run: a detached actor that frees the
    workers' reserved CPUs should the run's controller die while the process that started the run
    lives on (a notebook, a script running several runs). Ray frees them anyway when that process
    exits, as a command-line run's does; false saves the actor's process (a second or two of CPU
    a run)."""
    preemption_check_every: int = 1
    """Ask Ray every this many steps whether a node of the run is being drained (a spot notice) and
    checkpoint at once if so; 0 never asks. Each check is a small barrier across the workers. An
    elastic run below its most workers also checks then whether nodes joined that hold more,
    and checkpoints at once before Ray Train grows it (it restarts from the latest checkpoint)."""
    export_on_finish: bool = False
    """When training ends, write <run dir>/export (a Hugging Face model: safetensors, config,
    tokenizer) from the final checkpoint and check its logits against the trained model."""
    verbose: bool = False
    """Also show Ray's own driver and worker log lines on the console, as before (Ray Train's and
    Ray Data's logs, worker tracebacks, raylet notices). Off, the console keeps raytrain's lines
    (progress, phases, restarts with their reason, the summary); Ray's logs stay in its log
    directory either way (the run's first lines name it)."""

    def __post_init__(self) -> None:
        require(
            bool(self.name) and "/" not in self.name and self.name not in (".", ".."),
            "run.name",
            f"{self.name!r} must be a plain directory name (no '/').",
        )
        require(bool(self.storage_path), "run.storage_path", "must not be empty; e.g. ./runs or /fsx/runs.")
        require_filesystem(self.storage_path, "run.storage_path")
        require(self.num_to_keep >= 1, "run.num_to_keep", "must be >= 1.")
        require(self.max_failures >= -1, "run.max_failures", "must be >= -1 (-1 = retry forever).")
        require(self.gloo_timeout_s >= 10, "run.gloo_timeout_s", "must be at least 10 seconds.")
        require(
            0.05 <= self.poll_interval_s <= 60,
            "run.poll_interval_s",
            f"got {self.poll_interval_s}; use 0.05 to 60 (e.g. 0.5).",
        )
        require(self.preemption_check_every >= 0, "run.preemption_check_every", "must be >= 0 (0 = never).")

    @property
    def run_dir(self) -> Path:
        return Path(self.storage_path).expanduser().absolute() / self.name

    @property
    def hub_cache(self) -> Path:
        """What the driver fetches from the hub (models, tokenizers), kept for later runs."""
        return self.run_dir.parent / "hf_cache"

    @property
    def ray_init_address(self) -> str:
        """The address for ray.init: run.ray_address, else RAY_ADDRESS (set under `ray job
        submit`), else 'local'. Plain ray.init() would join whatever cluster
        /tmp/ray/ray_current_cluster names, even one left by a killed head or started by
        someone else on the machine; a run without an address gets its own local Ray."""
        return self.ray_address or os.environ.get("RAY_ADDRESS", "") or "local"


# ----------------------------------------------------------------------------- metrics


@dataclass
class MetricsConfig:
    """Metric sinks besides metrics.jsonl, which is always written and is the source of truth."""

    tensorboard: bool = True
    """Write TensorBoard event files to <run dir>/tensorboard (from rank 0)."""
    mlflow_tracking_uri: str = ""
    """Also log to MLflow at this tracking URI (e.g. http://mlflow:5000 or sqlite:///fsx/mlflow.db);
    needs the mlflow extra installed on every node; '' disables MLflow."""
    mlflow_experiment: str = "raytrain_cpu"
    """MLflow experiment the run is logged under (the MLflow run is named after run.name)."""

    def __post_init__(self) -> None:
        # A plain directory (MLflow's file store) is opened by rank 0, which runs elsewhere.
        if self.mlflow_tracking_uri and ":" not in self.mlflow_tracking_uri:
            self.mlflow_tracking_uri = absolute(self.mlflow_tracking_uri)
