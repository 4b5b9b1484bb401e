"""Two "nodes" on one machine: two network namespaces joined by a veth pair, optionally shaped.

Production ranks sit on separate c7i nodes whose single TCP flows are capped (10 Gbit/s inside a
cluster placement group); on one machine every rank shares the loopback and /dev/shm, so neither
the network cost nor the code paths a real cluster takes (gloo instead of the shared-memory
collectives, one Ray object store per node) show up. `two_nodes` builds the smallest thing that
behaves like two machines:

- namespaces A and B, one veth end in each (10.77.0.1/24 and 10.77.0.2/24), lo up in both;
- with `rate_mbit`, a tbf qdisc on BOTH veth ends, so each direction is capped as a NIC's is;
- with `flow_mbit`, under that tbf a cap per TCP flow as well (`shape_flows`): AWS caps one
  flow between two instances well below the node's rate, and gloo crosses nodes on few flows;
- per node one mount namespace with its own tmpfs on /dev/shm (and a /sys that shows that
  node's interfaces), held open by a small holder process; every command run on a node enters
  that node's network and mount namespaces, so the ranks of one node share a /dev/shm (as on a
  real node: Ray's object store, the shared-memory collectives) and the two nodes never do.

Must run as root (`ip netns`, `tc`, `mount`). Names carry this process's pid and a counter, so
parallel users cannot collide; namespaces left by a process that died without cleaning up
(SIGKILL) are removed by the next `two_nodes` that finds their pid gone. Everything the context
made is torn down on exit, on exceptions and on SIGINT/SIGTERM: every process inside the two
namespaces (found by namespace, so daemons such as `ray start`'s are included), the holders,
then the namespaces, which takes the veth pair and the tmpfs with them.

    with two_nodes(rate_mbit=500) as net:
        net.run("B", ["ip", "addr"])
        p = net.popen("A", ["python", "-c", "..."])
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORK = Path("/tmp/netns-work")
SUBNET = "10.77.0"
NODES = ("A", "B")
VETH = {"A": "veth-a", "B": "veth-b"}  # names live inside the namespaces, so they never collide
IP = {"A": f"{SUBNET}.1", "B": f"{SUBNET}.2"}
SHM_SIZE = "4g"  # a tmpfs only takes the pages written to it; room for Ray's object store
# The kernel's jiffy here is 4 ms (CONFIG_HZ=250). tc-tbf(8): the bucket must hold at least
# rate/HZ bytes or the rate cannot be reached when the dequeue runs a tick late; and at least one
# 64 KiB GSO packet (veth sends TCP's segmentation-offloaded super packets whole), or tbf must
# split every such packet in software, costing CPU the ranks compete for on this machine.
BURST_TIME_S = 0.004
MIN_BURST_BYTES = 128 << 10
# How long a packet may wait in tbf's queue: the queue holds rate x this (plus the burst). Long
# enough that a TCP flow's window fits without drops at these rates (there is no propagation
# delay here), short enough that a dropped packet still shows up as loss, as at a real cap.
TBF_LATENCY_MS = 50
# Per-flow cap (shape_flows): flows are hashed on their ports into this many htb classes, each
# capped at flow_mbit. This kernel has no sch_fq (whose maxrate would do it), no sfq and no flow
# classifier; htb, u32 and cls_bpf are there. Two flows that hash alike share one cap: at 1024
# classes, 16 flows collide with a chance of about 11% (flows.py reports the classes in use).
FLOW_CLASSES = 1024
FLOW_MINOR = 0x1000  # class 2:1000 (hex) is bucket 0; 2:1 takes what is not TCP over IPv4
_counter = itertools.count()


def burst_bytes(rate_mbit: float) -> int:
    """tbf's bucket for `rate_mbit`: max(rate x one jiffy, 128 KiB). A bucket lets a sender run
    ahead of the rate by at most its size after an idle period, so a multi-MiB collective's
    average stays within a few percent of the rate while one late tick cannot starve it."""
    return max(int(rate_mbit * 1e6 / 8 * BURST_TIME_S), MIN_BURST_BYTES)


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def netns_list() -> list[str]:
    out = _sh("ip", "-j", "netns", "list", check=False).stdout.strip()
    return [n["name"] for n in json.loads(out)] if out else []


def netns_pids(ns: str) -> list[int]:
    """Every process whose network namespace is `ns` (the kernel's view, so daemons that
    double-forked away from their parent are found too)."""
    out = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def kill_pids(pids: Sequence[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL what is still there after `grace_s`: each pid by number."""
    pids = [p for p in pids if p != os.getpid()]
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def cleanup_stale(prefix: str) -> list[str]:
    """Deletes `prefix`-<pid>-... namespaces whose creating pid is gone (a SIGKILLed run), with
    every process still inside them; returns their names."""
    removed = []
    for ns in netns_list():
        parts = ns.split("-")
        if not ns.startswith(prefix + "-") or len(parts) < 3 or not parts[-3].isdigit():
            continue
        if _alive(int(parts[-3])):
            continue
        kill_pids(netns_pids(ns), grace_s=2)
        _sh("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    return removed


@dataclass
class TwoNodes:
    """The live pair. Commands on a node run inside its network and mount namespaces."""

    ns: dict[str, str]
    rate_mbit: float | None
    tbf: dict[str, Any] | None
    flow_mbit: float | None = None
    flows: dict[str, Any] | None = None
    ip: dict[str, str] = field(default_factory=lambda: dict(IP))
    veth: dict[str, str] = field(default_factory=lambda: dict(VETH))
    holders: dict[str, subprocess.Popen] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def argv(self, node: str, cmd: Sequence[str], cwd: str | os.PathLike | None = None) -> list[str]:
        """`cmd` as run on `node`: nsenter into its holder's network and mount namespaces. The
        mount namespace is the holder's, not a fresh one per command, so processes of one node
        share that node's /dev/shm. --wd: entering a mount namespace resets the directory."""
        wd = os.fspath(cwd) if cwd is not None else os.getcwd()
        pid = self.holders[node].pid
        return ["nsenter", "-t", str(pid), "-n", "-m", f"--wd={wd}", "--", *map(str, cmd)]

    def popen(self, node: str, cmd: Sequence[str], cwd: str | os.PathLike | None = None, **kw: Any) -> subprocess.Popen:
        """Starts `cmd` on `node`; tracked, and killed at teardown if still running."""
        p = subprocess.Popen(self.argv(node, cmd, cwd), cwd=cwd, **kw)
        self.procs.append(p)
        return p

    def run(self, node: str, cmd: Sequence[str], cwd: str | os.PathLike | None = None, **kw: Any):
        """subprocess.run of `cmd` on `node` (text output captured unless told otherwise)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(node, cmd, cwd), cwd=cwd, **kw)

    def link_bytes(self, node: str) -> dict[str, int]:
        """The node's veth counters (tx_bytes, rx_bytes): what crossed the link, both ways. The
        veth is inside the namespace, so the host's /sys/class/net does not show it."""
        out = _sh("ip", "-n", self.ns[node], "-s", "-j", "link", "show", "dev", self.veth[node]).stdout
        st = json.loads(out)[0]["stats64"]
        return {"tx_bytes": st["tx"]["bytes"], "rx_bytes": st["rx"]["bytes"]}

    def pids(self, node: str) -> list[int]:
        return netns_pids(self.ns[node])


def _shape(ns: str, dev: str, rate_mbit: float, delay_ms: float) -> dict[str, Any]:
    """tbf at `rate_mbit` on `dev` (under netem's delay with `delay_ms`): handle 1:, or 10:
    below netem's 1:; the returned "class" is where a child of tbf goes (shape_flows)."""
    burst = burst_bytes(rate_mbit)
    tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]
    if delay_ms:
        # netem delay as the root and tbf below it; kernels without sch_netem fail here, clearly.
        r = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                "delay", f"{delay_ms}ms", check=False)  # fmt: skip
        if r.returncode:
            raise RuntimeError(f"delay_ms needs the netem qdisc, which this kernel lacks: {r.stderr.strip()}")
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
        child = "10:1"
    else:
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)
        child = "1:1"
    return {
        "rate_mbit": rate_mbit, "burst_bytes": burst, "latency_ms": TBF_LATENCY_MS, "delay_ms": delay_ms,
        "class": child,
    }  # fmt: skip


