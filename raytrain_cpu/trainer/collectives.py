"""Shared-memory collectives for DeepSpeed when every rank runs on one machine.

Why: gloo moves every byte through the loopback TCP stack and its own threads, while ranks on
one machine can simply share memory; ZeRO-3 runs dozens of collectives a step, so their cost
shows in the step time (benchmarks/results/ and docs/performance.md hold the measurements).

How: the ranks map one file in /dev/shm (unlinked once all have it, so nothing outlives
them). It holds rank 0's stamp (proof that the ranks share it), one 64-byte flag per rank
and, per rank, two slots (double buffering) of `slot_bytes`. A collective goes through in
chunks: each rank copies its chunk into its slot, publishes a sequence number in its flag,
waits until every flag has reached that number, then reads the others' slots. With two slot
sets a rank may overwrite a set only after everyone passed the barrier of the chunk after it,
which it has: one barrier per chunk.

The flag protocol relies on x86's ordered stores (TSO): a rank's data stores are visible
before its flag store. On other CPUs, with ranks on several machines or without room in
/dev/shm, DeepSpeed keeps gloo. Calls on a group other than all ranks, or on tensors that
are not contiguous CPU tensors, go to gloo as before.

Across machines (StripedCollectives, deepspeed.cross_node_collectives="striped"): gloo opens one
TCP connection per rank pair, and its ring all-gather and reduce-scatter cross each node boundary
on one of them per direction. Clouds cap one TCP flow well below a node's rate (AWS: 10 of a
c7i.48xlarge's 50 Gbit/s inside a placement group), so that ring reaches a fraction of the link.
Striped, each all-gather and reduce-scatter among all ranks is cut into chunks, one per extra
gloo group (each with its own connections, so its own flows), all issued at once: gloo's ring
on each chunk, so the same bytes on several flows; all-gathers give gloo's bits, reduce-scatters
may group a sum's terms otherwise (gloo segments each chunk itself): a rounding apart at most.
benchmarks/flows.py measured it, and the alternatives, on a link shaped that way.
"""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

FLAG_BYTES = 64  # one cache line per rank's flag, so two ranks' stores never share a line
DEFAULT_SLOT_BYTES = 16 << 20
MIN_SLOT_BYTES = 1 << 20
# Polls (~1 us each) before a waiting rank sleeps between polls. Ranks in step arrive within
# microseconds; a longer wait means a slower peer, and spinning then takes a vCPU that Ray's own
# processes or the peer itself may need (unpinned on 2 vCPUs, 2000 polls before yielding ran
# 1.02-1.03x gloo's speed, this 1.05-1.08x).
SPINS_BEFORE_SLEEP = 100
SLEEP_S = 50e-6
REDUCE_OPS = ("SUM", "AVG", "MAX", "MIN")
CROSS_NODE_MODES = ("gloo", "striped")
# A chunk per gloo group, none smaller than this: below it a stripe's fixed cost (one more ring
# of round trips) outweighs the flow it adds, so small tensors take fewer stripes.
MIN_STRIPE_BYTES = 1 << 20
# Flows per ring link: one flow is capped at a fifth of a c7i.48xlarge's rate, and each stripe
# adds one per direction. Four measured about 4x gloo's speed under a cap of a fifth; on an
# uncapped link they cost little (benchmarks/results/*/flows.md).
DEFAULT_STRIPES = 4


