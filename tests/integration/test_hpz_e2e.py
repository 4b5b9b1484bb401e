"""ZeRO++ hpZ (deepspeed.hpz_partition_size=2) on 4 ranks, as ranks {0,1} and {2,3} would be two
nodes: the same losses as flat ZeRO-3 from the sharded load on, and a resume from the project's
checkpoint goes on with the same losses. Plain processes on a real gloo group (no Ray: the engine
only needs the group, as it reuses Ray Train's), real DeepSpeed."""

from __future__ import annotations

import json
import os
from pathlib import Path

WORLD = 4
STEPS, ACCUM, SAVE_AT = 10, 2, 5  # the second micro batch of a step gathers from the hpZ partition only


def _train(rank: int, port: int, root: str, overrides: list[str]) -> None:
    """One of 4 spawned ranks: flat ZeRO-3 for STEPS steps, hpZ for STEPS steps with a checkpoint
    at SAVE_AT, then hpZ again from that checkpoint; each run's micro-batch losses to a file.
    All three in one process (a worker loads a model twice for DPO's reference, too)."""
    import torch

    from raytrain_cpu.checkpoint.identity import config_hash
    from raytrain_cpu.checkpoint.load import load_into
    from raytrain_cpu.checkpoint.save import write_checkpoint
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.trainer.engine import build_engine, deepspeed_config, init_local_group
    from raytrain_cpu.trainer.loading import load_model
    from raytrain_cpu.trainer.state import Worker

    torch.set_num_threads(1)
    init_local_group(rank, WORLD, port)
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two "nodes" of 2 ranks: what hpz_partition_size=0 takes
    # Four batches in turn, so the losses fall and a stale hpZ partition (old weights) would show.
    batches = [
        torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(100 * b + rank)) for b in range(4)
    ]
    ckpt_root = Path(root) / "checkpoints"
    result = {}
    for run, hpz in (("flat", 1), ("hpz", 0), ("resumed", 2)):  # 0: the ranks of a node, 2 here
        cfg = load_config(None, [*overrides, f"deepspeed.hpz_partition_size={hpz}"])
        w = Worker(
            cfg,
            {"model_dir": f"{root}/model"},
            rank,
            WORLD,
            Path(root),
            cfg.train.derive_global_batch(WORLD),
            lambda m: None,
        )
        ds_config = deepspeed_config(cfg, WORLD)
        loaded = load_model(w, ds_config)
        engine, _ = build_engine(w, loaded.model, ds_config)
        start = 0
        if run == "resumed":
            start = load_into(engine, ckpt_root / f"checkpoint_{SAVE_AT:06d}", rank, WORLD, cfg.to_dict())["step"]
        losses, secondaries = {}, 0
        for step in range(start, STEPS):
            if run == "hpz" and step == SAVE_AT:
                manifest = {
                    "step": step,
                    "world_size": WORLD,
                    "global_batch": w.global_batch,
                    "config_hash": config_hash(cfg.to_dict()),
                    **{k: getattr(cfg.deepspeed, k) for k in ("zero_stage", "sub_group_size")},
                }
                write_checkpoint(engine, ckpt_root, step, manifest, rank, WORLD)
            for micro in range(ACCUM):
                loss = engine(
                    input_ids=batches[(step * ACCUM + micro) % 4], labels=batches[(step * ACCUM + micro) % 4]
                ).loss
                engine.backward(loss)
                secondaries = max(
                    secondaries, sum(p.ds_secondary_tensor is not None for p in engine.module.parameters())
                )
                engine.step()
                losses[step * ACCUM + micro] = loss.item()
        result[run] = {"losses": losses, "secondaries": secondaries, "hpz": engine.zero_hpz_partition_size()}
        del engine, loaded
    Path(root, f"rank{rank}.json").write_text(json.dumps(result))


def test_hpz_trains_as_flat_zero3_and_resumes(tmp_path, shared_cache):
    from helpers import BF16_LOSS_TOL, fast_overrides, spawn_ranks

    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.model.loading import write_tiny_model
    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path
    from raytrain_cpu.trainer.engine import free_port

    overrides = fast_overrides(
        tmp_path / "runs", shared_cache, "train.micro_batch_size=2", f"train.grad_accum_steps={ACCUM}", "train.lr=3e-3"
    )
    write_tiny_model(
        load_config(None, overrides), load_tokenizer(resolve_tokenizer_path("bundled", "tiny")), tmp_path / "model"
    )
    spawn_ranks(_train, WORLD, free_port(), str(tmp_path), overrides)
    for rank in range(WORLD):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        flat, hpz, resumed = (r[k] for k in ("flat", "hpz", "resumed"))
        assert (flat["hpz"], hpz["hpz"], resumed["hpz"]) == (1, 2, 2)  # 0 took the 2 ranks of a "node"
        assert flat["secondaries"] == 0 < hpz["secondaries"], "no parameter kept an hpZ partition"
        assert flat["losses"]["0"] > flat["losses"][str(STEPS * ACCUM - 1)] + 1, "the weights barely moved"
        assert flat["losses"].keys() == hpz["losses"].keys()
        assert max(abs(hpz["losses"][k] - flat["losses"][k]) for k in flat["losses"]) < BF16_LOSS_TOL
        assert min(map(int, resumed["losses"])) == SAVE_AT * ACCUM
        assert resumed["losses"] == {k: v for k, v in hpz["losses"].items() if int(k) >= SAVE_AT * ACCUM}