def flow_bucket(sport: int, dport: int) -> int:
    """The bucket `shape_flows`' classifier puts a TCP packet of these ports in: both ports
    xor-ed (a flow's two directions and every flow to one listening port then differ), folded
    once, masked. The same in both directions of a flow."""
    h = sport ^ dport
    return (h ^ (h >> 8)) & (FLOW_CLASSES - 1)


def flow_classifier() -> str:
    """tc's cls_bpf bytecode (classic BPF) that returns the htb class of a packet: 2:(1000 +
    flow_bucket) for TCP over IPv4, 2:1 otherwise. cls_bpf hands classic BPF the frame from its
    Ethernet header at egress; a return other than 0 or -1 is taken as the class id."""
    bad = 17  # index of the last instruction
    prog = [
        (0x28, 0, 0, 12),  # ldh [12]: ethertype
        (0x15, 0, bad - 2, 0x0800),  # jeq IPv4 else -> ret 2:1
        (0x30, 0, 0, 23),  # ldb [23]: IP protocol
        (0x15, 0, bad - 4, 6),  # jeq TCP else -> ret 2:1
        (0xB1, 0, 0, 14),  # ldxb 4*([14]&0xf): IP header length
        (0x48, 0, 0, 14),  # ldh [x+14]: source port
        (0x02, 0, 0, 0),  # st M[0]
        (0x48, 0, 0, 16),  # ldh [x+16]: destination port
        (0x61, 0, 0, 0),  # ldx M[0]
        (0xAC, 0, 0, 0),  # xor x
        (0x02, 0, 0, 0),  # st M[0]
        (0x74, 0, 0, 8),  # rsh #8
        (0x61, 0, 0, 0),  # ldx M[0]
        (0xAC, 0, 0, 0),  # xor x
        (0x54, 0, 0, FLOW_CLASSES - 1),  # and #mask
        (0x44, 0, 0, (2 << 16) | FLOW_MINOR),  # or 2:1000
        (0x16, 0, 0, 0),  # ret a
        (0x06, 0, 0, (2 << 16) | 1),  # ret 2:1
    ]
    assert len(prog) == bad + 1
    return ",".join([str(len(prog))] + [" ".join(map(str, ins)) for ins in prog])


