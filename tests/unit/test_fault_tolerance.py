"""Fault tolerance: restarts, whole checkpoints, exact resume, distributed = single process.

Issue 6, point by point, and elastic training after it (fast tests first, then the Ray runs, marked slow):

1. restart on failure ........ test_kill_and_hang_recover_and_resume_exactly (a worker SIGKILLed),
                               test_elastic_run_shrinks_on_node_loss_and_grows_back (a node removed)
2. whole checkpoints only .... test_save_is_whole_or_absent, test_incomplete_checkpoint_fails_loudly
3. deterministic resume ...... test_rng_state_round_trip, test_kill_and_hang_recover_and_resume_exactly
4. distributed = single ...... test_distributed_matches_single_process
5. world-size changes ........ test_a_damaged_latest_checkpoint_resumes_from_the_one_before_on_fewer_workers
                               (the global batch kept: tests/test_preflight.py),
                               test_elastic_run_shrinks_on_node_loss_and_grows_back (in the run)
6. export at the end ......... test_export_on_finish (the CLI itself: tests/test_export.py)
7. failures surface fast ..... test_kill_and_hang_recover_and_resume_exactly (a worker SIGSTOPped),
                               test_save_is_whole_or_absent (storage full / read-only)
8. spot notices .............. test_elastic_run_shrinks_on_node_loss_and_grows_back (the node it
                               loses is drained for preemption first)
9. elastic training .......... test_elastic_run_shrinks_on_node_loss_and_grows_back (a node removed
                               and one added on a Ray Cluster; the batch rule: tests/test_config.py)

Issue 59: files fsynced before their manifest (test_checkpoint_files_are_fsynced_before_the_manifest);
a damaged checkpoint stepped past, kept and named (test_a_damaged_checkpoint_is_stepped_past_kept_and_named_once,
test_a_conversion_that_finds_damage_steps_back_on_the_driver; on Ray: the driver's start in
test_a_damaged_latest_checkpoint_resumes_from_the_one_before_on_fewer_workers, a restart in
test_kill_and_hang_recover_and_resume_exactly); the RNG state as tensors (test_rng_state_round_trip).

The slow tests share two 2-worker runs of the same config: `straight` (conftest.py: 64 steps,
no faults) and the fault run (killed, then hung, then finished).
The integration half, run alone as a script, prints the measured figures: it is the cluster
scenario's entry point too (`python tests/integration/test_fault_tolerance_e2e.py '<json>'`).
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_fault_tolerance_e2e.py."""

from __future__ import annotations

import json
import threading

import pytest

from raytrain_cpu.checkpoint import layout as ck_layout
from raytrain_cpu.checkpoint import load as ck_load
from raytrain_cpu.checkpoint import record as ck_record
from raytrain_cpu.checkpoint import verify as ck_verify
from raytrain_cpu.compat import ray as ray_compat
from raytrain_cpu.config.schema import load_config

# The elastic scenario's spot notice: the node goes RECLAIM_S after it (whole seconds: 6-7 s), and
# the watcher ends Ray Train's attempt RECLAIM_MARGIN_S before that. The workers take ~1 s to
# checkpoint for the notice; at 10 s they reached the next periodic checkpoint first (idle host),
# and the run resumed from that one instead.
RECLAIM_S, RECLAIM_MARGIN_S = 7, 2


def test_a_snapshot_caught_mid_write_is_read_again_and_a_broken_one_is_named(tmp_path):
    """Ray Train rewrites its snapshot in place at every report, so a poll of a live run can catch
    it empty: the read waits for the whole file; one that stays broken is an error naming it."""
    snapshot = tmp_path / ray_compat.SNAPSHOT
    snapshot.write_text("")
    whole = {"latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_000003"}}
    writer = threading.Timer(0.3, lambda: snapshot.write_text(json.dumps(whole)))
    writer.start()
    try:
        assert ck_record.latest_reported(tmp_path) == tmp_path / "checkpoint_000003"
    finally:
        writer.join()
    snapshot.write_text('{"latest_checkpoint_result": {"checkpoint_di')
    with pytest.raises(ck_layout.CheckpointError, match=f"{ray_compat.SNAPSHOT} is unreadable"):
        ck_record.latest_reported(tmp_path)
    snapshot.unlink()
    assert ck_record.latest_reported(tmp_path) is None


