"""Helpers both tiers import (`from helpers import ...`): tiny-run settings, spawned ranks, the
shared runs' settings, a fake EC2 metadata service."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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
    # No placement-group cleaner (an actor, so a process, each run: a fifth of a tiny run's CPU
    # with the dataset manager that LeanTorchTrainer leaves out); the CLI runs keep Ray's default.
    "run.placement_group_cleaner=false",
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


def as_stopped_at(run_dir: Path, step: int, to: Path) -> Path:
    """A copy of a finished run's directory as a run stopped after its checkpoint at `step` left it:
    later checkpoints gone (from Ray Train's record too), no export, metrics.jsonl up to `step`."""
    from raytrain_cpu.checkpoint import layout as ck_layout
    from raytrain_cpu.checkpoint import record as ck_record

    shutil.copytree(run_dir, to)
    later = [p for p in to.glob("checkpoint_0*") if int(p.name.split("_")[1]) > step]
    for p in [*later, to / "export", to / "summary.json"]:
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    ck_record.drop_from_record(to, {p.name for p in later}, ck_layout.checkpoint_dir_name(step))
    rows = (to / "metrics.jsonl").read_text().splitlines()
    (to / "metrics.jsonl").write_text("".join(f"{r}\n" for r in rows if json.loads(r).get("step", 0) <= step))
    return to


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


def child_env(join_session: bool = False) -> dict[str, str]:
    """This environment without console knobs, and without a Ray address (a child process starts
    its own Ray) unless `join_session`: then it keeps the session's (RAY_ADDRESS, which the
    ray_session fixture sets), and the child joins that Ray, as a job under `ray job submit` does."""
    drop = ("RAY_DEDUP_LOGS_ALLOW_REGEX", "RAY_DEDUP_LOGS_SKIP_REGEX", "RAY_DISABLE_WORKER_LOG_PREFIX")
    drop += () if join_session else ("RAY_ADDRESS",)
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
        # shutdown() waits for serve_forever's next look (every 0.5 s by default): each test closes one.
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

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


# ----------------------------------------------------------------------------- a run directory, a stub hub


def fake_run_dir(cfg, step: int = 2, world: int = 2) -> Path:
    """A run directory as run() leaves it after a checkpoint: config.yaml, a checkpoint with its
    manifest (the settings' hash, no shards), and Ray Train's snapshot naming it as the latest."""
    import yaml

    from raytrain_cpu.checkpoint import identity as ck_identity
    from raytrain_cpu.checkpoint import layout as ck_layout
    from raytrain_cpu.compat import ray as ray_compat

    run_dir = cfg.run.run_dir
    ckpt = run_dir / ck_layout.checkpoint_dir_name(step)
    ckpt.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    t = cfg.train
    manifest = {"step": step, "world_size": world, "config_hash": ck_identity.config_hash(cfg.to_dict())}
    manifest["global_batch"] = t.micro_batch_size * t.grad_accum_steps * world
    (ckpt / ck_layout.MANIFEST).write_text(
        json.dumps({**manifest, "format": ck_layout.FORMAT, "ds_tag": ck_layout.DS_TAG, "files": {}})
    )
    snapshot = {"latest_checkpoint_result": {"checkpoint_dir_name": ckpt.name}}
    (run_dir / ray_compat.SNAPSHOT).write_text(json.dumps(snapshot))
    return run_dir


# The stub hub's one public dataset: its parquet files and their git blob ids (a test changes one).
PUBLIC_DATASET = "owner/wiki"


HUB_FILES = {"default/train/0000.parquet": "b" * 40, "default/train/0001.parquet": "c" * 40}


def _hub_tree(folder: str) -> list[dict]:
    """The hub's tree listing of one folder (not recursive), as /api/datasets/<id>/tree/main answers."""
    entries = {}
    for path, oid in HUB_FILES.items():
        rest = path.removeprefix(f"{folder}/" if folder else "")
        if rest == path and folder:
            continue
        if "/" in rest:
            sub = f"{folder}/{rest.split('/')[0]}".strip("/")
            entries[sub] = {"type": "directory", "path": sub, "oid": "d" * 40}
        else:
            entries[path] = {
                "type": "file",
                "path": path,
                "size": 10,
                "oid": oid,
                "lfs": {"oid": oid, "size": 10, "pointerSize": 130},
            }
    return list(entries.values())


@contextlib.contextmanager
def stub_hub_server():
    """A local stand-in for the hub's API, serving its URL: it answers as huggingface.co does for
    PUBLIC_DATASET (HUB_FILES), for a gated repo without a token (401, X-Error-Code GatedRepo) and
    for a repo that does not exist (404, RepoNotFound): the real client, the real HTTP, nothing
    downloaded."""
    import http.server
    import threading
    import urllib.parse

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urllib.parse.urlparse(self.path)
            if url.path.startswith(f"/api/datasets/{PUBLIC_DATASET}"):
                listing = "/tree/main" in url.path
                tree = _hub_tree(urllib.parse.unquote(url.path.partition("/tree/main")[2]).strip("/"))
                if not listing or tree:
                    return self._json(tree if listing else {"id": PUBLIC_DATASET, "sha": "0" * 40})
            gated = "gated" in self.path
            self.send_response(401 if gated else 404)
            missing = "EntryNotFound" if PUBLIC_DATASET in self.path else "RepoNotFound"  # a folder it lacks
            self.send_header("X-Error-Code", "GatedRepo" if gated else missing)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _json(self, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()  # as FakeIMDS
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


# ----------------------------------------------------------------------------- other architectures

# Small enough that a leg costs little more than Ray Train's start-up.
_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**_SHAPE, "num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**_SHAPE, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_SHAPE, "num_key_value_heads": 2, "sliding_window": None}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_SHAPE, "num_key_value_heads": 1, "head_dim": 16}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 64, "n_layer": 2, "n_head": 4}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_SHAPE, "num_key_value_heads": 2}),
}


CONTEXT = 256  # max_position_embeddings / n_positions


def build_model(arch: str, out: Path) -> Path:
    """A randomly initialised `arch` written with save_pretrained (safetensors) + the bundled tokenizer."""
    import torch
    import transformers

    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path

    tok = load_tokenizer(resolve_tokenizer_path("bundled", "tiny"))
    config_cls, model_cls, shape = ARCHS[arch]
    positions = {"n_positions": CONTEXT} if arch == "gpt2" else {"max_position_embeddings": CONTEXT}
    config = getattr(transformers, config_cls)(
        vocab_size=len(tok),
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=None,
        **positions,
        **shape,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------- sharded loading


def loading_tensors() -> dict:
    """Tensors of awkward sizes for a checkpoint that ranks read their ZeRO-3 partitions of."""
    import torch

    return {
        "a.weight": torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5),  # 35: odd, padded partition
        "b.weight": torch.linspace(-1, 1, 3 * 4 * 5).reshape(3, 4, 5).to(torch.bfloat16),
        "norm.weight": torch.tensor([3.5]),  # fewer elements than ranks: rank 1 holds only padding
        "c.bias": torch.arange(8, dtype=torch.float32),
    }


class FakeZero3Model:
    """The attributes `_read_own_partitions` uses of a ZeRO-3 model: partitioned parameters."""

    def __init__(self, shapes: dict, dtype, world: int):
        from types import SimpleNamespace

        import torch

        self.params = {}
        for name, shape in shapes.items():
            numel = shape.numel()
            part = torch.full((-(-numel // world),), float("nan"), dtype=dtype)
            part.ds_numel = part.numel()
            self.params[name] = SimpleNamespace(ds_shape=shape, ds_numel=numel, ds_tensor=part, ds_process_group=None)

    def named_parameters(self):
        return iter(self.params.items())


# ----------------------------------------------------------------------------- chat data


def runs(tok, ids, labels) -> list[tuple[bool, str]]:
    """[(trained, decoded text)] of the maximal runs of tokens that are / are not trained."""
    from raytrain_cpu.data.sft import IGNORE

    out: list[tuple[bool, list[int]]] = []
    for tid, lab in zip(ids, labels):
        assert lab in (IGNORE, tid)  # a label is the token itself (the model shifts) or -100
        if out and out[-1][0] == (lab != IGNORE):
            out[-1][1].append(tid)
        else:
            out.append((lab != IGNORE, [tid]))
    return [(t, tok.decode(run, skip_special_tokens=False)) for t, run in out]


GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}


# ----------------------------------------------------------------------------- attention, fine-tuning, data


def tiny_llama_choosing(attn: str, seq_len: int = 96, dtype=None, **overrides):
    """A tiny Hugging Face Llama (fp32 unless `dtype`) and attention.choose's pick for it: (model,
    chosen, timings)."""
    import torch
    from transformers import LlamaForCausalLM

    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.model.loading import tiny_llama_config
    from raytrain_cpu.model.ops import attention

    cfg = load_config(
        None,
        ["model.tiny.hidden_size=64", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2", "model.tiny.num_layers=2"],
    )
    config = tiny_llama_config(cfg, 256, eos_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(torch.float32 if dtype is None else dtype)
    chosen, timings = attention.choose(model, attn, micro_batch=2, seq_len=seq_len, **overrides)
    return model, chosen, timings


SFT = [
    "data.format=chat",  # the bundled chat examples made from wikitext articles
    "data.seq_len=128",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.warmup_steps=1",
]


WIKI = "\n = Alpha = \n\n Alpha is a letter .\n\n = = History = = \n\n It is old .\n = Beta = \n\n Beta too .\n\n"


def spec(kind="text", bad="error", column="text", wikitext=True):
    from raytrain_cpu.data.sources import SourceSpec

    return SourceSpec(kind, ("x",), column, wikitext, bad)


def cache_of(path, blocks: int, first_value: int, seq_len: int = 4) -> str:
    """A cache split of `blocks` blocks, block i filled with first_value + i."""
    import numpy as np

    from raytrain_cpu.data.prepare import _BlockWriter

    writer = _BlockWriter(path, seq_len)
    for i in range(blocks):
        writer.add(np.full(seq_len, first_value + i, dtype=np.int32))
    writer.close()
    return str(path)
