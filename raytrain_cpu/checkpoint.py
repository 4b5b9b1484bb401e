"""Checkpoints: every rank saves its DeepSpeed shard, all ranks report it to Ray Train.

Layout of one Ray checkpoint directory (the files of all ranks land in the same one):

    checkpoint_000100/
      manifest.json                      step, world size, data position, config hash (rank 0)
      ds/zero_pp_rank_{r}_mp_rank_00_model_states.pt     (each rank)
      ds/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt (each rank)

Resume loads the checkpoint Ray hands back (`ray.train.get_checkpoint()`), always with an
explicit tag, never DeepSpeed's implicit `latest` file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

DS_TAG = "ds"
MANIFEST = "manifest.json"


def config_hash(config_dict: dict[str, Any]) -> str:
    """Hash of the settings that must not change across a resume (model, data, batch shape)."""
    keep = {k: config_dict[k] for k in ("model", "data")}
    keep["train"] = {k: config_dict["train"][k] for k in ("micro_batch_size", "grad_accum_steps", "seed")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:06d}"


def save_shard(engine, step: int, manifest: dict[str, Any], rank: int) -> Path:
    """Writes this rank's shard (and, on rank 0, the manifest) into a fresh local directory.

    Every rank must call this at the same steps: DeepSpeed's save has collectives inside.
    """
    local = Path(tempfile.mkdtemp(prefix=f"raytrain_ckpt_{step}_r{rank}_"))
    engine.save_checkpoint(str(local), tag=DS_TAG, client_state={"step": step}, save_latest=False)
    if rank == 0:
        (local / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return local


def report_checkpoint(metrics: dict[str, Any], local: Path, step: int) -> None:
    import ray.train

    ckpt = ray.train.Checkpoint.from_directory(str(local))
    ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=checkpoint_dir_name(step))
    shutil.rmtree(local, ignore_errors=True)


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / MANIFEST
    if not path.is_file():
        raise RuntimeError(
            f"checkpoint {ckpt_dir} has no {MANIFEST}: it is incomplete or not a raytrain_cpu checkpoint. "
            "Delete it (or pick another run.name) to start over."
        )
    return json.loads(path.read_text())


def load_into(engine, ckpt_dir: str | Path) -> dict[str, Any]:
    """Restores model, optimizer and LR-scheduler state; returns the manifest."""
    manifest = read_manifest(ckpt_dir)
    path, client = engine.load_checkpoint(
        str(ckpt_dir), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the shards in {ckpt_dir}/{DS_TAG}; the checkpoint is unreadable.")
    return manifest
