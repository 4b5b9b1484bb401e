"""The data stream as the loop sees it: a batch's model inputs and targets, this rank's micro
batches positioned for a resume, and the blocks a checkpoint records for its next step, which the
resumed stream is checked against."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from raytrain_cpu.checkpoint import load as ckpt_load
from raytrain_cpu.trainer.state import Loop, Worker

# ----------------------------------------------------------------------------- a batch


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


# ----------------------------------------------------------------------------- the stream


def as_torch(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """A stream's numpy batch as the model takes it: every column a torch int64 tensor."""
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)) for k, v in batch.items()}


def torch_batches(numpy_batches) -> Iterator[dict[str, Any]]:
    return map(as_torch, numpy_batches)


def open_batches(w: Worker, st: Loop, plan) -> Iterator[dict[str, Any]]:
    """This rank's micro batches (`plan`: its data.stream.StreamPlan), positioned at the first
    block the run has not trained on."""
    from raytrain_cpu.data.stream import train_batches

    # After a restart inside this driver run, the plan still starts at the driver's start.
    skip = ckpt_load.batches_to_skip(
        w.loop_config["start_position"], st.step, w.global_batch, w.cfg.train.grad_accum_steps
    )
    return torch_batches(train_batches(plan, skip, w.cfg.data.prefetch_batches))


def next_batch(w: Worker, st: Loop, batches, clock, block_log) -> dict[str, Any]:
    t0 = time.perf_counter()
    batch = next(batches)
    wait = time.perf_counter() - t0
    if st.first_batch_wait is None:
        # The first batch waits for its cache files to be opened and decoded: reported on its own,
        # so data_wait_frac measures the steady-state stall, and left out of the step's time.
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