def shape_flows(ns: str, dev: str, flow_mbit: float, parent: str | None) -> dict[str, Any]:
    """Caps each TCP flow on `dev` at `flow_mbit`: an htb (handle 2:) as the child of `parent`
    (the tbf that holds the node's rate; None: the root) with FLOW_CLASSES classes, each capped
    at flow_mbit (rate = ceil: no borrowing, so a flow never runs faster), a bfifo under each
    that holds flow_mbit x TBF_LATENCY_MS like tbf's queue, and cls_bpf putting each packet in
    its flow's class (flow_classifier). Packets that are not TCP/IPv4 (ARP) go to 2:1, capped
    at flow_mbit as well. Built with one `tc -batch` (thousands of commands)."""
    burst = burst_bytes(flow_mbit)
    limit = int(flow_mbit * 1e6 / 8 * TBF_LATENCY_MS / 1e3) + burst
    cls = f"htb rate {flow_mbit}mbit ceil {flow_mbit}mbit burst {burst} cburst {burst} quantum 65536"
    where = f"parent {parent}" if parent else "root"
    lines = [f"qdisc add dev {dev} {where} handle 2: htb default 1", f"class add dev {dev} parent 2: classid 2:1 {cls}"]
    for b in range(FLOW_CLASSES):
        minor = f"{FLOW_MINOR + b:x}"
        lines.append(f"class add dev {dev} parent 2: classid 2:{minor} {cls}")
        lines.append(f"qdisc add dev {dev} parent 2:{minor} bfifo limit {limit}")
    lines.append(f'filter add dev {dev} parent 2: protocol all prio 1 bpf bytecode "{flow_classifier()}" classid 2:1')
    batch = WORK / f"tc-flows-{ns}.batch"
    batch.write_text("\n".join(lines) + "\n")
    try:
        r = _sh("ip", "netns", "exec", ns, "tc", "-batch", str(batch), check=False)
    finally:
        batch.unlink(missing_ok=True)
    if r.returncode:
        raise RuntimeError(f"per-flow shaping failed on {ns}/{dev}: {r.stderr.strip()[-2000:]}")
    return {"flow_mbit": flow_mbit, "classes": FLOW_CLASSES, "burst_bytes": burst, "queue_bytes": limit}


