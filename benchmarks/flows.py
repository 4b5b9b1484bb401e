"""ZeRO-3's collectives across two nodes whose single TCP flows are capped below the node's rate.

    python benchmarks/flows.py [--rate-mbit 500] [--flow-mbit 100] [--sizes-mib 16,32] [--min-time 2]

On AWS one TCP flow between two instances is capped well below the node's rate (10 of a
c7i.48xlarge's 50 Gbit/s inside a cluster placement group), and gloo's ring collectives cross
each node boundary on one flow per direction, so they reach a fifth of the node. This runs, on
benchmarks/netns.py's two namespaces with a node-wide tbf and a per-flow cap under it
(`two_nodes(flow_mbit=...)`), 4 ranks (0,1 on A; 2,3 on B; 1 thread each), bf16:

- all_gather (all_gather_into_tensor: rank-major output) and reduce_scatter (reduce_scatter_tensor,
  sum), each as
- gloo: torch's own call on the world group (one ring: one flow per direction across);
- striped-k: k chunks on k gloo process groups (their own TCP connections), issued at once;
- exchange: one all_to_all_single, each rank sending each peer its part directly (every
  cross-node rank pair its own flow), then, for reduce_scatter, the sum done locally.

Per op: seconds, the veth's bytes per op each direction, the speedup over gloo and whether the
result matches gloo's (all_gather bit for bit; reduce_scatter's largest difference, its sums
being added in another order). Then the same unshaped, where the CPUs and not the link are the
limit. First, per setting, 1 and 4 parallel TCP flows A -> B show the caps hold. striped-k is
raytrain_cpu.trainer.collectives.StripedCollectives (deepspeed.cross_node_collectives), exchange
is here. Root only (namespaces); writes benchmarks/results/<machine>/flows.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench.common, netns, two_nodes: run as a script

PY = sys.executable
MIB = 1 << 20
WORLD = 4
PORT = 29710
OPS = ("all_gather", "reduce_scatter")
VARIANTS = ("gloo", "striped-2", "striped-4", "exchange")


# ----------------------------------------------------------------------------- one rank


def exchange_all_gather(full: Any, shard: Any, world: int) -> None:
    """all_gather_into_tensor as one all_to_all_single: each peer gets this rank's whole shard
    on its own connection (world copies of it, one per destination)."""
    import torch.distributed as dist

    dist.all_to_all_single(full, shard.repeat(world))


def exchange_reduce_scatter(full: Any, shard: Any, world: int) -> None:
    """reduce_scatter_tensor (sum) as one all_to_all_single, each rank sending each peer that
    peer's slice, then the slices received summed here in fp32, in rank order, rounded once."""
    import torch
    import torch.distributed as dist

    got = torch.empty_like(full)
    dist.all_to_all_single(got, full)
    shard.copy_(got.view(world, -1).sum(0, dtype=torch.float32))


