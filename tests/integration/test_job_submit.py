"""`ray job submit` on a real two-node Ray cluster on this machine, as the README runs it.

One module fixture starts the cluster with the `ray` CLI: a head (`ray start --head --block`:
token auth, dashboard on 127.0.0.1, no CPUs, so nothing trains there, as on AWS). One short
training job is submitted to it, with no node yet to train on, as on AWS before the autoscaler
starts the worker types (they start at 0): once the job says it waits for nodes, the test
starts a second node carrying the CPUs and a `trainer` resource, like a c7i worker, as the
autoscaler would. Every port is picked free and each node has its own --temp-dir, so the
cluster neither clashes with nor joins other Rays on the machine and never writes
/tmp/ray/ray_current_cluster. The job is followed with the CLI; two tests read that one job.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import ray.util
from helpers import die_with_parent, fast_overrides

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent  # the venv: `ray`, and the `python` the job's driver runs
STEPS = 3


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _node_ports() -> list[str]:
    """Ports every node opens, chosen free (Ray's defaults, e.g. the agent's 52365, would clash
    with another Ray on this machine); workers bind wherever the OS puts them."""
    nm, om, agent, agent_grpc, runtime_env, metrics = _free_ports(6)
    return [
        f"--node-manager-port={nm}",
        f"--object-manager-port={om}",
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
        "--min-worker-port=0",
        "--max-worker-port=0",
        "--object-store-memory=268435456",
        "--disable-usage-stats",
    ]


def _until(ready, procs: list[subprocess.Popen], timeout: float = 180) -> bool:
    """Whether `ready()` came true before the timeout and while every process lived."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if ready():
            return True
        if any(p.poll() is not None for p in procs):
            return False
        time.sleep(0.5)
    return False


def _tails(root: Path, node: str = "*") -> str:
    """A node's (by default every node's) `ray start`, raylet and GCS logs: why it did not come up."""
    raylet_gcs = ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err")
    logs = [
        *sorted(root.glob(f"{node}.log")),
        *(log for n in raylet_gcs for log in sorted(root.glob(f"{node}/session_2*/logs/{n}"))),
    ]
    return "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}" for log in logs)


def _wait_for(what: str, ready, procs: list[subprocess.Popen], root: Path, timeout: float = 180) -> None:
    t0 = time.time()
    if not _until(ready, procs, timeout):
        pytest.fail(f"{what} did not come up in {time.time() - t0:.0f}s\n{_tails(root)}")