def test_a_resume_names_the_optimizer_settings_and_the_learning_rate_it_changes():
    """A checkpoint brings back its LR schedule's state; the config's go in, and each change is
    named: a longer train.max_steps moved a cosine run's LR (3.0e-4 to 6.95e-4) without a word."""
    import types

    import torch

    from raytrain_cpu.trainer.schedule import apply_optimizer_settings, lr_factor

    t = load_config(None, ["train.max_steps=30", "train.warmup_steps=5", "train.lr=1e-3"]).train
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW(
        [{"params": [param], "weight_decay": t.weight_decay}, {"params": [], "weight_decay": 0.0}],
        lr=t.lr, betas=tuple(t.betas), eps=t.eps,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, t, t.max_steps))
    for _ in range(30):
        opt.step()
        sched.step()
    engine = types.SimpleNamespace(optimizer=opt)
    assert apply_optimizer_settings(engine, sched, t) == []  # the same settings: nothing to say
    longer = load_config(None, ["train.max_steps=40", "train.warmup_steps=5", "train.lr=1e-3"]).train
    (change,) = apply_optimizer_settings(engine, sched, longer)
    assert (
        change == "the learning rate at step 30: 0.0001 → 0.000261, the cosine schedule of train.max_steps=40 from here"
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_factor(30, longer, 40))
    other = load_config(None, ["train.max_steps=40", "train.warmup_steps=5", "train.lr=2e-3"]).train
    assert apply_optimizer_settings(engine, sched, other)[0] == "train.lr: 0.001 in the checkpoint → 0.002"


def test_batches_to_skip():
    # The driver planned from step 8 (position 64); Ray restarted the workers from step 24.
    assert ck_load.batches_to_skip(start_position=64, step=24, global_batch=8, accum=2) == 32
    assert ck_load.batches_to_skip(start_position=64, step=8, global_batch=8, accum=1) == 0
    # A restart that stepped back past damaged checkpoints to one before the driver's start: run again.
    with pytest.raises(
        ck_layout.CheckpointError, match=r"\(step 4\) predates .* \(step 8, .*run the same command again"
    ):
        ck_load.batches_to_skip(start_position=64, step=4, global_batch=8, accum=1)
    with pytest.raises(ck_layout.CheckpointError, match="inconsistent"):
        ck_load.batches_to_skip(start_position=64, step=4, global_batch=12, accum=1)


def test_the_driver_hashes_a_small_checkpoint_itself_and_finds_a_changed_byte(tmp_path):
    """hash_checkpoint below HASH_IN_DRIVER_BYTES reads the files in the driver (no Ray task to
    start): a byte changed with the size kept is named as a sha256 mismatch."""
    import hashlib

    from raytrain_cpu.launch.resume import HASH_IN_DRIVER_BYTES, hash_checkpoint

    ckpt = tmp_path / ck_layout.checkpoint_dir_name(8)
    files = {}
    for rank in range(2):
        rel = f"{ck_layout.DS_TAG}/shard_{rank}.pt"
        (ckpt / ck_layout.DS_TAG).mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(bytes([rank]) * 4096)
        files[rel] = {"size": 4096, "sha256": hashlib.sha256(bytes([rank]) * 4096).hexdigest(), "rank": rank}
    (ckpt / ck_layout.MANIFEST).write_text(json.dumps({"format": ck_layout.FORMAT, "step": 8, "files": files}))
    latest = {"path": str(ckpt), "world_size": 2, "step": 8}
    assert ck_verify.shard_bytes(ck_verify.read_manifest(ckpt)) <= HASH_IN_DRIVER_BYTES
    hash_checkpoint(latest)  # whole: nothing raised, and no Ray needed
    (ckpt / f"{ck_layout.DS_TAG}/shard_1.pt").write_bytes(b"\x07" + bytes([1]) * 4095)
    with pytest.raises(ck_layout.DamagedCheckpoint, match="shard_1.pt does not match its sha256"):
        hash_checkpoint(latest)
