"""`python -m raytrain_cpu.export <checkpoint> <out_dir>`: a ZeRO checkpoint -> a Hugging Face model.

The ZeRO shards are consolidated offline with DeepSpeed's zero_to_fp32 in lazy mode (the
optimizer shards are memory-mapped and one full tensor is in memory at a time), so neither a
process group nor Ray is needed. The output is what `save_pretrained` writes: safetensors
(split into ~5 GB files with an index above that), config.json, generation_config.json and the
tokenizer the run trained with. Weights are written in the training dtype by default: for bf16
training that is the bf16 rounding of the fp32 master weights, exactly the weights the trained
model computed with; `--dtype fp32` keeps the master weights themselves.

With `run.export_on_finish=true` training exports its final checkpoint to <run dir>/export and
compares the export's logits with the trained model's (summary.json: export_max_abs_logit_diff).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint.files import cannot_write, existing_folder, out_of_space
from raytrain_cpu.checkpoint.layout import DS_TAG, MANIFEST, CheckpointError, DamagedCheckpoint
from raytrain_cpu.checkpoint.verify import BEST_HELP, best_of, checkpoint_of, read_manifest, verify_checkpoint
from raytrain_cpu.compat.ray import SNAPSHOT
from raytrain_cpu.model.hub import is_hub_id

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
RUN_INFO = "raytrain.json"  # how the run rendered its data (format, template) and its LoRA settings
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
MERGED = "merged"  # a LoRA export's merged model, beside the adapter
MAX_SHARD_BYTES = 5 * 2**30  # save_pretrained's default split size


def _torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def _consolidated(ckpt_dir: Path):
    """{name: lazy tensor} of the whole model's fp32 master weights (tied names share one object)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=DS_TAG, lazy_mode=True)
    except Exception:
        damaged = _damaged_file(ckpt_dir)
        if damaged is None:  # every file matches its manifest: not a damaged file, so not ours to rename
            raise
        raise CheckpointError(f"{damaged}: DeepSpeed can't read it; use an earlier checkpoint") from None


def _damaged_file(ckpt_dir: Path) -> str | None:
    """What of the checkpoint differs from its manifest (the first file whose sha256 does not
    match), else None. A file damaged in place keeps its size, which is all the manifest check
    reads by default, and torch's own error names no file (or names it inside an unrelated hint).
    Hashed, not opened: our code unpickles none of DeepSpeed's files (DeepSpeed's own loading
    does, docs/checkpoints.md, "Checkpoints and trust")."""
    try:
        verify_checkpoint(ckpt_dir, hash_ranks=True)
    except DamagedCheckpoint as e:
        return str(e)
    return None


