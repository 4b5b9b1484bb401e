"""Step timing: per-phase seconds of the training steps, time in collectives, operator profile."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

# ----------------------------------------------------------------------------- step-time breakdown

PHASES = ("data_wait", "forward", "backward", "optimizer_step")
# DeepSpeed's collectives, as methods of its communication backend (compat.deepspeed.comm_backend).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_base",
    "all_gather_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
)


class CommTimer:
    """Seconds the training thread spends in DeepSpeed's collectives, waits included.

    ZeRO-3 launches its parameter all-gathers asynchronously and waits on the handle
    later, so both the calls and `Work.wait` are timed; a depth counter keeps a wait
    inside a timed call from counting twice. Only the installing thread is counted: gloo's
    own threads do the transfer, the training thread is what stalls.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        self._thread = threading.get_ident()
        self._undo: list[Callable[[], None]] = []

    def _timed(self, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if threading.get_ident() != self._thread or self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
                self._depth -= 1

        return wrapper

    def install(self) -> CommTimer:
        """Wraps the collectives of the live DeepSpeed backend (after deepspeed.init_distributed)."""
        from raytrain_cpu.compat.deepspeed import comm_backend
        from raytrain_cpu.compat.torch import c10d_work_class

        backend = comm_backend()
        for name in COLLECTIVES:
            if hasattr(backend, name):
                before = backend.__dict__.get(name)  # the shared-memory route, where installed
                setattr(backend, name, self._timed(getattr(backend, name)))
                self._undo.append(
                    lambda n=name, b=before: setattr(backend, n, b) if b else delattr(backend, n)
                )  # back to the route before, or to the class method
        work = c10d_work_class()
        wait = work.wait
        work.wait = self._timed(wait)
        self._undo.append(lambda: setattr(work, "wait", wait))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


# Training steps the step clock leaves out: the first compiles, allocates the activations and
# (in its optimizer step) AdamW's state; the second is the first in that memory layout and
# still runs markedly slower than the later steps; from the third on they are steady.
WARMUP_STEPS = 2


class StepClock:
    """Per-phase seconds of the training steps after `warmup` steps (which pay one-off costs).

    `start_step` .. `end_step` brackets one optimizer step (data wait through optimizer
    step), so logging, evaluation and checkpoints between steps are not counted. Each call
    costs a perf_counter. `comm` comes from a CommTimer when one is given and is part of
    forward, backward and optimizer step (ZeRO-3 gathers parameters in forward and backward
    and reduce-scatters gradients in backward and step).
    """

    def __init__(self, comm: CommTimer | None = None, warmup: int = WARMUP_STEPS) -> None:
        self.comm = comm
        self.warmup = warmup
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.comm_s = 0.0
        self.wall_s = 0.0
        self.steps = 0
        self._seen = 0
        self._pending = dict.fromkeys(PHASES, 0.0)
        self._t0 = 0.0
        self._comm0 = 0.0
        self._last_wall: float | None = None  # the last step's seconds, None while warming up
        self._peaks: list[tuple[float, float, float]] = []  # (a timed step's seconds, the GEMM rates after it)

    def start_step(self) -> None:
        self._pending = dict.fromkeys(PHASES, 0.0)
        self._t0 = time.perf_counter()
        self._comm0 = self.comm.seconds if self.comm else 0.0

    def add(self, phase: str, seconds: float) -> None:
        self._pending[phase] += seconds

    def end_step(self) -> None:
        self._seen += 1
        if self._seen <= self.warmup:
            return  # one-off costs (WARMUP_STEPS): not steady state
        for k, v in self._pending.items():
            self.totals[k] += v
        self.comm_s += (self.comm.seconds if self.comm else 0.0) - self._comm0
        self._last_wall = time.perf_counter() - self._t0
        self.wall_s += self._last_wall
        self.steps += 1

    def peak(self, flops_per_s: float, mean_flops_per_s: float) -> None:
        """The GEMM rates timed right after the last step (train.mfu_probe_every; peak and mean,
        host.gemm.time_training_mix); a warm-up step's are left out."""
        if self._last_wall is not None:
            self._peaks.append((self._last_wall, flops_per_s, mean_flops_per_s))
            self._last_wall = None

    def summary(self) -> dict[str, Any]:
        """Mean seconds per optimizer step by phase, the step's wall time, and (with peak()
        timings) the GEMM rate next to the steps."""
        n = max(self.steps, 1)
        out: dict[str, Any] = {f"{k}_s": v / n for k, v in self.totals.items()}
        out["comm_s"] = self.comm_s / n if self.comm else None
        out["step_wall_s"] = self.wall_s / n
        out["other_s"] = out["step_wall_s"] - sum(out[f"{k}_s"] for k in PHASES)
        out["steps"] = self.steps
        # MFU's denominator next to the steps: each timed step's rate weighted by its seconds,
        # so MFU = the steps' FLOPs over what the GEMMs could have done in their time.
        seconds = sum(t for t, _, _ in self._peaks)
        for key, i in (("peak_flops_per_s", 1), ("mean_gemm_flops_per_s", 2)):
            out[key] = sum(p[0] * p[i] for p in self._peaks) / seconds if self._peaks else None
        out["peak_timings"] = len(self._peaks)
        return out


# ----------------------------------------------------------------------------- operator profile

# Operator kinds for train.profile_step's table, matched on the profiler's names in this order.
OP_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("compiled kernels", ("cpp_fused", "compiledfxgraph", "torch-compiled region", "compiledfunction", "inductor")),
    # DeepSpeed's autograd functions around each gathered module: gathers, releases, gradient hand-off.
    ("ZeRO-3 hooks", ("backwardhookfunction", "prebackwardfunction", "postbackwardfunction", "zerostage3")),
    (
        "GEMM",
        (
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::baddbmm",
            "aten::_addmm",
            "mkldnn",
            "raytrain::weight_grad",
            "raytrain_weight_grad::",
        ),
    ),
    # raytrain_cpu.model.ops.attention's and fused_attention's operators count with everything they run (their GEMMs, softmax).
    (
        "attention",
        (
            "scaled_dot_product",
            "flash_attention",
            "_efficient_attention",
            "raytrain::causal_blocks",
            "raytrain_causal_blocks",
            "raytrain::fused_causal",
            "raytrain_fused_attention::",
        ),
    ),
    ("collectives", ("gloo", "c10d", "all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce")),
    ("optimizer", ("adamw", "_foreach_", "clip_grad")),
    ("copies and casts", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::index", "aten::empty")),
)


def _op_kind(name: str) -> str:
    name = name.lower()
    return next((k for k, pats in OP_KINDS if any(p in name for p in pats)), "other operators")


def _inside_attention(ev) -> bool:
    parent = getattr(ev, "cpu_parent", None)
    while parent is not None:
        if _op_kind(parent.name) == "attention":
            return True
        parent = parent.cpu_parent
    return False


def op_time_by_kind(events, step_wall_s: float) -> list[dict[str, Any]]:
    """Self time per operator kind (GEMM, attention, collectives, optimizer, copies and casts,
    ZeRO-3's hooks, other elementwise work) as seconds and shares of the profiled step; what
    no operator accounts for (Python, waiting for gloo's background collectives) is its own row.

    `events`: the profiler's events (`prof.events()`); an operator run inside an attention
    operator (raytrain_cpu.model.ops.attention's GEMMs and softmax) counts as attention."""
    seconds: dict[str, float] = {kind: 0.0 for kind, _ in OP_KINDS} | {"other operators": 0.0}
    for ev in events:
        kind = "attention" if _inside_attention(ev) else _op_kind(getattr(ev, "name", None) or ev.key)
        seconds[kind] += ev.self_cpu_time_total / 1e6
    seconds["outside operators (Python, collective waits)"] = max(0.0, step_wall_s - sum(seconds.values()))
    return [{"kind": k, "seconds": round(v, 4), "share": round(v / step_wall_s, 3)} for k, v in seconds.items()]
