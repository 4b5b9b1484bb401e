"""What every suite and one-off benchmark shares: the bench model's sizes, parameter counts and
MFU, spawned child processes, and the result files (benchmarks/results/<machine>/<name>.{json,md})."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from raytrain_cpu.host import features as host_features
from raytrain_cpu.model import shape as model_shape
from raytrain_cpu.obs.metrics import markdown_table

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
GB = 1e9
# Model and run shapes per --size. '50m': 16 layers of the brief's 512-wide Llama block (53M
# parameters with the 2048-token vocabulary), seq 512, one micro batch of 8 sequences per rank
# per step: train.micro_batch_size's default, what a run gets (the seed recipe trains 1 x 4
# accumulated; `options --variants "micro batch 4"` times the smaller one).
SIZES: dict[str, dict[str, Any]] = {
    "50m": {
        "model": {"hidden_size": 512, "num_layers": 16, "num_heads": 8, "num_kv_heads": 8, "intermediate_size": 1408},
        "seq_len": 512,
        "micro_batch": 8,
        "steps": 8,  # 6 timed after obs_timing.WARMUP_STEPS
        "load_model": {
            "hidden_size": 1536,
            "num_layers": 16,
            "num_heads": 12,
            "num_kv_heads": 12,
            "intermediate_size": 4096,
        },
    },
    "tiny": {
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 176},
        "seq_len": 64,
        "micro_batch": 4,
        "steps": 4,
        "load_model": None,  # a smoke run: the train model's load is enough
        "gemm_min_time_s": 0.02,
    },
}
VOCAB = 2048  # the bundled tokenizer


def model_overrides(shape: dict[str, int], seq_len: int) -> list[str]:
    return [f"model.tiny.{k}={v}" for k, v in shape.items()] + [
        f"model.tiny.max_position_embeddings={max(2048, seq_len)}",
        f"data.seq_len={seq_len}",
    ]


def bench_model_config(shape: dict[str, int], seq_len: int) -> tuple[Any, Any]:
    """(the run's Config, its LlamaConfig on SDPA attention, before any attention.choose) for the
    runs outside the trainer.

    The LlamaConfig is built as write_tiny_model builds the training runs' model (untied unless
    configured); the eos id only names a token, it changes no shape.
    """
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.model.loading import tiny_llama_config

    cfg = load_config(None, model_overrides(shape, seq_len))
    config = tiny_llama_config(cfg, VOCAB, eos_token_id=0)
    config._attn_implementation = "sdpa"
    config.use_cache = False  # as the trainers' loader sets it: no key/value cache built in training
    return cfg, config


def n_params(shape: dict[str, int], vocab: int = VOCAB) -> dict[str, int]:
    """Parameter counts of an untied Llama (raytrain_cpu.model.loading.count_parameters, without a file)."""
    return model_shape.ModelShape(
        "",
        vocab,
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_layers"],
        shape["num_heads"],
        shape["num_kv_heads"],
        attention_head_dim=model_shape.config_head_dim(shape),
    ).parameter_counts()


def mfu_of(tokens_per_s: float, params: dict[str, int], seq_len: int, peak_per_worker: float, world: int) -> float:
    """MFU = (6N + 12·L·d·seq) · tokens/s ÷ (measured GEMM peak of one worker × workers)."""
    from raytrain_cpu.obs.metrics import mfu

    return mfu(tokens_per_s, params, seq_len, peak_per_worker * world) or 0.0


def package_versions() -> dict[str, str]:
    """The stack's versions, recorded with every result (a lent machine may carry another torch)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "deepspeed", "ray", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "none"
    return out


def results_file(stem: str, feats: host_features.CpuFeatures | None = None) -> Path:
    """benchmarks/results/<this machine>/<stem>.json: one folder per machine (model and best matrix ISA)."""
    return RESULTS / (feats or host_features.cpu_features()).slug / f"{stem}.json"


