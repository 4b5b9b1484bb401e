"""The spot-notice watcher (raytrain_cpu.launch.spot) against a stand-in for EC2's IMDS (helpers.FakeIMDS).

What a drain does to a training run, on a Ray Cluster: tests/test_fault_tolerance.py's elastic
scenario, whose spot notice comes through this watcher.
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_spot_e2e.py."""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from helpers import FakeIMDS

from raytrain_cpu.launch import spot


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


def test_off_ec2_it_says_so_and_exits_2_only_when_told_to_give_up(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    args = [f"--imds={closed}", f"--lock={tmp_path / 'lock'}", "--poll-s=0.05", "--give-up-s=0.3"]
    assert spot.main(args) == 2
    out, err = capsys.readouterr()
    assert f"error: no instance metadata service at {closed}" in err and "runs on an EC2 instance" in err
    assert "(failing for 0.3 s, --give-up-s)" in err
    # Retried meanwhile, each failure logged: 0.05 s, then 0.1, 0.2 (the 4th fails at 0.35 s >= 0.3).
    assert "IMDS request failed (1 in a row): no instance metadata service" in out
    assert "IMDS request failed (3 in a row)" in out and "trying again in 0.2 s" in out


def _flaky_token_requests(monkeypatch, fail: set[int]) -> list[int]:
    """Makes the token requests (PUTs) numbered in `fail` (from 1) fail as an unreachable IMDS
    does; the rest reach the fake IMDS. Returns the list of request numbers made so far."""
    real, made = urllib.request.urlopen, []

    def urlopen(request, *args, **kwargs):
        if request.get_method() == "PUT":
            made.append(len(made) + 1)
            if made[-1] in fail:
                raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))
        return real(request, *args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return made


def test_failed_token_requests_and_refreshes_are_retried_with_backoff(imds, monkeypatch, capsys):
    # The first 3 token requests fail (IMDS not up yet), then the 5th and 6th (the refresh after the
    # token expires): the watch goes on through both, logs each failure, and still drains at the notice.
    made = _flaky_token_requests(monkeypatch, fail={1, 2, 3, 5, 6})
    monkeypatch.setattr(spot, "drain", lambda *args: ("n1", 1_799_999_985_000))
    threading.Timer(0.6, imds.expire_token).start()
    threading.Timer(1.4, imds.notice, ("terminate", 1_800_000_000)).start()
    assert spot.watch(imds.url, "127.0.0.1:6379", None, poll_s=0.05, margin_s=15) == spot.Notice(
        "terminate", 1_800_000_000.0
    )
    assert made == [1, 2, 3, 4, 5, 6, 7]
    out = capsys.readouterr().out
    waits = re.findall(r"IMDS request failed \((\d) in a row\): .*Connection refused.*; trying again in (\S+) s", out)
    assert waits == [("1", "0.05"), ("2", "0.1"), ("3", "0.2"), ("1", "0.05"), ("2", "0.1")]
    assert out.count("IMDS answers again, after 3 failed request(s)") == 1
    assert "IMDS answers again, after 2 failed request(s)" in out
    assert "drained Ray node n1 for preemption" in out


def test_the_backoff_doubles_up_to_its_cap(monkeypatch):
    monkeypatch.setattr(spot, "BACKOFF_CAP_S", 30.0)
    assert [spot.backoff_s(n, 5.0) for n in range(1, 6)] == [5.0, 10.0, 20.0, 30.0, 30.0]
    assert spot.backoff_s(10_000, 5.0) == 30.0  # no overflow after a day of failures
    assert spot.backoff_s(3, 60.0) == 60.0  # never faster than the poll interval asked for


def test_a_garbled_answer_is_a_failure_not_the_end(imds, monkeypatch, capsys):
    monkeypatch.setattr(spot, "drain", lambda *args: ("n1", 0))
    imds.action = {"action": "terminate"}  # no time
    threading.Timer(0.3, imds.notice, ("terminate", 1_800_000_000)).start()
    assert spot.watch(imds.url, "127.0.0.1:6379", None, poll_s=0.05, margin_s=15).action == "terminate"
    assert "IMDS request failed (1 in a row): 'time'" in capsys.readouterr().out


def test_the_log_goes_to_its_file_and_follows_a_new_ray_session(imds, tmp_path, monkeypatch, capsys):
    # The cluster configs log to Ray's session_latest/logs (where `ray logs` looks): a link that a
    # restarted Ray points at a new session. Each line goes where the link points when it is written,
    # and to stdout while it points nowhere.
    monkeypatch.setattr(spot, "LOG_FILE", None)
    old, new, latest = tmp_path / "session_1", tmp_path / "session_2", tmp_path / "session_latest"
    old.mkdir(), new.mkdir()
    latest.symlink_to(old)
    log = latest / "raytrain-spot-watch.log"
    monkeypatch.setattr(spot, "LOG_FILE", str(log))
    spot.say("one")
    latest.unlink()
    spot.say("two")  # Ray stopped: no session
    latest.symlink_to(new)
    spot.say("three")
    assert re.fullmatch(r"\[raytrain\] \S+ one\n", (old / log.name).read_text())
    assert "two" in capsys.readouterr().out
    assert (new / log.name).read_text().endswith(" three\n")


def test_main_logs_failures_and_the_drain_to_its_log_file(imds, tmp_path, monkeypatch):
    made = _flaky_token_requests(monkeypatch, fail={1})
    monkeypatch.setattr(spot, "drain", lambda *args: ("n1", 1_799_999_985_000))
    monkeypatch.setattr(spot, "LOG_FILE", None)  # main sets it; monkeypatch puts it back
    imds.notice("terminate", at=1_800_000_000)
    log = tmp_path / "raytrain-spot-watch.log"
    assert spot.main([f"--imds={imds.url}", f"--lock={tmp_path / 'lock'}", "--poll-s=0.05", f"--log={log}"]) == 0
    text = log.read_text()
    assert made == [1, 2]
    assert "IMDS request failed (1 in a row): no instance metadata service" in text
    assert "IMDS answers again, after 1 failed request(s)" in text and "drained Ray node n1" in text


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


def test_what_the_workers_say_of_a_notice():
    from raytrain_cpu.trainer.saving import spot_notice_line

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
