"""`python -m raytrain_cpu.evaluate <checkpoint | run dir | export | model dir> [data.key=value ...]`:
a model's eval loss and perplexity, as training's evaluation measures them, on one process.

The model: a checkpoint is first exported to a temporary directory (as `generate` does, a LoRA
checkpoint as its adapter on its base; a run directory stands for its latest checkpoint, or
with --best its best); an export or any Hugging Face model directory is loaded as it is. The
data: the settings the run trained with (the checkpoint's manifest, an export's raytrain.json;
the embedded default's bundled wikitext for a model directory without either), changed by
`data.*` overrides, and packed into blocks as training packs them, in the same data cache (a
run's own evaluation blocks are found there, not tokenized again; other data is packed once, on
a local Ray). The loss is token-weighted over
the same targets (a chat run's response tokens; a preference run's chosen answers, as its
evaluations' eval_loss), within each document where the run's data.attention_span says so, for
each source of a mixture too. A model on preference data also gets its DPO run's metrics
(eval_dpo_loss, eval_reward_accuracy, ...) against the run's reference: a LoRA model's base
with the adapters off; a fully fine-tuned (or merged) model's, the model its run started from
(the run's recorded model directory, loaded beside it); a SimPO run's, none. A plain model,
or one whose starting model is not on this machine, has no reference: its chosen answers'
loss only, unless --reference names one (which also replaces a run's own).

Why: the base model against its fine-tuned export on the same held-out blocks, a model on
text of your own (`data.eval_path=notes.txt` evaluates that file alone, in the run's format),
a checkpoint other than the one a run evaluated last.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint.layout import MANIFEST, CheckpointError
from raytrain_cpu.checkpoint.verify import BEST_HELP, best_of, read_manifest
from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.load import parse_override, set_dotted
from raytrain_cpu.config.schema import Config

MICRO_BATCH = 8  # blocks a forward: the loss sums do not depend on it


def _run_dir_above(path: Path) -> Path | None:
    """The run directory that holds `path` (a checkpoint, an export, its merged/), if any."""
    for d in (path, *list(path.parents)[:3]):
        if (d / "metrics.jsonl").is_file() and (d / "config.yaml").is_file():
            return d
    return None


def _run_info(path: Path) -> dict[str, Any]:
    """What a checkpoint's manifest or an export's raytrain.json records of its run; {} for a
    plain model directory."""
    from raytrain_cpu.model.generate import _run_info as export_info

    return read_manifest(path) if (path / MANIFEST).is_file() else export_info(path)


def _run_settings(info: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The data settings a checkpoint or an export records (`info`: _run_info's), and the
    tokenizer the run read where it is still there (its blocks are then found in the run's data
    cache; the export's own copy makes the same blocks, under another key): ({}, None) for a
    plain model directory."""
    tokenizer = info.get("tokenizer")
    there = tokenizer and Path(tokenizer).exists()  # a local copy: a hub id is fetched no more
    return info.get("data") or {}, tokenizer if there else None


def evaluation_config(path: Path, model_dir: Path, overrides: list[str], info: dict[str, Any] | None = None) -> Config:
    """The config whose data the model is evaluated on: the run's data settings, the model and
    its tokenizer, the run's storage (its data cache), then `overrides` (data.*, model.tokenizer).
    `info`: what `path` records of its run (_run_info), when the caller has read it already."""
    given = dict(parse_override(item) for item in overrides)
    for key in given:
        if not (key.startswith("data.") or key == "model.tokenizer"):
            raise ConfigError(
                f"{key}: evaluate takes data.* settings (the data to evaluate on) and model.tokenizer only, "
                "e.g. data.eval_path=…"
            )
    data, tokenizer = _run_settings(_run_info(path) if info is None else info)
    run_dir = _run_dir_above(path)
    raw: dict[str, Any] = {
        "model": {"name_or_path": str(model_dir), "tokenizer": tokenizer or str(model_dir)},
        "data": data,
        "run": {"storage_path": str(run_dir.parent) if run_dir else "./runs"},
    }
    for key, value in given.items():
        set_dotted(raw, key, value)
    if _eval_path_alone(given):
        # "Evaluate on this file": only it is read (prepare_evaluation packs it alone), but the
        # config wants training text of the same kind: the file stands in for it.
        raw["data"].update(source="auto", path=given["data.eval_path"], mix=[])
    return Config.from_dict(raw)


def _eval_path_alone(given: dict[str, Any]) -> bool:
    """data.eval_path given without data.path: that file alone is evaluated, standing in for the
    training text too (evaluation_config)."""
    return "data.eval_path" in given and "data.path" not in given


def check_data(cfg: Config, overrides: list[str]) -> None:
    """Lists the evaluation data's files (a missing path, a hub dataset's file list) before any
    export work. Where data.eval_path stands in for data.path, an error about data.path is about
    the data.eval_path the user set, and says so."""
    from raytrain_cpu.data.sources import DataError, check_sources

    try:
        check_sources(cfg.data)
    except (ConfigError, DataError) as e:
        if not _eval_path_alone(dict(parse_override(item) for item in overrides)):
            raise
        raise type(e)(re.sub(r"\bdata\.path\b", "data.eval_path", str(e))) from None


