"""Checkpoints that are whole or absent: written to staging, verified, renamed, then reported.

One checkpoint is a directory in the run directory, registered with Ray Train:

    checkpoint_000100/
      manifest.json      step, world size, data position, config hash, size + sha256 of every file
      ds/zero_pp_rank_{r}_mp_rank_00_model_states.pt        rank r's ZeRO-3 model-state shard
      ds/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt   rank r's fp32 master weights + Adam moments
      rng/rank{r}.pt     rank r's torch / numpy / python RNG state, as tensors and plain values
                         (read with torch.load(weights_only=True): no pickle of ours runs code)

Saving (`save_and_report`; every rank calls it at the same steps):

1. rank 0 empties `<run dir>/.staging/`; barrier.
2. every rank writes its DeepSpeed shard and RNG state into `.staging/checkpoint_000100/`,
   fsyncs and hashes its own files (the ranks hash in parallel; each node flushes what it wrote).
3. rank 0 gathers the file lists, checks that every rank's model and optimizer shards and RNG
   file are there with the size their writer saw (which also proves the storage is shared),
   fsyncs what else DeepSpeed left there and every directory, writes manifest.json last (so it
   never vouches for a file still in a cache) and renames the directory to `checkpoint_000100`.
4. rank 0 broadcasts success or its error; every rank then reports the directory to Ray Train
   where it lies (CheckpointUploadMode.NO_UPLOAD: nothing is copied), or raises that error.

A crash before step 4 leaves Ray's latest checkpoint as it was: a staging directory is never
reported (the next save clears it), and a renamed but unreported directory is not in Ray's
snapshot, so neither Ray nor the driver resumes from it. A rank that fails to write (storage
full or read-only) raises at once with the reason; Ray then ends the attempt.

Loading (`load_into`) takes the directory `choose_checkpoint` settled on, checks it against its
manifest, and loads it with an explicit DeepSpeed tag: DeepSpeed's `latest` file is never written
or read.

A damaged checkpoint (a file missing, of another size, or not matching its sha256) does not stop
the run: the driver (sizes, before Ray starts: `newest_verified`) and the workers (each rank's own
files hashed, one collective to agree: `choose_checkpoint`) step back to the newest checkpoint
Ray Train recorded that verifies. The damaged one is renamed `checkpoint_000100.damaged-<why>`
(nothing deleted; Ray Train neither hands it back nor deletes it), one line names it and why, and
a later save at its step takes a fresh name (`free_checkpoint_name`). When none verifies the run
fails naming them all.

DeepSpeed's shards are pickles that DeepSpeed itself loads whole (torch.load, weights_only off):
load checkpoints only from storage you trust (README: "Checkpoints and trust").

Resuming on another number of workers (a lost node, a bigger cluster) keeps the global batch
(`batch_conflict`): the driver first converts the checkpoint, once, into DeepSpeed's universal
format (`to_universal`: `universal/` beside `ds/`, one file per parameter and state, no
partitioning), which every rank of the new layout then slices its own partition from.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

DS_TAG = "ds"
UNIVERSAL = "universal"  # the same state in DeepSpeed's universal format, made for a resume on another world size
MANIFEST = "manifest.json"
STAGING = ".staging"
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of the reported checkpoints
FORMAT = 2


class CheckpointError(RuntimeError):
    """A checkpoint that can't be written, or one that is incomplete or unreadable."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are not what its manifest vouches for (or which has none): a
    resume steps back past it. `why` is a short word for its new name (missing-file, size,
    sha256, manifest, missing)."""

    def __init__(self, message: str, path: str | Path = "", why: str = "damaged"):
        super().__init__(message)
        self.path, self.why = Path(path), why

    def __reduce__(self):  # whole across Ray (a to_universal task's failure)
        return type(self), (str(self), str(self.path), self.why)


def hashed_settings(config_dict: dict[str, Any]) -> dict[str, Any]:
    """The settings a resume checks: model, data, batch shape, seed and LoRA (the step counter,
    LR schedule length, logging and checkpoint cadence may change). The EXECUTION_SETTINGS among
    them may change too (changed_settings); the hash still covers them, so it stays what the
    checkpoints made before that rule recorded.

    LoRA counts only when on (lora.rank > 0), so a full fine-tuning run hashes as it did
    before LoRA existed and its older checkpoints still resume; so does data.mix, only when set."""
    keep = {k: config_dict[k] for k in ("model", "data")}
    if not keep["data"].get("mix"):
        keep["data"] = {k: v for k, v in keep["data"].items() if k != "mix"}
    keep["train"] = {k: config_dict["train"][k] for k in ("micro_batch_size", "grad_accum_steps", "seed")}
    if (config_dict.get("lora") or {}).get("rank"):
        keep["lora"] = config_dict["lora"]
    return keep


def config_hash(config_dict: dict[str, Any]) -> str:
    """Hash of `hashed_settings`; each checkpoint's manifest records the one it was made with."""
    return hashlib.sha256(json.dumps(hashed_settings(config_dict), sort_keys=True).encode()).hexdigest()[:16]


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys; a list of sections (data.mix) by entry, data.mix[1].weight, and its length."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            out[f"{prefix}{k}"] = f"{len(v)} entr{'y' if len(v) == 1 else 'ies'}"
            for i, x in enumerate(v):
                out.update(_flatten(x, f"{prefix}{k}[{i}]."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Hashed settings that choose how a step is computed, not what it computes: a resume may change
# them (activation checkpointing to fit in memory, compilation, the attention kernel, the data
# pipeline's parallelism and where its cache lies: data.cache_key leaves those data settings out,
# the cache's blocks do not depend on them). The stream and the state stay what they were.
EXECUTION_SETTINGS = frozenset(
    {
        "model.activation_checkpointing",
        "model.attention",
        "model.attention_probs",
        "model.compile",
        "model.compile_scope",
        "model.fused_loss",
        "model.fused_norm",
        "model.fused_rotary",
        "model.fused_mlp",
        "model.weight_grad_kernel",
        "model.compile_cache_dir",
        "data.cache_dir",
        "data.tokenize_actors",
        "data.tokenize_batch_size",
        "data.prefetch_batches",
    }
)


# How each step's global batch splits over the workers: a resume may change it (more or fewer
# workers), as long as the global batch stays (batch_conflict). Each step then trains on the same
# blocks (data.StreamPlan), and only the order of the sums differs.
BATCH_SPLIT_SETTINGS = frozenset({"train.micro_batch_size", "train.grad_accum_steps"})


# Hashed settings an upgrade added whose default can compute something other than what the
# checkpoints made before them trained with: a checkpoint without one is compared as having the
# value that matches what it did (data.attention_span 'auto' takes 'document' for chat data).
EARLIER_BEHAVIOUR = {"data.attention_span": "block"}


def changed_settings(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key: old → new' for each hashed setting that differs between two resolved configs, other
    than EXECUTION_SETTINGS and BATCH_SPLIT_SETTINGS. A key only one side has is a field an
    upgrade added or removed since the checkpoint (its default keeps the old behaviour), except
    LoRA's, which are hashed only while LoRA is on: there one side lacking them means LoRA was
    turned on or off. Keys in EARLIER_BEHAVIOUR that the old side lacks take their value there."""
    a, b = EARLIER_BEHAVIOUR | _flatten(hashed_settings(old)), _flatten(hashed_settings(new))

    def differs(k: str) -> bool:
        if k in EXECUTION_SETTINGS or k in BATCH_SPLIT_SETTINGS:
            return False
        return a[k] != b[k] if k in a and k in b else k.startswith("lora.")

    return [f"{k}: {_show(a, k)} → {_show(b, k)}" for k in sorted(a.keys() | b.keys()) if differs(k)]


def _show(settings: dict[str, Any], key: str) -> str:
    return json.dumps(settings[key]) if key in settings else "(unset)"


def resume_conflict(manifest: dict[str, Any], path: str | Path, config_dict: dict[str, Any]) -> str | None:
    """Why `config_dict` can't resume from checkpoint `path` (its `manifest`); None when it can.

    The same hash resumes. Otherwise the old values come from the manifest's "settings"
    (hashed_settings) where it records them, else from the run directory's config.yaml (the
    resolved config of the last run), trusted only when they hash to the checkpoint's value,
    and the run resumes when only execution settings differ (changed_settings). Checked on the
    driver before Ray starts; `load_into` repeats it on every worker as the last line of defence.
    """
    if layout := layout_conflict(manifest, path, config_dict):
        return layout
    if manifest["config_hash"] == config_hash(config_dict):
        return None
    run_dir = Path(path).parent
    saved = run_dir / "config.yaml"
    old = manifest.get("settings") or _saved_config(saved)
    if old is not None and config_hash(old) == manifest["config_hash"]:
        changes = "; ".join(changed_settings(old, config_dict))
        if not changes:
            return None
    else:  # config.yaml is gone or was written by another version: only the hashes are known
        changes = f"config hash {manifest['config_hash']} → {config_hash(config_dict)} ({saved} does not record the old values)"
    return (
        f"run {run_dir.name!r} resumes from {path} (step {manifest['step']}), which was made with other "
        f"model/data/batch settings: {changes}. Either run again with the old values (or choose a new run.name to "
        f"start from scratch), or export the checkpoint (python -m raytrain_cpu.export {path} <dir>) and start a "
        "new run.name with model.name_or_path=<dir>."
    )


# DeepSpeed settings the checkpoint's optimizer shards are laid out by (each manifest records
# them as deepspeed.<key> was): ZeRO-3 keeps one entry per sub group.
LAYOUT_SETTINGS = ("zero_stage", "sub_group_size")


def layout_conflict(manifest: dict[str, Any], path: str | Path, config_dict: dict[str, Any]) -> str | None:
    """The layout settings that differ from those the manifest records (ones it predates are
    not checked; sub groups only between ZeRO-3 runs), as an error text; None when none do."""
    ds = config_dict["deepspeed"]
    keys = [k for k in LAYOUT_SETTINGS if k in manifest and manifest[k] != ds[k]]
    if "sub_group_size" in keys and not manifest.get("zero_stage") == ds["zero_stage"] == 3:
        keys.remove("sub_group_size")  # ZeRO-1 and -2 make no sub groups
    if not keys:
        return None
    changes = "; ".join(f"deepspeed.{k}: {manifest[k]} → {ds[k]}" for k in keys)
    return (
        f"checkpoint {path} (step {manifest['step']}) holds DeepSpeed shards laid out for other settings: "
        f"{changes}. Resume with {' '.join(f'deepspeed.{k}={manifest[k]}' for k in keys)}, or export it "
        f"(python -m raytrain_cpu.export {path} <dir>) and start a new run.name with model.name_or_path=<dir>."
    )


def _saved_config(path: Path) -> dict[str, Any] | None:
    """A run directory's config.yaml, or None when it is missing, unreadable or lacks a hashed section."""
    import yaml

    try:
        old = yaml.safe_load(path.read_text())
        hashed_settings(old)
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    return old


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:06d}"


def workers(n: int) -> str:
    return f"{n} worker{'s' * (n != 1)}"


def batch_conflict(manifest: dict[str, Any], path: str | Path, config_dict: dict[str, Any], world: int) -> str | None:
    """Why `world` workers with `config_dict`'s micro batch and accumulation can't resume from the
    checkpoint at `path`: their global batch differs from the one it trained with (the LR schedule
    and the data position count steps of it). None when it is the same; the text names the
    micro_batch_size or grad_accum_steps that keeps it, or the worker counts that can."""
    t = config_dict["train"]
    micro, accum = t["micro_batch_size"], t["grad_accum_steps"]
    saved = manifest["global_batch"]
    if micro * accum * world == saved:
        return None
    fixes = []
    if saved % (world * micro) == 0:
        fixes.append(f"train.grad_accum_steps={saved // (world * micro)}")
    if saved % (world * accum) == 0 and saved // (world * accum) != micro:
        fixes.append(f"train.micro_batch_size={saved // (world * accum)}")
    counts = [n for n in range(1, saved + 1) if saved % n == 0]
    fix = (
        f"Keep it with {' or '.join(fixes)}"
        if fixes
        else f"{saved} blocks do not split over {world} workers; use a worker count that divides it ({', '.join(map(str, counts))})"
    )
    return (
        f"checkpoint {path} (step {manifest['step']}) trained with a global batch of {saved} blocks "
        f"({workers(manifest['world_size'])}); {workers(world)} x micro_batch_size {micro} x "
        f"grad_accum_steps {accum} make {micro * accum * world}. {fix}. Or export it (python -m raytrain_cpu.export "
        f"{path} <dir>) and start a new run.name with model.name_or_path=<dir> (the optimizer state then starts fresh)."
    )


def universal_ready(ckpt_dir: str | Path) -> bool:
    """Whether `to_universal` has already converted this checkpoint (the directory exists only whole)."""
    return (Path(ckpt_dir) / UNIVERSAL / "zero" / "optimizer_state.pt").is_file()


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


# ----------------------------------------------------------------------------- file helpers


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_json_durably(path: Path, obj: Any) -> None:
    """Writes, fsyncs and renames into place, so the file is whole or absent."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _storage_state(path: Path) -> str:
    """'read-only', 'N MiB free' or '' for the filesystem holding `path` (for error messages)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return ""
    if st.f_flag & os.ST_RDONLY:
        return "the filesystem is read-only"
    return f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free on that filesystem"


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind an exception, if any (torch.save wraps write failures in RuntimeError)."""
    for _ in range(10):
        if e is None or isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def existing_folder(path: Path) -> Path:
    """`path` or the nearest folder above it that exists: where a directory to be made at `path` goes."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def cannot_write(folder: Path) -> str | None:
    """Why no file can be made in the existing `folder` (the OS's reason), or None. A probe file,
    removed again: os.access says yes to root on a read-only file system, and /proc refuses new
    files whatever its mode bits say."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return e.strerror or str(e)


def out_of_space(e: BaseException) -> bool:
    """A full filesystem or quota, however wrapped: the errno of an OSError behind it (torch.save
    wraps one in RuntimeError), or its words inside safetensors' or pyarrow's own errors."""
    os_error = _os_error(e)
    return (os_error is not None and os_error.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
        words in str(e) for words in ("No space left on device", "Disk quota exceeded")
    )


def _describe_write_error(e: BaseException, where: Path) -> str:
    os_error = _os_error(e)
    if out_of_space(e):
        what = "the storage is full (no space or quota left)"
    elif os_error is not None and os_error.errno == errno.EROFS:
        what = "the storage is read-only (EROFS)"
    else:
        what = f"{type(e).__name__}: {e}"
    state = _storage_state(where)
    return f"{what}{f'; {state}' if state else ''}"


# ----------------------------------------------------------------------------- the model a run starts from


def model_fingerprint(model_dir: str | Path) -> dict[str, str]:
    """{file: sha256} of a model directory's config.json (its settings, less the transformers
    version that wrote them) and of each safetensors file's header (every tensor's name, dtype,
    shape and byte range): what a resume compares to find a model directory changed in place.
    The headers, not the weights: they read in a moment at any model size, and a new model of
    the same architecture still differs in its files' names or metadata more often than not."""
    d = Path(model_dir)
    out = {}
    if (d / "config.json").is_file():
        settings = json.loads((d / "config.json").read_text())
        settings.pop("transformers_version", None)
        out["config.json"] = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = fh.read(int.from_bytes(fh.read(8), "little"))
        out[f.name] = hashlib.sha256(header).hexdigest()[:16]
    return out


