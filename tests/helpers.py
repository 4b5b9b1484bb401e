"""Helpers both tiers import (`from helpers import ...`): tiny-run settings, spawned ranks, the
shared runs' settings, a fake EC2 metadata service."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

# Small and quick: ~0.35M parameters, 64-token blocks, a handful of steps.
FAST = [
    "model.dtype=bf16",  # the production path on every machine ('auto' may pick fp32 where bf16 is slow)
    # 'auto' times both attentions at start-up, and at this tiny shape they come out close: runs that
    # tests compare bit for bit must not each take their own pick.
    "model.attention=causal_blocks",
    "data.seq_len=64",
    "train.micro_batch_size=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=4",
    "train.warmup_steps=2",
    # Ray Train's controller notices a tiny run's end (and registers its checkpoints) sooner.
    "run.poll_interval_s=0.25",
]


def fast_overrides(storage, cache, *extra: str) -> list[str]:
    """A fast tiny run's settings: its storage, the session's data cache, FAST, then `extra`."""
    return [f"run.storage_path={storage}", f"data.cache_dir={cache}", *FAST, *extra]


def _run_rank_and_exit(rank: int, rank_fn, *args) -> None:
    """A spawned rank: rank_fn(rank, *args), then out of the process at once. A library thread
    still joinable at interpreter exit can abort the process with "terminate called without an
    active exception" after all of its work is written (seen once in test_export's ranks), and
    torch.multiprocessing reports that SIGABRT as the test's failure."""
    try:
        rank_fn(rank, *args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def forward_backward(module, x, g) -> list:
    """module(x), then its backward from g: [the output, x's gradient, each parameter's gradient]."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(g)
    return [out.detach(), x.grad, *(p.grad for p in module.parameters())]


def spawn_ranks(rank_fn, nprocs: int, *args) -> None:
    """rank_fn(rank, *args) in `nprocs` spawned processes (never forked: the suite's pytest holds
    a Ray driver); raises if one fails."""
    import torch.multiprocessing as mp

    mp.start_processes(_run_rank_and_exit, args=(rank_fn, *args), nprocs=nprocs, start_method="spawn")


def spawn_two_ranks_on_tiny_model(rank_fn, tmp_path, overrides: list[str]) -> None:
    """Writes the tiny model under tmp_path/model and runs rank_fn(rank, port, str(tmp_path),
    overrides) in 2 spawned processes (a real gloo group, no Ray)."""
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.model.loading import write_tiny_model
    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path
    from raytrain_cpu.trainer.engine import free_port

    cfg = load_config(None, overrides)
    write_tiny_model(cfg, load_tokenizer(resolve_tokenizer_path("bundled", "tiny")), tmp_path / "model")
    spawn_ranks(rank_fn, 2, free_port(), str(tmp_path), overrides)


def zero3_steps(engine, batches) -> list[float]:
    """engine(ids, labels=ids), backward and step for each batch: the micro batches' losses."""
    losses = []
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


FUSED_VOCAB = 512  # fused_llama_pair's vocabulary


def fused_llama_pair(dtype=None):
    """A tiny Llama (Hugging Face's, in `dtype`: bf16 unless given) and a copy of it, the same
    weights, with the fused output layer and loss installed (raytrain_cpu.model.ops.loss)."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from raytrain_cpu.model.ops import loss as fused

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=FUSED_VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    hf = LlamaForCausalLM(config).to(dtype or torch.bfloat16)
    ours = copy.deepcopy(hf)
    assert fused.install(ours) is None
    return hf, ours


def fp32_partition_bits(engine) -> list[int]:
    """Every 97th element of the rank's fp32 master partitions, as int32 bits (bit-for-bit checks)."""
    import torch

    flats = engine.optimizer.fp32_partitioned_groups_flat
    return torch.cat([f.detach().reshape(-1) for f in flats]).view(torch.int32).tolist()[::97]


def _processes_of(raylet: str) -> dict[int, str]:
    """Live processes that the raylet with pid `raylet` started: {pid: title}."""
    mark = f"RAY_RAYLET_PID={raylet}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark in (proc / "environ").read_bytes().split(b"\0"):
                found[int(proc.name)] = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _stop_what_ray_left(raylet: str, grace_s: float = 10.0) -> None:
    """Kills, by pid, the session Ray's processes still alive `grace_s` after ray.shutdown(), and
    warns naming them. An actor process can hang while Python tears it down after Ray marked it
    dead (ray-project/ray#52322); once the raylet is gone nothing else stops it, and CI hosts
    would keep a `ray::TrainController` (seen now and then after a whole suite)."""
    import contextlib
    import signal
    import warnings

    deadline = time.time() + grace_s
    while (left := _processes_of(raylet)) and time.time() < deadline:
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if left:
        named = ", ".join(f"{title} (pid {pid})" for pid, title in sorted(left.items()))
        warnings.warn(
            f"killed what the session's Ray left running {grace_s:.0f} s after ray.shutdown(): {named}", stacklevel=1
        )


# ----------------------------------------------------------------------------- the straight run
# One fault-free 2-worker run that several slow tests compare against: the fault runs bit for bit
# (tests/integration/test_fault_tolerance_e2e.py), a single process and the compiled layers within bf16's
# tolerance. Made once per session: each Ray run costs ~20 s here, mostly worker start-up.
STEPS = 64


CKPT_EVERY = 16


BF16_LOSS_TOL = 1e-2  # |other recipe - straight| loss per step, first 20 bf16 steps (measured 8e-4)


def straight_overrides(name: str, storage, cache: str, *extra: str) -> list[str]:
    """The straight run's settings under another run name (and `extra` on top)."""
    return fast_overrides(
        storage,
        cache,
        f"run.name={name}",
        f"train.max_steps={STEPS}",
        f"train.checkpoint_every={CKPT_EVERY}",
        "run.num_to_keep=3",
        # One tokenizer actor leaves a CPU of the 2-CPU test Ray for Ray Data's read tasks.
        "data.tokenize_actors=1",
        *extra,
    )


def train_rows(run_dir) -> list[dict]:
    """metrics.jsonl's training rows (none while the file does not exist yet)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r and "step" in r]


def run_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in train_rows(run_dir)}


# ----------------------------------------------------------------------------- the entry point as a user runs it
# `python -m raytrain_cpu.main` in its own process, with its own Ray, once per session: the console
# test reads its console, the report tests read its run directory. One run for both saves a whole
# run's start-up (~20 s here). Its guards get an injected loss spike at step 12 and a NaN at step 16
# (guards.action=skip), so the same run shows the guards at work and gives the report marks.
CLI_STEPS = 24


CLI_OVERRIDES = [
    f"train.max_steps={CLI_STEPS}",
    "data.seq_len=64",
    "data.tokenize_actors=1",
    "train.micro_batch_size=4",
    "train.log_every=2",
    "train.eval_every=0",  # one evaluation, at the end: evaluations are the slow part here
    "train.eval_batches=4",
    "train.warmup_steps=2",
    "guards.action=skip",
    "guards.loss_window=5",
    "guards.inject=spike@12:50,nan@16",
    "run.poll_interval_s=0.25",  # as FAST
]


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it dies, however it dies
    (a test's teardown stops it otherwise)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def child_env() -> dict[str, str]:
    """This environment without a Ray address or console knobs: a child process starts its own Ray."""
    drop = ("RAY_ADDRESS", "RAY_DEDUP_LOGS_ALLOW_REGEX", "RAY_DEDUP_LOGS_SKIP_REGEX", "RAY_DISABLE_WORKER_LOG_PREFIX")
    return {k: v for k, v in os.environ.items() if k not in drop}


# ----------------------------------------------------------------------------- a stand-in for EC2's IMDS
class FakeIMDS:
    """EC2's instance metadata service as raytrain_cpu.launch.spot reads it (IMDSv2: a token from
    PUT /latest/api/token, then GET .../spot/instance-action with it), on 127.0.0.1. No notice
    until notice() posts one; expire_token() makes the next read answer 401, as IMDS does."""

    def __init__(self) -> None:
        import http.server
        import threading

        imds = self
        self.token, self.action = "t0", None

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self.send_error(400)
                self._send(200, imds.token.encode())

            def do_GET(self) -> None:
                if self.headers.get("X-aws-ec2-metadata-token") != imds.token:
                    return self.send_error(401)
                if self.path != "/latest/meta-data/spot/instance-action" or imds.action is None:
                    return self.send_error(404)
                self._send(200, json.dumps(imds.action).encode())

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def notice(self, action: str, at: float) -> int:
        """Posts a notice that EC2 will `action` the instance at `at`; the time it says (whole seconds)."""
        from raytrain_cpu.launch.spot import EC2_TIME

        self.action = {"action": action, "time": time.strftime(EC2_TIME, time.gmtime(at))}
        return int(at)

    def expire_token(self) -> None:
        self.token += "'"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
