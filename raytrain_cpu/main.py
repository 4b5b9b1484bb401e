"""`python -m raytrain_cpu.main [--config FILE] [key=value ...]`: the whole job, from the driver.

validate (before Ray) -> ray.init -> size the workers -> prepare data -> write the model ->
TorchTrainer(gloo) -> summary. Re-running the same command with the same run.name resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from raytrain_cpu.config import Config, ConfigError, load_config, options_help

# ----------------------------------------------------------------------------- validation


def check_storage(path: Path) -> None:
    """Fails if the run directory can't be created and written; leaves nothing behind."""
    probe_dir = path
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise ConfigError(
            f"run.storage_path: {probe_dir} is a file, so {path} can't be created. "
            "Choose a directory path for run.storage_path."
        )
    probe = probe_dir / f".raytrain_write_probe_{uuid.uuid4().hex[:8]}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"run.storage_path: cannot write under {probe_dir} ({e.strerror}). "
            "Point run.storage_path at a writable directory (on a cluster: the shared /fsx mount)."
        ) from None


def validate_before_ray(cfg: Config) -> None:
    from raytrain_cpu.data import DataError, source_specs
    from raytrain_cpu.model import check_model_path

    if not cfg.model.is_tiny:
        check_model_path(cfg.model.name_or_path)
    if cfg.model.tokenizer not in ("bundled", ""):
        p = Path(cfg.model.tokenizer).expanduser()
        if cfg.model.tokenizer.startswith((".", "/", "~")) and not p.is_dir():
            raise ConfigError(
                f"model.tokenizer: {cfg.model.tokenizer!r} does not exist; use 'bundled', '' or a tokenizer directory."
            )
    check_storage(cfg.run.run_dir)
    if cfg.data.source != "hub":
        try:
            source_specs(cfg.data)
        except DataError as e:
            raise ConfigError(str(e)) from None


def check_lora_before_ray(cfg: Config) -> dict[str, int] | None:
    """LoRA targets that match nothing, or layers peft can't wrap, fail here (a meta-device model:
    no weights, no memory), not minutes later on every worker. Hub ids are checked by the workers."""
    if not cfg.lora.enabled:
        return None
    from raytrain_cpu.lora import check_lora

    if cfg.model.is_tiny:
        from raytrain_cpu.model import tiny_llama_config

        model_config = tiny_llama_config(cfg, vocab_size=2048, eos_token_id=0)
    elif Path(cfg.model.name_or_path).expanduser().is_dir():
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(str(Path(cfg.model.name_or_path).expanduser()))
    else:
        return None
    return check_lora(model_config, cfg.lora, cfg.model.name_or_path)


# ----------------------------------------------------------------------------- scaling


def physical_cores() -> int:
    """Physical cores of this machine (vCPUs / threads per core)."""
    from raytrain_cpu.cpu import cpu_features

    return cpu_features().physical_cores