class _Done:
    """The handle of a collective that has already completed (DeepSpeed waits on handles)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class ShmCollectives:
    """All-gather, reduce-scatter and all-reduce among all ranks of one machine, in shared memory."""

    def __init__(self, buf: torch.Tensor, rank: int, world: int, slot_bytes: int, timeout_s: float) -> None:
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world, slot_bytes, timeout_s
        self.seq = 0  # barriers passed: the same count on every rank
        self.thread = threading.get_ident()
        self.buf = buf  # [rank 0's stamp][a flag per rank][2 sets x world slots]
        self.flags = buf[FLAG_BYTES : (world + 1) * FLAG_BYTES].view(torch.int64).numpy()[:: FLAG_BYTES // 8]
        self.data = buf[(world + 1) * FLAG_BYTES :]

    @staticmethod
    def size(world: int, slot_bytes: int) -> int:
        return (world + 1) * FLAG_BYTES + 2 * world * slot_bytes

    # ------------------------------------------------------------------ the barrier
    def _barrier(self) -> None:
        self.seq += 1
        self.flags[self.rank] = self.seq
        flags, seq, polls, t0 = self.flags, self.seq, 0, time.perf_counter()
        while flags.min() < seq:
            polls += 1
            if polls < SPINS_BEFORE_SLEEP:
                continue
            time.sleep(SLEEP_S)
            if polls % 1000 == 0 and time.perf_counter() - t0 > self.timeout_s:
                late = [r for r in range(self.world) if flags[r] < seq]
                raise RuntimeError(
                    f"rank {self.rank} waited {self.timeout_s:.0f} s in a shared-memory collective for "
                    f"rank(s) {late}: they died or hang; set deepspeed.shm_collectives=false to use gloo"
                )

    def _slot(self, rank: int, dtype: torch.dtype, published: bool = False) -> torch.Tensor:
        """Rank's slot in the set the next barrier publishes, or (`published`) in the set the
        last barrier published: sets alternate with the barrier count."""
        s = (((self.seq - published) % 2) * self.world + rank) * self.slot_bytes
        return self.data[s : s + self.slot_bytes].view(dtype)

    # ------------------------------------------------------------------ collectives
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out (world * n) = the ranks' inp (n), in rank order."""
        inp, n = inp.reshape(-1), inp.numel()
        outs = out.view(self.world, n)
        step = self.slot_bytes // inp.element_size()
        for s in range(0, n, step):
            e = min(n, s + step)
            self._slot(self.rank, inp.dtype)[: e - s].copy_(inp[s:e])
            self._barrier()
            for r in range(self.world):
                outs[r, s:e].copy_(self._slot(r, inp.dtype, published=True)[: e - s])

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        """out (n) = op over the ranks of their inp's (world * n) slice number `rank`."""
        n = out.numel()
        ins = inp.reshape(self.world, n)
        step = self.slot_bytes // (inp.element_size() * self.world)
        flat_out = out.view(-1)
        for s in range(0, n, step):
            e = min(n, s + step)
            m = e - s
            mine = self._slot(self.rank, inp.dtype)
            for r in range(self.world):
                mine[r * m : (r + 1) * m].copy_(ins[r, s:e])
            self._barrier()
            parts = [
                self._slot(r, inp.dtype, published=True)[self.rank * m : (self.rank + 1) * m] for r in range(self.world)
            ]
            self._reduce(parts, flat_out[s:e], op)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        flat = tensor.view(-1)
        n = flat.numel()
        step = self.slot_bytes // tensor.element_size()
        for s in range(0, n, step):
            e = min(n, s + step)
            self._slot(self.rank, tensor.dtype)[: e - s].copy_(flat[s:e])
            self._barrier()
            self._reduce(
                [self._slot(r, tensor.dtype, published=True)[: e - s] for r in range(self.world)], flat[s:e], op
            )

    def _reduce(self, parts: list[torch.Tensor], out: torch.Tensor, op: str) -> None:
        if op == "SUM" and len(parts) == 2:
            torch.add(parts[0], parts[1], out=out)  # bf16 adds in fp32 and rounds once
            return
        # Into a copy: the slots are the other ranks' input too. Sums accumulate in fp32 at least.
        widen = op in ("SUM", "AVG") and parts[0].is_floating_point()
        dtype = torch.promote_types(parts[0].dtype, torch.float32) if widen else parts[0].dtype
        acc = parts[0].to(dtype, copy=True)
        combine = {"SUM": torch.add, "AVG": torch.add, "MAX": torch.maximum, "MIN": torch.minimum}[op]
        for p in parts[1:]:
            combine(acc, p, out=acc)
        if op == "AVG":
            acc /= self.world
        out.copy_(acc)


class _Pending:
    """The handle of collectives in flight: waits on each, then runs `then` once (the local sum
    of an exchange). DeepSpeed waits on the handles of its async gathers."""

    def __init__(self, works: list[Any], then: Callable[[], None] | None = None) -> None:
        self.works, self.then = works, then

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait()
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self) -> bool:
        return self.then is None and all(w.is_completed() for w in self.works)


