"""The training loop's bookkeeping, without Ray: the resumed stream checked against the blocks
the checkpoint recorded, the log window's tokens/s over training time only, the learning rate
named at a resume, and model.dtype=auto's pick forced for a suite run (RAYTRAIN_DTYPE_AUTO)."""

from __future__ import annotations

import time
import types

import numpy as np
import pytest

from raytrain_cpu.data.prepare import _BlockWriter
from raytrain_cpu.data.stream import StreamPlan
from raytrain_cpu.host import features as host_features
from raytrain_cpu.obs.metrics import ThroughputWindow
from raytrain_cpu.trainer import setup as worker_setup
from raytrain_cpu.trainer.batches import check_resumed_stream, next_batch, stream_block_ids
from raytrain_cpu.trainer.schedule import apply_optimizer_settings, lr_factor, lr_held_line
from raytrain_cpu.trainer.state import Loop

MICRO, WORLD = 2, 2
GLOBAL = MICRO * WORLD * 2  # accumulation 2


def _cache(path, blocks: int, first_value: int) -> str:
    """A cache split of `blocks` 4-token blocks, block i filled with first_value + i."""
    writer = _BlockWriter(path, 4)
    for i in range(blocks):
        writer.add(np.full(4, first_value + i, dtype=np.int32))
    writer.close()
    return str(path)


@pytest.fixture
def mixture(tmp_path):
    """Two real caches mixed 3:1 (the small one through many epochs of its own)."""
    return (_cache(tmp_path / "big", 40, 0), _cache(tmp_path / "small", 5, 1000)), (40, 5), (0, 0, 1, 0)


def _plan(mixture, rank: int, start: int, seed: int = 7) -> StreamPlan:
    dirs, n_blocks, pattern = mixture
    return StreamPlan(dirs, n_blocks, seed, 64, MICRO, WORLD, rank, start, start + 4 * GLOBAL, pattern=pattern)


def _first_batch(plan: StreamPlan) -> dict[str, np.ndarray]:
    return plan.fetch({"id": np.arange(MICRO)})


def test_the_recorded_block_ids_are_the_streams(mixture):
    """save_checkpoint's record (stream_block_ids) names the blocks the stream delivers at those
    positions, a mixture's included, across epochs of the small source."""
    _, n_blocks, pattern = mixture
    for start in (0, 3 * GLOBAL, 11 * GLOBAL):
        recorded = stream_block_ids(np.arange(start, start + GLOBAL), n_blocks, pattern, 7, 64)
        for rank in range(WORLD):
            plan = _plan(mixture, rank, start)
            rows = plan.fetch({"id": np.arange(*plan.local_range)})
            first_step = rows["pos"] < start + GLOBAL
            np.testing.assert_array_equal(rows["block_id"][first_step], recorded[rows["pos"][first_step] - start])


def test_a_resumed_stream_that_does_not_go_on_is_caught(mixture):
    """The check compares what can differ: the blocks the resumed stream delivers against those
    the checkpoint recorded. A stream started elsewhere (a wrong skip) or in another order (another
    seed: the blocks the driver planned are not the checkpoint's) is named with both lists."""
    _, n_blocks, pattern = mixture
    step = 5
    start = step * GLOBAL
    recorded = {
        "position": start,
        "block_ids": stream_block_ids(np.arange(start, start + GLOBAL), n_blocks, pattern, 7, 64).tolist(),
    }
    for rank in range(WORLD):
        batch = _first_batch(_plan(mixture, rank, start))
        assert check_resumed_stream(rank, step, recorded, batch["pos"], batch["block_id"]) is None

    late = _first_batch(_plan(mixture, 1, start + GLOBAL))  # one step too far
    why = check_resumed_stream(1, step, recorded, late["pos"], late["block_id"])
    assert why.startswith(f"rank 1: the data stream resumed at positions {start + GLOBAL + MICRO}-")
    assert f"recorded the next step's blocks at positions {start}-{start + GLOBAL - 1}" in why

    other = _first_batch(_plan(mixture, 0, start, seed=8))
    why = check_resumed_stream(0, step, recorded, other["pos"], other["block_id"])
    assert f"holds blocks {other['block_id'].tolist()}" in why
    assert f"where the checkpoint recorded {recorded['block_ids'][:MICRO]}" in why


def _worker(messages: list[str]):
    return types.SimpleNamespace(rank=0, log=messages.append)


def _clock():
    return types.SimpleNamespace(add=lambda name, seconds: None)


def test_next_batch_stops_a_stream_that_is_not_the_checkpoints_unless_the_data_changed(mixture):
    _, n_blocks, pattern = mixture
    start = 2 * GLOBAL
    ids = stream_block_ids(np.arange(start, start + GLOBAL), n_blocks, pattern, 7, 64).tolist()
    other = _first_batch(_plan(mixture, 0, start, seed=8))
    messages: list[str] = []

    st = Loop(step=2, expected_blocks={"position": start, "block_ids": ids})
    with pytest.raises(RuntimeError, match="the first batch after resuming at step 2 holds blocks"):
        next_batch(_worker(messages), st, iter([other]), _clock(), None)

    st = Loop(step=2, expected_blocks={"position": start, "block_ids": ids}, data_changed=True)
    next_batch(_worker(messages), st, iter([other, other]), _clock(), None)
    assert messages == ["[resume] the first batch is not the one the checkpoint recorded: the changed data's new order"]
    assert st.expected_blocks is None  # checked once, on the first batch
    next_batch(_worker(messages), st, iter([other]), _clock(), None)
    assert len(messages) == 1


