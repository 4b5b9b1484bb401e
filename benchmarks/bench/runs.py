"""The suites made of training runs (raytrain_cpu.launch.driver.run with the bench's overrides):
train, placement, options, lora, dpo and seed."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from raytrain_cpu.host import memory as host_memory
from raytrain_cpu.obs.metrics import flops_per_token

from .common import BREAKDOWN_COLUMNS, GB, REPO, SIZES, chosen_variants, in_rep_order, mfu_of, model_overrides, n_params
from .gemm import gemm_peak, gemm_rows, gemm_threads

# jemalloc returning freed pages after 30 s unused, from its background thread (raytrain's
# MALLOC_CONF until host_memory.JEMALLOC_CONF kept them; the cluster images' still).
JEMALLOC_DECAY_30S = "background_thread:true,metadata_thp:auto,dirty_decay_ms:30000,muzzy_decay_ms:30000"


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
        # The host's average over those timings, not their best batches (host_gemm.time_training_mix).
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


def suite_placement(r: Runner, args) -> dict[str, Any]:
    """This project's default placement vs Ray's plain settings vs pinned, interleaved twice."""
    from raytrain_cpu.launch.sizing import local_ray_cpus

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
    "per-module gathers": ["deepspeed.gather_whole_layers=false"],  # the former default
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
    "micro batch 4": ["train.micro_batch_size=4"],  # the 50m bench's former micro batch
    "compile": ["model.compile=true"],  # the 50m model's default in bf16 (model.compile=auto)
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
    "jemalloc 30 s decay": [f"scaling.jemalloc_conf={JEMALLOC_DECAY_30S}"],  # the former default
    # host_memory.JEMALLOC_CONF's former setting: a kept extent serves requests of at least 1/64 its size only
    "jemalloc default extent fit": [f"scaling.jemalloc_conf={host_memory.JEMALLOC_DEFAULT_FIT}"],
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