def model_identity(name_or_path: str, model_dir: str | Path, revision: str | None) -> dict[str, Any]:
    """What each manifest records of the model the run started from: the configured name, the
    hub commit it resolved to (None for a local directory) and the directory's fingerprint."""
    return {"name_or_path": name_or_path, "revision": revision, "fingerprint": model_fingerprint(model_dir)}


def pinned_revision(manifest: dict[str, Any] | None, name_or_path: str) -> str | None:
    """The hub commit the checkpoint's run started from, when it is of this model; a resume and
    every restart load exactly it, not whatever the hub's main branch holds by then."""
    saved = (manifest or {}).get("model") or {}
    return saved.get("revision") if saved.get("name_or_path") == name_or_path else None


def model_changes(saved: dict[str, Any] | None, now: dict[str, Any] | None) -> str | None:
    """The files that differ between two model_identity fingerprints ('config.json changed;
    model-00002-of-00002.safetensors is gone'); None when the same or either is unknown (a
    checkpoint made before manifests recorded it)."""
    a, b = (saved or {}).get("fingerprint"), (now or {}).get("fingerprint")
    if not a or not b or a == b:
        return None
    changes = [f"{k} changed" for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]
    changes += [f"{k} is gone" for k in sorted(a.keys() - b.keys())]
    changes += [f"{k} is new" for k in sorted(b.keys() - a.keys())]
    return "; ".join(changes)