def _dashboard_answers(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/api/version", timeout=2)
    except urllib.error.HTTPError:
        return True  # 401: up, and asking for the token
    except OSError:
        return False
    return True


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stops the `ray start --block` processes this module started, by their pids: SIGTERM makes
    each one stop its own node's processes; anything of theirs still alive after that is killed."""
    tree = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=30)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()  # psutil refuses a pid that another process has taken since
    psutil.wait_procs(alive, timeout=10)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs, token auth on; yields how to talk to it and how to add the `trainer` node."""
    # Short and fresh: Ray's unix sockets live under the temp dir (108-byte path limit).
    root = Path(tempfile.mkdtemp(prefix="rtjob-", dir="/tmp"))
    token = root / "auth_token"
    token.write_text(secrets.token_hex(32))  # what `ray get-auth-token --generate` writes
    # Not the session's Ray (conftest sets RAY_ADDRESS to it) nor a token of the environment.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),  # this cluster's own token, not ~/.ray/auth_token
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # stop at once: no 30 s drain on SIGTERM
    )
    gcs, dash, client = _free_ports(3)
    gcs_address = f"{ray.util.get_node_ip_address()}:{gcs}"  # the address Ray advertises for the head
    url = f"http://127.0.0.1:{dash}"
    outs: list = []
    procs: list[subprocess.Popen] = []
    t0 = time.time()
    try:
        outs.append((root / "head.log").open("w"))
        head = subprocess.Popen(
            [BIN / "ray", "start", "--head", "--block", f"--temp-dir={root / 'head'}", f"--port={gcs}"]
            + ["--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--ray-client-server-port={client}"]
            + ["--num-cpus=0", *_node_ports()],
            env=env,
            preexec_fn=die_with_parent,  # a killed test run leaves no cluster behind
            stdout=outs[-1],
            stderr=subprocess.STDOUT,
        )
        procs.append(head)
        # `ray start` writes its address file once its node is up. The second node starts after
        # the whole head, so the two don't race for the ports each picked free beforehand.
        _wait_for("the head node", (root / "head" / "ray_current_cluster").exists, procs, root)
        _wait_for("the dashboard", lambda: _dashboard_answers(url), procs, root)
        print(f"\ncluster up in {time.time() - t0:.1f}s")

        def add_trainer_node() -> None:  # stopped with the head, first
            procs.insert(0, _start_trainer_node(root, gcs_address, env, outs))

        # Clients find the job API as the README says (RAY_API_SERVER_ADDRESS); the token comes
        # from RAY_AUTH_TOKEN_PATH above.
        yield {
            "env": env | {"RAY_API_SERVER_ADDRESS": url},
            "url": url,
            "gcs_address": gcs_address,
            "root": root,
            "add_trainer_node": add_trainer_node,
        }
    finally:
        t1 = time.time()
        _stop(procs)
        for out in outs:
            out.close()
        print(f"cluster stopped in {time.time() - t1:.1f}s")
        shutil.rmtree(root, ignore_errors=True)


def _start_trainer_node(root: Path, gcs_address: str, env: dict, outs: list, tries: int = 3) -> subprocess.Popen:
    """The second node, with fresh free ports on each try. `ray start` gives its raylet a fixed
    30 s to register (not configurable in Ray 2.60); a raylet that lost a port to another process
    or was starved on a busy CI machine does not register, and the whole `ray start` exits."""
    for attempt in range(1, tries + 1):
        temp = root / f"node{attempt + 1}"
        outs.append((root / f"{temp.name}.log").open("w"))
        node = subprocess.Popen(
            [BIN / "ray", "start", "--block", f"--address={gcs_address}", f"--temp-dir={temp}"]
            + ["--num-cpus=2", '--resources={"trainer": 2}', *_node_ports()],
            env=env,
            preexec_fn=die_with_parent,  # a killed test run leaves no cluster behind
            stdout=outs[-1],
            stderr=subprocess.STDOUT,
        )
        if _until((temp / "ray_current_cluster").exists, [node]):
            return node
        _stop([node])
        print(f"trainer node try {attempt} did not come up:\n{_tails(root, temp.name)}")
    pytest.fail(f"the trainer node did not come up in {tries} tries\n{_tails(root)}")


def _job_log(cluster: dict, sid: str) -> str:
    """The job's driver log as the head keeps it (what `ray job logs` serves): polled from the
    file, as each `ray` command is a Python process that imports Ray (about a core-second here)."""
    logs = sorted((cluster["root"] / "head").glob(f"session_*/logs/job-driver-{sid}.log"))
    return logs[-1].read_text(errors="replace") if logs else ""


def _ray(cluster: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BIN / "ray", *args], env=cluster["env"], capture_output=True, text=True, timeout=timeout, cwd=cluster["root"]
    )


@pytest.fixture(scope="module")
def job(cluster, tmp_path_factory, shared_cache):
    """One short run submitted with `ray job submit --no-wait` and followed with `ray job logs
    --follow`, exactly as the README does it."""
    storage = tmp_path_factory.mktemp("job_runs")
    sid = f"raytrain-test-{secrets.token_hex(4)}"
    overrides = fast_overrides(
        storage,
        shared_cache,
        f"train.max_steps={STEPS}",
        "train.eval_batches=2",
        "run.name=job-submit",
        "scaling.num_workers=2",
        "scaling.cpus_per_worker=0.5",
        "scaling.threads_per_worker=1",
        "scaling.resources_per_worker={trainer: 1}",  # only the second node has it
        "run.placement_group_cleaner=true",  # Ray's default (FAST leaves it out): checked below
    )
    t0 = time.time()
    submit = _ray(
        cluster, "job", "submit", "--no-wait", f"--submission-id={sid}", "--", "python", "-m", "raytrain_cpu.main",
        *overrides,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout + submit.stderr
    # No node can hold a worker yet: the job asks the autoscaler and waits; this test is the autoscaler.
    waiting = "[raytrain] waiting for nodes to hold 2 workers"
    if not _until(lambda: waiting in _job_log(cluster, sid), [], timeout=120):
        _ray(cluster, "job", "stop", sid)
        pytest.fail(f"job {sid} did not wait for nodes:\n{_job_log(cluster, sid)[-5000:]}")
    cluster["add_trainer_node"]()
    try:
        follow = _ray(cluster, "job", "logs", "--follow", sid, timeout=600)
    except subprocess.TimeoutExpired:
        _ray(cluster, "job", "stop", sid)
        pytest.fail(f"job {sid} still running after 600s:\n{_ray(cluster, 'job', 'logs', sid).stdout[-5000:]}")
    status = _ray(cluster, "job", "status", sid)
    print(f"job {sid}: {time.time() - t0:.0f}s from submit to end")
    listed = json.loads(_ray(cluster, "list", "jobs", f"--filter=submission_id={sid}", "--format=json").stdout)
    return {
        "id": sid,
        "job_id": listed[0]["job_id"],
        "status": listed[0]["status"],
        "status_cli": status.stdout + status.stderr,
        "logs": follow.stdout,
        "run_dir": storage / "job-submit",
        "wall_s": time.time() - t0,
    }


def test_job_submit_runs_main(cluster, job):
    assert job["status"] == "SUCCEEDED", f"{job['status_cli']}\n--- logs:\n{job['logs'][-8000:]}"
    assert "succeeded" in job["status_cli"]
    logs = job["logs"]
    assert f"step {STEPS}/{STEPS}" in logs and "== raytrain_cpu summary ==" in logs
    assert "[raytrain] 1 node(s) ready for the workers" in logs  # the one that came while it waited
    # Ray Train's helpers (the placement-group cleaner) found this cluster, not one of the other
    # Rays on the machine: their errors land in the nodes' Ray logs, not in the job's.
    for log in cluster["root"].glob("*/session_2*/logs/**/*"):
        if log.is_file():
            assert "Please specify the one to connect to" not in log.read_text(errors="replace"), log

    run_dir = job["run_dir"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 2
    assert (Path(summary["checkpoint_path"]) / "manifest.json").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))

    # Token auth is on: the job API refuses a request without the token ...
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{cluster['url']}/api/jobs/", timeout=5)
    assert refused.value.code == 401
    # ... and the dashboard (the job API) listens on 127.0.0.1 only, not on the node's address.
    node_ip = cluster["gcs_address"].rsplit(":", 1)[0]
    if node_ip != "127.0.0.1":
        with pytest.raises(OSError):
            socket.create_connection((node_ip, int(cluster["url"].rsplit(":", 1)[1])), timeout=2).close()


def test_training_workers_land_on_the_non_head_node(cluster, job):
    listed = json.loads(_ray(cluster, "list", "nodes", "--format=json").stdout)
    nodes = [n for n in listed if n["state"] == "ALIVE"]  # not a trainer node's failed first try
    head = {n["node_id"] for n in nodes if n["is_head_node"]}
    trainer_nodes = {n["node_id"] for n in nodes if n["resources_total"].get("trainer")}
    assert len(head) == 1 and len(trainer_nodes) == 1 and head != trainer_nodes
    workers = json.loads(
        _ray(
            cluster, "list", "actors", "--filter=class_name=RayTrainWorker", f"--filter=job_id={job['job_id']}",
            "--detail", "--format=json",
        ).stdout
    )  # fmt: skip
    assert len(workers) == 2, workers
    assert {w["node_id"] for w in workers} == trainer_nodes, "training workers must run on the trainer node only"


def test_a_relative_storage_path_in_a_working_dir_job_is_refused(cluster, tmp_path):
    """`ray job submit --working-dir` runs the driver in Ray's unpacked copy of that directory,
    which Ray deletes: a relative run.storage_path (the default ./runs) would put the run's
    checkpoints there. The job fails at once naming it, before Ray Train starts."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("a working directory as a user ships one")
    p = _ray(
        cluster, "job", "submit", f"--working-dir={work}", "--", "python", "-m", "raytrain_cpu.main",
        "run.storage_path=runs", timeout=180,
    )  # fmt: skip
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "error: run.storage_path: 'runs' is relative, and this job runs in Ray's copy of its --working-dir" in out
    assert "working_dir_files" in out and "[raytrain] Ray's own logs" not in out


