"""Checkpoints as the loop takes them: when (checkpoint_reason: the end, early stopping, the
period, a spot notice, room for an elastic run to grow), what each records (its manifest and
Ray Train's report), where they live, and the universal form a resume on another worker count
loads."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint import identity as ckpt_identity
from raytrain_cpu.checkpoint import layout as ckpt_layout
from raytrain_cpu.checkpoint import universal as ckpt_universal
from raytrain_cpu.model.tokenizer import resolve_tokenizer_path
from raytrain_cpu.trainer.batches import next_block_ids
from raytrain_cpu.trainer.engine import allreduce_sum
from raytrain_cpu.trainer.loading import Loaded
from raytrain_cpu.trainer.state import Loop, Worker

# ----------------------------------------------------------------------------- when


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
    return allreduce_sum([grow])[0] > 0


# ----------------------------------------------------------------------------- what and where


def checkpoint_manifest(w: Worker, st: Loop, reason: str, loaded: Loaded) -> dict[str, Any]:
    """What a checkpoint's manifest records (rank 0 writes it): what a resume checks and continues."""
    cfg = w.cfg
    return {
        "step": st.step,
        "reason": reason,
        "world_size": w.world,
        "global_batch": w.global_batch,
        "blocks_consumed": st.step * w.global_batch,
        "tokens_seen": st.step * w.tokens_per_step,
        "config_hash": w.loop_config["config_hash"],
        "settings": ckpt_identity.hashed_settings(w.loop_config["config"]),  # names what changed on a bad resume
        **{k: getattr(cfg.deepspeed, k) for k in ckpt_identity.LAYOUT_SETTINGS},  # how the shards are laid out
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


def checkpoint_report(w: Worker, st: Loop) -> dict[str, Any]:
    """The metrics a checkpoint is reported to Ray Train with."""
    return {
        "step": st.step,
        "loss": st.last.get("loss"),
        "tokens_seen": st.step * w.tokens_per_step,
        "train_wall_s": st.wall(),
        "tokens_per_s": st.steps_this_attempt * w.tokens_per_step / st.wall(),
        "data_wait_frac": st.total_wait / st.wall(),
        **st.eval_metrics,
        "checkpoint_score": st.watch.score(st.step),  # what Ray Train ranks by under run.best_metric
    }


def ray_storage_path() -> str:
    """Checkpoints live in Ray's experiment directory (the run dir) so they can be reported in place."""
    import ray.train

    return ray.train.get_context().get_storage().experiment_fs_path


def universal_checkpoint(w: Worker) -> None:
    """The checkpoint this attempt resumes from was saved by another number of workers: it loads
    from its universal form (checkpoint.to_universal). The driver makes that before a run that
    starts on a new count; in an elastic run the count changes inside the run, so rank 0 makes
    it here and the other ranks wait for its directory to appear. Not in a gloo barrier: the
    conversion can outlast run.gloo_timeout_s, and if rank 0 fails Ray Train stops the others."""
    path = w.resume_from
    if ckpt_layout.universal_ready(path):
        return
    w.log(
        f"{Path(path).name} holds ZeRO shards for {ckpt_layout.workers(w.resumed['world_size'])}; converting it for {w.world}"
    )
    if w.is_main:
        w.log(f"universal checkpoint: {ckpt_universal.to_universal(path, verified=True)}")
        return
    while not ckpt_layout.universal_ready(path):
        time.sleep(1)
