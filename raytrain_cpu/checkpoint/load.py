"""Loading a checkpoint into a DeepSpeed engine, and where a restarted rank's stream resumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint.identity import batch_conflict, resume_conflict
from raytrain_cpu.checkpoint.layout import DS_TAG, UNIVERSAL, CheckpointError, rng_file, universal_ready, workers
from raytrain_cpu.checkpoint.rng import read_rng_state, set_rng_state
from raytrain_cpu.checkpoint.verify import read_manifest, verify_checkpoint


def load_into(
    engine, ckpt_dir: str | Path, rank: int, world: int, config_dict: dict[str, Any], verified: bool = False
) -> dict[str, Any]:
    """Restores model, optimizer, LR scheduler and this rank's RNG state; returns the manifest.

    Fails loudly (CheckpointError) when the checkpoint is incomplete, damaged, made with settings
    `config_dict` may not change (resume_conflict) or another global batch (batch_conflict), or
    unreadable by DeepSpeed; it never starts from scratch. Saved for another number of workers,
    it loads from its universal form, which the engine must have been built to read
    (train.deepspeed_config) and the driver to have made (to_universal). `verified`: this rank's
    files were hashed just before (choose_checkpoint), so only their sizes are checked again.
    """
    ckpt_dir = Path(ckpt_dir)
    # On a new layout no rank loads the old shards: to_universal hashed them all before converting.
    rescaled = read_manifest(ckpt_dir)["world_size"] != world
    manifest = verify_checkpoint(ckpt_dir, hash_ranks=() if rescaled or verified else [rank])
    conflict = resume_conflict(manifest, ckpt_dir, config_dict) or batch_conflict(
        manifest, ckpt_dir, config_dict, world
    )
    if conflict:
        raise CheckpointError(conflict)
    if rescaled and not universal_ready(ckpt_dir):
        raise CheckpointError(
            f"checkpoint {ckpt_dir} holds ZeRO shards for {workers(manifest['world_size'])} and this run has "
            f"{world}, but it has no {UNIVERSAL}/ conversion; run again from the driver (python -m "
            "raytrain_cpu.main), which makes it."
        )
    tag = UNIVERSAL if rescaled else DS_TAG
    try:
        path, _ = engine.load_checkpoint(
            str(ckpt_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    except Exception as e:
        raise CheckpointError(f"DeepSpeed could not load {ckpt_dir}/{tag}: {type(e).__name__}: {e}") from e
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load the shards in {ckpt_dir}/{tag}; the checkpoint is unreadable.")
    if rescaled:
        # Each rank's RNG state belongs to its place in the old layout; on a new one every rank
        # keeps the seed it started with (train.seed + rank). The data order does not depend on it.
        _unshare_step_counters(engine)
    else:
        set_rng_state(read_rng_state(rng_file(ckpt_dir, rank)))
    return manifest


def _unshare_step_counters(engine) -> None:
    """DeepSpeed's universal load gives every parameter group one shared Adam step tensor, which
    the fused AdamW then advances once per group each step (2 groups: the step count runs at
    twice the rate, and the bias correction with it). Each group gets its own copy."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in inner.state.values():
        if "step" in state and hasattr(state["step"], "clone"):
            state["step"] = state["step"].clone()


def batches_to_skip(start_position: int, step: int, global_batch: int, accum: int) -> int:
    """Micro batches a rank skips when Ray restarts the workers inside one driver run.

    Each rank's stream begins where the driver planned (`start_position`, the checkpoint it saw
    at start-up); after an in-run restart Ray hands back a later checkpoint, so the blocks
    between the two are skipped (each step takes `accum` micro batches from every rank).
    """
    resumed_position = step * global_batch
    if start_position > resumed_position and not (start_position - resumed_position) % global_batch:
        raise CheckpointError(  # choose_checkpoint stepped back past damaged ones, beyond the driver's plan
            f"the checkpoint this restart resumes from (step {step}) predates where this run's data stream starts "
            f"(step {start_position // global_batch}, the checkpoint the driver started from): run the same command "
            "again, which resumes from it (the damaged checkpoints stepped past are renamed)."
        )
    if start_position > resumed_position or (resumed_position - start_position) % global_batch:
        raise CheckpointError(
            f"the data stream starts at block position {start_position} but the checkpoint is at step {step} "
            f"(position {resumed_position}); the run directory's checkpoints are inconsistent."
        )
    return (resumed_position - start_position) // global_batch * accum
