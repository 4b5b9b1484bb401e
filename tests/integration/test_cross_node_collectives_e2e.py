"""Striped cross-node collectives (raytrain_cpu.trainer.collectives.StripedCollectives,
deepspeed.cross_node_collectives="striped") on real gloo, 4 local processes: the same bits as
torch's all_gather_into_tensor, reduce_scatter_tensor's within its last bit, and the hook on DeepSpeed's backend
routes only calls among all ranks to them."""

from __future__ import annotations

import socket
from typing import Any

WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Backend:
    """Stands in for DeepSpeed's comm backend: torch's calls, each one counted."""

    def __init__(self) -> None:
        self.gloo_calls = 0

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        import torch.distributed as dist

        self.gloo_calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    def reduce_scatter_tensor(self, output_tensor, input_tensor, op=None, group=None, async_op=False):
        import torch.distributed as dist

        self.gloo_calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _check_direct(striped: Any) -> None:
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(dist.get_rank())
    # 3 MiB of bf16 takes all 3 stripes, odd sizes uneven chunks, tiny ones a single stripe.
    for dtype in (torch.bfloat16, torch.float32):
        for n in (5, 1001, (3 << 20) // 2 // WORLD + 7):
            shard = torch.randn(n, generator=gen).to(dtype)
            ref = torch.empty(n * WORLD, dtype=dtype)
            dist.all_gather_into_tensor(ref, shard)
            out = torch.full_like(ref, float("nan"))
            striped.all_gather(out, shard).wait()
            assert torch.equal(out, ref), ("all_gather", dtype, n)
            full = torch.randn(n * WORLD, generator=gen).to(dtype)
            ref = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(ref, full)
            # gloo's ring splits each chunk into its own segments, so a sum may group its four
            # terms otherwise than on the whole tensor: a rounding or two apart, no more.
            eps = torch.finfo(dtype).eps
            for op in ("SUM", "AVG"):
                out = torch.full_like(ref, float("nan"))
                striped.reduce_scatter(out, full, op).wait()
                want = (ref / WORLD if op == "AVG" else ref).float()
                err = (out.float() - want).abs().max().item() / want.abs().max().item()
                assert err <= 4 * eps, ("reduce_scatter", op, dtype, n, err)


def _check_hook() -> None:
    """install_cross_node on a stand-in backend: world-group calls (sync and async) give gloo's
    bits without reaching gloo's entry point; a pair's group goes to gloo."""
    import torch
    import torch.distributed as dist

    from raytrain_cpu.compat import deepspeed as compat_ds
    from raytrain_cpu.trainer import collectives

    backend = _Backend()
    compat_ds.comm_backend = lambda: backend  # install_cross_node looks it up when called
    assert collectives.install_cross_node("gloo") is None and backend.gloo_calls == 0
    assert collectives.install_cross_node("striped", log=lambda _: None, stripes=2) is not None
    rank = dist.get_rank()
    shard = torch.arange(3 << 18, dtype=torch.bfloat16) + rank
    ref = torch.empty(shard.numel() * WORLD, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(ref, shard)
    out = torch.empty_like(ref)
    backend.all_gather_into_tensor(out, shard)
    assert torch.equal(out, ref)
    out.zero_()
    backend.all_gather_into_tensor(out, shard, async_op=True).wait()
    assert torch.equal(out, ref)
    got = torch.empty_like(shard)
    backend.reduce_scatter_tensor(got, ref, op=dist.ReduceOp.SUM)
    want = torch.empty_like(shard)
    dist.reduce_scatter_tensor(want, ref)
    assert torch.allclose(got.float(), want.float(), rtol=2**-6, atol=0) and backend.gloo_calls == 0
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    two = torch.empty(shard.numel() * 2, dtype=torch.bfloat16)
    backend.all_gather_into_tensor(two, shard, group=pair)
    assert backend.gloo_calls == 1


def _rank(rank: int, port: int, errors: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        from raytrain_cpu.trainer import collectives

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        _check_direct(collectives.StripedCollectives(stripes=3))
        _check_hook()
        dist.destroy_process_group()
    except BaseException as e:
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def test_striped_matches_gloo():
    """All-gather in chunks on 3 gloo groups gives gloo's bits; reduce-scatter's sums (each chunk
    on gloo's own ring) are gloo's up to the last bit; through the backend hook too."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, errors)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not alive and not msgs and all(p.exitcode == 0 for p in procs), msgs or [p.exitcode for p in procs]
