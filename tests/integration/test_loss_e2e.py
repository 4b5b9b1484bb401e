"""The fused output layer + cross-entropy (raytrain_cpu.model.ops.loss) against Hugging Face's loss: the same
loss and gradients on a tiny Llama, in one process and under ZeRO-3 on 2 ranks.
This module's in-process tests: tests/unit/test_loss.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# ----------------------------------------------------------------------------- under ZeRO-3


def _train_both_ways(rank: int, port: int, root: str, overrides: list[str]) -> None:
    """One of 2 spawned ranks: 3 optimizer steps of 2 micro batches with Hugging Face's loss, then
    the same from the same weights with the fused one."""
    from helpers import fp32_partition_bits, zero3_steps

    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.trainer.engine import build_engine, deepspeed_config, init_local_group
    from raytrain_cpu.trainer.loading import load_model
    from raytrain_cpu.trainer.state import Worker

    torch.set_num_threads(1)
    init_local_group(rank, 2, port)
    result = {}
    for fused_loss in (False, True):
        cfg = load_config(None, [*overrides, f"model.fused_loss={str(fused_loss).lower()}"])
        messages: list[str] = []
        w = Worker(cfg, {"model_dir": f"{root}/model"}, rank, 2, Path(root), 16, messages.append)
        ds_config = deepspeed_config(cfg, 2)
        loaded = load_model(w, ds_config)
        engine, _ = build_engine(w, loaded.model, ds_config)
        gen = torch.Generator().manual_seed(rank)
        batches = [torch.randint(0, 2048, (4, 64), generator=gen) for _ in range(3 * cfg.train.grad_accum_steps)]
        result[str(fused_loss)] = {
            "losses": zero3_steps(engine, batches),
            "bits": fp32_partition_bits(engine),
            "log": [m for m in messages if m.startswith("[model] loss")],
        }
        del engine, loaded
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_zero3_trains_the_same_with_the_fused_loss(tmp_path, shared_cache):
    """DeepSpeed gathers the output layer inside the fused loss's call and reduces the gradient
    it returns: losses and updated weights bit for bit as with Hugging Face's loss."""
    from helpers import fast_overrides, spawn_two_ranks_on_tiny_model

    overrides = fast_overrides(tmp_path / "runs", shared_cache, "train.grad_accum_steps=2")
    spawn_two_ranks_on_tiny_model(_train_both_ways, tmp_path, overrides)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["True"]["losses"] == r["False"]["losses"]
        assert r["True"]["bits"] == r["False"]["bits"]
        assert r["False"]["log"] == ["[model] loss: Hugging Face's (model.fused_loss=false)"]
        assert r["True"]["log"][0].startswith("[model] loss: fused with the output layer")