def _start_holder(ns: str) -> subprocess.Popen:
    """A process in `ns` with a private mount namespace whose /dev/shm is a fresh tmpfs (and
    whose /sys is the namespace's, which `ip netns exec` remounts); it sleeps until teardown."""
    script = f"mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm && echo ready && exec sleep infinity"
    p = subprocess.Popen(
        ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = p.stdout.readline().strip() if p.stdout else ""
    if line != "ready":
        p.kill()
        raise RuntimeError(f"holder for {ns} did not start (got {line!r}, rc {p.poll()})")
    return p


def _teardown(net: TwoNodes | None, names: dict[str, str]) -> None:
    for p in net.procs if net else []:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
    existing = set(netns_list())
    for ns in names.values():
        if ns in existing:
            kill_pids(netns_pids(ns))
    for p in [*(net.procs if net else []), *(net.holders.values() if net else [])]:
        with contextlib.suppress(Exception):
            p.wait(timeout=5)
    for ns in names.values():
        if ns in existing:
            _sh("ip", "netns", "del", ns, check=False)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM (and SIGHUP) raise SystemExit in the main thread while the nodes exist, so the
    `finally` that tears them down runs; SIGINT already raises KeyboardInterrupt."""

    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


@contextlib.contextmanager
def two_nodes(
    rate_mbit: float | None, delay_ms: float = 0, name: str = "rtnet", flow_mbit: float | None = None
) -> Iterator[TwoNodes]:
    """Two namespaces joined by a veth pair, both ends capped at `rate_mbit` (None: unshaped);
    yields a TwoNodes that runs commands on node "A" (10.77.0.1) or "B" (10.77.0.2). With
    `flow_mbit`, each TCP flow is capped at that too, each direction (shape_flows), as AWS caps
    one flow between two instances below the node's rate."""
    if os.geteuid() != 0:
        raise PermissionError("two_nodes needs root (ip netns, tc, mount)")
    WORK.mkdir(parents=True, exist_ok=True)
    cleanup_stale(name)
    tag = f"{name}-{os.getpid()}-{next(_counter)}"
    names = {n: f"{tag}-{n.lower()}" for n in NODES}
    net = None
    with _signals_raise():
        try:
            for ns in names.values():
                _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", VETH["A"], "netns", names["A"], "type", "veth",
                "peer", "name", VETH["B"], "netns", names["B"])  # fmt: skip
            tbf = flows = None
            for n in NODES:
                ns, dev = names[n], VETH[n]
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "-n", ns, "addr", "add", f"{IP[n]}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                if rate_mbit:
                    tbf = _shape(ns, dev, rate_mbit, delay_ms)
                if flow_mbit:
                    flows = shape_flows(ns, dev, flow_mbit, tbf["class"] if tbf else None)
            net = TwoNodes(ns=names, rate_mbit=rate_mbit, tbf=tbf, flow_mbit=flow_mbit, flows=flows)
            for n in NODES:
                net.holders[n] = _start_holder(names[n])
            yield net
        finally:
            _teardown(net, names)


def check_private_shm(net: TwoNodes) -> dict[str, Any]:
    """A file made in A's /dev/shm is seen by a second process in A and not by one in B, and
    the host's /dev/shm does not have it: the nodes' /dev/shm are private to each node."""
    name = f"netns-check-{os.getpid()}"
    net.run("A", ["sh", "-c", f"echo x > /dev/shm/{name}"], check=True)
    seen = {n: net.run(n, ["test", "-e", f"/dev/shm/{name}"]).returncode == 0 for n in NODES}
    host = Path("/dev/shm", name).exists()
    net.run("A", ["rm", "-f", f"/dev/shm/{name}"])
    ok = seen["A"] and not seen["B"] and not host
    return {"seen_in_A": seen["A"], "seen_in_B": seen["B"], "seen_on_host": host, "private": ok}


if __name__ == "__main__":  # a self-check: python benchmarks/netns.py [rate_mbit [flow_mbit]]
    import sys

    rate = float(sys.argv[1]) if len(sys.argv) > 1 else None
    flow = float(sys.argv[2]) if len(sys.argv) > 2 else None
    before = netns_list()
    with two_nodes(rate, flow_mbit=flow) as net:
        print(net.ns, net.tbf, net.flows)
        print("shm", check_private_shm(net))
        print(net.run("A", ["ip", "-br", "addr"]).stdout.strip())
        print("\n".join(net.run("A", ["tc", "qdisc", "show", "dev", VETH["A"]]).stdout.splitlines()[:4]))
        print(net.link_bytes("A"))
    print("namespaces before", before, "after", netns_list())
