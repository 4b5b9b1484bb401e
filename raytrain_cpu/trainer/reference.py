"""DPO's reference: the engine with LoRA's adapters off, a frozen copy of the starting model, or
its log-likelihoods precomputed once by the engine before training (train.dpo_precompute_reference)."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from raytrain_cpu.trainer.batches import model_inputs
from raytrain_cpu.trainer.loading import Loaded, install_fused_layer_ops
from raytrain_cpu.trainer.state import Worker


def build_reference(w: Worker, loaded: Loaded, engine, ds_config: dict[str, Any]):
    """DPO's reference (a dpo.Reference; None for other data): under LoRA the engine with the
    adapters off; for full fine-tuning the frozen copy load_model made, computing as the trained
    model did at the start (its attention, fused loss and layer ops; uncompiled), run by an
    engine of its own under ZeRO-3 (no optimizer: DeepSpeed only gathers its partitions);
    SimPO's none (dpo.reference_free)."""
    import deepspeed
    from deepspeed.utils import set_z3_leaf_module

    from raytrain_cpu.model.loading import decoder_layers, unwrapped
    from raytrain_cpu.model.ops import loss
    from raytrain_cpu.trainer import dpo

    if not w.preference:
        return None
    if not w.reference_model:
        w.log(f"[engine] no reference model: train.dpo_loss={w.cfg.train.dpo_loss} compares none")
        return dpo.reference_free
    if w.cfg.train.dpo_precompute_reference:
        return precompute_reference(w, engine)
    if loaded.reference is None:
        return dpo.adapters_off(engine, engine.module, w.fused_loss)
    model = loaded.reference[0].requires_grad_(False)
    model.set_attn_implementation(unwrapped(loaded.model).config._attn_implementation)
    fused = w.fused_loss and loss.install(model) is None
    install_fused_layer_ops(w, model, log=lambda _: None)
    zero3 = w.cfg.deepspeed.zero_stage == 3
    if zero3:
        if w.cfg.deepspeed.gather_whole_layers:  # as the trained model gathers
            for layer in decoder_layers(model):
                set_z3_leaf_module(layer, True)
        inference = {k: v for k, v in ds_config.items() if k != "optimizer"}
        model, *_ = deepspeed.initialize(model=model, config=inference, dist_init_required=False)
    model.eval()
    w.log(f"[engine] DPO's reference: the frozen starting model, {'its own ZeRO-3 engine' if zero3 else 'whole'}")
    return dpo.frozen_copy(model, fused)


