"""What a run's checkpoints must share with a resume: the hashed settings, the global batch,
the DeepSpeed layout, and the model directory the run started from."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint.layout import CheckpointError, workers

# ----------------------------------------------------------------------------- settings


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