def prepared_sources(cfg: Config, log) -> tuple[list[tuple[str, Path, dict]], int | None]:
    """Each source's packed cache (data.mixture_sources; check_data has listed their files),
    prepared on a local Ray when missing, and the EOS id that bounds documents under
    data.attention_span=document (else None)."""
    from raytrain_cpu.data.prepare import documents_eos, prepare_evaluation
    from raytrain_cpu.data.stream import mixture_sources, read_meta

    cache = prepare_evaluation(cfg, log=log)
    return mixture_sources(cache, read_meta(cache)), documents_eos(cfg)


def _batches(cache: Path, meta: dict[str, Any], n_blocks: int, eos: int | None):
    """The first `n_blocks` eval blocks of a source's cache, MICRO_BATCH at a time, as tensors."""
    import numpy as np
    import torch

    from raytrain_cpu.data.stream import read_blocks

    has_labels = meta.get("data_format", "text") != "text"
    for lo in range(0, n_blocks, MICRO_BATCH):
        ids = np.arange(lo, min(lo + MICRO_BATCH, n_blocks))
        blocks = read_blocks(str(cache / "eval"), ids, has_labels, eos)
        yield {k: torch.from_numpy(v.astype(np.int64)) for k, v in blocks.items()}


def _chosen_only(batches):
    """Preference blocks with the rejected answers' labels dropped: the chosen answers' loss."""
    from raytrain_cpu.trainer.dpo import chosen_labels

    for batch in batches:
        yield batch | {"labels": chosen_labels(batch["labels"], batch["position_ids"])}


def _dpo_scoring(info: dict[str, Any], cfg: Config, log) -> dict[str, Any]:
    """The DPO loss settings (dpo.settings) the run trained with, as its manifest or export
    records them (`info`: _run_info's); the defaults for a checkpoint from before they were
    recorded."""
    from raytrain_cpu.trainer import dpo

    recorded = info.get("dpo")
    scoring = recorded or dpo.settings(cfg.train)
    smoothing = f", label smoothing {scoring['label_smoothing']}" if scoring["label_smoothing"] else ""
    if recorded:
        whose = "the run's"
    elif info:
        whose = "the defaults: this checkpoint predates recording the run's"
    else:
        whose = "the defaults: no DPO run recorded any"
    log(f"[evaluate] DPO's {scoring['loss']} loss, beta {scoring['beta']}{smoothing} ({whose})")
    return scoring


