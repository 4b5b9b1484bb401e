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
from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint import DS_TAG, CheckpointError, verify_checkpoint

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
MAX_SHARD_BYTES = 5 * 2**30  # save_pretrained's default split size


def _torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def _consolidated(ckpt_dir: Path):
    """{name: lazy tensor} of the whole model's fp32 master weights (tied names share one object)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=DS_TAG, lazy_mode=True)


def _write_safetensors(state, out: Path, dtype, max_shard_bytes: int) -> dict[str, Any]:
    """Streams tensors into safetensors files of at most ~max_shard_bytes; returns what it wrote."""
    from safetensors.torch import save_file

    shards: list[list[str]] = []  # tensor names per file; only the file being filled is in memory
    current: dict[str, Any] = {}
    current_bytes = total = 0
    seen: set[int] = set()

    def flush() -> None:
        nonlocal current, current_bytes
        shards.append(list(current))
        save_file(current, str(out / f".shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        current, current_bytes = {}, 0

    for name, lazy in state.items():
        if id(lazy) in seen:  # a tied weight (lm_head = embed_tokens): transformers re-ties it on load
            continue
        seen.add(id(lazy))
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
        final = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        (out / f".shard-{i:05d}.safetensors").rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"files": n, "bytes": total, "tensors": len(weight_map)}


def _write_config_and_tokenizer(out: Path, model_dir: str, tokenizer: str, dtype) -> None:
    from transformers import AutoConfig, GenerationConfig

    from raytrain_cpu.tokenizer import load_tokenizer

    config = AutoConfig.from_pretrained(model_dir)
    config.dtype = dtype
    config.save_pretrained(out)
    with contextlib.suppress(OSError):  # the base model may have no generation_config.json
        GenerationConfig.from_pretrained(model_dir).save_pretrained(out)
    load_tokenizer(tokenizer).save_pretrained(out)


def export_checkpoint(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "auto",
    model_dir: str | None = None,
    tokenizer: str | None = None,
    checksums: bool = False,
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Writes the Hugging Face model of a raytrain_cpu checkpoint; returns what it wrote.

    The checkpoint is verified against its manifest first (sizes; sha256 too with `checksums`).
    `model_dir` / `tokenizer` default to the ones the run trained with (from the manifest). The
    output appears whole or not at all (written next to `out_dir`, then renamed).
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    manifest = verify_checkpoint(ckpt_dir, hash_ranks=checksums)
    dtype = manifest.get("dtype", "fp32") if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: got {dtype!r}; choose auto, bf16 or fp32.")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass --overwrite or choose another directory.")
    model_dir = model_dir or manifest["model_dir"]
    tokenizer = tokenizer or manifest.get("tokenizer") or model_dir

    t0 = time.perf_counter()
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        torch_dtype = _torch_dtype(dtype)
        written = _write_safetensors(_consolidated(ckpt_dir), tmp, torch_dtype, max_shard_bytes)
        _write_config_and_tokenizer(tmp, model_dir, tokenizer, torch_dtype)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
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


# ----------------------------------------------------------------------------- checking an export


def probe_logits(engine, input_ids, rows: int = 2, tokens: int = 128) -> dict[str, Any]:
    """The trained model's logits on a slice of a batch. Every rank must call it (ZeRO-3 gathers)."""
    import torch

    x = input_ids[:rows, :tokens]
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=x).logits
    engine.train()
    return {"input_ids": x.clone(), "logits": logits.float()}


def max_abs_logit_diff(out_dir: str | Path, probe: dict[str, Any]) -> float:
    """Loads the export with `from_pretrained` (its own dtype) and compares its logits with `probe`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype="auto")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits.float()
    return float((logits - probe["logits"]).abs().max())


def export_on_finish(ckpt_dir: Path, run_dir: Path, probe: dict[str, Any] | None, log=print) -> dict[str, Any]:
    """Training's end (rank 0): export to <run dir>/export, check its logits, note both in the summary."""
    info = export_checkpoint(ckpt_dir, Path(run_dir) / "export", overwrite=True)
    if probe is not None:
        info["export_max_abs_logit_diff"] = max_abs_logit_diff(info["export_dir"], probe)
    log(
        f"[export] {info['export_dir']} ({info['dtype']}, {info['bytes'] / 2**20:.1f} MiB) from {ckpt_dir} "
        f"in {info['export_s']:.1f}s; max |logit diff| vs the trained model: {info.get('export_max_abs_logit_diff')}"
    )
    summary_path = Path(run_dir) / ".worker_summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        summary["export"] = info
        summary_path.write_text(json.dumps(summary, indent=2))
    return info


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m raytrain_cpu.export",
        description="Write an ordinary Hugging Face model (safetensors, config, tokenizer) from a raytrain_cpu "
        "ZeRO checkpoint directory (e.g. runs/tiny-local/checkpoint_000200).",
    )
    ap.add_argument("checkpoint", help="a checkpoint directory (holds manifest.json and ds/)")
    ap.add_argument("out_dir", help="where the model goes (created; must be empty unless --overwrite)")
    ap.add_argument(
        "--dtype", default="auto", choices=["auto", *DTYPES], help="weights dtype; auto = the training dtype"
    )
    ap.add_argument("--model-dir", default=None, help="config source (default: the model the run trained)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer to save (default: the one the run trained with)")
    ap.add_argument(
        "--checksums", action="store_true", help="verify every file's sha256 first (reads it all once more)"
    )
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")
    args = ap.parse_args(argv)
    try:
        info = export_checkpoint(
            args.checkpoint,
            args.out_dir,
            dtype=args.dtype,
            model_dir=args.model_dir,
            tokenizer=args.tokenizer,
            checksums=args.checksums,
            overwrite=args.overwrite,
        )
    except (CheckpointError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
