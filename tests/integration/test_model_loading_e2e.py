"""Sharded loading, the reading half: each rank reads exactly its ZeRO-3 range of every tensor.

The end-to-end half (a real ZeRO-3 model built by transformers, checked against the file) is
tests/test_train_e2e.py::test_sharded_loading_is_exact_and_partitioned. Here: a multi-file
checkpoint's index, and partitions of awkward sizes (not divisible by the world size, smaller
than it, 1-D to 3-D, fp32 and bf16 on disk) read by two real gloo ranks.
This module's in-process tests: tests/unit/test_model_loading.py."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from helpers import FakeZero3Model, loading_tensors
from safetensors.torch import save_file

from raytrain_cpu.model.loading import _checkpoint_files, _read_own_partitions
from raytrain_cpu.trainer.engine import free_port

WORLD = 2


TENSORS = loading_tensors()


def _rank(rank: int, port: int, files: dict[str, str], out: str) -> None:
    import torch.distributed as dist

    from raytrain_cpu.trainer.engine import init_local_group

    init_local_group(rank, WORLD, port)
    try:
        model = FakeZero3Model({k: v.shape for k, v in TENSORS.items()}, torch.float32, WORLD)
        _read_own_partitions(model, files)
        torch.save({k: p.ds_tensor for k, p in model.params.items()}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_each_rank_reads_exactly_its_partition(tmp_path):
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    files = _checkpoint_files(str(tmp_path))
    assert set(files) == set(TENSORS)
    # Spawned, never forked: the suite's pytest process holds a Ray driver, and a forked copy of
    # it (a multiprocessing Manager, say) shares its Ray connections.
    mp.spawn(_rank, args=(free_port(), files, str(tmp_path)), nprocs=WORLD)
    out = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)}
    for name, full in TENSORS.items():
        flat = full.float().reshape(-1)
        size = -(-flat.numel() // WORLD)
        joined = torch.cat([out[r][name] for r in range(WORLD)])
        assert torch.equal(joined[: flat.numel()], flat), name
        assert torch.all(joined[flat.numel() :] == 0), f"{name}: the padding past the tensor is zeroed"
        assert all(out[r][name].numel() == size for r in range(WORLD))