def worker_node_cpu(nodes: list[dict[str, Any]]):
    """CpuFeatures of the nodes the workers land on (assumed alike): this machine's when it is
    the only node with CPUs, else read on the first such node by a zero-CPU Ray task (the head
    node often is another instance type)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raytrain_cpu.cpu import cpu_features

    here = ray.get_runtime_context().get_node_id()
    if len(nodes) == 1 and nodes[0]["NodeID"] == here:
        return cpu_features()
    probe = ray.remote(num_cpus=0)(cpu_features).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[0]["NodeID"], soft=False)
    )
    try:
        return ray.get(probe.remote(), timeout=120)
    except (ray.exceptions.RayError, TimeoutError):
        return cpu_features()  # a guess from the driver's node beats failing the run


def derive_scaling(cfg: Config) -> dict[str, Any]:
    """Worker count, CPUs and threads per worker from what Ray reports (config wins when set).

    Defaults: one rank per socket of each node (2 on a single-socket machine, for the demo);
    intra-op threads = the physical cores behind a worker's Ray CPUs (Ray counts vCPUs).
    """
    import ray

    from raytrain_cpu.cpu import default_workers_per_node, threads_per_worker

    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0]
    cpus_per_node = min(n["Resources"]["CPU"] for n in nodes)
    feats = worker_node_cpu(nodes)
    s = cfg.scaling
    data_cpus = s.data_cpus or (1.0 if cpus_per_node <= 16 else 2.0)
    per_socket = default_workers_per_node(feats.sockets)
    if s.num_workers:
        workers = s.num_workers
    elif len(nodes) > 1:
        workers = len(nodes) * per_socket
    else:
        workers = max(per_socket, 2 if cpus_per_node >= 2 else 1)
    workers_per_node = max(1, -(-workers // len(nodes)))
    free = cpus_per_node - data_cpus
    if s.cpus_per_worker:
        cpus = s.cpus_per_worker
    else:
        cpus = max(0.25, free / workers_per_node)
        cpus = int(cpus) if cpus >= 1 else round(cpus, 2)
    if cpus * workers_per_node > cpus_per_node:
        raise ConfigError(
            f"scaling.cpus_per_worker: {workers_per_node} workers x {cpus} CPUs don't fit a node with "
            f"{cpus_per_node:g} CPUs; lower scaling.cpus_per_worker or scaling.num_workers."
        )
    threads = s.threads_per_worker or threads_per_worker(
        cpus, feats.threads_per_core, feats.physical_cores, workers_per_node
    )
    return {
        "num_workers": workers,
        "cpus_per_worker": cpus,
        "threads_per_worker": threads,
        "workers_per_node": workers_per_node,
        "data_cpus": data_cpus,
        "nodes": len(nodes),
        "cpus_per_node": cpus_per_node,
        "node_cpu": feats.to_dict(),
    }


def worker_env(cfg: Config, workers_per_node: int) -> dict[str, str]:
    """Env vars the training workers must have at process start (set by Ray's runtime env).

    The allocator has to be preloaded before the process starts. OMP_PROC_BIND is turned off
    when ranks share a node: libgomp binds at import time to the node's first cores, the same
    ones for every rank (the cluster images set it for one rank per node); placement then
    comes from scaling.pin_cores instead.
    """
    from raytrain_cpu.cpu import preload_env

    env = preload_env(cfg.scaling.allocator)
    if workers_per_node > 1:
        env["OMP_PROC_BIND"] = "false"
    return env


# ----------------------------------------------------------------------------- checkpoints on disk


def newest_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The manifest (+ "path") of the checkpoint Ray Train will hand back on resume, verified.

    Only Ray's snapshot counts: a checkpoint directory it does not list was never reported (a
    crash between writing and reporting) and is not resumed from. When the snapshot's latest
    checkpoint is missing, incomplete or unreadable this fails loudly instead of starting over.
    """
    from raytrain_cpu.checkpoint import CheckpointError, latest_reported, verify_checkpoint

    try:
        path = latest_reported(run_dir)
        return None if path is None else {**verify_checkpoint(path), "path": str(path)}
    except CheckpointError as e:
        raise ConfigError(
            f"run.name: {e}. Ray Train would resume run {run_dir.name!r} from it; restore the files, or start a "
            "new run.name (python -m raytrain_cpu.export turns an older, complete checkpoint into a model to start from)."
        ) from None


# ----------------------------------------------------------------------------- run


def quiet_worker_logs() -> None:
    """Runs at the start of every Ray worker process of a local run (worker_process_setup_hook).

    A local run starts Ray without the dashboard (a process that 2 cores cannot spare), and
    Ray Train's placement-group cleaner, which asks the dashboard's state API every second
    whether the controller is still alive, then logs a warning each time: ~100 lines a run.
    Its job (freeing the placement group when the controller dies) ends with the local Ray
    anyway, so only its warnings are dropped.
    """
    import logging

    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)


def build_datasets(cache: Path, meta: dict, cfg: Config, world: int, start: int) -> dict[str, Any]:
    from ray.data import DataContext

    from raytrain_cpu import datathrottle
    from raytrain_cpu.data import StreamPlan, eval_stream, train_stream

    # These streams' scheduling loops run inside the training workers: keep them from spinning.
    datathrottle.install(DataContext.get_current())

    end = cfg.train.max_steps * cfg.train.derive_global_batch(world)
    out = {}
    for r in range(world):
        plan = StreamPlan(
            str(Path(cache) / "train"),
            meta["blocks"],
            cfg.train.seed,
            cfg.data.shuffle_window,
            cfg.train.micro_batch_size,
            world,
            r,
            start,
            end,
            has_labels=meta.get("data_format", "text") != "text",
        )
        out[f"train_rank{r}"] = train_stream(cache, plan)
        if meta["eval_blocks"] >= world:
            out[f"eval_rank{r}"] = eval_stream(cache, world, r, meta["eval_blocks"])
    return out


