"""Shared-memory collectives (raytrain_cpu.trainer.collectives): the same results as gloo, chunked and
whole, with DeepSpeed's own entry points; a missing rank ends in a clear error, not a hang.
This module's in-process tests: tests/unit/test_collectives.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _collectives_rank(rank: int, port: int, root: str) -> None:
    """One of 2 spawned ranks: every routed collective against gloo's answer, then a timeout."""
    import os

    import deepspeed.comm as ds_dist
    import torch
    import torch.distributed as dist

    from raytrain_cpu.trainer import collectives
    from raytrain_cpu.trainer.engine import init_deepspeed, init_local_group

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    init_local_group(rank, 2, port)
    init_deepspeed()
    backend = ds_dist.comm.cdb
    gloo = {n: getattr(backend, n) for n in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")}
    # 1 MiB slots: the larger tensors below go through in several chunks.
    shm = collectives.install(timeout_s=1, log=lambda msg: None, slot_bytes=1 << 20)
    assert shm is not None and shm.slot_bytes == 1 << 20
    assert collectives.install(timeout_s=1) is shm  # a second load in one process reuses it

    mismatches = []
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        for n in (1, 777, 300_001):  # bf16 300k: 2 chunks of the gather, 3 of the reduce-scatter
            g = torch.Generator().manual_seed(100 * rank + n)
            part = (torch.randn(n, generator=g) * 100).to(dtype)
            full = (torch.randn(2 * n, generator=g) * 100).to(dtype)
            want, got = torch.empty(2 * n, dtype=dtype), torch.empty(2 * n, dtype=dtype)
            gloo["all_gather_into_tensor"](want, part)
            ds_dist.allgather_fn(got, part, async_op=True).wait()  # ZeRO-3's parameter gathers
            mismatches += [] if torch.equal(want, got) else [f"all_gather {dtype} {n}"]
            want, got = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            gloo["reduce_scatter_tensor"](want, full)
            ds_dist.reduce_scatter_fn(got, full)  # ZeRO's gradient reduction
            mismatches += [] if torch.equal(want, got) else [f"reduce_scatter {dtype} {n}"]
            for op in (ds_dist.ReduceOp.SUM, ds_dist.ReduceOp.MAX, dist.ReduceOp.MIN):
                want, got = full.clone(), full.clone()
                gloo["all_reduce"](want, op=op)
                ds_dist.all_reduce(got, op=op)
                mismatches += [] if torch.equal(want, got) else [f"all_reduce {op} {dtype} {n}"]
    # AVG (which gloo lacks) is the float sum over the ranks; a strided view falls back to gloo.
    x = torch.full((5,), float(rank + 1))
    ds_dist.all_reduce(x, op=ds_dist.ReduceOp.AVG)
    mismatches += [] if torch.equal(x, torch.full((5,), 1.5)) else [f"AVG gave {x}"]
    y = torch.arange(8.0).view(2, 4).t()
    ds_dist.all_reduce(y)
    mismatches += [] if torch.equal(y, 2 * torch.arange(8.0).view(2, 4).t()) else ["strided all_reduce"]

    error = ""
    if rank == 0:  # rank 1 never joins this one
        try:
            ds_dist.all_reduce(torch.ones(3))
        except RuntimeError as e:
            error = str(e)
    (Path(root) / f"rank{rank}.json").write_text(json.dumps({"mismatches": mismatches, "error": error}))
    # Leave together, the group torn down: a rank exiting with gloo's threads still running
    # (rank 1 while rank 0 waited above) aborted now and then ("terminate called ...").
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_shared_memory_collectives_match_gloo(tmp_path):
    from helpers import spawn_ranks

    from raytrain_cpu.trainer.engine import free_port

    spawn_ranks(_collectives_rank, 2, free_port(), str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["mismatches"] == [] and r1["mismatches"] == []
    assert "rank 0 waited 1 s in a shared-memory collective for rank(s) [1]" in r0["error"], r0["error"]
    assert "deepspeed.shm_collectives=false" in r0["error"]