def test_the_window_counts_the_steps_time_only():
    """tokens/s over the steps' own seconds: whatever ran between two steps (an evaluation, a
    save) is not in it; data_wait_frac is the waits' share of those seconds."""
    window = ThroughputWindow()
    window.add_step(2.0, 1000)
    # ... an evaluation of 30 s here is never added ...
    window.wait += 0.5
    window.add_step(3.0, 1000)
    assert window.tokens_per_s() == pytest.approx(2000 / 5.0)
    assert window.data_wait_frac() == pytest.approx(0.5 / 5.0)
    assert ThroughputWindow().tokens_per_s() == 0.0  # an empty window: no division by zero


def test_the_first_batchs_wait_leaves_the_steps_time():
    """The first batch waits for the data pipeline to start: reported on its own
    (first_batch_wait) and moved out of the step's time, while later waits count as the step's."""

    def slow_start():
        time.sleep(0.2)
        yield {"block_id": np.arange(2)}
        time.sleep(0.05)
        yield {"block_id": np.arange(2)}

    st = Loop()
    batches = slow_start()
    st.step_t0 = t0 = time.perf_counter()
    next_batch(_worker([]), st, batches, _clock(), None)
    assert st.first_batch_wait >= 0.2 and st.step_t0 == pytest.approx(t0 + st.first_batch_wait)
    assert st.window.wait == 0.0
    next_batch(_worker([]), st, batches, _clock(), None)
    assert 0.05 <= st.window.wait < 0.2


def test_a_resume_names_the_learning_rate_before_and_after():
    """Raising train.max_steps reshapes the schedule on purpose: cosine to the default floor of
    0.1, 1,000 steps raised to 2,000, moves the LR at step 1,000 5.6x (docs/configuration.md's example), and
    the resume names both; an LR the schedule keeps is named too."""
    import torch

    from raytrain_cpu.config.schema import load_config

    def train_settings(steps: int):
        return load_config(None, [f"train.max_steps={steps}"]).train

    t = train_settings(1000)
    param = torch.nn.Parameter(torch.zeros(2))
    groups = [{"params": [param], "weight_decay": t.weight_decay}, {"params": [], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, t, t.max_steps))
    opt.step()  # no gradient: nothing moves, and the scheduler's steps below are not "before the optimizer's"
    for _ in range(1000):
        sched.step()
    engine = types.SimpleNamespace(optimizer=opt)
    saved = opt.param_groups[0]["lr"]
    (change,) = apply_optimizer_settings(engine, sched, train_settings(2000))
    assert opt.param_groups[0]["lr"] / saved == pytest.approx(5.57, abs=0.01)
    assert change == (
        "the learning rate at step 1000: 0.0003 → 0.00167, the cosine schedule of train.max_steps=2000 from here"
    )
    assert lr_held_line(1000, 0.00167, train_settings(2000)) == (
        "the learning rate at step 1000: 0.00167, as in the checkpoint (the cosine schedule of train.max_steps=2000)"
    )


def test_auto_dtype_can_be_forced_for_a_suite_run(monkeypatch):
    """RAYTRAIN_DTYPE_AUTO=fp32 (or bf16) overrides model.dtype=auto's measured pick, so a bf16
    host can run the suite as a host without fast bf16 would; an explicit dtype and a resumed
    run's are kept; a value other than bf16 or fp32 is refused, naming the variable."""
    measured = {
        "dtype": "bf16",
        "requested": "auto",
        "reason": "auto: bf16 faster",
        "bf16_flops_per_s": 3.0,
        "fp32_flops_per_s": 1.0,
        "peak_flops_per_s": 3.0,
    }
    monkeypatch.setattr(
        worker_setup, "choose_dtype", lambda requested, gemms, agree: {**measured, "requested": requested}
    )
    monkeypatch.setattr(worker_setup, "gemms_for_model", lambda model_dir, tokens: [])
    monkeypatch.setattr(worker_setup, "place_threads", lambda *args: {})
    monkeypatch.setattr(worker_setup, "ipex_status", lambda: {})  # its import probe takes seconds

    def picked(requested: str, resumed: str | None = None) -> dict:
        return worker_setup.setup_worker(requested, "unused", 64, 1, 0, 1, False, agree=None, resumed_dtype=resumed)[
            "dtype"
        ]

    monkeypatch.delenv(host_features.FORCE_AUTO_DTYPE, raising=False)
    assert picked("auto")["dtype"] == "bf16"
    monkeypatch.setenv(host_features.FORCE_AUTO_DTYPE, "fp32")
    forced = picked("auto")
    assert forced["dtype"] == "fp32" and forced["peak_flops_per_s"] == 1.0
    assert forced["reason"] == "auto: fp32, forced by RAYTRAIN_DTYPE_AUTO (measured: auto: bf16 faster)"
    assert picked("bf16")["dtype"] == "bf16"  # configured: kept
    assert picked("auto", resumed="bf16")["dtype"] == "bf16"  # the checkpoint's optimizer states are bf16
    monkeypatch.setenv(host_features.FORCE_AUTO_DTYPE, "fp16")
    with pytest.raises(ValueError, match="RAYTRAIN_DTYPE_AUTO='fp16': model.dtype=auto can be forced to bf16 or fp32"):
        picked("auto")