def model_conflict(manifest: dict[str, Any], path: str | Path, model_dir: str, now: dict[str, Any]) -> str | None:
    """Why the model in `model_dir` (`now`, model_identity) can't go on from checkpoint `path`:
    its directory changed in place since the run started; None when it did not. A resumed run
    reads the model's config and tokenizer, and DPO its reference weights, from that directory."""
    saved = manifest.get("model") or {}
    if saved.get("name_or_path") != now["name_or_path"] or not (changes := model_changes(saved, now)):
        return None
    return (
        f"model.name_or_path: {model_dir} changed in place since the run started ({Path(path).name}, step "
        f"{manifest['step']}, was saved from it): {changes}. Put the model directory back as it was, or export the "
        f"checkpoint (python -m raytrain_cpu.export {path} <dir>) and start a new run.name with model.name_or_path=<dir>."
    )


def check_model_dir(model_dir: str | Path, identity: dict[str, Any] | None) -> None:
    """Raises CheckpointError naming what changed when `model_dir` no longer matches the
    model_identity the run recorded at its start: every restart loads it again."""
    if identity is None:  # the tiny model, built from model.tiny
        return
    if changes := model_changes(identity, {"fingerprint": model_fingerprint(model_dir)}):
        raise CheckpointError(
            f"model.name_or_path: {model_dir} changed in place since this run started: {changes}. Put it back as "
            "it was (or start a new run.name from it)."
        )


