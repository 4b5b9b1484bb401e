"""What crosses nodes: gloo and a Ray Train run between two network namespaces on one machine.

    python benchmarks/two_nodes.py gloo [--rates 200,500,1000,0] [--sizes-mib 8,32] [--min-time 1.5]
    python benchmarks/two_nodes.py train [--rate-mbit 0] [--steps 30] [overrides ...]

Production ranks sit on separate c7i nodes where one TCP flow is capped; on one machine ranks
share the loopback and /dev/shm, so the cross-node cost never shows. benchmarks/netns.py builds
two "nodes" (network namespaces joined by a veth pair, tbf-shaped at --rate(s), each with a
private /dev/shm); as root only.

`gloo` (plain torch.distributed, no Ray; 1 thread per rank): per rate, a single TCP flow and
two parallel ones A->B (does one flow fill the tbf rate?), then 2 ranks (one per node) and 4
(ranks 0,1 on A, 2,3 on B) run all_gather_into_tensor, reduce_scatter_tensor and all_reduce
of bf16 tensors. Per op: seconds, the tensor's bytes per second, the bytes that crossed the
veth per op (its counters, both ways) and the busier direction's rate as a share of tbf's.
Once per world size, `ss -tnpi` in both namespaces before and after one all-gather gives the
TCP connections between ranks (and the TCPStore's) and which of them carried the bytes.

`train`: a Ray head on A and a worker node on B (token auth, a custom resource of 2 worker
slots per node), and the project's job driven from A: 4 workers, 2 per node, tiny model; the
per-step times (metrics.jsonl, summary.json's step_breakdown) and the veth bytes per step
(counters sampled through the run, between the first timed step and the last). Extra
key=value overrides go to the run (e.g. deepspeed.hpz_partition_size=2).

Writes benchmarks/results/<machine>/two_nodes_{gloo,train}.json and .md (--json elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench.common, netns: run as a script

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
MIB = 1 << 20
OPS = ("all_gather", "reduce_scatter", "all_reduce")
GLOO_PORT = 29700
FLOW_PORT = 29800
RAY_PORT = 6379  # each namespace has its own ports, so Ray's defaults never meet another Ray's
SLOT = "rt_two_nodes_slot"  # the custom resource: 2 per node, 1 per training worker


# ----------------------------------------------------------------------------- gloo ranks


SS_LINE = re.compile(r"^ESTAB\s+\d+\s+\d+\s+(\S+):(\d+)\s+(\S+):(\d+)\s+(.*)$")


def ss_snapshot() -> list[dict[str, Any]]:
    """Established TCP sockets of this namespace: addresses, owning pid, bytes sent/received."""
    out = subprocess.run(["ss", "-tnpiH", "state", "established"], capture_output=True, text=True).stdout
    socks: list[dict[str, Any]] = []
    for line in out.splitlines():
        if not line[:1].isspace():  # ss -H without a state column: "0 0 local peer users:..."
            parts = line.split()
            if len(parts) < 4:
                continue
            (lip, lport), (pip, pport) = parts[2].rsplit(":", 1), parts[3].rsplit(":", 1)
            pid = re.search(r"pid=(\d+)", line)
            socks.append(
                {"local": f"{lip}:{lport}", "peer": f"{pip}:{pport}", "pid": int(pid.group(1)) if pid else None}
            )
        elif socks:
            for key in ("bytes_sent", "bytes_received"):
                m = re.search(rf"\b{key}:(\d+)", line)
                socks[-1][key] = int(m.group(1)) if m else socks[-1].get(key, 0)
    return socks


def veth_counters(dev: str) -> tuple[int, int]:
    base = Path("/sys/class/net", dev, "statistics")  # this node's /sys (netns.py's mount namespace)
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


def gloo_rank(args: argparse.Namespace) -> None:
    """One rank: init over tcp://A, ss snapshots around one all-gather (the first rank of each
    node), then each op x size timed for about --min-time; rank 0 prints the result."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank, world_size=world)
    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    opts = pg.options
    info = {
        "threads": opts._threads,
        "devices": len(opts._devices),  # one per GLOO_SOCKET_IFNAME entry
        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME", ""),
        "lazy_init": os.environ.get("TORCH_GLOO_LAZY_INIT", ""),
    }
    snap_rank = rank in (0, world // 2)  # the first rank of each node looks at its namespace
    dist.all_reduce(torch.ones(1))
    big = max(args.sizes_mib) * MIB // 2  # bf16 elements of the largest size
    x = torch.ones(big // world, dtype=torch.bfloat16)
    out = torch.empty(big // world * world, dtype=torch.bfloat16)
    dist.barrier()
    before = ss_snapshot() if snap_rank else []
    dist.barrier()
    dist.all_gather_into_tensor(out, x)
    dist.barrier()
    after = ss_snapshot() if snap_rank else []
    results = []
    for size_mib in args.sizes_mib:
        n = size_mib * MIB // 2 // world * world
        full = torch.ones(n, dtype=torch.bfloat16)
        shard = torch.ones(n // world, dtype=torch.bfloat16)
        calls = {
            "all_gather": lambda full=full, shard=shard: dist.all_gather_into_tensor(full, shard),
            "reduce_scatter": lambda full=full, shard=shard: dist.reduce_scatter_tensor(shard, full),
            "all_reduce": lambda full=full: dist.all_reduce(full),
        }
        for op in OPS:
            dist.barrier()
            t0 = time.perf_counter()
            calls[op]()  # warm-up: buffers, and tbf's bucket drained to its steady state
            warm = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.broadcast(warm, 0)
            reps = max(1, min(20, math.ceil(args.min_time / max(warm.item(), 1e-4))))
            dist.barrier()
            c0 = veth_counters(args.ifname) if rank == 0 else (0, 0)
            t0 = time.perf_counter()
            for _ in range(reps):
                calls[op]()
            dist.barrier()
            dt = (time.perf_counter() - t0) / reps
            c1 = veth_counters(args.ifname) if rank == 0 else (0, 0)
            results.append(
                {
                    "op": op,
                    "size_mib": size_mib,
                    "reps": reps,
                    "s_per_op": dt,
                    "tx_per_op": (c1[0] - c0[0]) / reps,  # A -> B
                    "rx_per_op": (c1[1] - c0[1]) / reps,  # B -> A
                }
            )
    print("RESULT " + json.dumps({"rank": rank, "pid": os.getpid(), "info": info, "ss_before": before,
                                  "ss_after": after, "results": results if rank == 0 else []}), flush=True)  # fmt: skip
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- TCP flows


def flow_sink(args: argparse.Namespace) -> None:
    """Accepts --flows connections and counts what each brings until it closes."""
    import socket

    srv = socket.create_server(("0.0.0.0", args.port), backlog=16)
    print("LISTENING", flush=True)
    conns = [srv.accept()[0] for _ in range(args.flows)]
    totals = [0] * len(conns)

    def drain(i: int) -> None:
        while chunk := conns[i].recv(1 << 20):
            totals[i] += len(chunk)

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(conns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("RESULT " + json.dumps({"bytes": totals}), flush=True)


def flow_source(args: argparse.Namespace) -> None:
    """--flows connections to the sink, each sending as fast as TCP lets it for --seconds."""
    import socket

    payload = b"\0" * (1 << 20)
    socks = [socket.create_connection((args.host, args.port)) for _ in range(args.flows)]
    t0 = time.perf_counter()

    def pump(s: socket.socket) -> None:
        while time.perf_counter() - t0 < args.seconds:
            s.sendall(payload)
        s.shutdown(socket.SHUT_WR)

    threads = [threading.Thread(target=pump, args=(s,)) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


def result_line(text: str) -> dict[str, Any]:
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError("no RESULT line in:\n" + text[-3000:])


def measure_flows(net: Any, flows: int, seconds: float) -> dict[str, Any]:
    """Goodput of `flows` parallel TCP flows A -> B over `seconds`."""
    sink = net.popen("B", [PY, __file__, "_sink", "--port", str(FLOW_PORT), "--flows", str(flows)],
                     stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert sink.stdout is not None
    sink.stdout.readline()  # LISTENING
    src = net.run("A", [PY, __file__, "_source", "--host", net.ip["B"], "--port", str(FLOW_PORT),
                        "--flows", str(flows), "--seconds", str(seconds)], timeout=seconds + 60)  # fmt: skip
    sent = result_line(src.stdout)
    got = result_line(sink.communicate(timeout=60)[0])
    per_flow = [b / sent["seconds"] for b in got["bytes"]]
    return {"flows": flows, "seconds": sent["seconds"], "bytes_per_s": sum(per_flow), "per_flow_bytes_per_s": per_flow}


# ----------------------------------------------------------------------------- gloo driver


def run_gloo(net: Any, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Ranks 0..world/2-1 on A, the rest on B; returns every rank's RESULT."""
    procs = []
    for rank in range(world):
        node = "A" if rank < world // 2 else "B"
        env = {**os.environ, "GLOO_SOCKET_IFNAME": net.veth[node], "OMP_NUM_THREADS": "1",
               "PYTHONWARNINGS": "ignore"}  # fmt: skip
        cmd = [PY, __file__, "_rank", "--rank", str(rank), "--world", str(world), "--master", net.ip["A"],
               "--port", str(GLOO_PORT), "--ifname", net.veth[node], "--min-time", str(args.min_time),
               "--sizes-mib", ",".join(map(str, args.sizes_mib))]  # fmt: skip
        procs.append(net.popen(node, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    return [result_line(o) for o in outs]


def connections(ranks: list[dict[str, Any]], ips: dict[str, str]) -> dict[str, Any]:
    """The TCP connections between ranks on different nodes, from both namespaces' ss: the A
    side names the A rank, the B side (its peer address) the B rank; and which carried bytes
    during the all-gather."""
    pid_rank = {r["pid"]: r["rank"] for r in ranks}
    side_a = [s for s in ranks[0]["ss_before"] if s["local"].startswith(ips["A"] + ":")]
    side_b = {s["local"]: s for s in ranks[len(ranks) // 2]["ss_before"] if s["local"].startswith(ips["B"] + ":")}
    after_a = {(s["local"], s["peer"]): s for s in ranks[0]["ss_after"]}
    pairs: dict[str, int] = {}
    flows = []
    for s in side_a:
        b = side_b.get(s["peer"])
        if not b:
            continue
        ra, rb = pid_rank.get(s["pid"]), pid_rank.get(b["pid"])
        store = s["peer"].endswith(f":{GLOO_PORT}") or s["local"].endswith(f":{GLOO_PORT}")
        key = f"{ra}-{rb}" + (" (TCPStore)" if store else "")
        pairs[key] = pairs.get(key, 0) + 1
        a2 = after_a.get((s["local"], s["peer"]), s)
        flows.append({
            "a_rank": ra, "b_rank": rb, "store": store,
            "a_to_b_bytes": a2.get("bytes_sent", 0) - s.get("bytes_sent", 0),
            "b_to_a_bytes": a2.get("bytes_received", 0) - s.get("bytes_received", 0),
        })  # fmt: skip
    return {"per_rank_pair": pairs, "flows_during_all_gather": flows}


def gloo_main(args: argparse.Namespace) -> None:
    from netns import check_private_shm, two_nodes

    table, flows_table, conn_info, raw = [], [], {}, []
    for rate in args.rates:
        with two_nodes(rate or None) as net:
            if rate == args.rates[0]:
                conn_info["private_shm"] = check_private_shm(net)
            for n in (1, 2):
                f = measure_flows(net, n, args.flow_seconds)
                flows_table.append({
                    "rate_mbit": rate or "unshaped", "flows": n, "MB_per_s": round(f["bytes_per_s"] / 1e6, 1),
                    "per_flow_MB_per_s": ",".join(f"{b / 1e6:.1f}" for b in f["per_flow_bytes_per_s"]),
                    "share_of_rate": round(f["bytes_per_s"] * 8 / (rate * 1e6), 3) if rate else None,
                })  # fmt: skip
                print(flows_table[-1], flush=True)
            for world in (2, 4):
                ranks = run_gloo(net, world, args)
                conn_info[f"world_{world}_rate_{rate or 'unshaped'}"] = connections(ranks, net.ip)
                conn_info["gloo_options"] = ranks[0]["info"]
                for r in ranks[0]["results"]:
                    size = r["size_mib"] * MIB
                    link = max(r["tx_per_op"], r["rx_per_op"]) / r["s_per_op"]
                    row = {
                        "rate_mbit": rate or "unshaped", "ranks": world, "op": r["op"], "size_mib": r["size_mib"],
                        "ms_per_op": round(r["s_per_op"] * 1e3, 1),
                        "tensor_MB_per_s": round(size / r["s_per_op"] / 1e6, 1),
                        "veth_MiB_per_op_a_to_b": round(r["tx_per_op"] / MIB, 2),
                        "veth_MiB_per_op_b_to_a": round(r["rx_per_op"] / MIB, 2),
                        "link_MB_per_s": round(link / 1e6, 1),
                        "share_of_rate": round(link * 8 / (rate * 1e6), 3) if rate else None,
                    }  # fmt: skip
                    table.append(row)
                    raw.append({**r, "rate_mbit": rate, "ranks": world})
                    print(row, flush=True)
    report(
        args.result_name,
        args.json,
        part="gloo",
        rates_mbit=args.rates,
        sizes_mib=args.sizes_mib,
        connections=conn_info,
        raw=raw,
        tables={
            "TCP flows A -> B (share: goodput over the tbf rate)": flows_table,
            "gloo collectives across the veth, bf16 (size: the whole tensor; link: busier direction)": table,
        },
        notes=[
            "tensor_MB_per_s = whole tensor bytes / seconds per op (all_gather's output, reduce_scatter's input).",
            "veth MiB per op: A's veth counters, each direction (IP and TCP headers included).",
            "share_of_rate = the busier direction's veth bytes/s x 8 / the tbf rate; both ends are shaped.",
            "tbf burst = max(rate x 4 ms, 128 KiB), latency 50 ms (benchmarks/netns.py).",
            f"gloo options: {conn_info.get('gloo_options')}",
        ],
    )


def report(stem: str, json_path: str | None, **fields: Any) -> None:
    """bench.common.report_script's record under `stem` (one script writes several results):
    the command as run, this machine, the package versions, then `fields`."""
    from bench.common import package_versions, portable_args, write_results

    from raytrain_cpu.host import features as host_features

    result = {
        "command": "python benchmarks/two_nodes.py " + " ".join(portable_args(None, json_path)),
        "machine": host_features.cpu_features().describe(),
        "versions": package_versions(),
        **fields,
    }
    print(write_results(stem, result, json_path).with_suffix(".md").read_text())


# ----------------------------------------------------------------------------- Ray train


TRAIN_DEFAULTS = [
    "data.seq_len=64",
    "train.micro_batch_size=4",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.eval_every=1000",
    "train.checkpoint_every=1000",
    "run.poll_interval_s=0.25",
    "scaling.threads_per_worker=1",
]


class Sampler(threading.Thread):
    """A's veth counters with wall-clock times, every `every` s, while the run trains."""

    def __init__(self, net: Any, every: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.net, self.every, self.samples, self.stop = net, every, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            c = self.net.link_bytes("A")
            self.samples.append((time.time(), c["tx_bytes"], c["rx_bytes"]))
            self.stop.wait(self.every)

    def at(self, t: float) -> tuple[float, float]:
        """(tx, rx) at wall time t, linear between the samples around it."""
        s = self.samples
        for (t0, a0, b0), (t1, a1, b1) in zip(s, s[1:]):
            if t0 <= t <= t1:
                f = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
                return a0 + f * (a1 - a0), b0 + f * (b1 - b0)
        raise ValueError(f"{t} is outside the sampled window")

    def per_step(self, times: list[float], first: int = 2) -> tuple[float, float]:
        """(tx, rx) bytes a step between the end of step `first` + 1 and the last of `times` (each
        logged step's wall time; by default from obs.timing.WARMUP_STEPS on: the steady steps)."""
        (tx0, rx0), (tx1, rx1) = self.at(times[first]), self.at(times[-1])
        n = len(times) - 1 - first
        return (tx1 - tx0) / n, (rx1 - rx0) / n


def ray_start(net: Any, node: str, temp_dir: Path, env: dict[str, str], head: bool) -> str:
    ray = str(Path(PY).parent / "ray")
    cmd = [ray, "start", "--node-ip-address", net.ip[node], "--temp-dir", str(temp_dir), "--num-cpus", "3",
           "--resources", json.dumps({SLOT: 2}), "--object-store-memory", str(100 * MIB),
           "--disable-usage-stats"]  # fmt: skip
    cmd += (
        ["--head", "--port", str(RAY_PORT), "--include-dashboard=false"]
        if head
        else ["--address", f"{net.ip['A']}:{RAY_PORT}"]
    )
    # Each node's processes (the raylet, then its workers) bind gloo to that node's veth: by
    # default gloo binds the address the hostname resolves to, and both namespaces share this
    # machine's hostname, which /etc/hosts points at 127.0.0.1 (on a real node it resolves to
    # the node's own address, so production needs no such setting).
    env = {**env, "GLOO_SOCKET_IFNAME": net.veth[node]}
    r = net.run(node, cmd, env=env, timeout=180)
    if r.returncode:
        raise RuntimeError(f"ray start on {node} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def wait_for_nodes(net: Any, env: dict[str, str], n: int, timeout_s: float = 120) -> list[dict[str, Any]]:
    code = (
        "import json, ray; ray.init(address='auto', logging_level='ERROR');"
        "print('RESULT ' + json.dumps([{'ip': x['NodeManagerAddress'], 'resources': x['Resources']}"
        " for x in ray.nodes() if x['Alive']]))"
    )
    deadline = time.monotonic() + timeout_s
    while True:
        r = net.run("A", [PY, "-c", code], env={**env, "RAY_ADDRESS": f"{net.ip['A']}:{RAY_PORT}"}, timeout=120)
        nodes = result_line(r.stdout) if "RESULT " in r.stdout else []
        if len(nodes) >= n or time.monotonic() > deadline:
            if len(nodes) < n:
                raise RuntimeError(f"{len(nodes)} of {n} Ray nodes alive:\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
            return nodes
        time.sleep(2)


def ray_env() -> dict[str, str]:
    """This environment for every Ray process on the two nodes: token auth with a fresh token
    (RAY_AUTH_TOKEN wins over ~/.ray/auth_token, which stays untouched: another Ray on this machine
    may use it), this Python's folder first on PATH (its `ray`), no address of another Ray."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "PYTHONWARNINGS": "ignore",
           "PATH": f"{Path(PY).parent}:{os.environ.get('PATH', '')}"}  # fmt: skip
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)
    return env


@contextlib.contextmanager
def ray_on_both(net: Any, temp_dir: Path, env: dict[str, str]):
    """A Ray head on A and a worker node on B, their session folders under `temp_dir`; yields the
    alive nodes. Their processes go with the namespaces; /tmp/ray/ray_current_cluster, which a
    head writes despite --temp-dir and later ray.init() calls would try to join, goes here."""
    ray_current = Path("/tmp/ray/ray_current_cluster")
    had_current = ray_current.exists()
    try:
        ray_start(net, "A", temp_dir / "ray-a", env, head=True)
        ray_start(net, "B", temp_dir / "ray-b", env, head=False)
        yield wait_for_nodes(net, env, 2)
    finally:
        if not had_current and ray_current.exists():
            ray_current.unlink()


def train_main(args: argparse.Namespace) -> None:
    from netns import IP, WORK, check_private_shm, two_nodes

    rate = args.rate_mbit or None
    tag = f"train-{os.getpid()}-{int(time.time())}"
    work = WORK / tag
    work.mkdir(parents=True)
    env = ray_env()
    name = args.name or f"two-nodes-{'unshaped' if rate is None else f'{args.rate_mbit:g}mbit'}"
    overrides = [
        f"run.ray_address={IP['A']}:{RAY_PORT}",
        f"run.storage_path={work / 'runs'}",
        f"run.name={name}",
        f"train.max_steps={args.steps}",
        "scaling.num_workers=4",
        "scaling.cpus_per_worker=1",
        f"scaling.resources_per_worker={{{SLOT}: 1}}",
        *TRAIN_DEFAULTS,
        *args.overrides,
    ]
    with two_nodes(rate) as net:
        shm = check_private_shm(net)
        with ray_on_both(net, work, env) as nodes:
            sampler = Sampler(net)
            c0 = net.link_bytes("A")
            sampler.start()
            t0 = time.time()
            drv = net.run("A", [PY, "-m", "raytrain_cpu.main", *overrides], cwd=REPO, env=env,
                          timeout=args.timeout)  # fmt: skip
            wall = time.time() - t0
            sampler.stop.set()
            sampler.join()
            c1 = net.link_bytes("A")
            (work / "driver.log").write_text(drv.stdout + "\n--- stderr\n" + drv.stderr)
            if drv.returncode:
                raise RuntimeError(
                    f"the run failed (rc {drv.returncode}); {work / 'driver.log'}:\n{drv.stderr[-3000:]}"
                )
    run_dir = work / "runs" / name
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [s for s in steps if "loss" in s and "time" in s]
    times = [s["time"] for s in steps]
    step_s = [round(b - a, 4) for a, b in zip(times, times[1:])]
    first = 2  # obs.timing.WARMUP_STEPS: from the end of step 3 on, every step is a steady one
    tx, rx = sampler.per_step(times, first)
    collectives = [c for c in summary.get("choices", []) if "collectives:" in c]
    bd = summary.get("step_breakdown") or {}
    row = {
        "rate_mbit": args.rate_mbit or "unshaped",
        "workers": summary.get("world_size"),
        "steps": summary.get("steps"),
        "step_s": round(bd.get("step_wall_s") or 0, 4),
        "comm_s": round(bd["comm_s"], 4) if bd.get("comm_s") is not None else None,
        "median_logged_step_s": sorted(step_s[first:])[len(step_s[first:]) // 2] if step_s[first:] else None,
        "veth_KiB_per_step_a_to_b": round(tx / 1024, 1),
        "veth_KiB_per_step_b_to_a": round(rx / 1024, 1),
        "veth_MiB_whole_run": round((c1["tx_bytes"] - c0["tx_bytes"] + c1["rx_bytes"] - c0["rx_bytes"]) / MIB, 1),
        "wall_s": round(wall, 1),
    }
    print(row, flush=True)
    report(
        args.result_name,
        args.json,
        part="train",
        rate_mbit=args.rate_mbit,
        overrides=overrides,
        private_shm=shm,
        ray_nodes=nodes,
        collectives=collectives,
        step_breakdown=bd,
        tokens_per_s=summary.get("tokens_per_s"),
        logged_step_s=step_s,
        n_params=summary.get("n_params"),
        tables={"Ray Train run across two namespaces (4 workers, 2 per node)": [row]},
        notes=[
            "step_s, comm_s: summary.json's step_breakdown (means after obs.timing.WARMUP_STEPS).",
            "logged step s: differences of metrics.jsonl times (train.log_every=1), step 3 on.",
            "veth KiB per step: A's veth counters sampled every 0.2 s, between the end of step 3 and the last "
            "step, over the steps between (Ray's own traffic included).",
            f"collectives: {'; '.join(collectives) or 'no line found'}",
        ],
    )


# ----------------------------------------------------------------------------- command line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gloo", help="gloo collectives and TCP flows across the link")
    g.add_argument("--rates", default="200,500,1000,0", help="Mbit/s, comma-separated; 0 = unshaped")
    g.add_argument("--sizes-mib", default="8,32")
    g.add_argument("--min-time", type=float, default=1.5, help="seconds each op x size is timed, about")
    g.add_argument("--flow-seconds", type=float, default=3.0)
    g.add_argument("--json", default=None)
    g.add_argument("--result-name", default="two_nodes_gloo", help="result file stem")
    t = sub.add_parser("train", help="the project's job on a two-node Ray cluster")
    t.add_argument("--rate-mbit", type=float, default=0, help="tbf rate; 0 = unshaped")
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--name", default="", help="run.name (default two-nodes-<rate>)")
    t.add_argument("--result-name", default="", help="result file stem (default two_nodes_train_<rate>)")
    t.add_argument("--timeout", type=float, default=1200)
    t.add_argument("--json", default=None)
    t.add_argument("overrides", nargs="*", help="key=value settings for the run")
    r = sub.add_parser("_rank")
    for a in ("--rank", "--world", "--port"):
        r.add_argument(a, type=int)
    r.add_argument("--master")
    r.add_argument("--ifname")
    r.add_argument("--min-time", type=float)
    r.add_argument("--sizes-mib")
    s = sub.add_parser("_sink")
    s.add_argument("--port", type=int)
    s.add_argument("--flows", type=int)
    c = sub.add_parser("_source")
    c.add_argument("--host")
    c.add_argument("--port", type=int)
    c.add_argument("--flows", type=int)
    c.add_argument("--seconds", type=float)
    args = ap.parse_args()
    if getattr(args, "sizes_mib", None):
        args.sizes_mib = [int(x) for x in args.sizes_mib.split(",")]
    if args.cmd == "gloo":
        args.rates = [float(x) for x in args.rates.split(",")]
        args.rates = [int(x) if x == int(x) else x for x in args.rates]
        gloo_main(args)
    elif args.cmd == "train":
        if not args.result_name:
            args.result_name = "two_nodes_train_" + (f"{args.rate_mbit:g}mbit" if args.rate_mbit else "unshaped")
        train_main(args)
    elif args.cmd == "_rank":
        gloo_rank(args)
    elif args.cmd == "_sink":
        flow_sink(args)
    elif args.cmd == "_source":
        flow_source(args)


if __name__ == "__main__":
    sys.exit(main())
