"""Checks the driver makes before Ray starts, against files already on disk (no training):
a resume whose model/data/batch settings differ from its checkpoint's (named key by key), a run
already finished, a run directory another job holds, a hub or S3 source that does not answer,
worker resources no node has, a data.seq_len longer than the model's context, a tokenizer that
outgrows the model's embedding, and a run whose planned memory does not fit its nodes or whose
checkpoints do not fit its storage.
This module's in-process tests: tests/unit/test_preflight.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fake_run_dir, stub_hub_server

from raytrain_cpu.config.checks import ConfigError

REPO = Path(__file__).resolve().parents[2]


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m raytrain_cpu.main *argv` in a child; a Ray it started would be a new local one."""
    return subprocess.run(
        [sys.executable, "-m", "raytrain_cpu.main", *argv],
        cwd=REPO,
        env=(env or dict(os.environ)) | {"RAY_ADDRESS": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_exits_2_before_ray(make_config):
    """`python -m raytrain_cpu.main` with a changed setting: exit 2, the old → new values, no Ray."""
    from helpers import fast_overrides

    old = make_config("run.name=r")
    fake_run_dir(old)
    argv = fast_overrides(old.run.storage_path, old.data.cache_dir, "run.name=r")
    p = cli(*argv, "data.seq_len=128")
    assert p.returncode == 2, p.stderr[-2000:]
    assert "error: run.name: run 'r' resumes from" in p.stderr and "data.seq_len: 64 → 128" in p.stderr
    assert "Traceback" not in p.stderr and "[raytrain]" not in p.stdout  # stopped before ray.init


@pytest.mark.parametrize(
    ("override", "key", "what"),
    [
        (
            "model.name_or_path=meta-llama/Meta-Llama-3-8B",
            "model.name_or_path",
            "the model 'meta-llama/Meta-Llama-3-8B'",
        ),
        ("model.tokenizer=openai-community/gpt2", "model.tokenizer", "the tokenizer 'openai-community/gpt2'"),
        ("data.source=hub", "data.hub_id", "the dataset 'wikitext'"),
    ],
)
def test_a_hub_this_machine_cannot_reach_is_one_line_before_ray(make_config, override, key, what):
    """Hub ids (the cluster configs') on a machine whose hub does not answer (HF_ENDPOINT at a
    closed local port: a real refused connection, nothing downloads): exit 2 naming the setting
    and the way round, before Ray starts, and nothing written. It used to be a network traceback
    once Ray had started (and ~45 s of transformers' retries for a tokenizer)."""
    from helpers import fast_overrides

    cfg = make_config()
    argv = fast_overrides(cfg.run.storage_path, cfg.run.storage_path + "/cache", override)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"} | {"HF_ENDPOINT": "http://127.0.0.1:9"}
    p = cli(*argv, env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.startswith(f"error: {key}: cannot reach the Hugging Face hub for {what} (ConnectError: "), p.stderr
    assert "DIR" in p.stderr and len(p.stderr.splitlines()) == 1
    assert "Ray's own logs" not in p.stdout and not Path(cfg.run.storage_path).exists()


@pytest.fixture(scope="module")
def stub_hub():
    """The stub hub's URL for this module's tests (helpers.stub_hub_server)."""
    with stub_hub_server() as url:
        yield url


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "model.name_or_path=owner/gated",
            "model.name_or_path: the model 'owner/gated' is gated on the hub and this machine's token may not read it. "
            "Accept its licence at https://huggingface.co/owner/gated and set HF_TOKEN",
        ),
        ("model.tokenizer=owner/missing", "model.tokenizer: no tokenizer 'owner/missing' on the hub (or it is private"),
        (
            "data.mix=[{source: bundled, weight: 1}, {source: hub, hub_id: owner/gated, weight: 1}]",
            "data.mix[1].hub_id: the dataset 'owner/gated' is gated on the hub and this machine's token may not read "
            "it. Accept its licence at https://huggingface.co/datasets/owner/gated",
        ),
        (("data.source=hub", "data.hub_id=owner/missing"), "data.hub_id: no dataset 'owner/missing' on the hub"),
    ],
)
def test_a_gated_or_missing_hub_repo_is_one_line_before_ray(make_config, stub_hub, override, expected):
    """What the hub answers for a gated model without HF_TOKEN or a misspelt id: exit 2, one line
    naming the setting and the fix, before Ray starts. A dataset's once came as HfFileSystem's
    FileNotFoundError traceback (exit 1)."""
    from helpers import fast_overrides

    cfg = make_config()
    overrides = (override,) if isinstance(override, str) else override
    argv = fast_overrides(cfg.run.storage_path, cfg.run.storage_path + "/cache", *overrides)
    p = cli(*argv, env={k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"} | {"HF_ENDPOINT": stub_hub})
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.startswith(f"error: {expected}") and len(p.stderr.splitlines()) == 1, p.stderr
    assert "Ray's own logs" not in p.stdout


def test_an_s3_path_this_machine_cannot_list_is_one_line_before_ray(make_config):
    """data.path=s3://... where S3 does not answer (AWS_ENDPOINT_URL at a closed local port: a
    real refused connection): exit 2 with AWS's reason and what to check, before Ray starts. It
    used to be pyarrow's traceback."""
    from helpers import fast_overrides

    cfg = make_config()
    argv = fast_overrides(cfg.run.storage_path, cfg.data.cache_dir, "data.source=parquet", "data.path=s3://b/wiki/")
    aws = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    aws |= {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    p = cli(*argv, env=dict(os.environ) | aws)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.startswith("error: data.path: cannot list 's3://b/wiki/' (") and "Could not connect" in p.stderr
    assert "AWS credentials" in p.stderr and len(p.stderr.splitlines()) == 1
    assert "Ray's own logs" not in p.stdout


def test_worker_resources_no_node_of_a_local_ray_has_fail_at_once(ray_session, make_config):
    """A cluster config's node-type resource on one machine (configs/llama3-8b-c7i.yaml's
    c7i_48xl): a local Ray never grows, so the error names it at once (Ray Train used to wait
    for it forever, printing "No available node types can fulfill resource request")."""
    from raytrain_cpu.launch.sizing import worker_nodes

    cfg = make_config("scaling.num_workers=2", "scaling.resources_per_worker={c7i_48xl: 1}")
    with pytest.raises(ConfigError, match=r"^scaling: no node offers 2 workers \{'CPU': 1, 'c7i_48xl': 1.0\}") as e:
        worker_nodes(cfg)
    assert "this process's own Ray has no autoscaler to start more" in str(e.value)
    assert worker_nodes(make_config("scaling.num_workers=2"))  # the node it has