# ----------------------------------------------------------------------------- RNG state


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def write_rng_state(path: Path, state: dict[str, Any]) -> None:
    """`state` (rng_state) as tensors and plain values, which torch.load reads with weights_only=True."""
    import torch

    name, key, pos, has_gauss, cached = state["numpy"]
    version, internal, gauss_next = state["python"]
    plain = {
        "torch": state["torch"],
        "numpy": {"name": name, "key": torch.from_numpy(key.astype("int64")), "pos": int(pos)},
        "numpy_gauss": [int(has_gauss), float(cached)],
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
    }
    torch.save(plain, path)


def read_rng_state(path: Path) -> dict[str, Any]:
    """rng_state's dict from `path`: written by write_rng_state (torch.load with weights_only=True),
    or a plain pickle of it, as checkpoints made before that (format 2 too) hold; read by an
    unpickler that admits only the tensor and numpy-array classes such a file names, so a
    resume across that upgrade keeps its RNG state and a foreign pickle runs no code."""
    import numpy as np
    import torch

    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"  # torch.save's zip container
        f.seek(0)
        if not zipped:
            return _RngUnpickler(f).load()
        plain = torch.load(f, weights_only=True)
    n = plain["numpy"]
    py = plain["python"]
    return {
        "torch": plain["torch"],
        "numpy": (n["name"], n["key"].numpy().astype(np.uint32), n["pos"], *plain["numpy_gauss"]),
        "python": (py["version"], tuple(py["state"].tolist()), py["gauss_next"]),
    }


