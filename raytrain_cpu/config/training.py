"""train: and guards: settings: the optimisation loop and its stability guards."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal, get_args

from raytrain_cpu.config.checks import ConfigError, choice, require

Schedule = Literal["cosine", "wsd", "constant"]
DpoLoss = Literal["sigmoid", "ipo", "hinge", "simpo"]
GuardAction = Literal["log", "skip", "stop"]

# ----------------------------------------------------------------------------- training


REFERENCE_FREE_LOSSES = ("simpo",)  # train.dpo_loss values that compare no reference model


@dataclass
class TrainConfig:
    """The optimisation loop."""

    max_steps: int = 200
    """Optimizer steps to run in total (a resumed run counts from where it stopped). Derived
    instead when train.epochs is set."""
    epochs: float = 0.0
    """Passes over the training data, in place of train.max_steps: once the data are packed the
    run takes ceil(epochs x training blocks / global batch) steps, so every block is trained on
    at least once an epoch (the last step may take a few blocks of the next pass). A mixture
    counts the blocks of all its sources and draws them by weight: a source weighted above its
    share of the blocks is read more than once an epoch, one below it only in part (the console
    says how often each is read). Fractions work (0.5: half the data). 0 (default):
    train.max_steps says how long. Set one of the two: where the command line gives one and the
    --config file the other, the command line's wins."""
    micro_batch_size: int = 8
    """Blocks per worker per forward/backward pass."""
    grad_accum_steps: int = 1
    """Micro batches accumulated per optimizer step."""
    global_batch_size: int = 0
    """Blocks per optimizer step over all workers; 0 derives it as micro_batch_size x
    grad_accum_steps x world size; if set it must equal that product."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of train.lr."""
    warmup_steps: int = 20
    """Linear warm-up steps (capped at a tenth of train.max_steps for short runs)."""
    schedule: Schedule = "cosine"
    """'cosine' (warm-up then cosine decay), 'wsd' (warm-up, stable, then linear decay over
    the last train.decay_fraction of steps) or 'constant' (warm-up then flat)."""
    decay_fraction: float = 0.2
    """Share of train.max_steps spent decaying, for schedule 'wsd'."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    fused_adamw: bool = True
    """Use PyTorch's fused AdamW kernel (`torch.optim.AdamW(fused=True)`): one pass over each
    parameter's state, with no temporaries: on the fp32 partitions ZeRO updates, much faster
    optimizer steps and 8 bytes per parameter less peak memory per rank than the per-tensor
    loop (false), whose sqrt and division make two partition-sized tensors."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 1234
    """Seeds model initialisation, data order and dropout."""
    log_every: int = 10
    """Write a metrics.jsonl line every this many steps."""
    eval_every: int = 100
    """Evaluate every this many steps (and always at the end); 0 evaluates only at the end."""
    eval_batches: int = 0
    """Micro batches per evaluation per worker; 0 evaluates the whole eval split."""
    eval_on_start: bool = False
    """Also evaluate before the first step (step 0 in metrics.jsonl): the starting model's loss,
    the baseline a fine-tuning run (and each source of a mixture) improves on. Not on a resume."""
    checkpoint_every: int = 100
    """Checkpoint every this many steps (and always at the end); 0 only at the end."""
    early_stop_patience: int = 0
    """Stop once the watched eval metric (run.best_metric, else eval_loss) has gone this many
    evaluations in a row without beating its best by more than train.early_stop_min_delta;
    0: never. The run then checkpoints and ends as finished, before train.max_steps."""
    early_stop_min_delta: float = 0.0
    """How much lower than its best the watched eval metric must be to count as an improvement."""
    sample_prompt: str = ""
    """A prompt the model completes greedily at each evaluation, to watch what a run learns: shown
    on the console, in <run dir>/samples.jsonl and TensorBoard. Chat and instruction runs render it
    as the user's message with the run's template, as `generate` does. Every rank takes part
    (ZeRO-3 gathers the weights for each new token). '': none."""
    sample_tokens: int = 32
    """New tokens of train.sample_prompt's completion, at most."""
    dpo_beta: float = 0.1
    """DPO's beta, for data.format=preference: the loss is -log sigmoid(beta x (how much more the
    model prefers the chosen response than the reference did, in log-likelihood)). A larger
    beta keeps the model closer to the reference; 0.1 is the DPO paper's and TRL's default."""
    dpo_loss: DpoLoss = "sigmoid"
    """The preference loss of each pair's margin x (the log-likelihood gain of the chosen response
    over the rejected one, relative to the reference): 'sigmoid', DPO's -log sigmoid(beta x);
    'ipo', (x - 1/(2 beta))^2 on log-likelihoods averaged per response token (IPO: a pair the
    model already ranks right by that much is pushed no further; against overfitting small or
    near-deterministic preference sets); 'hinge', max(0, 1 - beta x) (SLiC); 'simpo',
    -log sigmoid(beta x - train.simpo_gamma) with x the chosen response's per-token
    log-likelihood over the rejected one's and no reference model at all (SimPO: no reference
    forward, no frozen copy; its beta is larger, e.g. train.dpo_beta=2.0)."""
    simpo_gamma: float = 0.5
    """For train.dpo_loss=simpo: the margin (in beta-scaled per-token log-likelihood) by which
    the chosen response should beat the rejected one; TRL's default 0.5 (the SimPO paper: about
    half of beta)."""
    dpo_sft_weight: float = 0.0
    """For data.format=preference: adds this weight times the chosen responses' per-token loss
    (SFT's) to the preference loss (RPO; TRL's rpo_alpha, e.g. 1.0). DPO alone may lower both
    responses' likelihoods as long as the rejected one falls faster; this holds the chosen one
    up. The train rows' loss is then the sum, with dpo_loss and chosen_loss beside it."""
    dpo_label_smoothing: float = 0.0
    """For train.dpo_loss=sigmoid: the probability that a pair's labels are swapped (conservative
    DPO): each pair's loss is (1 - e) x DPO's + e x DPO's on the pair reversed. 0: plain DPO;
    below 0.5 (at 0.5 chosen and rejected weigh the same)."""
    dpo_precompute_reference: bool = False
    """For data.format=preference: compute the reference model's log-likelihoods of every pair the
    run will train and evaluate on once, before the first step, and keep them in <run dir>/
    reference_logps/<the starting model's key>/ (4 bytes a token; another model gets its own), each computed in the micro batch that first holds its
    block, so the numbers are the reference forward's. Training then runs no reference forward
    (a DPO step costs about what an SFT step does) and full fine-tuning holds no frozen copy of
    the model (2 bytes a parameter over the ranks, saved). The pass costs one forward over
    those pairs: it pays off when pairs come round again (train.epochs > 1, repeated
    evaluations) or where the copy does not fit. A resume computes only pairs it has not kept
    (more steps, more data). TRL's precompute_ref_log_probs."""
    record_block_ids: bool = False
    """Append the id of every block each rank trains on to <run dir>/block_ids/rank<r>.txt
    (an audit trail of the data order; the resume tests count them)."""
    profile_breakdown: bool = False
    """Also time the collectives (all-gather, reduce-scatter, all-reduce) in the training thread,
    so summary.json's step-time breakdown shows communication; forward, backward, optimizer
    step and data wait are always timed."""
    profile_step: int = 0
    """Record this optimizer step with torch.profiler on every rank (0: none). The run
    directory gets profile/rank<r>.json (a trace for Perfetto or chrome://tracing) and
    profile/rank<r>.md (time by operator kind, then the top operators). The profiler slows
    that step, which the run's tokens/s then includes."""
    mfu_probe_every: int = 0
    """Time the model's training GEMMs (forward, input and weight gradients, as `bench train`'s
    peak, 0.2 s a shape) after every this many optimizer steps
    (every rank at once, outside the step's clock and the logged tokens/s), and read MFU
    against the rate timed next to each step instead of at start-up. A shared host's GEMM
    rate drifts within minutes, and MFU against a rate timed minutes
    away follows the host, not the run: the console's MFU reads the latest timing,
    summary.json's step-time breakdown the timed steps' rates weighted by their time, both the
    best batches' (`peak_flops_per_s`) and every timed call's mean (`mean_gemm_flops_per_s`:
    a host that slows in short spells gives the steps its average, not its best). `bench
    train` sets 1. 0: the start-up timings only."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "micro_batch_size", "grad_accum_steps", "log_every"):
            require(getattr(self, name) > 0, f"train.{name}", "must be a positive integer.")
        for name in (
            "global_batch_size",
            "warmup_steps",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "early_stop_patience",
            "profile_step",
            "mfu_probe_every",
        ):
            require(getattr(self, name) >= 0, f"train.{name}", "must be >= 0.")
        require(self.lr > 0, "train.lr", f"got {self.lr}; must be > 0.")
        require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1].")
        choice(self.schedule, "train.schedule", get_args(Schedule))
        require(0 < self.decay_fraction <= 1, "train.decay_fraction", "must be in (0, 1].")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "train.betas",
            "must be two numbers in [0, 1), e.g. [0.9, 0.95].",
        )
        require(self.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping).")
        require(self.weight_decay >= 0, "train.weight_decay", f"got {self.weight_decay}; must be >= 0 (0: none).")
        require(self.early_stop_min_delta >= 0, "train.early_stop_min_delta", "must be >= 0.")
        require(self.sample_tokens > 0, "train.sample_tokens", "must be a positive integer.")
        self._check_dpo()
        require(self.eps > 0, "train.eps", f"got {self.eps}; must be > 0 (AdamW divides by sqrt(v) + eps), e.g. 1e-8.")
        require(
            math.isfinite(self.epochs) and self.epochs >= 0,
            "train.epochs",
            f"got {self.epochs}; must be >= 0, e.g. 3 (0: train.max_steps says how long).",
        )
        require(
            self.epochs > 0 or self.profile_step <= self.max_steps,  # epochs: known once the data are packed
            "train.profile_step",
            f"{self.profile_step} is past train.max_steps={self.max_steps}; pick a step in 1..max_steps, "
            "past the warm-up (the first two steps compile and allocate), or 0 for none.",
        )
        if self.global_batch_size:
            per_worker = self.micro_batch_size * self.grad_accum_steps
            require(
                self.global_batch_size % per_worker == 0,
                "train.global_batch_size",
                f"{self.global_batch_size} is not a multiple of micro_batch_size x grad_accum_steps "
                f"= {per_worker}; set it to {per_worker} x <number of workers> or to 0 to derive it.",
            )

    def _check_dpo(self) -> None:
        """The preference-loss settings (data.format=preference reads them)."""
        require(self.dpo_beta > 0, "train.dpo_beta", f"got {self.dpo_beta}; must be > 0 (e.g. 0.1).")
        choice(self.dpo_loss, "train.dpo_loss", get_args(DpoLoss))
        require(self.simpo_gamma >= 0, "train.simpo_gamma", f"got {self.simpo_gamma}; must be >= 0 (e.g. 0.5).")
        require(self.dpo_sft_weight >= 0, "train.dpo_sft_weight", f"got {self.dpo_sft_weight}; must be >= 0 (0: none).")
        require(
            0 <= self.dpo_label_smoothing < 0.5,
            "train.dpo_label_smoothing",
            f"got {self.dpo_label_smoothing}; must be in [0, 0.5), e.g. 0.1 (0: plain DPO).",
        )
        require(
            self.dpo_label_smoothing == 0 or self.dpo_loss == "sigmoid",
            "train.dpo_label_smoothing",
            f"smooths train.dpo_loss=sigmoid only, not {self.dpo_loss!r}; set it to 0 or train.dpo_loss=sigmoid.",
        )

    @property
    def dpo_reference(self) -> bool:
        """Whether train.dpo_loss compares a reference model (every preference loss but SimPO's)."""
        return self.dpo_loss not in REFERENCE_FREE_LOSSES

    @property
    def reference_each_step(self) -> bool:
        """Whether the reference model runs beside training (a forward each micro batch; full
        fine-tuning: a frozen copy), not precomputed once (train.dpo_precompute_reference)."""
        return self.dpo_reference and not self.dpo_precompute_reference

    def epoch_steps(self, blocks: int, global_batch: int) -> int:
        """train.epochs as optimizer steps over `blocks` training blocks, `global_batch` a step."""
        return max(1, math.ceil(self.epochs * blocks / global_batch - 1e-9))  # 2 x 600 / 400 is 3, not 4

    def derive_global_batch(self, world_size: int) -> int:
        """Blocks per optimizer step; raises ConfigError when the batch can't split evenly."""
        derived = self.micro_batch_size * self.grad_accum_steps * world_size
        if self.global_batch_size and self.global_batch_size != derived:
            per_worker = self.micro_batch_size * self.grad_accum_steps
            raise ConfigError(
                f"train.global_batch_size: {self.global_batch_size} blocks do not divide evenly over "
                f"{world_size} workers with micro_batch_size x grad_accum_steps = {per_worker} "
                f"(that gives {derived}). Set train.global_batch_size={derived}, or 0 to derive it, "
                f"or change scaling.num_workers to {self.global_batch_size // per_worker}."
            )
        return derived


# ----------------------------------------------------------------------------- guards


_INJECT = re.compile(r"^(spike@\d+(:[0-9.eE+-]+)?|nan@\d+)$")


@dataclass
class GuardConfig:
    """Stability guards: loss spikes, gradient-norm spikes and non-finite losses."""

    action: GuardAction = "log"
    """What a loss spike or a gradient-norm spike does: 'log' (warn, count it in summary.json
    and go on), 'skip' (drop that step's update on every rank; its data stays consumed) or
    'stop' (end the run with a message naming the step). A non-finite loss or gradient is never
    applied: it skips the step under 'log' and 'skip' and stops the run under 'stop'."""
    loss_spike_factor: float = 2.0
    """A step's loss (mean over ranks and micro batches) above this many times the running mean
    of the last guards.loss_window steps is a spike; 0 disables the check."""
    loss_window: int = 50
    """Steps in the running mean of the loss; spikes are looked for once it holds
    min(guards.loss_window, 10) steps (it starts empty after a resume)."""
    max_grad_norm: float = 0.0
    """A global gradient norm (before clipping) above this is a spike; 0 disables the check.
    With guards.action=skip the norm is taken before the update (ZeRO-3 only: one extra pass
    over each rank's gradient shard)."""
    max_skips: int = 20
    """Stop the run once more than this many steps have been skipped (spikes and non-finite
    losses together, counted across resumes)."""
    inject: str = ""
    """Testing aid: 'spike@STEP[:FACTOR]' and/or 'nan@STEP', comma-separated, multiply rank
    0's loss at that step by FACTOR (default 100) or by NaN; '' injects nothing."""

    def __post_init__(self) -> None:
        choice(self.action, "guards.action", get_args(GuardAction))
        require(
            self.loss_spike_factor == 0 or self.loss_spike_factor > 1,
            "guards.loss_spike_factor",
            f"got {self.loss_spike_factor}; use a factor > 1 (e.g. 2) or 0 to disable.",
        )
        require(self.loss_window >= 1, "guards.loss_window", "must be a positive number of steps.")
        require(self.max_grad_norm >= 0, "guards.max_grad_norm", "must be >= 0 (0 disables the check).")
        require(self.max_skips >= 0, "guards.max_skips", "must be >= 0.")
        for item in filter(None, (x.strip() for x in self.inject.split(","))):
            require(bool(_INJECT.match(item)), "guards.inject", f"{item!r}: write spike@STEP[:FACTOR] or nan@STEP.")