def report_script(script: str, json_path: str | None, **fields: Any) -> None:
    """Writes and prints the result of benchmarks/<script>.py (write_results, named after the
    script): its command line as run, this machine, the package versions, then `fields`."""
    result = {
        "command": f"python benchmarks/{script}.py " + " ".join(portable_args(None, json_path)),
        "machine": host_features.cpu_features().describe(),
        "versions": package_versions(),
        **fields,
    }
    print(write_results(script, result, json_path).with_suffix(".md").read_text())


def write_results(suite: str, result: dict[str, Any], json_path: str | None, workdir: Path | None = None) -> Path:
    """<suite>.json plus <suite>.md (the tables) in this machine's folder of benchmarks/results
    (`host_features.CpuFeatures.slug`: model and best matrix ISA), or at --json.

    Paths under the scratch directory are recorded as <workdir>/...: results are committed,
    and this machine's temporary paths mean nothing elsewhere.
    """
    path = Path(json_path) if json_path else results_file(suite)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2, default=str)
    if workdir is not None:
        text = text.replace(str(workdir), "<workdir>")
    path.write_text(text)
    command = result["command"].replace(str(workdir), "<workdir>") if workdir is not None else result["command"]
    md = [f"# raytrain_cpu bench: {suite}", "", f"`{command}` on {result['machine']}", ""]
    if "versions" in result:
        md += [", ".join(f"{k} {v}" for k, v in result["versions"].items()), ""]
    for name, table in result.get("tables", {}).items():
        md += [f"## {name}", "", markdown_table(table), ""]
    md += [f"- {n}" for n in result.get("notes", [])]
    path.with_suffix(".md").write_text("\n".join(md) + "\n")
    return path


BREAKDOWN_COLUMNS = [
    "variant",
    "workers",
    "threads",
    "dtype",
    "tokens_per_s",
    "step_s",
    "data_wait_s",
    "forward_s",
    "backward_s",
    "optimizer_step_s",
    "comm_s",
    "other_s",
]


def tokens_per_step(run: dict[str, Any]) -> int:
    """A training run's tokens per step, all workers': its tokens/s is tokens per step over the
    mean step time, so this is the run's exact batch."""
    return round(run["tokens_per_s"] * run["step_s"])


def in_rep_order(variants: Iterable, rep: int) -> list:
    """The variants in repetition `rep`'s order: as given in even repetitions, reversed in odd
    ones, so that each holds each place equally often over an even number of repetitions: the
    same settings can run faster second than first in a pair (benchmarks/results/*/options-order.md)."""
    ordered = list(variants)
    return ordered[::-1] if rep % 2 else ordered


def run_procs(
    target: Callable, n: int, args: tuple, env: dict[str, str] | None = None, timeout_s: float = 3600
) -> list[Any]:
    """target(i, *args, queue) in n spawned processes at once (i = 0..n-1); their results in order.

    Each child puts (i, result) on the queue. `env` is added to the children's environment: a
    spawned child inherits this process's environment at start, which is the only point an
    LD_PRELOAD allocator can still take effect; the parent's own is restored right after. A
    child that dies without a result (an exception, the OOM killer) raises here instead of
    leaving the others waiting.
    """
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(i, *args, q)) for i in range(n)]
    env = env or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < n:
        try:
            i, res = q.get(timeout=5)
            results[i] = res
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(procs) if i not in results and not p.is_alive()]
            if dead:
                code = procs[dead[0]].exitcode
                raise RuntimeError(f"{target.__name__} [{dead[0]}] exited with code {code} and no result") from None
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise TimeoutError(f"{target.__name__} gave no result in {timeout_s:.0f}s") from None
    for p in procs:
        p.join()
    return [results[i] for i in range(n)]


def portable_args(argv: list[str] | None, json_path: str | None) -> list[str]:
    """The command line as recorded in results: --json's path (this machine's) as <json>."""
    return ["<json>" if a == json_path else a for a in (argv if argv is not None else sys.argv[1:])]


def chosen_variants(args: argparse.Namespace) -> set[str]:
    """--variants as a set of names ("a, b" and "a,b" alike); empty when none were given."""
    return {name.strip() for name in args.variants.split(",") if name.strip()}
