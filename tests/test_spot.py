"""The spot-notice watcher (raytrain_cpu.spot) against a stand-in for EC2's IMDS (conftest.FakeIMDS).

What a drain does to a training run, on a Ray Cluster: tests/test_fault_tolerance.py's elastic
scenario, whose spot notice comes through this watcher.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from conftest import FakeIMDS

from raytrain_cpu import spot


@pytest.fixture
def imds():
    server = FakeIMDS()
    yield server
    server.close()


def test_no_notice_then_a_notice(imds):
    token = spot.imds_token(imds.url)
    assert spot.instance_action(imds.url, token) is None  # IMDS answers 404 until EC2 sends one
    imds.notice("terminate", at=1_800_000_000)
    assert spot.instance_action(imds.url, token) == spot.Notice("terminate", 1_800_000_000.0)
    imds.expire_token()
    with pytest.raises(PermissionError):
        spot.instance_action(imds.url, token)


def test_the_deadline_leaves_the_margin_and_is_never_past():
    notice = spot.Notice("terminate", 1000.0)
    assert notice.deadline_ms(margin_s=15, now=900.0) == 985_000
    assert notice.deadline_ms(margin_s=15, now=990.0) == 990_000  # a late notice: drain at once


def test_the_watch_renews_its_token_and_stops_at_the_notice(imds, monkeypatch, capsys):
    drained = []

    def drain(*args):  # the first try finds Ray restarting
        drained.append(args)
        if len(drained) == 1:
            raise ConnectionError("GCS unavailable")
        return "n1", 1_799_999_985_000

    monkeypatch.setattr(spot, "drain", drain)
    threading.Timer(0.3, imds.expire_token).start()
    threading.Timer(0.6, imds.notice, ("terminate", 1_800_000_000)).start()
    notice = spot.watch(imds.url, "127.0.0.1:6379", None, poll_s=0.05, margin_s=15)
    assert notice == spot.Notice("terminate", 1_800_000_000.0)
    assert drained == [("127.0.0.1:6379", None, notice, 15)] * 2
    out = capsys.readouterr().out
    assert "draining the node failed (GCS unavailable); trying again" in out
    assert "spot notice: terminate at 2027-01-15T08:00:00Z; drained Ray node n1 for preemption" in out
    assert "deadline 2027-01-15T07:59:45Z" in out


def test_off_ec2_it_says_so_and_exits_2(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert spot.main([f"--imds={closed}", f"--lock={tmp_path / 'lock'}"]) == 2
    err = capsys.readouterr().err
    assert f"error: no instance metadata service at {closed}" in err and "runs on an EC2 instance" in err


def test_a_margin_past_the_reclaim_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        spot.main(["--margin-s=-5"])
    assert e.value.code == 2 and "--margin-s >= 0" in capsys.readouterr().err


def test_one_watcher_a_machine(imds, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(spot, "drain", lambda *args: ("n1", 0))  # no Ray here to drain
    lock = tmp_path / "lock"
    first = threading.Thread(target=spot.main, args=([f"--imds={imds.url}", f"--lock={lock}", "--poll-s=0.05"],))
    first.start()
    deadline = time.time() + 10
    while "watching" not in capsys.readouterr().out and time.time() < deadline:
        time.sleep(0.05)
    assert spot.main([f"--imds={imds.url}", f"--lock={lock}"]) == 0
    assert "a watcher holds" in capsys.readouterr().out
    imds.notice("terminate", at=time.time() + 120)  # the first drains and ends
    first.join(timeout=30)
    assert not first.is_alive()


def test_the_node_to_drain_is_the_one_at_this_machines_ip(ray_session):
    from ray._raylet import GcsClient

    nodes = GcsClient(address=ray_session.get_runtime_context().gcs_address).get_all_node_info()
    ip = ray_session.util.get_node_ip_address()
    assert spot.local_node_id(nodes, ip) == ray_session.get_runtime_context().get_node_id()
    with pytest.raises(
        spot.SpotError, match="0 live Ray nodes at 10.9.9.9, not 1: name the node to drain with --node-id"
    ):
        spot.local_node_id(nodes, "10.9.9.9")


def test_what_the_workers_say_of_a_notice():
    from raytrain_cpu.train import spot_notice_line

    line = spot_notice_line(["cf1fee43d76f928a3afc5482367c94fa"], 1_800_000_000_000, now=1_799_999_990.0)
    assert line == (
        "spot notice: node(s) cf1fee43d76f go at 08:00:00 UTC (in 10 s); checkpointing now. Ray Train then "
        "restarts the workers without them, from this checkpoint (not counted in run.max_failures)"
    )
    assert "go with no deadline;" in spot_notice_line(["cf1fee43d76f928a"], 0, now=0.0)


def test_a_drain_that_keeps_failing_gives_up_at_the_reclaim(imds, monkeypatch):
    def drain(*args):
        raise ConnectionError("GCS unavailable")

    monkeypatch.setattr(spot, "drain", drain)
    imds.notice("terminate", at=time.time() + 0.5)
    with pytest.raises(spot.SpotError, match=r"could not drain the node before the reclaim: GCS unavailable"):
        spot.watch(imds.url, "127.0.0.1:6379", None, poll_s=0.05, margin_s=15)
