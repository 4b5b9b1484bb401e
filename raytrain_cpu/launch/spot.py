"""`python -m raytrain_cpu.spot`: turns an EC2 spot interruption notice into a Ray drain.

EC2 announces a spot reclaim about two minutes ahead, in the instance metadata service (IMDS,
`spot/instance-action`), and tells nobody else. Ray learns of a coming preemption only from a
drain request for the node (reason PREEMPTION, with the time the node goes). This watcher runs
beside the raylet on each worker of a `ray up` cluster (cluster/aws-c7i.yaml starts it), polls
IMDS and, on a notice, drains its node. Then:

- the training workers see the notice (`ray.train.get_preemption_info()`, every
  run.preemption_check_every steps) and checkpoint at once;
- at the drain's deadline Ray Train restarts the workers on the nodes left (an elastic run) or
  on the replacement the autoscaler starts, from that checkpoint, and counts no failure
  (FailureConfig.max_preemption_failures=-1).

The deadline is the notice's time less `--margin-s`: Ray counts a node that dies before its
drain's deadline as an unexpected loss, one of run.max_failures, with a restart from the
latest checkpoint Ray had registered. Ending the attempt a little before the reclaim avoids
both. A drain for preemption cannot be refused or undone: the node takes no new work.

It holds no Ray connection while it waits (Ray may restart meanwhile); only a notice makes it
connect, find its node and drain it, then it exits. One watcher a machine (a lock file).

IMDS failing (throttled, restarting, a token request refused) never ends the watch: an ended
watcher leaves its node to be reclaimed with no drain, which Ray counts as a failure. Each failed
request is logged and retried, at the poll interval doubled per failure in a row, up to
BACKOFF_CAP_S. `--log` names the file it writes (the cluster configs name one in Ray's session
log directory, so `ray logs raytrain-spot-watch.log --node-ip IP` shows it).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import socket
import sys
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

IMDS = "http://169.254.169.254"  # the instance metadata service, from inside the instance only
TOKEN_TTL_S = 21600  # IMDSv2 session tokens last up to 6 hours
LOCK = "/tmp/raytrain-spot-watch.lock"
EC2_TIME = "%Y-%m-%dT%H:%M:%SZ"  # how IMDS writes a notice's time (UTC), and how the watcher says times
# The longest wait between IMDS retries: EC2's notice comes about 2 minutes ahead, so a watcher that
# backs off longer could learn of it too late to checkpoint.
BACKOFF_CAP_S = 30.0
# Where say() writes (main's --log); None: stdout. Opened again for each line, so a file under Ray's
# session_latest follows Ray to a new session when it restarts.
LOG_FILE: str | None = None


class SpotError(Exception):
    """The watcher cannot do its job here (no IMDS, no Ray node to drain): says why."""


@dataclass(frozen=True)
class Notice:
    """An interruption notice: what EC2 will do to the instance, and when (epoch seconds)."""

    action: str  # terminate, stop or hibernate
    time: float

    def deadline_ms(self, margin_s: float, now: float) -> int:
        """The drain's deadline: the notice's time less the margin, not before now."""
        return int(max(self.time - margin_s, now) * 1000)


# ----------------------------------------------------------------------------- IMDS (v2: a session token first)


def imds_token(imds: str, timeout_s: float = 2.0) -> str:
    request = urllib.request.Request(
        f"{imds}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return r.read().decode()
    except (urllib.error.URLError, OSError) as e:
        raise SpotError(
            f"no instance metadata service at {imds} ({e}): this watcher runs on an EC2 instance "
            "(IMDSv2 enabled, hop limit >= 1), or with --imds pointing at one"
        ) from e


def instance_action(imds: str, token: str, timeout_s: float = 2.0) -> Notice | None:
    """The pending interruption notice, or None. IMDS answers 404 until EC2 sends one; a 401
    means the token expired (PermissionError: ask for a new one)."""
    request = urllib.request.Request(
        f"{imds}/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        if e.code == 401:
            raise PermissionError("IMDS token expired") from e
        raise
    when = datetime.strptime(body["time"], EC2_TIME).replace(tzinfo=UTC)
    return Notice(body["action"], when.timestamp())


# ----------------------------------------------------------------------------- Ray


def local_node_id(nodes: dict[Any, Any], ip: str) -> str:
    """The hex id of the one live Ray node at `ip` (a machine runs one raylet on a cluster)."""
    from ray.core.generated import gcs_pb2

    alive = gcs_pb2.GcsNodeInfo.ALIVE
    here = [i.node_id.hex() for i in nodes.values() if i.state == alive and i.node_manager_address == ip]
    if len(here) != 1:
        raise SpotError(
            f"{len(here)} live Ray nodes at {ip}, not 1: name the node to drain with --node-id "
            "(`ray list nodes` shows the ids)"
        )
    return here[0]


def drain(address: str, node_id: str | None, notice: Notice, margin_s: float) -> tuple[str, int]:
    """Drains this machine's node (or `node_id`) for preemption; (node id, deadline in epoch ms)."""
    from ray.util import get_node_ip_address

    from raytrain_cpu.compat import ray as ray_compat

    gcs = ray_compat.gcs_client(address)
    node_id = node_id or local_node_id(gcs.get_all_node_info(), get_node_ip_address())
    deadline_ms = notice.deadline_ms(margin_s, time.time())
    message = f"EC2 spot interruption notice: {notice.action} at {_iso(notice.time)}"
    accepted, why = ray_compat.drain_for_preemption(gcs, node_id, message, deadline_ms)
    if not accepted:
        raise SpotError(f"Ray refused to drain node {node_id}: {why}")
    return node_id, deadline_ms