class StripedCollectives:
    """All-gather and reduce-scatter among all ranks as chunks on `stripes` extra gloo groups at
    once (see the module's docstring). The groups are made here: every rank must construct it,
    at the same point. Each call returns a handle to wait on. All-gathers are gloo's bit for bit;
    reduce-scatters run gloo's ring per chunk, whose segments differ from the whole tensor's,
    so a sum may round differently (within a rounding or two of gloo's)."""

    def __init__(self, stripes: int = DEFAULT_STRIPES) -> None:
        self.world = dist.get_world_size()
        self.groups = [dist.new_group(backend="gloo") for _ in range(stripes)]

    def _bounds(self, n: int, nbytes: int) -> list[tuple[Any, int, int]]:
        """(group, start, end) of each chunk of n elements (nbytes in all: the ring's size)."""
        k = max(1, min(len(self.groups), nbytes // MIN_STRIPE_BYTES, n))
        step = -(-n // k)
        return [(self.groups[i], i * step, min(n, (i + 1) * step)) for i in range(k) if i * step < n]

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _Pending:
        """out (world * n) = the ranks' inp (n), in rank order (all_gather_into_tensor)."""
        inp, n = inp.reshape(-1), inp.numel()
        outs = out.view(self.world, n)
        works = [
            dist.all_gather([outs[r, s:e] for r in range(self.world)], inp[s:e], group=g, async_op=True)
            for g, s, e in self._bounds(n, out.numel() * out.element_size())
        ]
        return _Pending(works)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> _Pending:
        """out (n) = op over the ranks of their inp's (world * n) slice number `rank`
        (reduce_scatter_tensor). AVG: gloo's SUM, then divided (gloo has no AVG)."""
        n = out.numel()
        flat_out = out.view(-1)
        ins = inp.reshape(self.world, n)
        red = dist.ReduceOp.SUM if op == "AVG" else getattr(dist.ReduceOp, op)
        works, chunks = [], []
        for g, s, e in self._bounds(n, inp.numel() * inp.element_size()):
            chunk = ins[:, s:e].reshape(-1)  # a copy: gloo wants the ranks' slices in one tensor
            chunks.append(chunk)
            works.append(dist.reduce_scatter_tensor(flat_out[s:e], chunk, op=red, group=g, async_op=True))

        def done() -> None:
            chunks.clear()  # kept until the sends were done
            if op == "AVG":
                flat_out.div_(self.world)

        return _Pending(works, done)


# ---------------------------------------------------------------------- DeepSpeed's backend


def _map_shared(rank: int, size: int) -> torch.Tensor | None:
    """One zeroed file in /dev/shm mapped by every rank; None on every rank if any rank does not
    see rank 0's file (another machine under the same hostname). Rank 0 stamps the file with a
    random number each rank must read back, and unlinks it once all have mapped it, so a crash
    leaves nothing in /dev/shm."""
    made = [(f"/dev/shm/raytrain-coll-{uuid.uuid4().hex}", uuid.uuid4().int & ((1 << 62) - 1))] if rank == 0 else [None]
    dist.broadcast_object_list(made, src=0)
    path, stamp = made[0]
    if rank == 0:
        _create_segment(path, size, stamp)
    dist.barrier()
    buf = None
    if os.path.exists(path):  # never create the file on a machine rank 0 is not on
        with contextlib.suppress(RuntimeError):
            buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    seen = torch.tensor([int(buf is not None and int(buf[:8].view(torch.int64)) == stamp)])
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)  # also: every rank has mapped it
    if rank == 0:
        os.unlink(path)
    return buf if seen.item() else None


def _create_segment(path: str, size: int, stamp: int) -> None:
    """The zeroed segment, `size` bytes, `stamp` in its first 8, readable and writable by this
    user only (0600): the ranks are this user's processes, and the slots carry the model's
    weights and gradients, which no other user of the machine should read or write while the
    file exists. O_EXCL: never a file someone else made at that name; fchmod: whatever the
    umask says."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)
        f.truncate(size)
        f.write(stamp.to_bytes(8, "little"))


def _slot_bytes(world: int) -> int:
    """The largest slot up to DEFAULT_SLOT_BYTES that leaves /dev/shm three quarters free
    (Ray's object store lives there too; docker's default /dev/shm is 64 MiB)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    room = st.f_bavail * st.f_frsize // 4
    slot = DEFAULT_SLOT_BYTES
    while slot > room // (2 * world) and slot >= MIN_SLOT_BYTES:
        slot //= 2
    return slot if slot >= MIN_SLOT_BYTES else 0


def _whole_world() -> Callable[[Any], bool]:
    """group -> whether it is all ranks (None: the world), remembered per group."""
    full = list(range(dist.get_world_size()))
    whole: dict[int, bool] = {}

    def everyone(group) -> bool:
        if group is None:
            return True
        key = id(group)
        if key not in whole:
            whole[key] = dist.get_process_group_ranks(group) == full
        return whole[key]

    return everyone


def _op_name(op) -> str | None:
    name = getattr(op, "name", None)  # DeepSpeed's ReduceOp, torch's RedOpType
    if name is None:  # a torch ReduceOp object
        name = next((n for n in REDUCE_OPS if op == getattr(dist.ReduceOp, n)), None)
    return name if name in REDUCE_OPS else None


def install(
    timeout_s: float, log: Callable[[str], None] = print, slot_bytes: int = 0, cross_node: str = "gloo"
) -> ShmCollectives | StripedCollectives | None:
    """Routes DeepSpeed's all-gathers, reduce-scatters and all-reduces among all ranks through
    shared memory when they share one x86 machine; otherwise, with `cross_node` "striped",
    its all-gathers and reduce-scatters through StripedCollectives (install_cross_node), else
    leaves gloo. Every rank decides alike: the checks are all-reduced, and ranks that do not
    see rank 0's file (other machines) turn it down for everyone."""
    shm = _install_shm(timeout_s, log, slot_bytes)
    if shm is None and cross_node != "gloo":
        return install_cross_node(cross_node, log)
    return shm


def install_cross_node(
    mode: str, log: Callable[[str], None] = print, stripes: int = DEFAULT_STRIPES
) -> StripedCollectives | None:
    """DeepSpeed's all_gather_into_tensor and reduce_scatter_tensor among all ranks through
    StripedCollectives (`mode` "striped"; "gloo" leaves gloo), for ranks on several machines.
    Every rank must call it (it makes process groups). Other groups, tensors that are not
    contiguous CPU tensors and all-reduces stay on gloo."""
    from raytrain_cpu.compat.deepspeed import comm_backend

    if mode not in CROSS_NODE_MODES:
        raise ValueError(f"cross-node collectives must be one of {CROSS_NODE_MODES}, not {mode!r}")
    backend = comm_backend()
    if hasattr(backend, "_raytrain_striped"):  # a second load in the same process (tests)
        return backend._raytrain_striped
    if mode == "gloo" or dist.get_world_size() < 2:
        return None
    striped = StripedCollectives(stripes)
    everyone = _whole_world()

    def usable(group, *tensors: torch.Tensor, op: str = "SUM") -> bool:
        return (
            everyone(group)
            and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and (op != "AVG" or tensors[0].is_floating_point())
        )

    gloo_all_gather = backend.all_gather_into_tensor
    gloo_reduce_scatter = backend.reduce_scatter_tensor

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if not usable(group, output_tensor, input_tensor):
            return gloo_all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        handle = striped.all_gather(output_tensor, input_tensor)
        if not async_op:
            handle.wait()
        return handle

    def reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        name = _op_name(op)
        if name is None or not usable(group, output_tensor, input_tensor, op=name):
            return gloo_reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        handle = striped.reduce_scatter(output_tensor, input_tensor, name)
        if not async_op:
            handle.wait()
        return handle

    backend.all_gather_into_tensor = all_gather_into_tensor
    backend.reduce_scatter_tensor = reduce_scatter_tensor
    backend._raytrain_striped = striped
    log(f"collectives: gloo, all-gathers and reduce-scatters striped over {stripes} groups (cross_node_collectives)")
    return striped


def _install_shm(timeout_s: float, log: Callable[[str], None], slot_bytes: int) -> ShmCollectives | None:
    """The shared-memory collectives when every rank is on this x86 machine (install)."""
    from raytrain_cpu.compat.deepspeed import comm_backend

    backend = comm_backend()
    if hasattr(backend, "_raytrain_shm"):  # a second load in the same process (tests)
        return backend._raytrain_shm
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return None
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    slot = min(slot_bytes, _slot_bytes(world)) if slot_bytes else _slot_bytes(world)
    ok = torch.tensor([int(x86 and slot > 0), slot], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # all ranks agree on whether and how big
    if not ok[0].item():
        log(f"collectives: gloo ({'no room in /dev/shm' if x86 else 'not an x86 CPU'})")
        return None
    slot = int(ok[1].item())
    buf = _map_shared(rank, ShmCollectives.size(world, slot))
    if buf is None:
        log("collectives: gloo (the ranks do not share one machine's /dev/shm)")
        return None
    shm = ShmCollectives(buf, rank, world, slot, timeout_s)
    everyone = _whole_world()

    def usable(group, *tensors: torch.Tensor, op: str = "SUM") -> bool:
        return (
            threading.get_ident() == shm.thread
            and everyone(group)
            and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and (op != "AVG" or tensors[0].is_floating_point())
        )

    gloo_all_gather = backend.all_gather_into_tensor
    gloo_reduce_scatter = backend.reduce_scatter_tensor
    gloo_all_reduce = backend.all_reduce

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if not usable(group, output_tensor, input_tensor):
            return gloo_all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        shm.all_gather(output_tensor, input_tensor)
        return _Done()

    def reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        name = _op_name(op)
        if name is None or not usable(group, output_tensor, input_tensor, op=name):
            return gloo_reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        shm.reduce_scatter(output_tensor, input_tensor, name)
        return _Done()

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        name = _op_name(op)
        if name is None or not usable(group, tensor, op=name):
            return gloo_all_reduce(tensor, op=op, group=group, async_op=async_op)
        shm.all_reduce(tensor, name)
        return _Done()

    backend.all_gather_into_tensor = all_gather_into_tensor
    backend.reduce_scatter_tensor = reduce_scatter_tensor
    backend.all_reduce = all_reduce
    backend._raytrain_shm = shm
    log(f"collectives: shared memory among {world} ranks ({2 * world} x {shm.slot_bytes >> 20} MiB slots)")
    return shm