def _write_safetensors(tensors, out: Path, dtype, max_shard_bytes: int, base_name: str = "model") -> dict[str, Any]:
    """Streams (name, tensor) pairs into safetensors files of at most ~max_shard_bytes; returns what it wrote."""
    from safetensors.torch import save_file

    shards: list[list[str]] = []  # tensor names per file; only the file being filled is in memory
    current: dict[str, Any] = {}
    current_bytes = total = 0
    # Tied weights are one tensor under two names. Weak references, not bare ids: the merged LoRA
    # weights are temporaries, and a freed one's id may come back for a later tensor (not a tie).
    seen: dict[int, weakref.ref] = {}

    def flush() -> None:
        nonlocal current, current_bytes
        shards.append(list(current))
        save_file(current, str(out / f".shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        current, current_bytes = {}, 0

    for name, lazy in tensors:
        tied = seen.get(id(lazy))
        if tied is not None and tied() is lazy:  # lm_head = embed_tokens: transformers re-ties it on load
            continue
        seen[id(lazy)] = weakref.ref(lazy)
        tensor = lazy.contiguous()
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if current and current_bytes + nbytes > max_shard_bytes:
            flush()
        current[name] = tensor
        current_bytes += nbytes
        total += nbytes
    flush()

    # Final names once the count is known, as save_pretrained names them.
    n = len(shards)
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        final = f"{base_name}.safetensors" if n == 1 else f"{base_name}-{i:05d}-of-{n:05d}.safetensors"
        (out / f".shard-{i:05d}.safetensors").rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / f"{base_name}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"files": n, "bytes": total, "tensors": len(weight_map)}


def _write_config_and_tokenizer(out: Path, model_dir: str, tokenizer: str, dtype, manifest: dict[str, Any]) -> None:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    config.dtype = dtype
    config.save_pretrained(out)
    with contextlib.suppress(OSError):  # the base model may have no generation_config.json
        GenerationConfig.from_pretrained(model_dir).save_pretrained(out)
    _write_tokenizer(out, tokenizer, manifest)


def _write_tokenizer(out: Path, tokenizer: str, manifest: dict[str, Any]) -> None:
    """The run's tokenizer, with the chat template it trained with (chat/instruction runs), and
    raytrain.json: the data settings, so `generate` renders prompts exactly as training did."""
    from raytrain_cpu.model.tokenizer import load_tokenizer, save_tokenizer

    tok = load_tokenizer(tokenizer)
    data = manifest.get("data") or {}
    if data.get("format", "text") != "text":
        from raytrain_cpu.config.data import DataConfig
        from raytrain_cpu.model.chat import chat_template_for

        tok.chat_template = chat_template_for(tok, DataConfig(**data))
    save_tokenizer(tok, out)
    info = {k: manifest.get(k) for k in ("step", "dtype", "model_dir", "tokenizer", "lora", "data", "dpo")}
    (out / RUN_INFO).write_text(json.dumps(info, indent=2))


def hub_model(manifest: dict[str, Any]) -> str:
    """The hub id the run's model came from ('' for a local or tiny model)."""
    name = ((manifest.get("settings") or {}).get("model") or {}).get("name_or_path", "")
    return name if is_hub_id(name) else ""


def _run_sources(ckpt_dir: Path, manifest: dict[str, Any], model_dir: str | None, tokenizer: str | None):
    """(config source, tokenizer): as given, else the run's own from the manifest.

    A run directory copied to another machine (FSx to a laptop) or moved still exports: a tiny
    run's own base model is looked up beside the checkpoint, the bundled tokenizer in this
    install. Anything else the manifest names and this machine lacks is an error naming the
    option that replaces it, before anything is written."""
    from raytrain_cpu.model.tokenizer import BUNDLED_TOKENIZER

    def missing(path: str) -> bool:  # local paths are recorded absolute; a hub id is never missing here
        return path.startswith("/") and not Path(path).exists()

    _check_given(model_dir, tokenizer)
    recorded = manifest["model_dir"]
    if model_dir is None:
        model_dir = recorded
        beside = ckpt_dir.parent / "base_model"
        hub = hub_model(manifest)
        if missing(recorded) and Path(recorded).name == beside.name and beside.is_dir():
            model_dir = str(beside)
        elif missing(recorded) and hub:
            model_dir = hub  # the run's download stayed behind: the hub has it
        elif missing(recorded):
            raise CheckpointError(
                f"the run trained {recorded}, which is not on this machine: pass --model-dir with a copy of that "
                "model directory or its hub id (its config.json is read, and its tokenizer unless --tokenizer)"
            )
    if tokenizer is None:
        tokenizer = manifest.get("tokenizer") or recorded
        if missing(tokenizer) and Path(tokenizer).parts[-3:] == BUNDLED_TOKENIZER.parts[-3:]:
            tokenizer = str(BUNDLED_TOKENIZER)  # the bundled one, from another install
        elif tokenizer == recorded:
            tokenizer = model_dir
        elif missing(tokenizer):
            raise CheckpointError(
                f"the run's tokenizer {tokenizer} is not on this machine: pass --tokenizer with a copy or its hub id"
            )
    template = (manifest.get("data") or {}).get("chat_template") or ""
    if missing(template):
        raise CheckpointError(
            f"the run rendered its chat data with {template}, which is not on this machine: copy that template "
            "file there, or export where the run trained"
        )
    return model_dir, tokenizer


def _check_given(model_dir: str | None, tokenizer: str | None) -> None:
    """--model-dir and --tokenizer name a local directory or a hub id (is_hub_id: how the rest of
    raytrain reads a name): anything else would reach the hub as a malformed repo id."""
    if model_dir is not None and not is_hub_id(model_dir) and not Path(model_dir, "config.json").is_file():
        what = "has no config.json" if Path(model_dir).is_dir() else "does not exist"
        raise CheckpointError(
            f"--model-dir: {model_dir!r} {what}; give a copy of the model directory the run trained (its "
            "config.json is read) or its hub id, e.g. meta-llama/Meta-Llama-3-8B"
        )
    if tokenizer is not None and not is_hub_id(tokenizer) and not Path(tokenizer).is_dir():
        what = "is a file" if Path(tokenizer).exists() else "does not exist"
        raise CheckpointError(
            f"--tokenizer: {tokenizer!r} {what}; give a directory holding the run's tokenizer (a model directory "
            "will do) or its hub id"
        )


def export_checkpoint(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "auto",
    model_dir: str | None = None,
    tokenizer: str | None = None,
    checksums: bool = False,
    overwrite: bool = False,
    merge: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Writes the Hugging Face model of a raytrain_cpu checkpoint; returns what it wrote.

    The checkpoint is verified against its manifest first (sizes; sha256 too with `checksums`).
    `model_dir` / `tokenizer` default to the ones the run trained with (from the manifest). The
    output appears whole or not at all (written next to `out_dir`, then renamed).

    A LoRA run's checkpoint exports as a peft adapter (adapter_model.safetensors,
    adapter_config.json naming the base model, and the tokenizer) in `out_dir`; with `merge`
    also as an ordinary model with the adapters folded in, in `out_dir/merged`.
    """
    ckpt_dir, out_dir = checkpoint_of(ckpt_dir), Path(out_dir)
    # Every cheap check first: the file check below reads the whole checkpoint with `checksums`.
    manifest = read_manifest(ckpt_dir)
    dtype = manifest.get("dtype", "fp32") if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: got {dtype!r}; choose auto, bf16 or fp32.")
    sources = _run_sources(ckpt_dir, manifest, model_dir, tokenizer)
    _check_out_dir(ckpt_dir, out_dir, overwrite, _kept_dirs(ckpt_dir, manifest, sources))
    _check_writable(out_dir)
    verify_checkpoint(ckpt_dir, hash_ranks=checksums)
    model_dir, tokenizer = sources

    t0 = time.perf_counter()
    target = out_dir.resolve()  # "out/.." or "x/." have no name of their own to put the staging one beside
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        torch_dtype = _torch_dtype(dtype)
        state = _consolidated(ckpt_dir)
        if manifest.get("lora"):
            written = _write_lora(state, tmp, torch_dtype, manifest, model_dir, tokenizer, merge, max_shard_bytes)
        else:
            written = _write_safetensors(state.items(), tmp, torch_dtype, max_shard_bytes)
            _write_config_and_tokenizer(tmp, model_dir, tokenizer, torch_dtype, manifest)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except Exception as e:  # OSError, or safetensors' own error around one
        if not out_of_space(e):
            raise
        raise CheckpointError(
            f"{out_dir}: no space left on its filesystem for the export ({e}); nothing was kept. Free space there, "
            "or choose another out_dir."
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "export_dir": str(out_dir),
        "checkpoint": str(ckpt_dir),
        "step": manifest["step"],
        "dtype": dtype,
        **written,
        "export_s": time.perf_counter() - t0,
    }


def _check_out_dir(ckpt_dir: Path, out_dir: Path, overwrite: bool, kept: dict[Path, tuple[str, str]]) -> None:
    """Refuses an out_dir whose replacement would lose what a run needs, --overwrite or not: the
    export replaces out_dir whole, so out_dir must not be, hold or lie in a checkpoint, a run or
    one of the `kept` directories (_kept_dirs), nor be or hold the current directory."""
    ckpt, out = ckpt_dir.resolve(), out_dir.resolve()
    if where := _relation(out, ckpt):
        raise FileExistsError(
            f"{out_dir} {where} the checkpoint {ckpt_dir}; choose an out_dir outside it (e.g. {ckpt.parent / 'export'})."
        )
    for path, (what, needed_by) in kept.items():
        if where := _relation(out, path):
            raise FileExistsError(
                f"{out_dir} {where} {what} {path}, which {needed_by}; the export replaces out_dir whole, so "
                f"choose an out_dir outside it (e.g. {ckpt.parent / 'export'})."
            )
    _check_not_cwd(out_dir, out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out_dir} is a file; the export is a directory: choose another out_dir.")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass --overwrite or choose another directory.")
    # A checkpoint, a run directory or a storage path of runs: --overwrite never replaces training state.
    patterns = [f"{depth}{name}" for name in (MANIFEST, SNAPSHOT) for depth in ("", "*/", "*/*/")]
    held = next((p for pattern in patterns for p in out.glob(pattern)), None)
    if held:
        raise FileExistsError(
            f"{out_dir} holds raytrain checkpoints ({held.parent}); --overwrite never replaces them: "
            "choose another directory."
        )


def _check_not_cwd(out_dir: Path, out: Path) -> None:
    """out_dir (resolved: `out`) must not be or hold the current directory: "." would be emptied."""
    try:
        cwd = Path.cwd().resolve()
    except FileNotFoundError:  # a process whose cwd was deleted: nothing there to lose
        return
    if (where := _relation(out, cwd)) and where != "is inside":
        raise FileExistsError(
            f"{out_dir} {where} the current directory {cwd}, which the export would replace whole; choose a new "
            "directory for it (e.g. ./export)."
        )


def _relation(out: Path, path: Path) -> str:
    """How resolved `out` stands to resolved `path`: 'is', 'holds', 'is inside' or '' (apart)."""
    if out == path:
        return "is"
    if out in path.parents:
        return "holds"
    return "is inside" if path in out.parents else ""


def _kept_dirs(ckpt_dir: Path, manifest: dict[str, Any], sources: tuple[str, str]) -> dict[Path, tuple[str, str]]:
    """{resolved local directory: (what it is, what reads it)} for the model and tokenizer the run
    started from (its manifest's, and the base model beside its checkpoints that a copied run
    falls back to) and those this export reads (`sources`, _run_sources'); hub ids are none."""
    model_users = "a resume, DPO's reference and a LoRA adapter's base read"
    named = [
        (manifest.get("model_dir"), "the model the run started from", model_users),
        (ckpt_dir.parent / "base_model", "the run's base model", model_users),
        (manifest.get("tokenizer"), "the run's tokenizer", "a resume and every export of the run read"),
        (sources[0], "the model this export reads its config from", "this export reads"),
        (sources[1], "the tokenizer this export copies", "this export reads"),
    ]
    kept: dict[Path, tuple[str, str]] = {}
    for path, what, needed_by in named:
        if path and Path(path).is_dir():
            kept.setdefault(Path(path).resolve(), (what, needed_by))
    return kept


def _check_writable(out_dir: Path) -> None:
    """out_dir's staging directory can be made beside it, checked before any work, in the
    nearest existing folder above out_dir."""
    above = existing_folder(out_dir.resolve().parent)
    if not above.is_dir():
        raise FileExistsError(f"{out_dir}: {above} is a file, so nothing can go under it; choose another out_dir.")
    if why := cannot_write(above):
        raise CheckpointError(f"{out_dir}: can't write in {above} ({why}); choose an out_dir in a writable place.")


def _write_lora(state, out: Path, dtype, manifest, model_dir: str, tokenizer: str, merge: bool, max_shard_bytes: int):
    """adapter_model.safetensors + adapter_config.json (+ merged/) from the consolidated state."""
    from raytrain_cpu.model import lora

    settings = manifest["lora"]
    if not lora.is_lora_state(state):
        raise CheckpointError(f"the manifest records LoRA settings but the checkpoint holds no adapters: {settings}")
    # fp32 whatever the training dtype: peft keeps adapters in fp32 beside a bf16 base (its
    # autocast_adapter_dtype), so that is what the trained model computed with.
    adapter_dtype = _torch_dtype("fp32")
    written = _write_safetensors(
        lora.adapter_state(state), out, adapter_dtype, max_shard_bytes, base_name="adapter_model"
    )
    if written["files"] > 1:  # peft reads one adapter file; adapters are small, so this is a hard limit
        raise CheckpointError(f"the adapters need {written['files']} files; raise the shard size")
    # A hub model by its id, as peft names bases, so the adapter loads anywhere (load_exported
    # still takes the run's own copy when it is on this machine); else the directory it exports against.
    lora.peft_config(settings, base_model=hub_model(manifest) or str(model_dir)).save_pretrained(str(out))
    _write_tokenizer(out, tokenizer, manifest)
    written = {"adapter": written}
    if merge:
        merged = out / MERGED
        merged.mkdir()
        written["merged"] = _write_safetensors(lora.merged_state(state, settings), merged, dtype, max_shard_bytes)
        _write_config_and_tokenizer(merged, model_dir, tokenizer, dtype, manifest)
    return {"files": written["adapter"]["files"], "bytes": written["adapter"]["bytes"], **written}


# ----------------------------------------------------------------------------- loading an export


def is_adapter_dir(path: str | Path) -> bool:
    return all((Path(path) / f).is_file() for f in ADAPTER_FILES)


def model_or_checkpoint(path: str | Path) -> Path:
    """`path` as generate and evaluate read it: a checkpoint (a run directory: its latest), an
    export or a Hugging Face model directory. Anything else is a CheckpointError saying which of
    those it is not and what to pass, before a tokenizer's loader guesses at it."""
    p = checkpoint_of(path)
    if (p / MANIFEST).is_file() or (p / "config.json").is_file() or is_adapter_dir(p):
        return p
    if (p / DS_TAG).is_dir() or not p.is_dir():  # a checkpoint without its manifest, or a reported one gone
        read_manifest(p)  # raises, saying so (export's own check)
    runs = sorted({m.parts[-3] for m in p.glob(f"*/checkpoint_*/{MANIFEST}")})
    if runs:
        raise CheckpointError(
            f"{path} is a storage path of runs ({', '.join(runs)}), not one model: pass a run directory "
            f"(e.g. {p / runs[0]}) or one of its checkpoints"
        )
    held = sorted(m.parent.name for m in p.glob(f"checkpoint_*/{MANIFEST}"))
    if held:
        raise CheckpointError(
            f"{path} holds checkpoints but no {SNAPSHOT} to say which is its latest: pass one, e.g. {p / held[-1]}"
        )
    raise CheckpointError(
        f"{path} is not a model directory (no config.json), a checkpoint (no {MANIFEST}) or a run directory (no "
        "checkpoints): pass one of those, e.g. runs/<name> or an export"
    )


def load_exported(path: str | Path, dtype=None):
    """An export as a model for inference: an ordinary model directory, or a LoRA adapter
    directory on top of the base model its adapter_config.json names."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not is_adapter_dir(path):
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or "auto").eval()
    from peft import PeftModel

    from raytrain_cpu.model.lora import quiet_peft

    base_dir = json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]
    info = json.loads((path / RUN_INFO).read_text()) if (path / RUN_INFO).is_file() else {}
    local = info.get("model_dir")
    if is_hub_id(base_dir) and local and Path(local).is_dir():
        base_dir = local  # the run's download of that hub model, not a second one
    if dtype is None:  # the adapter's own dtype (the training dtype), for the base too
        dtype = _torch_dtype(info.get("dtype") or "fp32")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    with quiet_peft():
        return PeftModel.from_pretrained(base, str(path)).eval()


# ----------------------------------------------------------------------------- checking an export


def probe_logits(engine, input_ids, rows: int = 2, tokens: int = 128) -> dict[str, Any]:
    """The trained model's logits on a slice of a batch. Every rank must call it (ZeRO-3 gathers)."""
    import torch

    x = input_ids[:rows, :tokens]
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=x).logits
    engine.train()
    attention = getattr(getattr(engine.module, "config", None), "_attn_implementation", None)
    return {"input_ids": x.clone(), "logits": logits.float(), "attention": attention}


def max_abs_logit_diff(out_dir: str | Path, probe: dict[str, Any]) -> float:
    """Loads the export (its own dtype; an adapter on its base) and compares its logits with `probe`,
    computed with the attention the trained model ran (the same bits where the weights are)."""
    import torch

    from raytrain_cpu.model.ops import attention

    model = load_exported(out_dir)
    block = attention.block_of(probe.get("attention"))
    if block:
        model.set_attn_implementation(attention.register(block))
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits.float()
    return float((logits - probe["logits"]).abs().max())


def export_on_finish(ckpt_dir: Path, run_dir: Path, probe: dict[str, Any] | None, log=print) -> dict[str, Any]:
    """Training's end (rank 0): export to <run dir>/export, check its logits, note both in the summary."""
    info = export_checkpoint(ckpt_dir, Path(run_dir) / "export", overwrite=True, merge=True)
    if probe is not None:
        info["export_max_abs_logit_diff"] = max_abs_logit_diff(info["export_dir"], probe)
        if "merged" in info:  # a LoRA run: the adapter on its base above, the merged model here
            info["merged_max_abs_logit_diff"] = max_abs_logit_diff(Path(info["export_dir"]) / MERGED, probe)
    check = (
        f"max |logit diff| vs the trained model: {info['export_max_abs_logit_diff']}"
        if probe is not None
        else "not compared with the trained model (it is not this attempt's last step)"
    )
    log(
        f"[export] {info['export_dir']} ({info['dtype']}, {info['bytes'] / 2**20:.1f} MiB) from {ckpt_dir} "
        f"in {info['export_s']:.1f}s; {check}"
    )
    summary_path = Path(run_dir) / ".worker_summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        summary["export"] = info
        summary_path.write_text(json.dumps(summary, indent=2))
    return info


# ----------------------------------------------------------------------------- CLI


@contextlib.contextmanager
def progress_to_stderr() -> Iterator[None]:
    """Keeps a command's stdout for its result (export's JSON, generate's text), so it pipes:
    DeepSpeed prints its checkpoint-reading progress to stdout, and its logger writes to the
    stdout it finds when first imported, which in these commands happens inside this block."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m raytrain_cpu.export",
        description="Write an ordinary Hugging Face model (safetensors, config, tokenizer) from a raytrain_cpu "
        "ZeRO checkpoint directory (e.g. runs/tiny-local/checkpoint_000200).",
    )
    ap.add_argument(
        "checkpoint", help="a checkpoint directory (holds manifest.json and ds/), or a run directory: its latest one"
    )
    ap.add_argument("out_dir", help="where the model goes (created; must be empty unless --overwrite)")
    ap.add_argument("--best", action="store_true", help=BEST_HELP)
    ap.add_argument(
        "--dtype", default="auto", choices=["auto", *DTYPES], help="weights dtype; auto = the training dtype"
    )
    ap.add_argument("--model-dir", default=None, help="config source (default: the model the run trained)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer to save (default: the one the run trained with)")
    ap.add_argument(
        "--checksums", action="store_true", help="verify every file's sha256 first (reads it all once more)"
    )
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="LoRA runs: also write the model with the adapters merged in, to <out_dir>/merged",
    )
    args = ap.parse_args(argv)
    try:
        with progress_to_stderr():
            info = export_checkpoint(
                best_of(args.checkpoint) if args.best else args.checkpoint,
                args.out_dir,
                dtype=args.dtype,
                model_dir=args.model_dir,
                tokenizer=args.tokenizer,
                checksums=args.checksums,
                overwrite=args.overwrite,
                merge=args.merge,
            )
    except (CheckpointError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.merge and "adapter" not in info:
        print(
            f"note: --merge ignored: {info['checkpoint']} is not a LoRA run, so the export is already the whole model",
            file=sys.stderr,
        )
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