class _RngUnpickler(pickle.Unpickler):
    """Reads an RNG file of the older, pickled form: a dict of a torch byte tensor and numpy's and
    Python's state tuples. Only the classes such a file names are found; a tensor's storage is
    read by torch.load with weights_only=True."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda b: torch.load(io.BytesIO(b), weights_only=True)
        allowed = {
            ("torch._utils", "_rebuild_tensor_v2"),
            ("collections", "OrderedDict"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy.core.multiarray", "_reconstruct"),
        }
        if (module, name) not in allowed:
            raise CheckpointError(f"an RNG state file names {module}.{name}, which no RNG state holds; not loaded")
        return super().find_class(module, name)


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _rng_file(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / "rng" / f"rank{rank}.pt"


# ----------------------------------------------------------------------------- collectives


def _all_gather(obj: Any, world: int) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ----------------------------------------------------------------------------- saving


def _own_files(engine, staging: Path, rank: int) -> list[Path]:
    """The files this rank wrote: its DeepSpeed shards (by DeepSpeed's own naming) and RNG file."""
    own = [_rng_file(staging, rank)]
    if engine.save_non_zero_checkpoint:
        own.append(Path(engine._get_ckpt_name(str(staging), DS_TAG)))
    if engine.save_zero_checkpoint:
        own.append(Path(engine._get_zero_ckpt_name(str(staging), DS_TAG)))
    return own


def _write_rank(engine, staging: Path, step: int, rank: int) -> dict[str, dict[str, Any]]:
    """Step 2: this rank's shard + RNG state; returns {relative path: {size, sha256, rank}}."""
    engine.save_checkpoint(str(staging), tag=DS_TAG, client_state={"step": step}, save_latest=False)
    rng = _rng_file(staging, rank)
    rng.parent.mkdir(parents=True, exist_ok=True)
    write_rng_state(rng, rng_state())
    files = {}
    for p in _own_files(engine, staging, rank):
        if not p.is_file():
            raise CheckpointError(f"rank {rank}: DeepSpeed reported success but {p} was not written")
        fsync_file(p)  # on this node, which wrote it: another node's fsync does not flush this one's cache
        files[str(p.relative_to(staging))] = {"size": p.stat().st_size, "sha256": _sha256(p), "rank": rank}
    return files


def _seal(staging: Path, files: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Step 3's writes (rank 0): fsyncs what DeepSpeed wrote besides the ranks' own files (its
    recovery script) and every directory, then writes the manifest last, so it only vouches for
    files already on the storage."""
    for p in sorted(staging.rglob("*")):
        if p.is_file() and str(p.relative_to(staging)) not in files:
            fsync_file(p)
    for d in sorted({p for p in staging.rglob("*") if p.is_dir()}, reverse=True):
        fsync_dir(d)
    _write_json_durably(staging / MANIFEST, {**manifest, "format": FORMAT, "ds_tag": DS_TAG, "files": files})
    fsync_dir(staging)


def _check_staged(staging: Path, per_rank: list[dict[str, dict[str, Any]]], zero_stage: int) -> dict[str, Any]:
    """Step 3 (rank 0): every rank's shards are present with the size their writer saw."""
    files: dict[str, Any] = {}
    for rank, own in enumerate(per_rank):
        kinds = {k for rel in own for k in ("optim_states", "model_states", "rng/") if k in rel}
        needed = {"optim_states", "rng/"} | ({"model_states"} if zero_stage == 3 or rank == 0 else set())
        if needed - kinds:
            raise CheckpointError(f"rank {rank} wrote no {', '.join(sorted(needed - kinds))} file into {staging}")
        files.update(own)
    for rel, meta in files.items():
        p = staging / rel
        size = p.stat().st_size if p.is_file() else None
        if size != meta["size"]:
            raise CheckpointError(
                f"{p}: rank {meta['rank']} wrote {meta['size']} bytes but rank 0 sees "
                f"{'no file' if size is None else f'{size} bytes'}; is run.storage_path shared by all nodes?"
            )
    return files


def write_checkpoint(
    engine, ckpt_root: Path, step: int, manifest: dict[str, Any], rank: int, world: int, previous: Path | None = None
) -> Path:
    """Steps 1-3 of the save; returns the finished directory on every rank, or raises CheckpointError.

    `previous` (the checkpoint resumed from or last written) only names what stays intact in errors.
    """
    import torch.distributed as dist

    ckpt_root = Path(ckpt_root)
    name = free_checkpoint_name(ckpt_root, step)
    staging, final = ckpt_root / STAGING / name, ckpt_root / name
    intact = f"checkpoint {step} was not reported; {f'{previous} is intact and stays the latest' if previous else 'no earlier checkpoint exists'}"

    # 1. a clean staging directory (a crashed attempt may have left one behind)
    if rank == 0:
        try:
            shutil.rmtree(ckpt_root / STAGING, ignore_errors=True)
            staging.mkdir(parents=True)
        except OSError as e:
            raise CheckpointError(f"cannot create {staging}: {_describe_write_error(e, staging)}; {intact}") from e
    dist.barrier()

    # 2. every rank writes and hashes its own files; a failure here ends the attempt from this rank
    try:
        own = _write_rank(engine, staging, step, rank)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"rank {rank} could not write checkpoint {step} to {staging}: {_describe_write_error(e, staging)}; {intact}"
        ) from e
    per_rank = _all_gather(own, world)

    # 3. rank 0 verifies, writes the manifest last and renames; everyone learns the outcome
    error = None
    if rank == 0:
        try:
            files = _check_staged(staging, per_rank, engine.zero_optimization_stage())
            _seal(staging, files, manifest)
            if final.exists():  # written by a crashed attempt but never reported: not Ray's latest
                shutil.rmtree(final)
            os.replace(staging, final)
            fsync_dir(ckpt_root)
        except Exception as e:
            error = f"checkpoint {step} failed verification: {e}; {intact}"
            if isinstance(e, OSError):
                error = f"checkpoint {step} could not be finished in {ckpt_root}: {_describe_write_error(e, staging)}; {intact}"
            shutil.rmtree(staging, ignore_errors=True)
    error = _broadcast(error)
    if error:
        raise CheckpointError(error)
    return final


def report_checkpoint(metrics: dict[str, Any], final: Path) -> None:
    """Step 4: every rank reports the finished directory to Ray Train, in place (no copy)."""
    import ray.train
    from ray.train import CheckpointUploadMode

    ray.train.report(
        metrics,
        checkpoint=ray.train.Checkpoint.from_directory(str(final)),
        checkpoint_dir_name=final.name,
        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
    )


def save_and_report(
    engine,
    ckpt_root: Path,
    step: int,
    manifest: dict[str, Any],
    metrics: dict[str, Any],
    rank: int,
    world: int,
    previous: Path | None = None,
) -> Path:
    """The whole save: write, verify, rename, report. Every rank must call it at the same steps."""
    final = write_checkpoint(engine, ckpt_root, step, manifest, rank, world, previous)
    report_checkpoint(metrics, final)
    return final


# ----------------------------------------------------------------------------- finding and checking


def _snapshot(run_dir: Path, tries: int = 5, wait_s: float = 0.2) -> dict[str, Any]:
    """Ray Train's record of the run's reported checkpoints ({} before the first).

    Ray Train rewrites the file in place (truncate, then write) each time a checkpoint is
    reported, so a reader polling a live run can catch it empty or half written: read again a
    few times before calling it unreadable."""
    snapshot = Path(run_dir) / SNAPSHOT
    for attempt in range(tries):
        if attempt:
            time.sleep(wait_s)
        if not snapshot.is_file():
            return {}
        try:
            return json.loads(snapshot.read_text())
        except (OSError, ValueError) as e:
            error = e
    raise CheckpointError(
        f"{snapshot} is unreadable ({error}); Ray Train can't tell which checkpoint to resume from"
    ) from error


def latest_reported(run_dir: Path) -> Path | None:
    """The checkpoint Ray Train will hand back on resume: the latest one in its snapshot."""
    latest = _snapshot(run_dir).get("latest_checkpoint_result")
    if not latest:
        return None
    return Path(run_dir) / latest["checkpoint_dir_name"]


# ----------------------------------------------------------------------------- damaged checkpoints

DAMAGED = ".damaged-"  # a damaged checkpoint's new name: checkpoint_000100.damaged-sha256
DAMAGE_NOTE = "DAMAGED.txt"  # inside it: what was found, in full
# Left alone at a damaged checkpoint's old name: Ray Train may still list that name (a restart
# inside the run), and when it drops it, it deletes the directory there, or fails the whole run
# (FileNotFoundError in its controller) when there is none.
MOVED = "MOVED.txt"


def reported_newest_first(run_dir: Path) -> list[str]:
    """The checkpoints Ray Train's record lists, the one it hands back first, then newest
    reported first (under run.best_metric its list is ordered by score, its indices by time)."""
    record = _snapshot(run_dir)
    results = record.get("checkpoint_results") or []
    indices = record.get("checkpoint_report_indices") or list(range(len(results)))
    names = [r["checkpoint_dir_name"] for _, r in sorted(zip(indices, results, strict=True), key=lambda x: -x[0])]
    latest = (record.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
    return list(dict.fromkeys(([latest] if latest else []) + names))


def _damaged_copy(ckpt_dir: Path) -> Path | None:
    """Where a checkpoint renamed as damaged lies now, if it was."""
    return next(iter(sorted(ckpt_dir.parent.glob(f"{glob.escape(ckpt_dir.name)}{DAMAGED}*"))), None)


def resumable(run_dir: Path) -> list[str]:
    """reported_newest_first without the damaged checkpoints stepped past (gone or moved)."""
    return [n for n in reported_newest_first(run_dir) if (Path(run_dir) / n).is_dir() and not _moved(Path(run_dir) / n)]


def free_checkpoint_name(ckpt_root: Path, step: int) -> str:
    """The directory name of the checkpoint at `step`: checkpoint_dir_name(step), or that with -2,
    -3, ... when a damaged checkpoint had the name. Ray Train may still list the damaged one
    under it (after a restart inside the run), and deletes whatever lies there once it drops it."""
    base = name = checkpoint_dir_name(step)
    n = 1
    while _damaged_copy(Path(ckpt_root) / name) is not None:
        n += 1
        name = f"{base}-{n}"
    return name


def _moved(ckpt_dir: Path) -> bool:
    """Whether `ckpt_dir` is what mark_damaged leaves at a damaged checkpoint's old name."""
    return (ckpt_dir / MOVED).is_file() and not (ckpt_dir / MANIFEST).exists()


def _missing(ckpt_dir: Path) -> DamagedCheckpoint:
    copy = _damaged_copy(ckpt_dir)
    why = f"found damaged before, kept as {copy.name}" if copy else "the directory is gone"
    return DamagedCheckpoint(f"checkpoint {ckpt_dir} is missing ({why})", ckpt_dir, "missing")


def mark_damaged(error: DamagedCheckpoint) -> str:
    """Renames the damaged checkpoint `error` names to `<name>.damaged-<why>`, with every file
    kept and a note of what was found, so neither a resume nor Ray Train (which deletes the
    checkpoints it drops) takes it again, and leaves a directory holding only MOVED.txt at the old
    name for Ray Train to delete; returns what became of it, for the one line that says so."""
    path = error.path
    if not path.is_dir() or _moved(path):
        return str(error)
    target = path.with_name(f"{path.name}{DAMAGED}{error.why}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED}{error.why}-{n}")
    with contextlib.suppress(OSError):  # the note is a courtesy; the rename is what counts
        (path / DAMAGE_NOTE).write_text(f"{error}\n")
    os.rename(path, target)
    path.mkdir()
    (path / MOVED).write_text(f"{error}; kept as {target.name}\n")
    fsync_dir(path.parent)
    return f"{error}; kept as {target.name}"


def drop_from_record(run_dir: Path, names: Collection[str], latest: str) -> None:
    """Removes the checkpoints `names` from Ray Train's record of the run and makes `latest` the
    one it hands back. Before Ray starts, when nothing else writes the file: Ray Train refuses to
    start on a record that lists a directory no longer there."""
    record = _snapshot(run_dir)
    results = record.get("checkpoint_results") or []
    indices = record.get("checkpoint_report_indices") or list(range(len(results)))
    kept = [(i, r) for i, r in zip(indices, results, strict=True) if r["checkpoint_dir_name"] not in names]
    record["checkpoint_results"] = [r for _, r in kept]
    record["checkpoint_report_indices"] = [i for i, _ in kept]
    record["latest_checkpoint_result"] = next(
        (r for _, r in kept if r["checkpoint_dir_name"] == latest), {"checkpoint_dir_name": latest, "metrics": {}}
    )
    pending = zip(record.get("pending_training_results") or [], record.get("pending_validation_specs") or [])
    pending = [(r, v) for r, v in pending if r["checkpoint_dir_name"] not in names]
    if "pending_training_results" in record:
        record["pending_training_results"] = [r for r, _ in pending]
        record["pending_validation_specs"] = [v for _, v in pending]
    for key in [k for k in record if k.endswith("_checkpoint_dir_names")]:
        record[key] = [n for n in record[key] if n not in names]
    snapshot = Path(run_dir) / SNAPSHOT
    tmp = snapshot.with_name(f".{snapshot.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, snapshot)


def _none_verifies(run_dir: Path, errors: list[DamagedCheckpoint]) -> CheckpointError:
    return CheckpointError(
        f"none of run {Path(run_dir).name!r}'s checkpoints verifies: {'; '.join(map(str, errors))}. Restore their "
        "files (from a copy of the run directory), or start a new run.name (python -m raytrain_cpu.export turns a "
        "whole checkpoint into a model to start from); nothing was renamed or deleted"
    )


def newest_verified(
    run_dir: Path, log: Callable[[str], None], damaged: dict[str, DamagedCheckpoint] | None = None
) -> dict[str, Any] | None:
    """The driver's choice: the manifest (+ "path") of the newest checkpoint in Ray Train's
    record whose files are all there with their sizes (the workers hash their own), skipping
    `damaged` (names found so by other checks: to_universal hashes every shard). Those it steps
    past are renamed (mark_damaged), one line each, and dropped from the record, so Ray Train
    hands the workers this one. None when the record lists none; CheckpointError when none verifies."""
    run_dir = Path(run_dir)
    errors: list[DamagedCheckpoint] = []
    for name in reported_newest_first(run_dir):
        path = run_dir / name
        try:
            if name in (damaged or {}):
                raise damaged[name]
            if not path.is_dir() or _moved(path):
                raise _missing(path)
            manifest = verify_checkpoint(path)
        except DamagedCheckpoint as e:
            errors.append(e)
            continue
        for e in errors:
            log(f"[raytrain] {mark_damaged(e)}; resuming from {name}")
        if errors:
            drop_from_record(run_dir, [e.path.name for e in errors], name)
            for e in errors:  # no longer in Ray Train's record: what stood in for them goes
                if _moved(e.path):
                    shutil.rmtree(e.path)
        return {**manifest, "path": str(path)}
    if errors:
        raise _none_verifies(run_dir, errors)
    return None


def _check_own(ckpt_dir: Path, rank: int, world: int) -> dict[str, Any]:
    """A worker's share of checking a checkpoint: every file's size, and the sha256 of the files
    this rank loads (saved for another worker count: of old ranks rank, rank + world, ..., unless
    its universal form, made from hashed shards, is what loads)."""
    if not ckpt_dir.is_dir() or _moved(ckpt_dir):
        raise _missing(ckpt_dir)
    saved = read_manifest(ckpt_dir)["world_size"]
    if saved == world:
        mine = [rank]
    else:
        mine = [] if universal_ready(ckpt_dir) else [r for r in range(saved) if r % world == rank]
    return verify_checkpoint(ckpt_dir, hash_ranks=mine)


def choose_checkpoint(
    handed: Path | None, rank: int, world: int, log: Callable[[str], None], hashed: str | None = None
) -> tuple[Path | None, dict[str, Any]]:
    """The workers' choice, on every attempt: the checkpoint Ray Train handed back (`handed`)
    when it verifies on every rank, else the newest older one in Ray Train's record that does.
    Every rank hashes its own files; one gather per checkpoint tried makes all ranks agree. Rank
    0 renames those stepped past (mark_damaged), one line each. `hashed`: the checkpoint the
    driver hashed whole before Ray Train started (hash_checkpoint), whose sizes alone are checked
    again (the first attempt reads no shard twice). Returns (path, manifest), or
    (None, {}) when Ray Train handed none; raises CheckpointError when none verifies, or when one
    fails in another way (a manifest of another format) that stepping back would not mend."""
    import torch.distributed as dist

    if handed is None:
        return None, {}
    run_dir = handed.parent
    errors: list[DamagedCheckpoint] = []
    for name in dict.fromkeys([handed.name, *reported_newest_first(run_dir)]):
        path = run_dir / name
        manifest: dict[str, Any] = {}
        try:
            manifest = verify_checkpoint(path) if name == hashed else _check_own(path, rank, world)
            verdict: tuple[str, Any] = ("ok", None)
        except DamagedCheckpoint as e:
            verdict = ("damaged", e)
        except CheckpointError as e:
            verdict = ("error", str(e))
        verdicts = _all_gather(verdict, world)
        if fatal := next((v for kind, v in verdicts if kind == "error"), None):
            raise CheckpointError(fatal)
        if found := next((v for kind, v in verdicts if kind == "damaged"), None):
            errors.append(found)
            continue
        if rank == 0:
            for e in errors:
                log(f"[resume] {mark_damaged(e)}; resuming from {name}")
        if errors:
            dist.barrier()  # the renames are done before any rank names its next checkpoint (free_checkpoint_name)
        return path, manifest
    raise _none_verifies(run_dir, errors)


UNSCORED = sys.float_info.max
"""The `checkpoint_score` of a checkpoint with no evaluation at its step: ranked last. Finite, as
Ray Train writes its record with pydantic, which turns inf into null."""


def rank_unscored_last(run_dir: Path) -> list[str]:
    """Rewrites the null scores in Ray Train's record of the run (checkpoints saved without an
    evaluation, before 2026-11-30, reported with inf) as UNSCORED, which Ray can rank: a resume
    with run.best_metric failed on them ('float' * 'NoneType') at every retry. Before Ray starts,
    when nothing else writes the file. Returns the checkpoints rewritten."""
    snapshot = Path(run_dir) / SNAPSHOT
    record = _snapshot(run_dir)
    fixed = []
    for result in [*(record.get("checkpoint_results") or []), record.get("latest_checkpoint_result") or {}]:
        metrics = result.get("metrics") or {}
        if "checkpoint_score" in metrics and metrics["checkpoint_score"] is None:
            metrics["checkpoint_score"] = UNSCORED
            fixed.append(result["checkpoint_dir_name"])
    if fixed:
        tmp = snapshot.with_name(f".{snapshot.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, snapshot)
    return sorted(set(fixed))


def scored_metrics(run_dir: Path) -> dict[str, str | None]:
    """{checkpoint name: the eval metric its `checkpoint_score` is of} for every checkpoint Ray
    Train still lists for the run; None where it was reported without a score (saved before
    checkpoints carried one), which Ray Train's ranking would put first."""
    out = {}
    for result in _snapshot(run_dir).get("checkpoint_results") or []:
        name = result["checkpoint_dir_name"]
        scored = "checkpoint_score" in (result.get("metrics") or {})
        manifest = Path(run_dir) / name / MANIFEST
        watch = (json.loads(manifest.read_text()).get("eval_watch") or {}) if manifest.is_file() else {}
        out[name] = watch.get("metric", "eval_loss") if scored else None
    return out


def checkpoint_of(path: str | Path) -> Path:
    """`path` when it is a checkpoint; for a run directory, its latest reported checkpoint (the
    one a resume loads); else `path` as given, for read_manifest to say what it lacks."""
    p = Path(path)
    if (p / MANIFEST).is_file() or not p.is_dir():
        return p
    return latest_reported(p) or p


BEST_HELP = "with a run directory: its best checkpoint (run.best_metric), not its latest"  # --best of the CLIs


def best_of(run_dir: str | Path) -> Path:
    """A run directory's best checkpoint under run.best_metric: the one its latest checkpoint's
    manifest names (train.EvalWatch), which Ray Train keeps while it ranks first."""
    run_dir = Path(run_dir)
    latest = latest_reported(run_dir) if run_dir.is_dir() else None
    if latest is None:
        raise CheckpointError(f"--best takes a run directory, and {run_dir} holds no reported checkpoint")
    best = (read_manifest(latest).get("eval_watch") or {}).get("best_checkpoint")
    if not best:
        raise CheckpointError(
            f"{run_dir} did not rank its checkpoints (run.best_metric was not set): drop --best for its latest "
            f"checkpoint, or pass one of them{_siblings(latest)}"
        )
    return run_dir / best["name"]


def _siblings(ckpt_dir: Path) -> str:
    """'; <run dir> holds checkpoint_000100, ...' for a mistyped checkpoint path, else ''."""
    run_dir = ckpt_dir.parent
    found = sorted(p.name for p in run_dir.glob("checkpoint_*") if (p / MANIFEST).is_file() and DAMAGED not in p.name)
    return f"; {run_dir} holds {', '.join(found)}" if found else ""


def shard_bytes(manifest: dict[str, Any]) -> int:
    """The size of a checkpoint's DeepSpeed shards (every rank's files under ds/), from its manifest."""
    return sum(meta["size"] for rel, meta in manifest["files"].items() if rel.startswith(f"{DS_TAG}/"))


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / MANIFEST
    if not path.is_file():
        if Path(ckpt_dir).is_dir():
            raise DamagedCheckpoint(
                f"checkpoint {ckpt_dir} has no {MANIFEST}: it is incomplete or not a raytrain_cpu checkpoint",
                ckpt_dir,
                "no-manifest",
            )
        raise CheckpointError(
            f"checkpoint {ckpt_dir} has no {MANIFEST}: it is incomplete or not a raytrain_cpu checkpoint"
            f" (the directory does not exist{_siblings(Path(ckpt_dir))})"
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise DamagedCheckpoint(f"{path} is unreadable: {e}", ckpt_dir, "manifest") from e
    if not isinstance(manifest, dict):
        raise DamagedCheckpoint(f"{path} holds no JSON object", ckpt_dir, "manifest")
    if manifest.get("format") != FORMAT or "files" not in manifest:
        raise CheckpointError(f"{path} has no file list (format {manifest.get('format')}, expected {FORMAT})")
    return manifest


def verify_checkpoint(ckpt_dir: str | Path, *, hash_ranks: Collection[int] | bool = ()) -> dict[str, Any]:
    """Checks a checkpoint against its manifest and returns the manifest.

    Every listed file must exist with its recorded size; the sha256 of the files of `hash_ranks`
    (True: all) is recomputed. Raises CheckpointError naming the first problem.
    """
    ckpt_dir = Path(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    for rel, meta in manifest["files"].items():
        p = ckpt_dir / rel
        if not p.is_file():
            raise DamagedCheckpoint(
                f"checkpoint {ckpt_dir} is incomplete: {rel} (rank {meta['rank']}) is missing", ckpt_dir, "missing-file"
            )
        if p.stat().st_size != meta["size"]:
            raise DamagedCheckpoint(
                f"checkpoint {ckpt_dir} is damaged: {rel} has {p.stat().st_size} bytes, the manifest says {meta['size']}",
                ckpt_dir,
                "size",
            )
        if (hash_ranks is True or meta["rank"] in (hash_ranks or ())) and _sha256(p) != meta["sha256"]:
            raise DamagedCheckpoint(
                f"checkpoint {ckpt_dir} is damaged: {rel} does not match its sha256", ckpt_dir, "sha256"
            )
    return manifest


# ----------------------------------------------------------------------------- loading


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
        set_rng_state(read_rng_state(_rng_file(ckpt_dir, rank)))
    return manifest


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