def reference_batches(w: Worker) -> list[tuple[int, str, np.ndarray]]:
    """(rank, cache split directory, block ids) of every micro batch that first
    trains on each block (the stream's positions, data.StreamPlan: rank r's j-th micro batch
    holds positions (j W + r) m ... + m, up to the end of the first pass over the blocks or of
    the run), then of every evaluation's (data.eval_stream: rank r evaluates r, r + W, ..., each
    rank ceil(n/W) rows, the last one padding where W does not divide n), in that order, each as
    the run composes it."""
    from raytrain_cpu.data.stream import eval_blocks_per_rank, global_order, read_meta

    cfg, t, world, m = w.cfg, w.cfg.train, w.world, w.cfg.train.micro_batch_size
    cache = Path(w.loop_config["data_cache"])
    meta = read_meta(cache)
    n, rounds = meta["blocks"], world * m
    # The first pass's last round of micro batches may reach into the second (pairs with its first blocks).
    end = min(t.max_steps * w.global_batch, -(-n // rounds) * rounds)
    ids = np.concatenate([global_order(n, t.seed, e, cfg.data.shuffle_window) for e in range(-(-end // n))])[:end]
    train = str(cache / "train")
    batches = [(j % world, train, ids[j * m : (j + 1) * m]) for j in range(end // m)]
    if meta["eval_blocks"] >= world:  # a source with fewer eval blocks than workers is not evaluated
        per_rank = eval_blocks_per_rank(meta["eval_blocks"], world, t.eval_batches * m)
        evals = str(cache / "eval")
        for lo in range(0, per_rank, m):
            batches += [(r, evals, np.arange(lo, min(lo + m, per_rank)) * world + r) for r in range(world)]
    return batches


KEPT_ROWS_PER_PART = 512  # a part on the run's storage every 512 blocks: an interrupted pass keeps them


def precompute_reference(w: Worker, engine):
    """train.dpo_precompute_reference: the reference's log p(label) of every block the run trains
    and evaluates on, computed by the engine itself before Trainer.resume loads a checkpoint into it:
    it still is the starting model (under LoRA its adapters are still zero), so no copy is ever
    loaded. Each block's row comes from the micro batch that first holds it, composed as the run
    composes it (reference_batches; a GEMM's last bits can depend on its batch-mates), so it is
    the forward the reference would have run there. Kept in <run dir>/reference_logps/<model
    key>/ (dpo.KeptLogps, dpo.reference_key: rows of another starting model under the same
    run.name are never read); a block an earlier attempt kept (an interrupted pass's parts too)
    is not computed again."""
    import torch.distributed as dist

    from raytrain_cpu.trainer import dpo

    t0 = time.perf_counter()
    key = dpo.reference_key(w.cfg.model.name_or_path, w.loop_config["model_dir"])
    directory = dpo.reference_directory(w.run_dir, key)
    read = _block_reader(w)
    kept = dpo.KeptLogps(directory)
    batches = reference_batches(w)
    owner: dict[bytes, tuple[int, int]] = {}  # each block's first (micro batch, row)
    rows: dict[int, list[tuple[int, bytes]]] = {}  # the micro batches to run, each with the (row, block) they keep
    for b, (_, split, ids) in enumerate(batches):
        for row, digest in enumerate(dpo.block_digests(read(split, ids))):
            if owner.setdefault(digest, (b, row)) == (b, row) and digest not in kept:
                rows.setdefault(b, []).append((row, digest))
    computed = sum(len(r) for r in rows.values())
    dist.barrier()  # every rank has read what is kept (so plans the same batches) before any adds to it
    if rows:
        _compute_reference_rows(w, engine, batches, rows, read, directory)
        kept = dpo.KeptLogps(directory)
    w.reference_pass = {"blocks": len(owner), "computed": computed, "seconds": time.perf_counter() - t0}
    w.log(
        f"[reference] DPO's reference log-likelihoods of {len(owner):,} blocks: {computed:,} computed by the "
        f"starting model in {w.reference_pass['seconds']:.1f}s, {len(owner) - computed:,} kept from before "
        f"({directory}); training runs no reference forward"
    )
    return dpo.precomputed(kept)


def _block_reader(w: Worker) -> Callable[[str, np.ndarray], dict[str, Any]]:
    """(cache split, block ids) -> their rows as one batch of int64 tensors, as the streams give
    (the eval split's ids past its end: eval_stream's padding rows)."""
    import torch

    from raytrain_cpu.data.prepare import documents_eos
    from raytrain_cpu.data.stream import read_blocks, read_eval_blocks, read_meta

    eos = documents_eos(w.cfg)
    n_eval = read_meta(Path(w.loop_config["data_cache"]))["eval_blocks"]

    def read(split: str, ids: np.ndarray) -> dict[str, Any]:
        if Path(split).name == "eval":
            rows = read_eval_blocks(split, ids, n_eval, True, eos)
        else:
            rows = read_blocks(split, ids, True, eos)
        return {k: torch.from_numpy(v.astype(np.int64)) for k, v in rows.items() if k != "block_id"}

    return read


def _compute_reference_rows(
    w: Worker, engine, batches, rows: dict[int, list[tuple[int, bytes]]], read, directory: Path
) -> None:
    """This rank's micro batches among `rows` through the engine in eval mode, their kept rows
    written a part at a time. Every rank runs as many forwards (ZeRO-3 gathers the weights for
    each): the busiest rank's count, the others repeating a batch whose rows they drop. Every
    rank knows every batch's rank, so the counts need no collective; the barrier at the end
    puts every part in place before any rank reads them."""
    import torch
    import torch.distributed as dist

    from raytrain_cpu.trainer import dpo

    mine = [b for b in sorted(rows) if batches[b][0] == w.rank]
    forwards = max(Counter(batches[b][0] for b in rows).values())
    digests, logps, last_note = [], [], time.perf_counter()

    def keep() -> None:
        if digests:
            dpo.keep_logps(directory, f"{uuid.uuid4().hex[:12]}-rank{w.rank}", digests, np.concatenate(logps))
        digests.clear()
        logps.clear()

    engine.eval()
    with torch.no_grad():
        for k in range(forwards):
            b = mine[k] if k < len(mine) else next(iter(rows))  # past its own: a forward for the gathers only
            out = dpo.forward_logps(engine, model_inputs(read(*batches[b][1:])), w.fused_loss).float().numpy()
            if k < len(mine):  # the digests the plan made of this batch's blocks: not hashed again
                digests.extend(d for _, d in rows[b])
                logps.append(out[[row for row, _ in rows[b]]])
            if len(digests) >= KEPT_ROWS_PER_PART:
                keep()
            if time.perf_counter() - last_note > 30:
                w.log(f"[reference] {k + 1:,} of {forwards:,} micro batches a rank")
                last_note = time.perf_counter()
    keep()
    engine.train()
    dist.barrier()
