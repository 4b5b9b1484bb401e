"""`python -m raytrain_cpu.bench [gemm|train|load|scaling|placement|options|seed|lora|dpo|reference|all]`: CPU benchmarks.

Every comparison is measured side by side in one invocation (the machines this runs on are
often shared, so absolute figures drift; ratios taken minutes apart hold). Results go to
benchmarks/results/<machine>/<suite>.json and a markdown table next to it (or --json PATH),
<machine> naming the CPU model and its best matrix ISA (e.g. amd-epyc-avx512_bf16).

* gemm      bf16 and fp32 GEMM FLOP/s at the model's own training GEMM shapes (forward,
            input-gradient and weight-gradient products), in one process per worker running
            at the same time with each worker's threads: the peak MFU is measured against.
* train     tokens/s, MFU and the step-time breakdown (data wait, forward, backward,
            optimizer step, and the collectives inside them) of the ~50M Llama at seq 512.
* load      peak RSS of each rank during ZeRO-3 sharded loading, against a naive full load
            of the same model, and the bound 2*params/world + largest tensor + 1.5 GB.
* scaling   tokens/s at 1 and 2 workers with the same threads per worker, beside the host's
            own ceiling: plain PyTorch in 1 process against 2 at once (--repeats N: N rounds
            in turn, the median round's figures).
* placement this project's thread placement against Ray's plain settings (and pinning).
* options   torch.compile (per layer or the whole model), per-module ZeRO-3 gathers,
            activation checkpointing, bf16, the per-tensor AdamW loop and glibc malloc
            (fixed or dynamic mmap threshold) against the defaults.
* seed      this project against the seed recipe (HF Trainer + DeepSpeed ZeRO-3 with CPU
            offload, padded batches), interleaved ours, seed, ours: useful and raw tokens/s.
* lora      LoRA (r=16, every projection) against full fine-tuning: tokens/s, peak RSS per
            rank, optimizer state bytes per rank, trainable parameters.
* dpo       DPO and SimPO against SFT on the same pairs (SFT on the chosen answers), full
            fine-tuning (a frozen copy of the model as DPO's reference; SimPO has none) and
            LoRA r=16 (adapters off), each DPO also with its reference precomputed, and full
            DPO against LoRA DPO: tokens/s, step breakdown, peak RSS per rank, the precomputing
            pass's seconds (`--variants` picks some: SFT,DPO,SimPO,...).
* reference the 2-worker ZeRO-3 run against plain single-process PyTorch (no DeepSpeed, no
            Ray) on the same model, dtype, tokens per step and cores, interleaved zero3,
            reference, zero3: tokens/s per core and their ratio (issue 12's goal: >= 0.95).
            bf16 runs get two references, autocast and bf16 weights with fp32 master
            weights; `--variants compile` adds torch.compile on the faster of them.

--size tiny runs everything on a 0.4M-parameter model in seconds (the smoke test).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from statistics import median
from typing import Any

from raytrain_cpu.host import cpu
from raytrain_cpu.obs.metrics import flops_per_token, markdown_table
from raytrain_cpu.planner.memory import ModelShape, config_head_dim

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GB = 1e9

# Model and run shapes per --size. '50m': 16 layers of the brief's 512-wide Llama block (53M
# parameters with the 2048-token vocabulary), seq 512, one micro batch of 8 sequences per rank
# per step: train.micro_batch_size's default, what a run gets (the seed recipe trains 1 x 4
# accumulated; 4 here until 2026-11-27, `options --variants "micro batch 4"`).
SIZES: dict[str, dict[str, Any]] = {
    "50m": {
        "model": {"hidden_size": 512, "num_layers": 16, "num_heads": 8, "num_kv_heads": 8, "intermediate_size": 1408},
        "seq_len": 512,
        "micro_batch": 8,
        "steps": 8,  # 6 timed after cpu.WARMUP_STEPS
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
# jemalloc returning freed pages after 30 s unused, from its background thread (raytrain's
# MALLOC_CONF until cpu.JEMALLOC_CONF kept them; the cluster images' still).
JEMALLOC_DECAY_30S = "background_thread:true,metadata_thp:auto,dirty_decay_ms:30000,muzzy_decay_ms:30000"


# ----------------------------------------------------------------------------- shared helpers


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
    d, L = shape["hidden_size"], shape["num_layers"]
    heads, kv = shape["num_heads"], shape["num_kv_heads"]
    # plan.ModelShape's layer: q and o at heads x head_dim (a size's own head_dim, where it names one).
    dims = ModelShape("", vocab, d, shape["intermediate_size"], L, heads, kv, attention_head_dim=config_head_dim(shape))
    per_layer = sum(dims.layer_param_numels())
    return {
        "total": 2 * vocab * d + L * per_layer + d,
        "non_embedding": vocab * d + L * per_layer + d,
        "num_layers": L,
        "hidden_size": d,
        "attention_width": dims.q_dim,
    }


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


def results_file(stem: str, feats: cpu.CpuFeatures | None = None) -> Path:
    """benchmarks/results/<this machine>/<stem>.json: one folder per machine (model and best matrix ISA)."""
    return RESULTS / (feats or cpu.cpu_features()).slug / f"{stem}.json"


def report_script(script: str, json_path: str | None, **fields: Any) -> None:
    """Writes and prints the result of benchmarks/<script>.py (write_results, named after the
    script): its command line as run, this machine, the package versions, then `fields`."""
    result = {
        "command": f"python benchmarks/{script}.py " + " ".join(_portable_args(None, json_path)),
        "machine": cpu.cpu_features().describe(),
        "versions": package_versions(),
        **fields,
    }
    print(write_results(script, result, json_path).with_suffix(".md").read_text())


def write_results(suite: str, result: dict[str, Any], json_path: str | None, workdir: Path | None = None) -> Path:
    """<suite>.json plus <suite>.md (the tables) in this machine's folder of benchmarks/results
    (`cpu.CpuFeatures.slug`: model and best matrix ISA), or at --json.

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


# ----------------------------------------------------------------------------- gemm


def _gemm_worker(rank: int, threads: int, gemms: list[cpu.Gemm], rounds: int, min_time_s: float, out) -> None:
    import torch

    torch.set_num_threads(threads)
    best: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):  # dtypes alternate, so drift on a shared machine hits both alike
        for dtype in (torch.bfloat16, torch.float32):
            r = cpu.gemm_probe(gemms, dtype, min_time_s)
            if r["flops_per_s"] > best.get(r["dtype"], {}).get("flops_per_s", 0.0):
                best[r["dtype"]] = r
    out.put((rank, best))


def gemm_peak(
    shape: dict[str, int], tokens: int, workers: int, threads: int, rounds: int = 2, min_time_s: float = 0.2
) -> dict[str, Any]:
    """GEMM FLOP/s of one worker's threads at the model's training GEMM shapes, all workers at once.

    One process per worker runs concurrently, as the training workers do (they share the
    memory bandwidth and, here, the last-level cache). Returns the per-worker mean per dtype.
    """
    gemms = cpu.llama_gemms(
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_heads"],
        shape["num_kv_heads"],
        VOCAB,
        shape["num_layers"],
        tokens,
    )
    results = _run_procs(_gemm_worker, workers, (threads, gemms, rounds, min_time_s))
    out: dict[str, Any] = {"workers": workers, "threads_per_worker": threads, "tokens": tokens}
    for dtype in ("bfloat16", "float32"):
        per = [r[dtype] for r in results]
        out[dtype] = {
            "flops_per_s_per_worker": sum(p["flops_per_s"] for p in per) / len(per),
            "best_shape_flops_per_s_per_worker": sum(p["best_flops_per_s"] for p in per) / len(per),
            "per_worker": [p["flops_per_s"] for p in per],
            "shapes": per[0]["shapes"],
        }
    out["bf16_over_fp32"] = out["bfloat16"]["flops_per_s_per_worker"] / out["float32"]["flops_per_s_per_worker"]
    return out


