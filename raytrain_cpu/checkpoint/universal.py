"""DeepSpeed's universal format: a checkpoint converted once, so a resume on another number of
workers can slice its partitions from it. The conversion runs in a child process
(`python -m raytrain_cpu.checkpoint.universal`)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from raytrain_cpu.checkpoint.files import fsync_dir
from raytrain_cpu.checkpoint.layout import DS_TAG, UNIVERSAL, CheckpointError, universal_ready
from raytrain_cpu.checkpoint.verify import shard_bytes, verify_checkpoint


def to_universal(ckpt_dir: str | Path, verified: bool = False) -> str:
    """Converts checkpoint `ckpt_dir`'s ZeRO shards into DeepSpeed's universal format, once, in
    `<ckpt_dir>/universal/`, so any number of ranks can load it; returns what it did.

    The conversion runs in a child process (`_convert`: DeepSpeed's ds_to_universal, which reads
    one rank's optimizer shard at a time, so its memory peak is about one shard, not the model;
    then slim_common_state), so what it loads leaves with the process. It writes into
    `universal.partial/` and renames it when done, so an interrupted conversion leaves no
    directory that looks finished. The checkpoint's own files are only read. `verified`: the
    workers hashed them all just before (choose_checkpoint), so only their sizes are checked.
    """
    ckpt_dir = Path(ckpt_dir)
    out, partial = ckpt_dir / UNIVERSAL, ckpt_dir / f"{UNIVERSAL}.partial"
    if universal_ready(ckpt_dir):
        return f"{out} (made before)"
    manifest = verify_checkpoint(ckpt_dir, hash_ranks=not verified)  # no rank of the new layout hashes the old shards
    shutil.rmtree(partial, ignore_errors=True)
    need = shard_bytes(manifest)
    free = shutil.disk_usage(ckpt_dir).free
    if free < need * 2.2:  # DeepSpeed's fragments and the merged files, before it drops the fragments
        raise CheckpointError(
            f"converting {ckpt_dir} for the new worker count needs about {need * 2.2 / 2**30:.2f} GiB on its "
            f"filesystem while it works ({need / 2**30:.2f} GiB once done) and {free / 2**30:.2f} GiB are free; "
            "free some space (run.num_to_keep keeps fewer checkpoints) and run again."
        )
    t0 = time.perf_counter()
    _child([__name__, str(ckpt_dir / DS_TAG), str(partial)], partial, f"DeepSpeed could not convert {ckpt_dir}")
    (ckpt_dir / "latest_universal").unlink(missing_ok=True)  # DeepSpeed's pointer: tags here are explicit
    fsync_dir(partial)
    partial.rename(out)
    fsync_dir(ckpt_dir)
    return f"{out} ({need / 2**20:,.1f} MiB of shards in {time.perf_counter() - t0:.1f}s)"


def _child(module_args: list[str], partial: Path, what: str) -> None:
    """`python -m *module_args` in a child process; when it fails, `partial` is removed and a
    CheckpointError says `what`, with the child's last line and the command that shows it all."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", *module_args], capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        last = ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]
        raise CheckpointError(
            f"{what} (exit {done.returncode}: {last}). The whole output: python -m {' '.join(module_args)}"
        )


def slim_common_state(universal_dir: Path) -> None:
    """Empties the copy of rank 0's whole optimizer shard (fp32 weights and both moments) that
    DeepSpeed's ZeRO-3 conversion leaves in zero/optimizer_state.pt. Every rank of the new
    layout loads that file whole, yet reads only the step count, the parameter groups and the
    loss-scale settings from it: kept, it adds a shard to each rank's memory at the resume
    (24 GiB for Llama-3-8B saved on 4 workers) and half the checkpoint again on the storage."""
    import torch

    path = universal_dir / "zero" / "optimizer_state.pt"
    state = torch.load(path, weights_only=False)  # DeepSpeed's own pickle, made from our checkpoint
    if not state.get("fp32_flat_groups"):  # ZeRO-1/2: already small
        return
    state["fp32_flat_groups"] = []
    inner = state["optimizer_state_dict"]
    inner["state"] = {k: {"step": v["step"]} for k, v in inner["state"].items() if "step" in v}
    tmp = path.with_name(f"{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _convert(ds_dir: str, out: str) -> None:
    """to_universal's child: DeepSpeed's conversion, then slim_common_state. One process for
    both, as each start-up imports torch and DeepSpeed (seconds a process, for a checkpoint of
    any size)."""
    import sys

    from deepspeed.checkpoint import ds_to_universal

    # inject_missing_state: ZeRO-1/2 shards lack the layout notes Megatron adds; plain data parallelism needs none.
    sys.argv = ["ds_to_universal", "--input_folder", ds_dir, "--output_folder", out, "--inject_missing_state"]
    sys.argv += ["--num_extract_workers", "1", "--num_merge_workers", "1"]  # in this process, one shard at a time
    ds_to_universal.main(ds_to_universal.parse_arguments())
    slim_common_state(Path(out))


if __name__ == "__main__":  # to_universal's child: what it loads leaves with the process
    import sys

    _convert(*sys.argv[1:])
