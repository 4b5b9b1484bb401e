"""ZeRO-3's step with the reused fp32 gradient buffer (train.reuse_fp32_grad_buffer) and the
kept reduce-scatter buffer (train.reuse_reduce_scatter_buffer): the same losses and weights,
bit for bit, as DeepSpeed's own step, over several sub groups and gradient buckets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _train_both_ways(rank: int, port: int, root: str, overrides: list[str]) -> None:
    """One of 2 spawned ranks: 3 steps with DeepSpeed's step, then 3 from the same weights with the buffer."""
    import torch
    from helpers import fp32_partition_bits, zero3_steps

    from raytrain_cpu.compat import deepspeed_zero3
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.planner import memory as plan
    from raytrain_cpu.trainer.engine import build_engine, deepspeed_config, init_local_group
    from raytrain_cpu.trainer.loading import load_model
    from raytrain_cpu.trainer.state import Worker

    torch.set_num_threads(1)
    init_local_group(rank, 2, port)
    result = {}
    for reuse in (False, True):
        flags = [
            f"deepspeed.reuse_fp32_grad_buffer={str(reuse).lower()}",
            f"deepspeed.reuse_reduce_buffer={str(reuse).lower()}",
        ]
        cfg = load_config(None, [*overrides, *flags])
        messages: list[str] = []
        w = Worker(cfg, {"model_dir": f"{root}/model"}, rank, 2, Path(root), 8, messages.append)
        ds_config = deepspeed_config(cfg, 2)
        ds_config["zero_optimization"]["reduce_bucket_size"] = (
            50_000  # several gradient buckets through the kept buffer
        )
        loaded = load_model(w, ds_config)
        engine, _ = build_engine(w, loaded.model, ds_config)
        ids = torch.randint(0, 2048, (4, 64), generator=torch.Generator().manual_seed(rank))
        losses = zero3_steps(engine, [ids] * 3)
        flats = engine.optimizer.fp32_partitioned_groups_flat
        result[str(reuse)] = {
            "losses": losses,
            "weights": torch.cat([f.detach().reshape(-1) for f in flats]).double().sum().item(),
            "bits": fp32_partition_bits(engine),
            "sub_groups": len(flats),
            "largest": max(f.numel() for f in flats),
            # what the planner counts: the weight-decay group (the matrices) in model order
            "planned": plan.largest_sub_group(
                [p.ds_numel for p in loaded.model.parameters() if len(p.ds_shape) >= 2], 2, cfg.deepspeed.sub_group_size
            ),
            "log": messages,
            "kept_reduce_buffers": {str(k): v.numel() for k, v in deepspeed_zero3._KEPT_REDUCE_BUFFERS.items()},
            "largest_param": max(p.ds_numel for p in loaded.model.parameters()),
        }
        del engine, loaded
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_reused_fp32_grad_buffer_steps_as_deepspeed_does(tmp_path, shared_cache):
    from helpers import fast_overrides, spawn_two_ranks_on_tiny_model

    # ~0.18M parameters per rank in sub groups of 30k: several sub groups, the buffer reused.
    overrides = fast_overrides(tmp_path / "runs", shared_cache, "deepspeed.sub_group_size=30000")
    spawn_two_ranks_on_tiny_model(_train_both_ways, tmp_path, overrides)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        stock, reused = r["False"], r["True"]
        assert stock["sub_groups"] == reused["sub_groups"] > 2
        assert reused["largest"] == reused["planned"]
        assert reused["losses"] == stock["losses"] and reused["losses"][2] < reused["losses"][0]
        assert reused["bits"] == stock["bits"] and reused["weights"] == stock["weights"]
        # Buckets of at most 50k elements through the kept buffer; the embedding (131k, a
        # bucket alone) reduces in place, as in DeepSpeed.
        assert stock["kept_reduce_buffers"] == {} and reused["largest_param"] > 50_000
        assert 0 < reused["kept_reduce_buffers"]["torch.bfloat16"] <= 50_000
        assert any("fp32 gradient buffer" in m for m in reused["log"]) and not any(
            "fp32 gradient buffer" in m for m in stock["log"]
        )
