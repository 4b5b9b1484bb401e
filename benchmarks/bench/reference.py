"""The plain-PyTorch reference (one process, no DeepSpeed, no Ray) and the suites read against
it: reference, and scaling's host ceiling."""

from __future__ import annotations

import time
from statistics import median
from typing import TYPE_CHECKING, Any

from raytrain_cpu.host import memory as host_memory
from raytrain_cpu.obs import timing as obs_timing

from .common import (
    BREAKDOWN_COLUMNS,
    VOCAB,
    bench_model_config,
    chosen_variants,
    in_rep_order,
    run_procs,
    tokens_per_step,
)

if TYPE_CHECKING:
    from .runs import Runner  # the suites' argument; runs imports gemm


def suite_scaling(r: Runner, args) -> dict[str, Any]:
    """1 worker x 1 thread against 2 workers x 1 thread: the same cores per worker; beside it
    the host's own ceiling, plain PyTorch (one worker's micro batch, its dtype and compile, no
    DeepSpeed or Ray) in 1 process alone against 2 copies at once. Two busy cores of a small
    VM share caches, memory bandwidth and the hypervisor's slices, so two copies run slower than
    one alone, which no change to the training can win back. With --repeats N everything runs
    in N rounds, in turn first and last (in_rep_order), and each figure is the median of the
    rounds': the host's speed drifts over minutes, and single rounds of the same code vary widely."""
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
    steps = r.spec["steps"] - obs_timing.WARMUP_STEPS
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
        torch.set_num_interop_threads(1)  # as the workers (host.threads.place_threads): only jit.fork uses it
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
                "allocator": host_memory.allocator_in_use(),
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
    the allocator a training worker gets (`allocator`, host_memory.preload_env); compiled kernels go
    to `compile_cache_dir` (inductor's cache, reused by later runs). Returns tokens/s and
    the mean forward, backward and optimizer seconds of `steps` steps after `warmup` (by
    default the trainers' obs_timing.WARMUP_STEPS; with compile the first compiles the graphs).
    """
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype must be 'bf16' or 'fp32', not {dtype!r}")
    if precision not in REFERENCE_PRECISIONS:
        raise ValueError(f"precision must be one of {REFERENCE_PRECISIONS}, not {precision!r}")
    warmup = obs_timing.WARMUP_STEPS if warmup is None else warmup
    args = (spec, dtype, threads, batch, steps, compile, precision, warmup)
    env = host_memory.preload_env(allocator)
    if compile_cache_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir
    return run_procs(_reference_worker, processes, args, env, timeout_s)


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


# Issue 61's bar for one rank against plain PyTorch at the same threads (bench reference --threads).
THREADS_GOAL = 0.9
# The comparison's tables that a thread sweep gathers over its counts.
THROUGHPUT_TABLE = "throughput: same model, dtype, tokens per step and cores"
BREAKDOWN_TABLE = "step-time breakdown (s per optimizer step; comm is inside forward/backward/step)"


def suite_reference(r: Runner, args) -> dict[str, Any]:
    """The ZeRO-3 run (--workers ranks) against plain single-process PyTorch on the same model,
    dtype, tokens per step and cores, interleaved: zero3, references, zero3. With --threads
    1,2,4,... the same at each count of threads per rank in turn (thread_sweep)."""
    if args.threads:
        return thread_sweep(r, args)
    return reference_at(r, args, [f"scaling.num_workers={args.workers}"])


def reference_at(r: Runner, args, overrides: list[str], tag: str = "") -> dict[str, Any]:
    """One comparison: the ZeRO-3 run under `overrides`, the references at its cores, the
    ZeRO-3 run again; `tag` keeps its run names apart from another comparison's."""
    zero3 = [r.run(f"zero3-0{tag}", overrides)]
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
            r.spec, z["dtype"], cores, batch, r.spec["steps"] - obs_timing.WARMUP_STEPS, compile=compiled, precision=precision,
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
    zero3.append(r.run(f"zero3-1{tag}", overrides))
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
            THROUGHPUT_TABLE: throughput,
            "per-core throughput ratio, ZeRO-3 / plain PyTorch (goal >= 0.95)": ratios,
            BREAKDOWN_TABLE: [
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
            f"{tokens} random tokens per step in one micro batch, as many threads as the ZeRO-3 run has cores, "
            "AdamW(fused=True) with the project's lr, betas, eps and weight-decay groups, gradient clipping "
            f"at {refs[0]['grad_clip']}; the first {obs_timing.WARMUP_STEPS} steps excluded, as in the training runs.",
            "bf16 recipes: 'autocast' = fp32 weights and optimizer, forward under torch.autocast(bf16); "
            "'bf16_master' = bf16 weights and gradients with an fp32 master copy for clipping and AdamW "
            "(DeepSpeed's bf16 recipe by hand). The ratio row of the faster one is the goal's.",
            "final loss: the training runs read the bench corpus, the reference random tokens "
            "(ln 2048 = 7.62 is chance), so the two losses are not comparable.",
            f"best reference at {cores} cores: {best['variant']} ({per_core(best):.0f} tokens/s per core); "
            f"ZeRO-3 / best, per core = {ratio:.3f} (mean of {len(zero3)} interleaved ZeRO-3 runs).",
        ],
    }


def thread_sweep(r: Runner, args) -> dict[str, Any]:
    """bench reference --threads 1,2,4,...: at each count in turn, --workers ranks of that many
    threads against plain PyTorch with as many threads in all (reference_at). Issue 61 asks it
    of one rank (--workers 1), at least THREADS_GOAL of plain PyTorch at every count: what ZeRO-3's
    hooks, our kernels and the OpenMP settings cost must not grow with the threads, and a
    1- or 2-thread figure says nothing of a 16- or 92-thread rank."""
    per = {}
    for t in args.threads:
        ov = [f"scaling.num_workers={args.workers}", f"scaling.threads_per_worker={t}"]
        per[t] = reference_at(r, args, ov, f"-t{t}")
    return _sweep_report(per)


def _sweep_report(per: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Each thread count's ratio against its best reference, and its runs, in one set of tables."""
    rows = []
    for t, rep in per.items():
        best = next(x for x in rep["reference"] if x["variant"] == rep["best_reference"])
        rows.append(
            {
                "threads per rank": t,
                "ranks": rep["zero3"][0]["workers"],
                "ZeRO-3 tokens/s (two runs)": ", ".join(f"{x['tokens_per_s']:,.0f}" for x in rep["zero3"]),
                "best reference": best["variant"],
                "reference tokens/s": best["tokens_per_s"],
                "ZeRO-3 / reference, per core": rep["ratio"],
                "goal": THREADS_GOAL,
                "meets goal": rep["ratio"] >= THREADS_GOAL,
            }
        )
    first = next(iter(per.values()))
    tables = {f"ZeRO-3 against plain PyTorch at each thread count (goal >= {THREADS_GOAL})": rows}
    for name in (THROUGHPUT_TABLE, BREAKDOWN_TABLE):  # each count's rows, one table each
        tables[name] = [{"threads per rank": t, **row} for t, rep in per.items() for row in rep["tables"][name]]
    return {
        "by_threads": {str(t): rep for t, rep in per.items()},
        "ratios": {str(t): rep["ratio"] for t, rep in per.items()},
        "meets_goal": all(rep["ratio"] >= THREADS_GOAL for rep in per.values()),
        "tables": tables,
        "notes": [*first["notes"][:-1], *(rep["notes"][-1] for rep in per.values())],
    }