def test_ray_job_stop_stops_the_run_where_it_can_resume(cluster, job, tmp_path, shared_cache):
    """`ray job stop` sends the driver SIGTERM (SIGKILL after RAY_JOB_STOP_WAIT_TIME_S): the run
    stops as on Ctrl-C, the workers aborted by Ray Train, and the job's log says where it resumes.
    Ray's own SIGTERM handler used to exit mid-call with a stack dump and an abort (exit 134)."""
    from raytrain_cpu.checkpoint.record import latest_reported
    from raytrain_cpu.checkpoint.verify import verify_checkpoint

    sid = f"raytrain-stop-{secrets.token_hex(4)}"
    overrides = fast_overrides(
        tmp_path, shared_cache, "train.max_steps=100000", "train.checkpoint_every=2", "run.name=stopped",
        "scaling.num_workers=1", "scaling.cpus_per_worker=0.5", "scaling.threads_per_worker=1",
        "scaling.resources_per_worker={trainer: 1}",
    )  # fmt: skip
    stop_wait = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})  # the job supervisor's grace
    submit = _ray(
        cluster, "job", "submit", "--no-wait", f"--submission-id={sid}", f"--runtime-env-json={stop_wait}",
        "--", "python", "-m", "raytrain_cpu.main", *overrides,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout + submit.stderr
    run_dir = tmp_path / "stopped"
    if not _until(lambda: latest_reported(run_dir) is not None, [], timeout=240):
        _ray(cluster, "job", "stop", sid)
        pytest.fail(f"job {sid} saved no checkpoint:\n{_ray(cluster, 'job', 'logs', sid).stdout[-5000:]}")
    stop = _ray(cluster, "job", "stop", sid, timeout=120)
    logs = _ray(cluster, "job", "logs", sid).stdout
    assert "was stopped" in stop.stdout + stop.stderr, stop.stdout + stop.stderr + logs[-5000:]
    latest = latest_reported(run_dir)
    assert f"[raytrain] interrupted: run 'stopped' stopped before step 100000; its latest checkpoint is {latest}" in (
        logs
    ), logs[-5000:]
    assert "SIGTERM received" not in logs
    assert verify_checkpoint(latest)["step"] % 2 == 0  # whole: a resume starts there
