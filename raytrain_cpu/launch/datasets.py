"""The run's data once packed: what each rank opens its streams from, the steps train.epochs
makes, and what it says when the data evaluates nothing or is read more than once."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.schema import Config


def stream_spec(meta: dict, sources: list[tuple[str, Path, dict]], cfg: Config, worlds: list[int], start: int) -> dict:
    """What every rank needs to open its own streams (data.stream.rank_streams), as a plain dict
    for the loop config: the training stream's plan but for the worker count and rank, which
    each attempt knows (an elastic run's changes), and each source's eval split.
    `sources`: data.mixture_sources of the cache's meta."""
    from raytrain_cpu.data.prepare import documents_eos

    # Chat/instruction blocks carry labels (-100 where no loss); a mixture's text blocks then too.
    labelled = [source_meta.get("data_format", "text") != "text" for _, _, source_meta in sources]
    return {
        "train": {
            "train_dirs": [str(source_cache / "train") for _, source_cache, _ in sources],
            "n_blocks": [source_meta["blocks"] for _, _, source_meta in sources],
            "seed": cfg.train.seed,
            "window": cfg.data.shuffle_window,
            "micro": cfg.train.micro_batch_size,
            "start": start,
            "end": cfg.train.max_steps * cfg.train.derive_global_batch(worlds[-1]),
            "pattern": list(meta.get("pattern", (0,))),
            "source_labels": labelled,
            # data.attention_span=document: the blocks carry each token's place in its document
            "documents_eos": documents_eos(cfg),
        },
        "eval": {
            name: {"cache": str(source_cache), "n_eval": source_meta["eval_blocks"], "has_labels": has_labels}
            for (name, source_cache, source_meta), has_labels in zip(sources, labelled)
        },
        "eval_blocks": cfg.train.eval_batches * cfg.train.micro_batch_size,  # 0: the whole split
    }


def no_evaluation(meta: dict[str, Any], world: int, source: str = "") -> str:
    """Why a run with these packed blocks (a cache's meta.json) evaluates nothing (of mixture
    source `source`), and the fix."""
    held_out = meta["eval_source"]
    fix = (
        f"{held_out.capitalize()} of {meta['documents']}; raise data.eval_fraction or set "
        f"{'an eval_path in its data.mix entry' if source else 'data.eval_path'}"
        if isinstance(held_out, str)  # held out from the training text
        else "Give more evaluation text or lower data.seq_len"
    )
    return (
        f"no evaluation{f' of {source}' if source else ''}: the eval data makes {meta['eval_blocks']} blocks of "
        f"{meta['seq_len']} tokens, fewer than one per worker ({world}). {fix}."
    )


def check_watched_metric(cfg: Config, sources: list[tuple[str, Any, dict[str, Any]]], world: int) -> None:
    """run.best_metric and train.early_stop_patience read an eval metric: the data must give every
    worker eval blocks of its source (of some source, for eval_loss), or it is never measured."""
    if not (cfg.run.best_metric or cfg.train.early_stop_patience):
        return
    metric = cfg.watched_metric
    whole = ("eval_loss", "eval_dpo_loss")  # over every source (a preference run has one)
    watched = [(name, m) for name, _, m in sources if metric in whole or metric == f"eval_loss/{name}"]
    if all(m["eval_blocks"] < world for _, m in watched):
        name, m = watched[0]
        key = "run.best_metric" if cfg.run.best_metric else "train.early_stop_patience"
        raise ConfigError(f"{key} watches {metric}, which this run never measures: {no_evaluation(m, world, name)}")


def steps_of_epochs(cfg: Config, meta: dict[str, Any], global_batch: int) -> Config:
    """The config with train.max_steps derived from train.epochs, now that the blocks are counted
    (unchanged without train.epochs). Workers, config.yaml and the checkpoints see the steps."""
    t = cfg.train
    if not t.epochs:
        return cfg
    steps = t.epoch_steps(meta["blocks"], global_batch)
    print(
        f"[raytrain] train.epochs={t.epochs:g}: {meta['blocks']:,} training blocks, {global_batch} a step: "
        f"{steps} steps",
        flush=True,
    )
    if t.profile_step > steps:
        raise ConfigError(
            f"train.profile_step: {t.profile_step} is past the {steps} steps of train.epochs={t.epochs:g}; "
            f"pick a step in 1..{steps}, or 0 for none."
        )
    return dataclasses.replace(cfg, train=dataclasses.replace(t, max_steps=steps))


def note_epochs(meta: dict[str, Any], needed: int) -> None:
    """Says when the run reads its data (a mixture: a source) more than once."""
    if "sources" not in meta:
        if needed > meta["blocks"]:
            print(
                f"[raytrain] {needed} blocks needed, {meta['blocks']} in the data: {needed / meta['blocks']:.1f} epochs",
                flush=True,
            )
        return
    epochs = [f"{s['name']} {needed * s['share'] / s['blocks']:.2f}" for s in meta["sources"] if s["share"]]
    print(f"[raytrain] {needed} blocks needed; epochs of each source: {', '.join(epochs)}", flush=True)