def _reference(model, info: dict[str, Any], log, given: str = ""):
    """DPO's reference for `model` (a dpo.Reference), or None (logged why): none for a
    reference-free loss (SimPO); the `given` model (--reference); a LoRA model's base with the
    adapters off; else the model its DPO run started from (`info`: _run_info's)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raytrain_cpu.config.training import REFERENCE_FREE_LOSSES
    from raytrain_cpu.trainer import dpo

    if (info.get("dpo") or {}).get("loss") in REFERENCE_FREE_LOSSES:
        return dpo.reference_free
    if given:
        start, whose = given, "given by --reference"
    elif isinstance(model, PeftModel):
        return dpo.adapters_off(model, model, False)
    else:
        start, whose = info.get("model_dir") if info.get("dpo") else None, "the model the run started from"
        if not start or not Path(start).is_dir():
            why = f"the model its run started from, {start}, is not on this machine" if start else "no DPO run recorded"
            fix = " (--reference <model dir> names one)" if start else ""
            log(f"[evaluate] no DPO metrics: {why}{fix}, so no reference model; the chosen answers' loss only")
            return None
    log(f"[evaluate] DPO's reference: {start}, {whose}")
    return dpo.frozen_copy(AutoModelForCausalLM.from_pretrained(start, dtype=model.dtype).eval(), False)


def check_reference(given: str) -> None:
    """--reference names a model directory (or a hub id, loaded as transformers loads one)."""
    from raytrain_cpu.model.hub import is_hub_id

    if given and not (Path(given, "config.json").is_file() or is_hub_id(given)):
        what = "has no config.json" if Path(given).is_dir() else "is not a directory"
        raise ValueError(
            f"--reference: {given!r} {what}; give the model DPO's rewards are measured against (the model the "
            "run started from: its directory, an export, or a hub id)"
        )


def evaluate_model(
    path: str | Path,
    overrides: list[str] = (),
    *,
    best: bool = False,
    max_blocks: int = 0,
    dtype: str = "auto",
    reference: str = "",
    log=print,
) -> dict[str, Any]:
    """eval_loss, eval_perplexity, eval_tokens (and each mixture source's) of the model at
    `path` on its run's evaluation data (or the data `overrides` name), over each source's first
    `max_blocks` eval blocks (0: all of them); with eval_blocks and the checkpoint evaluated.
    On preference data DPO's metrics too, against `reference` (a model directory) where given,
    else the run's own reference (_reference)."""
    import functools

    import torch

    from raytrain_cpu.model.export import _torch_dtype, load_exported, model_or_checkpoint
    from raytrain_cpu.model.generate import _export_dir
    from raytrain_cpu.trainer.evaluation import eval_metrics, eval_sums, pair_eval_metrics, pair_eval_sums

    path = best_of(path) if best else model_or_checkpoint(path)
    info = _run_info(path)
    # Bad settings and missing data fail before the export (minutes for a large model).
    check_data(evaluation_config(path, path, list(overrides), info), list(overrides))
    check_reference(reference)
    with ExitStack() as stack:
        # A LoRA checkpoint as its adapter on the base: it computes as training did, and DPO's
        # reference is that base with the adapters off.
        model_dir = _export_dir(path, stack, merge=False)
        cfg = evaluation_config(path, model_dir, list(overrides), info)
        sources, eos = prepared_sources(cfg, log)
        model = load_exported(model_dir, None if dtype == "auto" else _torch_dtype(dtype))
        # use_cache=False: transformers builds the mask of packed documents from position_ids only without a cache.
        forward = functools.partial(model, use_cache=False)
        sums, blocks, pairs = [], 0, None
        with torch.no_grad():
            for name, cache, meta in sources:
                n = meta["eval_blocks"] if not max_blocks else min(max_blocks, meta["eval_blocks"])
                log(f"[evaluate] {name + ': ' if name else ''}{n} eval blocks of {meta['seq_len']} tokens from {cache}")
                batches = _batches(cache, meta, n, eos)
                blocks += n
                if meta.get("data_format") != "preference":
                    sums += eval_sums(forward, batches)
                elif ref := _reference(model, info, log, reference):  # preference data is never a mixture
                    scoring = _dpo_scoring(info, cfg, log)
                    pairs = pair_eval_metrics(pair_eval_sums(model, ref, batches, False, scoring))
                else:
                    sums += eval_sums(forward, _chosen_only(batches))
    out = pairs or eval_metrics([name for name, _, _ in sources], sums)
    if not out["eval_tokens"]:
        raise ValueError("the evaluation data make no eval block with a target; give more text (data.eval_path=…)")
    return {**out, "eval_blocks": blocks, "model": str(path)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m raytrain_cpu.evaluate",
        description="The eval loss and perplexity of a checkpoint, a run's latest (or best) one, an export or a Hugging "
        "Face model directory, on its run's evaluation data or on the data given by data.* overrides (one process).",
    )
    ap.add_argument(
        "model", help="a checkpoint, a run directory (its latest checkpoint), an export or a model directory"
    )
    ap.add_argument(
        "overrides",
        nargs="*",
        help="data.* settings (and model.tokenizer), e.g. data.eval_path=notes.txt (that file alone)",
    )
    ap.add_argument("--best", action="store_true", help=BEST_HELP)
    ap.add_argument("--max-blocks", type=int, default=0, help="evaluate each source's first N eval blocks (0: all)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: the dtype it was saved in")
    ap.add_argument(
        "--reference",
        default="",
        help="preference data: the model DPO's rewards are measured against (a model directory or hub id), in place of "
        "the run's (a LoRA model's base with the adapters off, else the model its run started from): for a run "
        "whose starting model is elsewhere now, or to score any model against another",
    )
    args = ap.parse_intermixed_args(argv)  # overrides may follow the options
    if args.max_blocks < 0:
        print("error: --max-blocks must be >= 0 (0: all)", file=sys.stderr)
        return 2
    if not Path(args.model).is_dir():
        print(
            f"error: {args.model!r} is not a directory; give a checkpoint, a run directory or a model", file=sys.stderr
        )
        return 2
    from raytrain_cpu.data.sources import DataError
    from raytrain_cpu.model.export import progress_to_stderr
    from raytrain_cpu.obs.console import quiet_local_console

    quiet_local_console()  # packing new data runs on a local Ray: its progress lines are not ours

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731  stdout holds the JSON
    try:
        with progress_to_stderr():
            result = evaluate_model(
                args.model,
                args.overrides,
                best=args.best,
                max_blocks=args.max_blocks,
                dtype=args.dtype,
                reference=args.reference,
                log=log,
            )
    except (CheckpointError, ConfigError, DataError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dpo_part = (
        f" | dpo loss {result['eval_dpo_loss']:.4f}, reward accuracy {100 * result['eval_reward_accuracy']:.1f}% "
        f"over {result['eval_pairs']:.0f} pairs"
        if "eval_dpo_loss" in result
        else ""
    )
    log(
        f"[evaluate] eval loss {result['eval_loss']:.4f} ppl {result['eval_perplexity']:.2f} over "
        f"{result['eval_tokens']:,} targets{dpo_part}"
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