def gemm_threads(workers: int) -> int:
    """Each GEMM process's threads: its share of the cores this process may use."""
    return max(1, cpu.cpu_features().usable_cores // workers)


def gemm_rows(g: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for dtype in ("bfloat16", "float32"):
        d = g[dtype]
        rows.append(
            {
                "dtype": dtype,
                "workers x threads": f"{g['workers']} x {g['threads_per_worker']}",
                "GFLOP/s per worker (model GEMM mix)": d["flops_per_s_per_worker"] / 1e9,
                "GFLOP/s per worker (best shape)": d["best_shape_flops_per_s_per_worker"] / 1e9,
            }
        )
    return rows


# ----------------------------------------------------------------------------- training runs


class Runner:
    """Runs raytrain_cpu.launch.driver.run with bench overrides; one Ray for all runs, one data cache."""

    def __init__(self, size: str, workdir: Path, extra: list[str], keep_checkpoints: bool = False):
        self.size, self.spec = size, SIZES[size]
        self.workdir = workdir
        self.extra = extra
        self.keep_checkpoints = keep_checkpoints
        self.stamp = time.strftime("%H%M%S")

    def base(self) -> list[str]:
        s = self.spec
        return [
            f"run.storage_path={self.workdir / 'runs'}",
            f"data.cache_dir={self.workdir / 'data_cache'}",
            f"model.compile_cache_dir={self.workdir / 'inductor_cache'}",
            *model_overrides(s["model"], s["seq_len"]),
            f"train.micro_batch_size={s['micro_batch']}",
            f"train.max_steps={s['steps']}",
            "train.warmup_steps=1",
            "train.log_every=1",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.checkpoint_every=0",
            "train.profile_breakdown=true",
            "data.tokenize_actors=1",
            "metrics.tensorboard=false",
        ]

    def check_overrides(self) -> None:
        """The user's key=value overrides over the bench's own, as every run reads them: a
        misspelt key stops here with config's message instead of after the first suite's work."""
        from raytrain_cpu.config.schema import load_config

        load_config(None, [*self.base(), *self.extra, "run.name=bench-check"])

    def run(self, name: str, overrides: list[str]) -> dict[str, Any]:
        from raytrain_cpu.config.schema import load_config
        from raytrain_cpu.launch.driver import run

        cfg = load_config(None, [*self.base(), *self.extra, *overrides, f"run.name=bench-{name}-{self.stamp}"])
        print(f"[bench] {name}: {' '.join(overrides) or 'defaults'}", flush=True)
        t0 = time.perf_counter()
        s = run(cfg)
        if not self.keep_checkpoints:
            drop_checkpoints(Path(s["run_dir"]))
        bd = s["step_breakdown"]
        params = n_params(self.spec["model"])
        row = {
            "variant": name,
            "overrides": " ".join(overrides).replace(str(REPO), "<repo>"),  # as recorded: no machine's paths
            "workers": s["world_size"],
            "threads": s["scaling"]["threads_per_worker"],
            "dtype": s["cpu"]["dtype"]["dtype"],
            "allocator": s["cpu"]["allocator"],
            "compiled": s.get("compiled", False),
            "pinned": s["cpu"]["placement"]["pinned_cpus"],
            "tokens_per_s": bd["tokens_per_s"],
            "tokens_per_s_incl_overheads": s["tokens_per_s"],
            "step_s": bd["step_wall_s"],
            "data_wait_s": bd["data_wait_s"],
            "forward_s": bd["forward_s"],
            "backward_s": bd["backward_s"],
            "optimizer_step_s": bd["optimizer_step_s"],
            "comm_s": bd["comm_s"],
            "other_s": bd["other_s"],
            "steps_timed": bd["steps"],
            "final_loss": s["final_loss"],
            "reference_pass_s": (s.get("reference_pass") or {}).get("seconds"),  # DPO's precomputed reference
            "load_peak_rss_gb": max(s["cpu"]["load_peak_rss_bytes"]) / GB,
            "train_peak_rss_gb_max_rank": _train_peak_rss_gb(s["run_dir"]),
            "malloc": s["cpu"].get("malloc", s["cpu"]["allocator"]),
            "probe_peak_flops_per_worker": s["cpu"]["dtype"]["peak_flops_per_s"],
            "in_step_peak_flops_per_worker": bd.get("peak_flops_per_s"),  # train.mfu_probe_every
            "in_step_mean_flops_per_worker": bd.get("mean_gemm_flops_per_s"),
            "mfu_vs_worker_probe": mfu_of(
                bd["tokens_per_s"] or 0.0,
                params,
                self.spec["seq_len"],
                s["cpu"]["dtype"]["peak_flops_per_s"],
                s["world_size"],
            ),
            "wall_s": time.perf_counter() - t0,
            "run_dir": s["run_dir"],
        }
        print(f"[bench] {name}: {row['tokens_per_s']:.0f} tokens/s, step {row['step_s']:.2f}s", flush=True)
        return row


def drop_checkpoints(run_dir: Path) -> None:
    """Removes a bench run's checkpoints, which no bench resumes: the final save holds the
    weights with their fp32 copies and AdamW moments (~0.8 GB at 50m), and a suite of repeated
    variants in one workdir would fill a small disk. Its summary, metrics and base model stay."""
    import shutil

    for ckpt in run_dir.glob("checkpoint_*"):
        shutil.rmtree(ckpt, ignore_errors=True)


def _train_peak_rss_gb(run_dir: str) -> float | None:
    """The training high-water mark of the rank that peaked highest (metrics.jsonl's memory rows)."""
    from raytrain_cpu.obs.metrics import read_metrics

    peaks = [m["mem_peak_max_gib"] for m in read_metrics(run_dir).train if "mem_peak_max_gib" in m]
    return max(peaks) * 2**30 / GB if peaks else None


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


def suite_train(r: Runner, args) -> dict[str, Any]:
    spec = r.spec
    tokens = spec["micro_batch"] * spec["seq_len"]
    threads = gemm_threads(args.workers)
    g_before = gemm_peak(spec["model"], tokens, args.workers, threads)
    # The workers time their GEMM mix after every step too: the host's rate drifts within minutes,
    # and only that timing sits next to the steps (the peaks around the run bracket them).
    row = r.run("train", [f"scaling.num_workers={args.workers}", "train.mfu_probe_every=1"])
    g_after = gemm_peak(spec["model"], tokens, args.workers, row["threads"])
    params = n_params(spec["model"])
    fpt = flops_per_token(params, spec["seq_len"])
    peaks = {
        f"{dtype} GEMM peak": (g_before[dtype]["flops_per_s_per_worker"] + g_after[dtype]["flops_per_s_per_worker"]) / 2
        for dtype in ("bfloat16", "float32")
    }
    in_steps, in_steps_mean = row["in_step_peak_flops_per_worker"], row["in_step_mean_flops_per_worker"]
    if in_steps:
        peaks[f"{row['dtype']} GEMM mix timed after each step (in the workers)"] = in_steps
        # The host's average over those timings, not their best batches (cpu.time_training_mix).
        peaks[f"{row['dtype']} GEMM mix timed after each step, mean rate"] = in_steps_mean
    mfu_rows = [
        {
            "against": against,
            "peak GFLOP/s per worker": peak / 1e9,
            "tokens/s": row["tokens_per_s"],
            "model GFLOP per token": fpt / 1e9,
            "MFU": mfu_of(row["tokens_per_s"], params, spec["seq_len"], peak, row["workers"]),
        }
        for against, peak in peaks.items()
    ]
    bd_total = row["step_s"]
    shares = {
        k: (row[k] or 0.0) / bd_total
        for k in ("data_wait_s", "forward_s", "backward_s", "optimizer_step_s", "comm_s", "other_s")
    }
    return {
        "params": params,
        "flops_per_token": fpt,
        # MFU against the rate the workers timed next to their steps (None where they timed none)
        "mfu_in_steps": mfu_of(row["tokens_per_s"], params, spec["seq_len"], in_steps, row["workers"])
        if in_steps
        else None,
        "mfu_in_steps_mean_rate": mfu_of(row["tokens_per_s"], params, spec["seq_len"], in_steps_mean, row["workers"])
        if in_steps_mean
        else None,
        "gemm_before": g_before,
        "gemm_after": g_after,
        "run": row,
        "tables": {
            "GEMM peak (before training)": gemm_rows(g_before),
            "GEMM peak (after training)": gemm_rows(g_after),
            "MFU": mfu_rows,
            "step-time breakdown (s per optimizer step, mean over ranks; comm is inside forward/backward/step)": [
                {k: row[k] for k in BREAKDOWN_COLUMNS}
            ],
            "shares of the step": [shares],
        },
    }


def suite_gemm(r: Runner, args) -> dict[str, Any]:
    spec = r.spec
    tokens = spec["micro_batch"] * spec["seq_len"]
    g = gemm_peak(
        spec["model"],
        tokens,
        args.workers,
        gemm_threads(args.workers),
        rounds=3,
        min_time_s=spec.get("gemm_min_time_s", 0.2),
    )
    return {
        "gemm": g,
        "tables": {
            "GEMM peak": gemm_rows(g),
            "per shape (bf16, worker 0)": g["bfloat16"]["shapes"],
            "per shape (fp32, worker 0)": g["float32"]["shapes"],
        },
    }


def tokens_per_step(run: dict[str, Any]) -> int:
    """A training run's tokens per step, all workers': its tokens/s is tokens per step over the
    mean step time, so this is the run's exact batch."""
    return round(run["tokens_per_s"] * run["step_s"])


def suite_scaling(r: Runner, args) -> dict[str, Any]:
    """1 worker x 1 thread against 2 workers x 1 thread: the same cores per worker; beside it
    the host's own ceiling, plain PyTorch (one worker's micro batch, its dtype and compile, no
    DeepSpeed or Ray) in 1 process alone against 2 copies at once. Two busy cores of a small
    VM share caches, memory bandwidth and the hypervisor's slices: on the native 2-core AMX host
    two copies ran at 0.83-0.97 of one alone (median 0.89 over five rounds), which no change to
    the training can win back. With --repeats N everything runs in N rounds, in turn first and
    last (in_rep_order), and each figure is the median of the rounds': the host's speed drifts
    over minutes, and single rounds of the same code there ranged from 0.60 to 0.95."""
    rounds: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        got: dict[str, Any] = {}
        for name in in_rep_order(("scale-1", "scale-2", "host"), rep):
            if name == "host":
                # Its settings (dtype, compile, batch) are the first round's 1-worker run's: the first to run.
                got["host"] = _host_ceiling(r, (rounds[0] if rounds else got)["scale-1"])
            else:
                ov = [f"scaling.num_workers={name[-1]}", "scaling.threads_per_worker=1"]
                got[name] = r.run(name if rep == 0 else f"{name}-{rep}", ov) | {"variant": name, "rep": rep}
        rounds.append(got)
    return _scaling_report(rounds)


def _host_ceiling(r: Runner, run: dict[str, Any]) -> dict[str, Any]:
    """Plain PyTorch at one worker's share of `run` (a training run's row), alone and 2 at once."""
    batch = tokens_per_step(run) // run["workers"] // r.spec["seq_len"]
    recipe = "bf16_master" if run["dtype"] == "bf16" else "autocast"  # the faster bf16 recipe on every host so far
    kw = {
        "compile": bool(run.get("compiled")),
        "precision": recipe,
        "allocator": run["allocator"],
        "compile_cache_dir": str(r.workdir / "inductor_cache"),
    }
    steps = r.spec["steps"] - cpu.WARMUP_STEPS
    out = {}
    for n in (1, 2):
        print(
            f"[bench] host ceiling: {n} plain PyTorch process(es), {batch} x {r.spec['seq_len']} tokens each",
            flush=True,
        )
        res = reference_runs(r.spec, run["dtype"], 1, batch, steps, processes=n, **kw)
        out[n] = [x["tokens_per_s"] for x in res]
        print(f"[bench] host ceiling: {', '.join(f'{t:.0f}' for t in out[n])} tokens/s", flush=True)
    return {"alone": out[1][0], "together": out[2], "recipe": recipe + (" + compile" if kw["compile"] else "")}


def _scaling_report(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each round's efficiencies and the medians over the rounds."""
    rows = []
    for rep, x in enumerate(rounds):
        one, two, host = x["scale-1"], x["scale-2"], x["host"]
        eff = two["tokens_per_s"] / (2 * one["tokens_per_s"])
        host_eff = sum(host["together"]) / (2 * host["alone"])
        rows.append(
            {
                "round": rep,
                "tokens/s at 1": one["tokens_per_s"],
                "tokens/s at 2": two["tokens_per_s"],
                "efficiency = t2 / (2 t1)": eff,
                "step time added at 2 workers (s)": two["step_s"] - one["step_s"],
                "host: plain PyTorch alone": host["alone"],
                "host: 2 at once": ", ".join(f"{t:,.0f}" for t in host["together"]),
                "host efficiency": host_eff,
                "host efficiency, slower copy": min(host["together"]) / host["alone"],
                "efficiency / host's": eff / host_eff,
            }
        )
    med = {
        k: median(x[k] for x in rows) for k in ("efficiency = t2 / (2 t1)", "host efficiency", "efficiency / host's")
    }
    runs = [x[k] for x in rounds for k in ("scale-1", "scale-2")]
    return {
        "runs": runs,
        "host": [x["host"] for x in rounds],
        "efficiency": med["efficiency = t2 / (2 t1)"],
        "round_efficiencies": [x["efficiency = t2 / (2 t1)"] for x in rows],
        "host_efficiency": med["host efficiency"],
        "efficiency_vs_host": med["efficiency / host's"],
        "tables": {
            "scaling (1 thread per worker)": [{k: x[k] for k in BREAKDOWN_COLUMNS} for x in runs],
            "efficiency, each round": rows,
            "medians over the rounds": [{"rounds": len(rows), "host recipe": rounds[0]["host"]["recipe"], **med}],
        },
    }


def in_rep_order(variants: Iterable, rep: int) -> list:
    """The variants in repetition `rep`'s order: as given in even repetitions, reversed in odd
    ones, so that each holds each place equally often over an even number of repetitions. The
    same settings ran 1.02x and 1.05x faster second than first in a pair (AMD Zen 5, `bench
    options --variants model.dtype=bf16 --repeats 2`, options-order.md there)."""
    ordered = list(variants)
    return ordered[::-1] if rep % 2 else ordered


def suite_placement(r: Runner, args) -> dict[str, Any]:
    """This project's default placement vs Ray's plain settings vs pinned, interleaved twice."""
    from raytrain_cpu.launch.driver import local_ray_cpus

    cpus = local_ray_cpus() or os.cpu_count() or 1  # what a local Ray offers
    ray_threads = max(1, math.floor(max((cpus - 1) / 2, 0)))  # Ray's OMP_NUM_THREADS: floor of the worker's CPUs, min 1
    variants = {
        "raytrain default": [],
        "ray plain": [
            "scaling.allocator=system",
            "scaling.pin_cores=false",
            f"scaling.threads_per_worker={ray_threads}",
        ],
        "pinned": ["scaling.pin_cores=true"],
    }
    rows = []
    for rep in range(args.repeats):
        for name, ov in in_rep_order(variants.items(), rep):
            rows.append(r.run(f"{name.replace(' ', '-')}-{rep}", ov) | {"variant": name, "rep": rep})
    return {"runs": rows, "tables": {"placement": _compare(rows, "raytrain default")}}


# The options suite's runs by name: each switch against the defaults (see suite_options).
OPTIONS_VARIANTS: dict[str, list[str]] = {
    "defaults": [],
    "model.dtype=bf16": ["model.dtype=bf16"],
    "model.dtype=fp32": ["model.dtype=fp32"],
    "activation_checkpointing": ["model.activation_checkpointing=true"],
    "params persistent": ["deepspeed.param_persistence_threshold=100000000"],
    "per-module gathers": ["deepspeed.gather_whole_layers=false"],  # the default until 2026-11-27
    "gloo collectives": ["deepspeed.shm_collectives=false"],
    "fresh fp32 gradients": ["deepspeed.reuse_fp32_grad_buffer=false"],
    "fresh reduce buffers": ["deepspeed.reuse_reduce_buffer=false"],
    "sdpa attention": ["model.attention=sdpa"],
    "causal-blocks attention": ["model.attention=causal_blocks"],
    "causal-blocks 128 attention": ["model.attention=causal_blocks_128"],
    "fused attention": ["model.attention=fused"],
    "recomputed attention probs": ["model.attention_probs=recompute"],
    "unfused loss": ["model.fused_loss=false"],
    "unfused norm": ["model.fused_norm=false"],
    "unfused rotary": ["model.fused_rotary=false"],
    "fused MLP": ["model.fused_mlp=true"],
    "autograd weight gradients": ["model.weight_grad_kernel=false"],
    "micro batch 4": ["train.micro_batch_size=4"],  # the 50m bench's until 2026-11-27
    "compile": ["model.compile=true"],  # the 50m model's default in bf16 since model.compile=auto (2026-12-01)
    "uncompiled": ["model.compile=false"],
    "compile + sdpa attention": ["model.compile=true", "model.attention=sdpa"],
    "compile (whole model)": ["model.compile=true", "model.compile_scope=model"],
    # Skipping a step on the gradient norm reads ZeRO-3's partitions: below 3 the guard logs.
    "ZeRO-2": ["deepspeed.zero_stage=2", "guards.action=log"],
    "ZeRO-1": ["deepspeed.zero_stage=1", "guards.action=log"],
    "ZeRO-2 + compile": ["deepspeed.zero_stage=2", "guards.action=log", "model.compile=true"],
    "AdamW per-tensor": ["train.fused_adamw=false"],
    "glibc 32 MiB mmap threshold": ["scaling.allocator=system"],  # the workers' glibc default
    "glibc dynamic mmap threshold": ["scaling.allocator=system", "scaling.glibc_mmap_threshold=0"],
    "jemalloc": ["scaling.allocator=jemalloc"],  # against a base run with scaling.allocator=system
    "jemalloc 30 s decay": [f"scaling.jemalloc_conf={JEMALLOC_DECAY_30S}"],  # the default until 2026-11-27
    # cpu.JEMALLOC_CONF before 2026-11-28: a kept extent serves requests of at least 1/64 its size only
    "jemalloc default extent fit": [f"scaling.jemalloc_conf={cpu.JEMALLOC_DEFAULT_FIT}"],
    "jemalloc 30 s decay without oversize arena": [f"scaling.jemalloc_conf={JEMALLOC_DECAY_30S},oversize_threshold:0"],
    "glibc fixed mmap threshold": ["scaling.allocator=system", f"scaling.glibc_mmap_threshold={1 << 20}"],
}


def suite_options(r: Runner, args) -> dict[str, Any]:
    """Each switch against the defaults, interleaved: bf16 forced, activation checkpointing,
    per-module ZeRO-3 gathers in place of whole layers, gloo in place of the shared-memory
    collectives, DeepSpeed's fresh fp32 gradient each step and fresh reduce-scatter buffers in
    place of the kept ones, SDPA's and the causal blocks' attention in place of the start-up
    timing's pick, the blocks' probabilities recomputed in the backward instead of kept
    (model.attention_probs), Hugging Face's loss, norms and rotary embedding in place of the
    fused ones, the fused MLP activation, autograd's weight gradients in place of
    model.weight_grad_kernel's, micro batch 4 in place of 8 (twice the ZeRO-3
    gathers and hooks per token), compile per layer and of the whole model, no compile (in
    bf16 the 50m model compiles its layers by default: model.compile=auto), ZeRO-2 and ZeRO-1
    (no parameter gathers: for a model that fits whole on every rank, see `plan`), PyTorch's
    per-tensor AdamW loop in place of the fused kernel, and glibc malloc with the workers' fixed
    mmap threshold and with its own dynamic one (against jemalloc or tcmalloc where the defaults
    find them installed)."""
    only = chosen_variants(args)
    rows = []
    for rep in range(args.repeats):
        for name, ov in in_rep_order(OPTIONS_VARIANTS.items(), rep):
            if only and name not in only and name != "defaults":
                continue
            rows.append(r.run(f"opt-{len(rows)}", ov) | {"variant": name, "rep": rep})
    return {"runs": rows, "tables": {"options": _compare(rows, "defaults")}}


LORA = ["lora.rank=16", "lora.alpha=32"]
# The lora suite's runs by name (see suite_lora).
LORA_VARIANTS: dict[str, list[str]] = {
    "full fine-tuning": [],
    "LoRA r=16": LORA,
    "LoRA r=16 + per-module gathers": [*LORA, "deepspeed.gather_whole_layers=false"],
    "LoRA r=16 + compile": [*LORA, "model.compile=true"],
}


def suite_lora(r: Runner, args) -> dict[str, Any]:
    """LoRA (rank 16 on every projection) against full fine-tuning, interleaved, same data and
    steps; and LoRA's own levers against plain LoRA (whole-layer gathers, the default): per-module
    gathers, per-layer compile."""
    only = chosen_variants(args)
    rows = []
    for rep in range(args.repeats):
        for name, ov in in_rep_order(LORA_VARIANTS.items(), rep):
            if only and name not in only | {"full fine-tuning", "LoRA r=16"}:  # the two baselines always run
                continue
            row = r.run(f"lora-{len(rows)}", ov) | {"variant": name, "rep": rep}
            s = json.loads((Path(row["run_dir"]) / "summary.json").read_text())
            row |= {
                "trainable_params": s["trainable_params"],
                "total_params": s["total_params"],
                "optimizer_state_mb_per_rank": max(s["optimizer_state_bytes"]) / 1e6,
            }
            rows.append(row)
    table = _compare(rows, "full fine-tuning")
    extra = {x["variant"]: x for x in rows}
    for t in table:
        x = extra[t["variant"]]
        t |= {k: x[k] for k in ("trainable_params", "optimizer_state_mb_per_rank", "train_peak_rss_gb_max_rank")}
    lora_rows = [x for x in rows if x["variant"].startswith("LoRA")]
    tables = {"LoRA vs full fine-tuning": table, "LoRA's levers": _compare(lora_rows, "LoRA r=16")}
    return {"runs": rows, "tables": tables}


def dpo_variants() -> dict[str, list[str]]:
    """The dpo suite's runs by name: SFT on the chosen answers, DPO, DPO with its reference
    precomputed and SimPO, full fine-tuning and LoRA r=16, all on the bundled pairs."""
    from raytrain_cpu.model.tokenizer import BUNDLED_SFT

    pairs = [f"data.path={BUNDLED_SFT / 'preference_train.jsonl'}", "data.source=jsonl"]
    sft = [*pairs, "data.format=instruction", "data.response_column=chosen"]
    dpo = [*pairs, "data.format=preference"]
    simpo = [*dpo, "train.dpo_loss=simpo", "train.dpo_beta=2.0"]
    precomputed = [*dpo, "train.dpo_precompute_reference=true"]
    return {
        "SFT": sft,
        "DPO": dpo,
        "DPO precomputed": precomputed,
        "SimPO": simpo,
        "SFT LoRA r=16": [*sft, *LORA],
        "DPO LoRA r=16": [*dpo, *LORA],
        "DPO LoRA r=16 precomputed": [*precomputed, *LORA],
    }


def suite_dpo(r: Runner, args) -> dict[str, Any]:
    """DPO against SFT on the chosen answers of the same bundled pairs, the same block shape,
    interleaved; full fine-tuning (DPO's reference: a frozen copy of the starting model) and
    LoRA r=16 (the base with the adapters off); each also with the reference precomputed
    (train.dpo_precompute_reference: its pass's seconds beside the tokens/s, which leave it out)."""
    variants = dpo_variants()
    only = chosen_variants(args) or set(variants)
    rows = []
    for rep in range(args.repeats):
        for name, ov in in_rep_order([(k, v) for k, v in variants.items() if k in only], rep):
            rows.append(r.run(f"dpo-{len(rows)}", ov) | {"variant": name, "rep": rep})
    peaks = {x["variant"]: x for x in rows}  # the last repeat's
    tables = {}
    for title, base, others in (
        ("full fine-tuning", "SFT", ("DPO", "DPO precomputed", "SimPO")),
        ("LoRA r=16", "SFT LoRA r=16", ("DPO LoRA r=16", "DPO LoRA r=16 precomputed")),
    ):
        table = _compare([x for x in rows if x["variant"] in (base, *others)], base)
        for t in table:
            t |= {k: peaks[t["variant"]][k] for k in ("load_peak_rss_gb", "train_peak_rss_gb_max_rank")}
            t["reference pass s"] = peaks[t["variant"]]["reference_pass_s"]  # before the first step
        if len(table) > 1:
            tables[f"preference losses against SFT, {title}"] = table
    full_lora = _compare([x for x in rows if x["variant"] in ("DPO", "DPO LoRA r=16")], "DPO LoRA r=16")
    if len(full_lora) > 1:
        tables["DPO, full fine-tuning against LoRA r=16"] = full_lora
    return {"runs": rows, "tables": tables}


def _compare(rows: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Median tokens/s per variant and its ratio to the baseline's."""
    by: dict[str, list[dict[str, Any]]] = {}
    for x in rows:
        by.setdefault(x["variant"], []).append(x)
    med = {k: sorted(x["tokens_per_s"] for x in v)[len(v) // 2] for k, v in by.items()}
    out = []
    for k, v in by.items():
        out.append(
            {
                "variant": k,
                "runs": len(v),
                "tokens/s (median)": med[k],
                "vs " + baseline: med[k] / med[baseline] if med.get(baseline) else None,
                "tokens/s each": ", ".join(f"{x['tokens_per_s']:.0f}" for x in v),
                "optimizer step s (median)": sorted(x.get("optimizer_step_s") or 0.0 for x in v)[len(v) // 2],
                "peak RSS GB, max rank": max((x.get("train_peak_rss_gb_max_rank") or 0.0) for x in v) or None,
                "dtype": v[0]["dtype"],
                "allocator": v[0].get("malloc", v[0]["allocator"]),
                "threads": v[0]["threads"],
                "pinned": v[0]["pinned"],
                "final loss": v[0]["final_loss"],
            }
        )
    return out


def run_seed_recipe(model_dir: str, steps: int, out: Path, fresh_build: bool = True) -> dict[str, Any]:
    """benchmarks/seed_recipe.py under torchrun with 2 processes (1 thread each), as the recipe runs."""
    import shutil
    import subprocess

    ext = out.parent / "seed_recipe_ext"
    if fresh_build:
        shutil.rmtree(ext, ignore_errors=True)  # the recipe's cpu_adam build, timed from scratch
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        str(REPO / "benchmarks" / "seed_recipe.py"),
        "--model_dir", model_dir, "--max_steps", str(steps), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "SEED_EXT_DIR": str(ext), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    print(f"[bench] seed recipe: {' '.join(cmd)}", flush=True)
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
    res = json.loads(out.read_text())
    # The script relative to the repo; write_results records scratch paths as <workdir>.
    res["command"] = (
        f"torchrun --nproc_per_node=2 benchmarks/seed_recipe.py --model_dir <run>/base_model "
        f"--max_steps {steps} --out {out}"
    )
    print(f"[bench] seed recipe: {res['useful_tokens_per_s']:.1f} useful tokens/s", flush=True)
    return res


def suite_seed(r: Runner, args) -> dict[str, Any]:
    """This project against the seed recipe (HF Trainer + DeepSpeed offload), interleaved:
    ours, seed, ours; same model file, text, seq_len 512 and 2 x 1 core."""
    if r.spec["seq_len"] != 512 and r.size != "tiny":
        raise ValueError("the seed recipe pads to 512")
    ours = [r.run("ours-0", ["scaling.num_workers=2"])]
    model_dir = str(Path(ours[0]["run_dir"]) / "base_model")
    seed = run_seed_recipe(model_dir, r.spec["steps"], r.workdir / "seed_recipe.json")
    ours.append(r.run("ours-1", ["scaling.num_workers=2"]))
    # Packed blocks have no padding: every token trained is a useful one.
    ours_tps = min(x["tokens_per_s"] for x in ours)  # the conservative one
    ratio = ours_tps / seed["useful_tokens_per_s"]
    raw_ratio = ours_tps / seed["padded_tokens_per_s"]  # issue 12's goal 3: tokens computed, padding or not
    return {
        "ours": ours,
        "seed": seed,
        "ratio": ratio,
        "raw_ratio": raw_ratio,
        "tables": {
            "useful tokens/s, same model and cores": [
                {
                    "recipe": "seed: HF Trainer + DeepSpeed ZeRO-3 offload, bf16, pad to 512",
                    "useful tokens/s": seed["useful_tokens_per_s"],
                    "all tokens/s (padding included)": seed["padded_tokens_per_s"],
                    "useful share": seed["useful_fraction"],
                    "s per optimizer step": seed["step_s"],
                    "one-off cpu_adam build (s)": seed["cpu_adam_build_s"],
                },
                *(
                    {
                        "recipe": f"raytrain_cpu ({x['variant']}, {x['dtype']}, packed)",
                        "useful tokens/s": x["tokens_per_s"],
                        "all tokens/s (padding included)": x["tokens_per_s"],
                        "useful share": 1.0,
                        "s per optimizer step": x["step_s"],
                        "one-off cpu_adam build (s)": 0.0,
                    }
                    for x in ours
                ),
            ],
            "ratio": [
                {
                    "raytrain_cpu / seed (useful tokens/s, lower of the two runs)": ratio,
                    "raytrain_cpu / seed (all tokens/s, padding included)": raw_ratio,
                }
            ],
        },
    }


# ----------------------------------------------------------------------------- plain PyTorch reference

# How the reference trains in bf16 (fp32 runs ignore it):
#  'autocast'    fp32 weights, gradients and AdamW; the forward under torch.autocast(bf16), so
#                every GEMM runs in bf16 and autograd runs the backward GEMMs in bf16 too.
#  'bf16_master' bf16 weights (no per-step weight casts) and bf16 gradients, with an fp32
#                master copy that clipping and AdamW work on, copied back after each step:
#                DeepSpeed's own bf16 recipe, done by hand.
REFERENCE_PRECISIONS = ("autocast", "bf16_master")


def _reference_worker(
    rank: int,
    spec: dict[str, Any],
    dtype: str,
    threads: int,
    batch: int,
    steps: int,
    compile: bool,
    precision: str,
    warmup: int,
    out,
) -> None:
    """One process, no DeepSpeed, no Ray: the project's Llama trained on random tokens."""
    import contextlib

    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)  # as the workers (cpu.place_threads): only jit.fork uses it
    cfg, config = bench_model_config(spec["model"], spec["seq_len"])
    t = cfg.train
    torch.manual_seed(t.seed)
    model = LlamaForCausalLM(config).train()
    bf16 = dtype == "bf16"
    master = bf16 and precision == "bf16_master"
    autocast_on = bf16 and not master
    if master:
        model.to(torch.bfloat16)
        params = [p for p in model.parameters() if p.requires_grad]
        opt_params = [p.detach().float().requires_grad_() for p in params]
        for m in opt_params:
            m.grad = torch.empty_like(m)  # allocated once; each step copies the bf16 grads in
    else:
        params = opt_params = [p for p in model.parameters() if p.requires_grad]
    attn = "sdpa"
    if not autocast_on:
        # The trainers' attention pick (model.attention=auto); the blocks leave autocast to SDPA.
        from raytrain_cpu.model.ops import attention
        from raytrain_cpu.planner import memory as plan

        keep_probs = plan.probs_keeper(config, spec["seq_len"], False, cfg.model.attention_probs)
        attn, _ = attention.choose(model, "auto", batch, spec["seq_len"], keep_probs=keep_probs)
        # ... and their loss (model.fused_loss; its GEMMs are written for one dtype, not autocast).
        from raytrain_cpu.model.ops import loss as fused_loss

        fused_loss.install(model)
    if master:  # the trainers' weight gradients (model.weight_grad_kernel=auto): bf16 weights only
        from raytrain_cpu.model.ops import linear

        n = sum(p.numel() for p in params)
        if linear.choose("auto", dtype, n, linear.linear_shapes(model), batch * spec["seq_len"]).on:
            linear.install(model)
    if not compile:  # the trainers' norms and rotary embeddings, under autocast too; inductor fuses its own
        from raytrain_cpu.model.ops import norm, rotary

        norm.install(model)
        rotary.install(model)
    # The project's optimizer: AdamW without weight decay on norms, its lr, betas and eps.
    groups = [
        {"params": [p for p in opt_params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in opt_params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps, fused=True)
    fwd = torch.compile(model) if compile else model
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_on)
    gen = torch.Generator().manual_seed(0)
    totals = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_step_s": 0.0, "step_s": 0.0}
    loss_value = float("nan")
    for step in range(warmup + steps):
        ids = torch.randint(0, VOCAB, (batch, spec["seq_len"]), generator=gen)
        t0 = time.perf_counter()
        with autocast:
            loss = fwd(input_ids=ids, labels=ids).loss
        loss_value = float(loss.detach())
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if master:
            torch._foreach_copy_([m.grad for m in opt_params], [p.grad for p in params])
            model.zero_grad(set_to_none=True)
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(opt_params, t.grad_clip, foreach=True)
        opt.step()
        if not master:  # the master grads are overwritten by the next copy: nothing to zero
            opt.zero_grad(set_to_none=True)
        if master:
            with torch.no_grad():
                torch._foreach_copy_(params, opt_params)
        t3 = time.perf_counter()
        if step >= warmup:  # warm-up steps allocate, fill caches and compile: not steady state
            for k, v in (("forward_s", t1 - t0), ("backward_s", t2 - t1), ("optimizer_step_s", t3 - t2)):
                totals[k] += v
            totals["step_s"] += t3 - t0
    per_step = {k: v / steps for k, v in totals.items()}
    tokens = batch * spec["seq_len"]
    out.put(
        (
            rank,
            {
                "threads": torch.get_num_threads(),
                "dtype": dtype,
                "precision": (precision if bf16 else "fp32") + (" + compile" if compile else ""),
                "tokens_per_step": tokens,
                "tokens_per_s": tokens / per_step["step_s"],
                **per_step,
                "steps_timed": steps,
                "final_loss": loss_value,
                "allocator": cpu.allocator_in_use(),
                "grad_clip": t.grad_clip,
                "attention": attn,
            },
        )
    )


def reference_run(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Plain single-process PyTorch training of the bench model: reference_runs' one process."""
    return reference_runs(*args, **kwargs)[0]


def reference_runs(
    spec: dict[str, Any],
    dtype: str,
    threads: int,
    batch: int,
    steps: int,
    compile: bool = False,
    precision: str = "autocast",
    warmup: int | None = None,
    allocator: str = "auto",
    compile_cache_dir: str | None = None,
    timeout_s: float = 3600,
    processes: int = 1,
) -> list[dict[str, Any]]:
    """Plain single-process PyTorch training of the bench model (`spec`, a SIZES entry), in
    `processes` independent copies at once (bench scaling's host ceiling runs two), each its
    own result.

    `batch` sequences of spec["seq_len"] random tokens per step, in one micro batch, with
    `threads` intra-op threads; `dtype` is 'bf16' or 'fp32' (what model.dtype resolved to).
    Runs in a fresh spawned process so its thread pool and allocator start clean, preloading
    the allocator a training worker gets (`allocator`, cpu.preload_env); compiled kernels go
    to `compile_cache_dir` (inductor's cache, reused by later runs). Returns tokens/s and
    the mean forward, backward and optimizer seconds of `steps` steps after `warmup` (by
    default the trainers' cpu.WARMUP_STEPS; with compile the first compiles the graphs).
    """
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype must be 'bf16' or 'fp32', not {dtype!r}")
    if precision not in REFERENCE_PRECISIONS:
        raise ValueError(f"precision must be one of {REFERENCE_PRECISIONS}, not {precision!r}")
    warmup = cpu.WARMUP_STEPS if warmup is None else warmup
    args = (spec, dtype, threads, batch, steps, compile, precision, warmup)
    env = cpu.preload_env(allocator)
    if compile_cache_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir
    return _run_procs(_reference_worker, processes, args, env, timeout_s)


def _run_procs(
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


def _reference_row(name: str, res: dict[str, Any]) -> dict[str, Any]:
    """A reference result in the training runs' row layout (one process; no data wait or comm)."""
    return {
        "variant": name,
        "workers": 1,
        "threads": res["threads"],
        "dtype": res["dtype"],
        "precision": res["precision"],
        "allocator": res["allocator"],
        "tokens_per_step": res["tokens_per_step"],
        "tokens_per_s": res["tokens_per_s"],
        "step_s": res["step_s"],
        "data_wait_s": 0.0,
        "forward_s": res["forward_s"],
        "backward_s": res["backward_s"],
        "optimizer_step_s": res["optimizer_step_s"],
        "comm_s": None,
        # The three phases tile the step; what is left is rounding.
        "other_s": max(0.0, res["step_s"] - res["forward_s"] - res["backward_s"] - res["optimizer_step_s"]),
        "steps_timed": res["steps_timed"],
        "final_loss": res["final_loss"],
        "grad_clip": res["grad_clip"],
        "attention": res["attention"],
    }


def suite_reference(r: Runner, args) -> dict[str, Any]:
    """The 2-worker ZeRO-3 run against plain single-process PyTorch on the same model, dtype,
    tokens per step and cores, interleaved: zero3, references, zero3."""
    zero3 = [r.run("zero3-0", [f"scaling.num_workers={args.workers}"])]
    z = zero3[0]
    batch = tokens_per_step(z) // r.spec["seq_len"]
    cores = z["workers"] * z["threads"]
    precisions = REFERENCE_PRECISIONS if z["dtype"] == "bf16" else ("autocast",)  # fp32 has one recipe
    only = chosen_variants(args)
    named = only & set(precisions)  # --variants may name recipes; 'compile' alone keeps them all
    eager = [p for p in precisions if not named or p in named]

    def reference(name: str, precision: str, compiled: bool) -> dict[str, Any]:
        print(f"[bench] {name}: {batch} x {r.spec['seq_len']} tokens, {cores} threads, {z['dtype']}", flush=True)
        res = reference_run(
            r.spec, z["dtype"], cores, batch, r.spec["steps"] - cpu.WARMUP_STEPS, compile=compiled, precision=precision,
            allocator=z["allocator"], compile_cache_dir=str(r.workdir / "inductor_cache"),
        )  # fmt: skip
        print(f"[bench] {name}: {res['tokens_per_s']:.0f} tokens/s, step {res['step_s']:.2f}s", flush=True)
        return _reference_row(name, res) | {"recipe": precision}

    refs = [reference("reference" if len(eager) == 1 else f"reference {p}", p, False) for p in eager]
    # Opt-in (inductor's C++ build takes a while on a few cores), and a given where ZeRO-3 compiled
    # its layers (model.compile=auto at this size): plain PyTorch gets the same lever.
    if "compile" in only or z.get("compiled"):
        best_eager = max(refs, key=lambda x: x["tokens_per_s"])
        refs.append(reference("reference + compile", best_eager["recipe"], True))
    zero3.append(r.run("zero3-1", [f"scaling.num_workers={args.workers}"]))
    for x in zero3:
        x["tokens_per_step"] = tokens_per_step(x)
        x["precision"] = "DeepSpeed " + x["dtype"] + (" + compile" if x.get("compiled") else "")
    return _reference_report(zero3, refs, f"{batch} x {r.spec['seq_len']}", cores)


def _reference_report(zero3: list[dict], refs: list[dict], tokens: str, cores: int) -> dict[str, Any]:
    """The runs, the per-core ratios against each reference (the best one's is the goal's) and the tables."""

    def per_core(x: dict[str, Any]) -> float:
        return x["tokens_per_s"] / (x["workers"] * x["threads"])

    best = max(refs, key=per_core)
    z_pc = [per_core(x) for x in zero3]
    z_mean = sum(z_pc) / len(z_pc)  # two runs, so mean and median agree
    ratio = z_mean / per_core(best)
    throughput = [
        {
            "run": x["variant"],
            "processes x threads": f"{x['workers']} x {x['threads']}",
            "cores": x["workers"] * x["threads"],
            "dtype": x["dtype"],
            "precision": x["precision"],
            "tokens per step": x["tokens_per_step"],
            "tokens/s": x["tokens_per_s"],
            "tokens/s per core": per_core(x),
            "s per step": x["step_s"],
            "final loss": x["final_loss"],
        }
        for x in (zero3[0], *refs, zero3[1])
    ]
    ratios = [
        {
            "reference": x["variant"],
            "ZeRO-3 / reference, per core (mean of the ZeRO-3 runs)": z_mean / per_core(x),
            "lower ZeRO-3 run": min(z_pc) / per_core(x),
            "higher ZeRO-3 run": max(z_pc) / per_core(x),
            "goal": 0.95,
            "meets goal": z_mean / per_core(x) >= 0.95,
        }
        for x in refs
    ]
    return {
        "zero3": zero3,
        "reference": refs,
        "best_reference": best["variant"],
        "ratio": ratio,
        "tables": {
            "throughput: same model, dtype, tokens per step and cores": throughput,
            "per-core throughput ratio, ZeRO-3 / plain PyTorch (goal >= 0.95)": ratios,
            "step-time breakdown (s per optimizer step; comm is inside forward/backward/step)": [
                {k: x.get(k) for k in ("variant", "precision", *BREAKDOWN_COLUMNS[1:])}
                for x in (zero3[0], *refs, zero3[1])
            ],
        },
        "notes": [
            "reference: one process, no DeepSpeed, no Ray; the same LlamaForCausalLM (attention: "
            + ", ".join(f"{r['precision']} {r.get('attention', 'sdpa')}" for r in refs)
            + ", as the trainers' model.attention=auto picks it, SDPA under autocast; the trainers' fused "
            "loss (model.fused_loss) except under autocast, and bf16_master its weight gradients "
            "(model.weight_grad_kernel=auto)), "
            f"{tokens} random tokens per step in one micro batch, {cores} threads, "
            "AdamW(fused=True) with the project's lr, betas, eps and weight-decay groups, gradient clipping "
            f"at {refs[0]['grad_clip']}; the first {cpu.WARMUP_STEPS} steps excluded, as in the training runs.",
            "bf16 recipes: 'autocast' = fp32 weights and optimizer, forward under torch.autocast(bf16); "
            "'bf16_master' = bf16 weights and gradients with an fp32 master copy for clipping and AdamW "
            "(DeepSpeed's bf16 recipe by hand). The ratio row of the faster one is the goal's.",
            "final loss: the training runs read the bench corpus, the reference random tokens "
            "(ln 2048 = 7.62 is chance), so the two losses are not comparable.",
            f"best reference here: {best['variant']} ({per_core(best):.0f} tokens/s per core); "
            f"ZeRO-3 / best, per core = {ratio:.3f} (mean of {len(zero3)} interleaved ZeRO-3 runs).",
        ],
    }


# ----------------------------------------------------------------------------- one kernel, variant against variant


def _count(text: str) -> int:
    """argparse type of the kernel benches' counts: 0 repeats or steps would time nothing and
    still write a result file."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def kernel_bench_parser(doc: str, shapes: list[str], steps: int, repeats: int) -> argparse.ArgumentParser:
    """The command line of the one-kernel benchmarks (benchmarks/loss_head.py, benchmarks/norm.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(shapes), help=f"comma-separated: {', '.join(shapes)}")
    ap.add_argument("--tokens", type=_count, default=2048, help="tokens per step (micro batch x seq)")
    ap.add_argument("--threads", type=_count, default=1, help="torch threads: one worker's share")
    ap.add_argument("--steps", type=_count, default=steps, help="timed steps per run, after a warm-up")
    ap.add_argument("--repeats", type=_count, default=repeats, help="interleaved runs of each variant")
    ap.add_argument("--json", default=None, help="where to write the results (default: the machine's folder)")
    return ap


def interleaved_runs(
    child: Callable, args: argparse.Namespace, variants: tuple[str, ...], extra: dict[str, Any] | None = None
) -> list[dict]:
    """child(0, spec, queue) once per shape, repeat and variant of `args` (kernel_bench_parser's),
    each in a fresh spawned process (its allocator and caches start clean) with the allocator
    settings a training worker gets (cpu.preload_env: which tensors come back as fresh, faulted
    pages depends on them), the variants interleaved so that the host's drift falls on all of
    them; spec holds the shape, variant, tokens, threads and steps (and `extra`); the rows are the
    spec, the repeat and the result."""
    spec = {"tokens": args.tokens, "threads": args.threads, "steps": args.steps} | (extra or {})
    env = cpu.preload_env()
    rows = []
    for shape in args.shapes.split(","):
        for rep in range(args.repeats):
            for variant in in_rep_order(variants, rep):
                run = spec | {"shape": shape, "variant": variant}
                (res,) = _run_procs(child, 1, (run,), env)
                rows.append(run | {"rep": rep} | res)
                print(f"[{child.__module__}] {shape} {variant}: {res}", flush=True)
    return rows


def attention_inputs(b: int, h: int, hk: int, s: int, d: int) -> tuple[Any, Any, Any, Any]:
    """Seeded bf16 q, k, v (leaves) and the output's gradient of one attention call, each a
    (b, heads, s, d) view of (b, s, heads, d) memory: as Hugging Face's Llama hands them over
    from its projections, and o_proj's backward the gradient (benchmarks/attention.py and
    benchmarks/document_mask.py)."""
    import torch

    gen = torch.Generator().manual_seed(0)

    def projected(heads: int) -> torch.Tensor:
        return torch.randn(b, s, heads, d, generator=gen).to(torch.bfloat16).transpose(1, 2)

    q, k, v = (projected(n).requires_grad_() for n in (h, hk, hk))
    return q, k, v, projected(h)


def attention_shape_label(name: str, h: int, hk: int, s: int, d: int, tokens: int) -> str:
    """An attention bench's shape column: 'name (heads h/hk x d, seq s, batch b)', b rows of s
    making up `tokens`."""
    return f"{name} (heads {h}/{hk} x {d}, seq {s}, batch {max(1, tokens // s)})"


def time_kernel_steps(run: Callable[[], Any], leaves: Sequence, steps: int) -> dict[str, float]:
    """A one-kernel bench's timing: `run()` (a forward and backward) once to warm up, then
    `steps` times, the gradients of `leaves` cleared before each; the median milliseconds and
    the minor page faults per step (every fresh allocation the allocator maps anew)."""
    import resource

    def step() -> float:
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        run()
        return time.perf_counter() - t0

    step()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = [step() for _ in range(steps)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    return {"step_ms": 1e3 * median(times), "faults_per_step": faults / steps}


def saved_tensor_bytes(run: Callable[[], Any], exclude: Sequence = ()) -> int:
    """Bytes autograd keeps for the backward while `run()` builds its graph, each storage once,
    those of the tensors in `exclude` (the input, the weights) left out."""
    import torch

    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    own = {t.untyped_storage().data_ptr() for t in exclude}
    return sum(n for ptr, n in saved.items() if ptr not in own)


def time_with_saved_bytes(run: Callable[[], Any], leaves: Sequence, spec: dict[str, Any]) -> dict[str, float]:
    """The norm and MLP benches' result: time_kernel_steps, and the bytes per token autograd
    keeps for the backward besides `leaves` (saved_tensor_bytes)."""
    saved = saved_tensor_bytes(run, leaves)
    return time_kernel_steps(run, leaves, spec["steps"]) | {"saved_bytes_per_token": saved / spec["tokens"]}


def saved_bytes_columns(mine: list[dict], speed: float) -> dict[str, Any]:
    """The norm and MLP benches' table columns for one shape and variant (time_with_saved_bytes rows)."""
    return {
        "ms per forward + backward, each run": ", ".join(f"{r['step_ms']:.2f}" for r in mine),
        "speed vs hugging face (medians)": speed,
        "page faults per step (median)": median(r["faults_per_step"] for r in mine),
        "saved for backward, bytes per token": mine[0]["saved_bytes_per_token"],
    }


def write_kernel_bench(
    name: str, rows: list[dict], title: str, table: list[dict], notes: list[str], json_path: str | None
) -> None:
    """Writes a one-kernel benchmark's JSON and table (benchmarks/<name>.py) and prints the table."""
    # The children's allocator settings, as a training worker's: the preloaded libraries by
    # file name (this machine's paths mean nothing where the results are read).
    env = cpu.preload_env()
    if "LD_PRELOAD" in env:
        env["LD_PRELOAD"] = ":".join(Path(p).name for p in env["LD_PRELOAD"].split(":"))
    result = {
        "command": f"python benchmarks/{name}.py " + " ".join(_portable_args(None, json_path)),
        "machine": cpu.cpu_features().describe(),
        "versions": package_versions(),
        "allocator_env": env,
        "runs": rows,
        "tables": {title: table},
        "notes": notes,
    }
    print(write_results(name, result, json_path).with_suffix(".md").read_text())


def against_baseline(rows: list[dict], key: str, baseline: str) -> Iterator[tuple[str, str, list[dict], float]]:
    """(shape, variant, that variant's rows, median `key` of the baseline / of the variant) for
    each shape and variant in the order run: > 1 means the variant took less."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    for shape in shapes:
        base = median(r[key] for r in rows if r["shape"] == shape and r["variant"] == baseline)
        for variant in variants:
            mine = [r for r in rows if r["shape"] == shape and r["variant"] == variant]
            yield shape, variant, mine, base / median(r[key] for r in mine)


# ----------------------------------------------------------------------------- load


def _load_worker(rank: int, world: int, port: int, model_dir: str, dtype_name: str, mode: str, out) -> None:
    """One rank: imports, then (after resetting the peak) a sharded or a naive load."""
    import torch

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    from transformers import AutoModelForCausalLM

    if mode == "sharded":
        import torch.distributed as dist

        from raytrain_cpu.config.schema import load_config
        from raytrain_cpu.model.loading import load_sharded
        from raytrain_cpu.trainer.loop import deepspeed_config, init_deepspeed, init_local_group

        init_local_group(rank, world, port)
        init_deepspeed()
        ds_config = deepspeed_config(
            load_config(None, ["model.dtype=" + ("bf16" if dtype == torch.bfloat16 else "fp32")]), world
        )

        def load():
            model, keep = load_sharded(model_dir, ds_config, dtype)
            dist.barrier()
            return model, keep
    else:

        def load():
            return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), None

    before = _rss()
    cpu.reset_peak_rss()
    t0 = time.perf_counter()
    model, keep = load()
    seconds = time.perf_counter() - t0
    peak = cpu.peak_rss_bytes()
    out.put((rank, {"rss_before_load": before, "peak_rss": peak, "load_s": seconds}))
    del model


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _spawn(world: int, target: Callable, *args) -> list[dict[str, Any]]:
    """target(rank, world, port, *args, queue) on `world` gloo ranks; their results by rank."""
    from raytrain_cpu.trainer.loop import free_port

    return _run_procs(target, world, (world, free_port(), *args), timeout_s=1800)


def _write_model(shape: dict[str, int], out: Path) -> Path:
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.model.loading import write_tiny_model
    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path

    cfg = load_config(None, model_overrides(shape, 512))
    tok = load_tokenizer(resolve_tokenizer_path("bundled", "tiny"))
    return write_tiny_model(cfg, tok, out)


def load_compare(shape: dict[str, int], workdir: Path, world: int, dtype_name: str = "bfloat16") -> dict[str, Any]:
    model_dir = _write_model(shape, workdir / f"load_model_{shape['hidden_size']}x{shape['num_layers']}")
    params = n_params(shape)
    bytes_per = 2 if dtype_name == "bfloat16" else 4
    largest = VOCAB * shape["hidden_size"]
    largest = max(largest, shape["hidden_size"] * shape["intermediate_size"])
    bound = bytes_per * params["total"] / world + bytes_per * largest + 1.5e9
    sharded = _spawn(world, _load_worker, str(model_dir), dtype_name, "sharded")
    naive = _spawn(world, _load_worker, str(model_dir), dtype_name, "naive")
    rows = []
    for r in range(world):
        rows.append(
            {
                "rank": r,
                "sharded peak RSS (GB)": sharded[r]["peak_rss"] / GB,
                "naive peak RSS (GB)": naive[r]["peak_rss"] / GB,
                "sharded / naive": sharded[r]["peak_rss"] / naive[r]["peak_rss"],
                "sharded: load adds (GB)": (sharded[r]["peak_rss"] - sharded[r]["rss_before_load"]) / GB,
                "naive: load adds (GB)": (naive[r]["peak_rss"] - naive[r]["rss_before_load"]) / GB,
                "bound (GB)": bound / GB,
                "within bound": sharded[r]["peak_rss"] <= bound,
                "sharded load (s)": sharded[r]["load_s"],
                "naive load (s)": naive[r]["load_s"],
            }
        )
    return {
        "model": shape,
        "params": params["total"],
        "dtype": dtype_name,
        "world": world,
        "bound_bytes": bound,
        "sharded": sharded,
        "naive": naive,
        "rows": rows,
    }


def suite_load(r: Runner, args) -> dict[str, Any]:
    out = {"tables": {}}
    for label, shape in (("train model", r.spec["model"]), ("larger model", r.spec["load_model"])):
        if shape is None:
            continue
        res = load_compare(shape, r.workdir, args.workers)
        out[label] = res
        out["tables"][f"loading, {label}: {res['params'] / 1e6:.0f}M params, {res['dtype']}, {res['world']} ranks"] = (
            res["rows"]
        )
    return out


# ----------------------------------------------------------------------------- CLI

SUITES = {
    "gemm": suite_gemm,
    "train": suite_train,
    "load": suite_load,
    "scaling": suite_scaling,
    "placement": suite_placement,
    "options": suite_options,
    "seed": suite_seed,
    "lora": suite_lora,
    "dpo": suite_dpo,
    "reference": suite_reference,
}


def _portable_args(argv: list[str] | None, json_path: str | None) -> list[str]:
    """The command line as recorded in results: --json's path (this machine's) as <json>."""
    return ["<json>" if a == json_path else a for a in (argv if argv is not None else sys.argv[1:])]


def chosen_variants(args: argparse.Namespace) -> set[str]:
    """--variants as a set of names ("a, b" and "a,b" alike); empty when none were given."""
    return {name.strip() for name in args.variants.split(",") if name.strip()}


def variant_names(suite: str) -> list[str]:
    """The names --variants may give for `suite` (none: the suite takes no --variants)."""
    if suite == "options":
        return list(OPTIONS_VARIANTS)
    if suite == "lora":
        return list(LORA_VARIANTS)
    if suite == "dpo":
        return list(dpo_variants())
    if suite == "reference":
        return [*REFERENCE_PRECISIONS, "compile"]
    return []


NO_TRAINING_RUNS = {"gemm", "load"}  # the suites that take no key=value overrides


def result_stem(suite: str, size: str) -> str:
    """A smoke run at another size must not overwrite the committed 50m results."""
    return suite if size == "50m" else f"{suite}-{size}"


def result_path(suite: str, args: argparse.Namespace, feats: cpu.CpuFeatures) -> Path:
    """Where `suite`'s results go: --json, or this machine's folder of benchmarks/results."""
    return Path(args.json) if args.json else results_file(result_stem(suite, args.size), feats)


def _unwritable(folder: Path) -> str:
    """Why no file can be written in `folder` (made if missing); '' if one can."""
    from raytrain_cpu.checkpoint.store import cannot_write, existing_folder

    folder = existing_folder(folder)
    if not folder.is_dir():
        return f"{folder} is a file"
    why = cannot_write(folder)
    return f"cannot create files in {folder} ({why})" if why else ""


def check_args(args: argparse.Namespace, suites: list[str], runner: Runner, feats: cpu.CpuFeatures) -> None:
    """Every argument, before anything runs: a bad one would otherwise surface after minutes of
    runs (an override at the first training run, --json once all of them are done, its results
    lost) or not at all (0 repeats, a misspelt variant)."""
    for flag, value in (("--workers", args.workers), ("--repeats", args.repeats)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.json and len(suites) > 1:
        raise ValueError(
            "--json names one suite's result file; 'all' writes each suite's into benchmarks/results/<machine>/: "
            "run the suites one at a time, or drop --json"
        )
    _check_variants(chosen_variants(args), args.suite, suites)
    if args.overrides and set(suites) <= NO_TRAINING_RUNS:
        raise ValueError(
            f"{' '.join(args.overrides)}: key=value overrides apply to training runs, and {args.suite} runs none"
        )
    runner.check_overrides()
    for name in suites:
        path = result_path(name, args, feats)
        if why := "it is a directory" if path.is_dir() else _unwritable(path.parent):
            raise ValueError(f"{'--json' if args.json else 'results'} {path}: {why}; give --json a writable path")
    if why := _unwritable(runner.workdir):
        raise ValueError(f"--workdir {runner.workdir}: {why}; give a writable directory")


def _check_variants(chosen: set[str], suite: str, suites: list[str]) -> None:
    """Each name --variants gives must be one of the suites' own: a misspelt one ran nothing."""
    known = list(dict.fromkeys(name for s in suites for name in variant_names(s)))
    if chosen and not known:
        raise ValueError(f"--variants: {suite} has no variants to pick from (options, lora, dpo and reference have)")
    if unknown := sorted(chosen - set(known)):
        names = ", ".join(repr(n) for n in unknown)
        raise ValueError(f"--variants: unknown {names}; {suite} knows {', '.join(known)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raytrain_cpu.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("suite", choices=[*SUITES, "all"])
    ap.add_argument("--size", choices=list(SIZES), default="50m")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="interleaved repetitions of each variant (placement, options, scaling, lora, dpo)",
    )
    ap.add_argument(
        "--variants",
        default="",
        help="options, lora, dpo: comma-separated subset of variants to run; reference: recipes (autocast, "
        "bf16_master) and/or compile",
    )
    ap.add_argument("--workdir", default="/tmp/raytrain_bench", help="runs, data cache and model files")
    ap.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each training run's checkpoints under --workdir (by default removed once the run is read)",
    )
    ap.add_argument("--json", default=None, help="result file (default benchmarks/results/<machine>/<suite>.json)")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides for every training run")
    args = ap.parse_intermixed_args(argv)  # overrides may follow the options
    runner = Runner(args.size, Path(args.workdir), args.overrides, args.keep_checkpoints)
    feats = cpu.cpu_features()
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    try:
        check_args(args, suites, runner, feats)
    except ValueError as e:  # config.ConfigError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # Ray starts its workers at nice 15; on a shared machine that hands their cores to any other
    # process, and would skew comparisons with plain processes (the seed recipe's torchrun).
    os.environ.setdefault("RAY_worker_niceness", "0")
    for name in suites:
        t0 = time.perf_counter()
        result = SUITES[name](runner, args)
        result |= {
            "command": "python -m raytrain_cpu.bench " + " ".join(_portable_args(argv, args.json)),
            "machine": feats.describe(),
            "cpu": feats.to_dict(),
            "allocator_found": Path(cpu.find_allocator()[1]).name or "none",  # the library, not this machine's path
            "versions": package_versions(),
            "size": args.size,
            "bench_wall_s": time.perf_counter() - t0,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        path = write_results(result_stem(name, args.size), result, str(result_path(name, args, feats)), runner.workdir)
        print(f"[bench] {name} -> {path} and {path.with_suffix('.md')}", flush=True)
        print(path.with_suffix(".md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