def run(cfg: Config) -> dict[str, Any]:
    """Runs (or resumes) the job; returns the summary written to summary.json."""
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_cpu.checkpoint import config_hash
    from raytrain_cpu.data import prepare, read_meta
    from raytrain_cpu.metrics import count_events, read_metrics
    from raytrain_cpu.model import count_parameters, write_tiny_model
    from raytrain_cpu.tokenizer import load_tokenizer, resolve_tokenizer_path
    from raytrain_cpu.train import train_loop

    t0 = time.perf_counter()
    run_dir = cfg.run.run_dir
    ray_env = {"TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
    os.environ.update(ray_env)
    if not ray.is_initialized():
        local = cfg.run.ray_init_address == "local"
        ray.init(
            address=cfg.run.ray_init_address,
            runtime_env={"env_vars": ray_env}
            | ({"worker_process_setup_hook": "raytrain_cpu.main.quiet_worker_logs"} if local else {}),
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=True,
            logging_level="WARNING",
        )
    # Helper processes (e.g. Ray Train's placement-group cleaner) find this cluster, not another.
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    # One progress line from rank 0 instead of Ray Data's bars and per-operator logs (which it
    # writes every few seconds when stdout is not a terminal). Set before any dataset exists:
    # a dataset keeps a copy of the context it was built with, also on the workers.
    from ray.data import DataContext

    data_ctx = DataContext.get_current()
    data_ctx.enable_progress_bars = False
    data_ctx.print_on_execution_start = False
    data_ctx.execution_options.preserve_order = True  # each rank's blocks arrive in plan order
    sizing = derive_scaling(cfg)
    world = sizing["num_workers"]
    global_batch = cfg.train.derive_global_batch(world)  # ConfigError names the fix
    print(
        f"[raytrain] {world} workers x {sizing['cpus_per_worker']} CPUs ({sizing['threads_per_worker']} threads), "
        f"global batch {global_batch} blocks, run dir {run_dir}; nodes: {sizing['node_cpu']['model_name']} "
        f"({sizing['node_cpu']['best_isa']})",
        flush=True,
    )

    # ---- data
    cache = prepare(cfg, log=lambda m: print(m, flush=True))
    meta = read_meta(cache)
    needed = cfg.train.max_steps * global_batch
    if needed > meta["blocks"]:
        print(
            f"[raytrain] {needed} blocks needed, {meta['blocks']} in the data: {needed / meta['blocks']:.1f} epochs",
            flush=True,
        )

    # ---- model
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.model.is_tiny:
        tok = load_tokenizer(resolve_tokenizer_path(cfg.model.tokenizer, "tiny"))
        model_dir = str(write_tiny_model(cfg, tok, run_dir / "base_model"))
    else:
        model_dir = cfg.model.name_or_path
        if "/" in model_dir and not Path(model_dir).exists():
            from huggingface_hub import snapshot_download

            # Download once to shared storage so every worker reads the same files.
            model_dir = snapshot_download(
                model_dir,
                cache_dir=str(run_dir.parent / "hf_cache"),
                allow_patterns=["*.json", "*.safetensors", "tokenizer*"],
            )
    n_params = count_parameters(model_dir)

    # ---- resolved config and resume position
    cfg_dict = cfg.to_dict()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
    if cfg.train.record_block_ids:
        (run_dir / "block_ids").mkdir(exist_ok=True)
    latest = newest_checkpoint(run_dir)
    start_step = latest["step"] if latest else 0
    if latest and latest["step"] >= cfg.train.max_steps:
        print(f"[raytrain] {latest['path']} is already at step {latest['step']} >= train.max_steps; nothing to do.")
    if latest and latest["world_size"] != world:
        from raytrain_cpu.checkpoint import world_size_remedy

        raise ConfigError(f"scaling.num_workers: {world_size_remedy(latest['path'], latest['world_size'], world)}")
    start = start_step * global_batch
    datasets = build_datasets(cache, meta, cfg, world, start)

    # ---- trainer
    loop_config = {
        "config": cfg_dict,
        "run_dir": str(run_dir),
        "model_dir": model_dir,
        "config_hash": config_hash(cfg_dict),
        "threads_per_worker": sizing["threads_per_worker"],
        "has_eval": meta["eval_blocks"] >= world,
        "start_position": start,
        "record_block_ids": cfg.train.record_block_ids,
        "n_params": n_params,
    }
    # A dead or hung peer ends the attempt within run.gloo_timeout_s wherever the others wait for it:
    # in a gloo collective (TorchConfig below), in Ray Train's own barriers (report, preemption
    # checks) or in the controller's health check of a worker that stopped answering.
    os.environ["RAY_TRAIN_COLLECTIVE_TIMEOUT_S"] = str(cfg.run.gloo_timeout_s)
    os.environ["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] = str(cfg.run.gloo_timeout_s)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        # gloo: the CPU collective backend that ships with PyTorch; oneCCL bindings are retired.
        torch_config=TorchConfig(backend="gloo", timeout_s=cfg.run.gloo_timeout_s),
        scaling_config=ray.train.ScalingConfig(
            num_workers=world,
            use_gpu=False,
            resources_per_worker={"CPU": sizing["cpus_per_worker"], **cfg.scaling.resources_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name=cfg.run.name,
            storage_path=str(run_dir.parent),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.num_to_keep),
            # Restarts resume from the latest reported checkpoint; announced preemptions (spot
            # notices) have their own, unlimited budget.
            failure_config=ray.train.FailureConfig(max_failures=cfg.run.max_failures, max_preemption_failures=-1),
            worker_runtime_env={"env_vars": {**ray_env, **worker_env(cfg, sizing["workers_per_node"])}},
        ),
        datasets=datasets,
        dataset_config=ray.train.DataConfig(datasets_to_split=[]),
    )
    result = trainer.fit()

    # ---- summary
    worker_summary = json.loads((run_dir / ".worker_summary.json").read_text())
    summary = {
        **worker_summary,
        "wall_s": time.perf_counter() - t0,
        "checkpoint_path": result.checkpoint.path if result.checkpoint else None,
        "run_dir": str(run_dir),
        "data_cache": str(cache),
        "padding_tokens": meta["padding_tokens"],
        "padding_frac": meta.get("padding_frac", 0.0),
        "truncated_examples": meta.get("truncated_examples", 0),
        "data_format": meta.get("data_format", "text"),
        "skipped_rows": meta["skipped_rows"],
        "scaling": sizing,
        # From metrics.jsonl rather than the worker: it spans every attempt of a resumed run.
        "guard_events": count_events(read_metrics(run_dir)),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def print_summary(s: dict[str, Any]) -> None:
    ppl = f"{s['eval_perplexity']:.2f}" if s.get("eval_perplexity") is not None else "n/a"
    resumed = f" (resumed from step {s['resumed_from_step']})" if s.get("resumed_from_step") else ""
    print(
        "\n== raytrain_cpu summary ==\n"
        f"steps            {s['steps']}{resumed}\n"
        f"tokens seen      {s['tokens_seen']:,}\n"
        f"final loss       {s['final_loss']:.4f}\n"
        f"eval perplexity  {ppl}\n"
        f"tokens/s         {s['tokens_per_s']:,.0f} on {s['world_size']} workers\n"
        f"wall time        {s['wall_s']:.0f}s\n"
        f"checkpoint       {s['checkpoint_path']}\n"
        f"run directory    {s['run_dir']} (metrics.jsonl, summary.json)\n"
        f"guards           {_guard_line(s)}\n"
        f"report           python -m raytrain_cpu.report {s['run_dir']}\n",
        flush=True,
    )
    if s.get("guard_stop"):
        print(f"error: the run stopped early at step {s['steps']}: {s['guard_stop']}", file=sys.stderr, flush=True)


def _guard_line(s: dict[str, Any]) -> str:
    g = s.get("guard_events") or {}
    if not any(g.values()):
        return "no loss spikes, gradient-norm spikes or non-finite losses"
    return ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in g.items()) + " (event rows in metrics.jsonl)"


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m raytrain_cpu.main",
        description=(
            "Train a causal LM on CPUs with Ray Train (gloo) + DeepSpeed ZeRO-3. With no arguments: "
            "a tiny Llama on the bundled wikitext-2, 2 workers on a local Ray."
        ),
        epilog=options_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", default=None, help="YAML config file (e.g. configs/local.yaml); defaults are built in")
    ap.add_argument(
        "overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=20 scaling.num_workers=1"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        validate_before_ray(cfg)
        check_lora_before_ray(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from raytrain_cpu.data import DataError

    try:
        summary = run(cfg)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(summary)
    return 3 if summary.get("guard_stop") else 0


if __name__ == "__main__":
    raise SystemExit(main())