def rank_main(args: argparse.Namespace) -> None:
    """One rank: the world group plus 4 more gloo groups (the stripes), then each op x size x
    variant timed for about --min-time after a warm-up; rank 0 reads A's veth counters around
    the timed calls and prints the result."""
    import torch
    import torch.distributed as dist
    from netns import flow_bucket
    from two_nodes import ss_snapshot, veth_counters

    from raytrain_cpu.trainer.collectives import StripedCollectives

    torch.set_num_threads(1)
    rank, world = args.rank, WORLD
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{PORT}", rank=rank, world_size=world)
    impl = {"striped-2": StripedCollectives(stripes=2), "striped-4": StripedCollectives(stripes=4)}
    dist.barrier()
    conns = []
    if rank == 0:  # the cross-node TCP connections and the per-flow class each hashes to
        for s in ss_snapshot():
            lip, lport = s["local"].rsplit(":", 1)
            pip, pport = s["peer"].rsplit(":", 1)
            if lip == args.ip_a and pip == args.ip_b:
                conns.append(flow_bucket(int(lport), int(pport)))

    def call(op: str, variant: str, full: torch.Tensor, shard: torch.Tensor) -> None:
        if variant == "gloo":
            if op == "all_gather":
                dist.all_gather_into_tensor(full, shard)
            else:
                dist.reduce_scatter_tensor(shard, full)
        elif variant == "exchange":
            (exchange_all_gather if op == "all_gather" else exchange_reduce_scatter)(full, shard, world)
        elif op == "all_gather":
            impl[variant].all_gather(full, shard).wait()
        else:
            impl[variant].reduce_scatter(shard, full, "SUM").wait()

    results = []
    gen = torch.Generator().manual_seed(1234 + rank)
    for size_mib in args.sizes_mib:
        n = size_mib * MIB // 2 // world * world
        data = torch.randn(n, generator=gen).to(torch.bfloat16)
        for op in OPS:
            reference = None
            for variant in VARIANTS:
                if op == "all_gather":
                    shard, full = data[: n // world].clone(), torch.empty(n, dtype=torch.bfloat16)
                    out = full
                else:
                    shard, full = torch.empty(n // world, dtype=torch.bfloat16), data.clone()
                    out = shard
                dist.barrier()
                t0 = time.perf_counter()
                call(op, variant, full, shard)  # warm-up: buffers, and tbf's bucket at its steady state
                warm = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.broadcast(warm, 0)
                if reference is None:
                    reference = out.clone()
                    diff = 0.0
                    same = True
                else:
                    same = bool(torch.equal(out, reference))
                    diff = (out.float() - reference.float()).abs().max().item()
                    scale = reference.float().abs().max().item()
                    diff = diff / scale if scale else diff
                stats = torch.tensor([float(same), diff], dtype=torch.float64)
                stats[0] = -stats[0]
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # every rank's: all same, the worst diff
                reps = max(1, min(10, math.ceil(args.min_time / max(warm.item(), 1e-4))))
                dist.barrier()
                c0 = veth_counters(args.ifname) if rank == 0 else (0, 0)
                t0 = time.perf_counter()
                for _ in range(reps):
                    call(op, variant, full, shard)
                dist.barrier()
                dt = (time.perf_counter() - t0) / reps
                c1 = veth_counters(args.ifname) if rank == 0 else (0, 0)
                results.append({
                    "op": op, "variant": variant, "size_mib": size_mib, "reps": reps, "s_per_op": dt,
                    "tx_per_op": (c1[0] - c0[0]) / reps, "rx_per_op": (c1[1] - c0[1]) / reps,
                    "same_as_gloo": stats[0].item() < 0, "max_rel_diff": stats[1].item(),
                })  # fmt: skip
                if rank == 0:
                    print(f"  {op} {variant} {size_mib} MiB: {dt:.3f} s", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps({"rank": rank, "buckets": conns, "results": results if rank == 0 else []}), flush=True)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def run_ranks(net: Any, args: argparse.Namespace) -> dict[str, Any]:
    from two_nodes import result_line

    procs = []
    for rank in range(WORLD):
        node = "A" if rank < WORLD // 2 else "B"
        env = {**os.environ, "GLOO_SOCKET_IFNAME": net.veth[node], "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        cmd = [PY, __file__, "--rank", str(rank), "--master", net.ip["A"], "--ifname", net.veth[node],
               "--ip-a", net.ip["A"], "--ip-b", net.ip["B"], "--min-time", str(args.min_time),
               "--sizes-mib", ",".join(map(str, args.sizes_mib))]  # fmt: skip
        err = None if rank == 0 else subprocess.DEVNULL
        procs.append(net.popen(node, cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env))
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    return result_line(outs[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbit", type=float, default=500, help="the node's rate (tbf), each direction")
    ap.add_argument("--flow-mbit", type=float, default=100, help="one TCP flow's cap (c7i.48xlarge: a fifth)")
    ap.add_argument("--sizes-mib", default="16,32", help="whole tensor (all_gather's output, reduce_scatter's input)")
    ap.add_argument("--min-time", type=float, default=2.0, help="seconds each op x size x variant is timed, about")
    ap.add_argument("--flow-seconds", type=float, default=3.0)
    ap.add_argument("--no-unshaped", action="store_true", help="skip the unshaped run")
    ap.add_argument("--json", default=None)
    for a in ("--rank", "--master", "--ifname", "--ip-a", "--ip-b"):  # one rank, as the driver starts it
        ap.add_argument(a, help=argparse.SUPPRESS, type=int if a == "--rank" else str)
    args = ap.parse_args()
    args.sizes_mib = [int(x) for x in args.sizes_mib.split(",")]
    if args.rank is not None:
        rank_main(args)
        return

    from bench.common import report_script
    from netns import netns_list, two_nodes
    from two_nodes import measure_flows

    before = netns_list()
    settings = [(args.rate_mbit, args.flow_mbit)] + ([] if args.no_unshaped else [(None, None)])
    flows_table, table, raw, shaping, buckets = [], [], [], {}, {}
    for rate, flow in settings:
        label = f"{rate:g}/{flow:g}" if rate else "unshaped"
        with two_nodes(rate, flow_mbit=flow, name="rtflows") as net:
            shaping[label] = {"tbf": net.tbf, "flows": net.flows}
            for n in (1, 4):
                f = measure_flows(net, n, args.flow_seconds)
                flows_table.append({
                    "node/flow Mbit": label, "flows": n, "Mbit_per_s": round(f["bytes_per_s"] * 8 / 1e6, 1),
                    "per_flow_Mbit_per_s": ",".join(f"{b * 8 / 1e6:.0f}" for b in f["per_flow_bytes_per_s"]),
                })  # fmt: skip
                print(flows_table[-1], flush=True)
            res = run_ranks(net, args)
        b = res["buckets"]
        buckets[label] = {"cross_node_connections": len(b), "distinct_flow_classes": len(set(b))}
        base = {(r["op"], r["size_mib"]): r["s_per_op"] for r in res["results"] if r["variant"] == "gloo"}
        for r in res["results"]:
            row = {
                "node/flow Mbit": label, "op": r["op"], "size_mib": r["size_mib"], "variant": r["variant"],
                "s_per_op": round(r["s_per_op"], 3),
                "veth_MiB_a_to_b": round(r["tx_per_op"] / MIB, 1), "veth_MiB_b_to_a": round(r["rx_per_op"] / MIB, 1),
                "speedup": round(base[(r["op"], r["size_mib"])] / r["s_per_op"], 2),
                "as_gloo": "bit-identical" if r["same_as_gloo"] else f"max rel diff {r['max_rel_diff']:.1e}",
            }  # fmt: skip
            table.append(row)
            raw.append({**r, "setting": label})
            print(row, flush=True)
    assert netns_list() == before, "namespaces left behind"
    report_script(
        "flows",
        args.json,
        rate_mbit=args.rate_mbit,
        flow_mbit=args.flow_mbit,
        sizes_mib=args.sizes_mib,
        shaping=shaping,
        connections=buckets,
        raw=raw,
        tables={
            "TCP flows A -> B (the caps: one flow, several)": flows_table,
            f"{WORLD} ranks (2 per node), bf16; size: the whole tensor; speedup over gloo's own": table,
        },
        notes=[
            "node/flow Mbit: tbf's rate on each veth end / htb's cap per TCP flow under it (netns.shape_flows).",
            "veth MiB per op: A's veth counters, each direction (IP and TCP headers included).",
            "striped-k: k chunks on k gloo groups at once; exchange: one all_to_all_single (+ a local fp32 sum).",
            "as_gloo: every rank's output compared with gloo's bit for bit; else the largest difference relative "
            "to the largest magnitude (exchange sums in fp32 in rank order; striped runs gloo's ring per chunk, "
            "whose segments may group a sum otherwise at other sizes).",
            f"cross-node TCP connections (rank 0's, all groups) and the per-flow classes they hash to: {buckets}",
        ],
    )


if __name__ == "__main__":
    main()
