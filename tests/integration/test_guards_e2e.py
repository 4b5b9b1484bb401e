"""Stability guards: decisions on synthetic loss sequences, and a real 2-rank DeepSpeed ZeRO-3
engine where an injected spike, an injected NaN and a gradient-norm spike leave parameters and
optimizer state untouched on every rank, while normal steps keep training.

(The end-to-end run through Ray Train, with events in metrics.jsonl and counts in summary.json,
is in tests/test_report.py, which shares that run with the report tests.)
This module's in-process tests: tests/unit/test_guards.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from raytrain_cpu.trainer.engine import free_port

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- a real ZeRO-3 engine

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import deepspeed
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state
    from raytrain_cpu.config.training import GuardConfig
    from raytrain_cpu.obs.guards import StabilityGuard
    from raytrain_cpu.trainer.engine import init_deepspeed, init_local_group

    rank, world = int(sys.argv[2]), 2
    torch.set_num_threads(1)
    init_local_group(rank, world, int(sys.argv[3]))
    init_deepspeed()

    def all_reduce_sum(values):
        t = torch.tensor(values, dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return t.tolist()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    conf = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 8 * world,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    engine, _, _, sched = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=conf,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    )
    params = list(engine.module.parameters())

    def snapshot():
        out = []
        for p in params:
            out.append(safe_get_local_fp32_param(p).clone())
            out.append(p.ds_tensor.detach().clone())
            for key in ("exp_avg", "exp_avg_sq"):
                try:
                    out.append(safe_get_local_optimizer_state(p, key).clone())
                except (KeyError, TypeError, AttributeError):
                    pass  # no optimizer state before the first update
        return out

    cfg = GuardConfig(action="skip", loss_window=3, loss_spike_factor=2.0, max_grad_norm=1e6, inject="spike@5:50,nan@6")
    events = []
    guard = StabilityGuard(cfg, all_reduce_sum, world, rank, 3, on_event=lambda e: events.append(e.row()))
    gen = torch.Generator().manual_seed(100 + rank)
    records = []
    for step in range(1, 9):
        guard.cfg.max_grad_norm = 1e-6 if step == 7 else 1e6  # step 7: a gradient-norm spike
        before = snapshot()
        losses = []
        for micro in range(2):
            x = torch.randn(4, 16, generator=gen)
            y = torch.randn(4, 16, generator=gen)
            loss = ((engine(x.bfloat16()).float() - y) ** 2).mean()
            losses.append(float(loss.detach()))
            loss = guard.before_backward(step, losses, loss, micro == 1)
            engine.backward(loss)
            if micro == 1:
                guard.before_step(step, engine)
            engine.step()
        guard.after_step(step, engine, sched)
        after = snapshot()
        changed = len(before) != len(after) or any(not torch.equal(a, b) for a, b in zip(before, after))
        records.append({"step": step, "changed": changed, "skipped_steps": engine.skipped_steps,
                        "lr": sched.get_last_lr()[0], "step_loss": guard.step_loss, "tensors": len(after)})
    out = {"records": records, "events": events, "counts": guard.counts}
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    torch.distributed.barrier()
    """
)


@pytest.mark.slow
def test_skip_leaves_zero3_parameters_unchanged_on_every_rank(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), str(r), port],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    # Every rank took the same decisions at the same steps.
    assert ranks[0]["events"] == ranks[1]["events"]
    assert [r["skipped_steps"] for r in ranks[0]["records"]] == [r["skipped_steps"] for r in ranks[1]["records"]]
    events = [(e["step"], e["event"], e["action"]) for e in ranks[0]["events"]]
    assert events == [(5, "loss_spike", "skip"), (6, "nonfinite", "skip"), (7, "grad_norm", "skip")]

    for rank in ranks:
        changed = {r["step"]: r["changed"] for r in rank["records"]}
        # Skipped steps leave weights, fp32 master weights and Adam moments exactly as they were...
        assert not changed[5] and not changed[6] and not changed[7], changed
        # ...and training goes on around them.
        assert changed[1] and changed[4] and changed[8], changed
        assert rank["records"][-1]["skipped_steps"] == 3
        assert all(r["tensors"] == 4 * 4 for r in rank["records"])  # 4 params x (fp32, bf16, exp_avg, exp_avg_sq)
        assert rank["counts"] == {"loss_spike": 1, "grad_norm": 1, "nonfinite": 1, "skipped_steps": 3}
        # The learning rate keeps following the step count through skips: lr(s) = 1e-2 / (1 + s).
        for r in rank["records"]:
            assert r["lr"] == pytest.approx(1e-2 / (1 + r["step"]))