# ----------------------------------------------------------------------------- the watch


def watch(
    imds: str, address: str, node_id: str | None, poll_s: float, margin_s: float, give_up_s: float | None = None
) -> Notice:
    """Polls IMDS until a notice comes, drains the node, returns the notice."""
    say(f"watching {imds} every {poll_s:g} s for a spot interruption notice (drain margin {margin_s:g} s)")
    notice = wait_for_notice(imds, poll_s, give_up_s)
    while True:
        try:
            drained, deadline_ms = drain(address, node_id, notice, margin_s)
            break
        except Exception as e:  # Ray restarting, its GCS busy: the notice stands until its time
            if time.time() >= notice.time:
                raise SpotError(f"could not drain the node before the reclaim: {e}") from e
            say(f"draining the node failed ({e}); trying again")
            time.sleep(poll_s)
    say(
        f"spot notice: {notice.action} at {_iso(notice.time)}; drained Ray node {drained} for preemption, "
        f"deadline {_iso(deadline_ms / 1000)}: the workers checkpoint now and restart elsewhere then"
    )
    return notice


def wait_for_notice(imds: str, poll_s: float, give_up_s: float | None = None) -> Notice:
    """Polls IMDS every `poll_s` until a notice comes. A failed request (the token's or the
    notice's) is logged and retried with backoff (backoff_s); only `give_up_s` seconds of failures
    in a row end the wait (SpotError), and by default nothing does."""
    token: str | None = None
    failures, failing_since = 0, 0.0
    while True:
        fresh = token is None
        try:
            token = token or imds_token(imds)
            notice = instance_action(imds, token)
        except PermissionError as e:  # the token expired (they last 6 hours): a new one at once
            token = None
            if not fresh:
                continue
            failure: Exception = SpotError(f"IMDS refused the token it had just given ({e})")
        except (SpotError, urllib.error.URLError, OSError, ValueError, KeyError) as e:
            failure = e  # IMDS throttles bursts and restarts; a garbled answer is one too
        else:
            if failures:
                say(f"IMDS answers again, after {failures} failed request(s)")
                failures = 0
            if notice is not None:
                return notice
            time.sleep(poll_s)
            continue
        failures += 1
        failing_since = failing_since if failures > 1 else time.monotonic()
        if give_up_s is not None and time.monotonic() - failing_since >= give_up_s:
            raise SpotError(f"{failure} (failing for {give_up_s:g} s, --give-up-s)") from failure
        delay = backoff_s(failures, poll_s)
        say(f"IMDS request failed ({failures} in a row): {failure}; trying again in {delay:g} s")
        time.sleep(delay)


def backoff_s(failures: int, poll_s: float) -> float:
    """The wait after `failures` failed IMDS requests in a row: the poll interval, doubled for each
    failure after the first, at most BACKOFF_CAP_S (or the poll interval, if that is longer)."""
    return min(poll_s * 2 ** min(failures - 1, 32), max(BACKOFF_CAP_S, poll_s))


def say(message: str) -> None:
    """Logs one line: to LOG_FILE when it can be written (Ray's log directory exists only while Ray
    runs), else to stdout."""
    line = f"[raytrain] {time.strftime('%H:%M:%S')} {message}"
    if LOG_FILE is not None:
        try:
            with open(LOG_FILE, "a") as f:
                f.write(line + "\n")
            return
        except OSError:
            pass
    print(line, flush=True)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime(EC2_TIME)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m raytrain_cpu.spot",
        description="On an EC2 spot instance of a Ray cluster: wait for the spot interruption notice, then drain "
        "this node in Ray for preemption, so training checkpoints at once and restarts elsewhere without "
        "counting a failure. Exits after draining.",
    )
    ap.add_argument("--address", default="auto", help="the Ray cluster's GCS address (default: this node's Ray)")
    ap.add_argument("--node-id", default=None, help="the Ray node to drain (default: the one at this machine's IP)")
    ap.add_argument("--imds", default=IMDS, help=f"the instance metadata service (default {IMDS})")
    ap.add_argument("--poll-s", type=float, default=5.0, help="seconds between IMDS polls (default 5)")
    ap.add_argument(
        "--margin-s",
        type=float,
        default=15.0,
        help="end the training attempt this many seconds before the notice's time (default 15)",
    )
    ap.add_argument("--lock", default=LOCK, help=f"one watcher per lock file (default {LOCK})")
    ap.add_argument(
        "--log",
        default=None,
        help="append the log to this file, opened again for each line (default: stdout; stdout also while "
        "the file cannot be written)",
    )
    ap.add_argument(
        "--give-up-s",
        type=float,
        default=None,
        help="exit (code 2) once IMDS has failed this many seconds in a row (default: never; a watcher that "
        "exits leaves its node unwatched)",
    )
    args = ap.parse_args(argv)
    if args.poll_s <= 0 or args.margin_s < 0:
        ap.error("--poll-s must be > 0 and --margin-s >= 0 (a deadline after the reclaim counts it as a failure)")
    if args.give_up_s is not None and args.give_up_s < 0:
        ap.error("--give-up-s must be >= 0 (or left out: never give up)")
    global LOG_FILE
    LOG_FILE = args.log
    with open(args.lock, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"a watcher holds {args.lock} already on {socket.gethostname()}: nothing to do")
            return 0
        try:
            watch(args.imds, args.address, args.node_id, args.poll_s, args.margin_s, args.give_up_s)
        except SpotError as e:
            say(f"error: {e}")
            print(f"error: {e}", file=sys.stderr)
            return 2
        except Exception:  # a bug: its traceback where the watcher's log is read, not only stderr
            say(f"error: the watcher failed:\n{traceback.format_exc()}")
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
