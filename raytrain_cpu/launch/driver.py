"""`python -m raytrain_cpu.main [--config FILE] [key=value ...]`: the whole job, from the driver.

validate (before Ray) -> already finished? -> fetch hub files -> hold the run directory ->
ray.init -> size the workers -> prepare data -> write the model -> TorchTrainer(gloo) -> summary.
Re-running the same command with the same run.name resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from raytrain_cpu.config.checks import ConfigError, is_url
from raytrain_cpu.config.help import options_help
from raytrain_cpu.config.schema import Config, load_config
from raytrain_cpu.launch.datasets import (
    check_watched_metric,
    no_evaluation,
    note_epochs,
    steps_of_epochs,
    stream_spec,
)
from raytrain_cpu.launch.resume import (
    check_model_unchanged,
    check_resume,
    finished_run,
    newest_checkpoint,
    resume_world,
    verify_resume,
)
from raytrain_cpu.launch.signals import STOP_SIGNAL, sigterm_held_while_ray_starts, sigterm_kept, stop_on_sigterm
from raytrain_cpu.launch.sizing import check_memory, derive_scaling, local_ray_cpus, worker_env
from raytrain_cpu.launch.summary import print_failed, print_interrupted, print_summary
from raytrain_cpu.launch.validate import (
    check_checkpoint_room,
    check_lora_before_ray,
    check_tokenizer_fits,
    validate_before_ray,
)
from raytrain_cpu.model.hub import download_model, is_hub_id
from raytrain_cpu.obs.console import (
    hide_core_log_lines,
    quiet_ray_console,
    quiet_ray_loggers,
    ray_log_file,
    restart_notice,
)
from raytrain_cpu.obs.metrics import count_events, read_choices, read_metrics, run_log_size


def quiet_worker_logs() -> None:
    """Runs at the start of every Ray worker process of a local run (worker_process_setup_hook).

    A local run starts Ray without the dashboard (a process that 2 cores cannot spare), and
    Ray Train's placement-group cleaner, which asks the dashboard's state API every second
    whether the controller is still alive, then logs a warning each time.
    Its job (freeing the placement group when the controller dies) ends with the local Ray
    anyway, so only its warnings are dropped. It asks the cluster named by RAY_ADDRESS, else the
    one it finds on the machine, and stops with a traceback where it finds several.
    """
    import ray

    from raytrain_cpu.compat.ray import PLACEMENT_GROUP_CLEANER_LOGGER

    logging.getLogger(PLACEMENT_GROUP_CLEANER_LOGGER).setLevel(logging.ERROR)
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)


def run(cfg: Config) -> dict[str, Any]:
    """Runs (or resumes) the job; returns the summary written to summary.json.

    A Ray it starts prints raytrain's lines only, unless run.verbose (raytrain_cpu.obs.console); a
    Ray the caller started keeps the caller's console.
    """
    done = None if cfg.train.epochs else finished_run(cfg)  # train.epochs: the steps are known once packed
    if done is not None:
        return done
    t0 = time.perf_counter()
    model_dir = fetch_from_hub(cfg)
    check_tokenizer_fits(cfg, model_dir)
    with hold_run_dir(cfg.run.run_dir), sigterm_kept():
        return run_on_ray(cfg, model_dir, t0)


def fetch_from_hub(cfg: Config) -> str:
    """What comes from the hub, before Ray starts: a hub this machine can't reach (or a token
    that may not read the model) stops the job before anything else runs. Returns the model's
    local directory ('tiny' for the tiny model, written later)."""
    from raytrain_cpu.checkpoint.identity import pinned_revision
    from raytrain_cpu.data.prepare import materialize_tokenizer
    from raytrain_cpu.model.loading import check_causal_lm, check_context_length
    from raytrain_cpu.model.tokenizer import resolve_tokenizer_path

    model_dir = cfg.model.name_or_path
    if is_hub_id(model_dir):
        # A resumed run, and every restart in it, loads the commit its start resolved, not the newest.
        latest = newest_checkpoint(cfg.run.run_dir)
        revision = pinned_revision(latest, model_dir)
        at = f" at commit {revision} (that {Path(latest['path']).name} trained from)" if revision else ""
        print(
            f"[raytrain] fetching {model_dir}{at} from the hub into {cfg.run.hub_cache} (kept for later runs)",
            flush=True,
        )
        model_dir = download_model(model_dir, cfg.run.hub_cache, revision)
        # What validate_before_ray checks of a local model, now that this one is local too.
        check_causal_lm(model_dir)
        check_context_length(model_dir, cfg.data.seq_len)
        check_lora_before_ray(cfg, model_dir)
    tokenizer = resolve_tokenizer_path(cfg.model.tokenizer, cfg.model.name_or_path)
    if is_hub_id(tokenizer):  # saved once under the data cache, where prepare and the workers read it
        materialize_tokenizer(tokenizer, cfg)
    return model_dir


RUN_LOCK = ".raytrain.lock"  # in the run directory: "pid N on HOST, since T" of the job that holds it


@contextlib.contextmanager
def hold_run_dir(run_dir: Path) -> Iterator[None]:
    """Holds the run directory for this job: a second job with the same run.name and storage
    while this one runs (a job submitted again by mistake) stops with a ConfigError instead of
    writing its checkpoints into the same directory. An flock, which the kernel drops when the
    process ends, so a killed driver leaves nothing to clean up; on storage without flock (a
    Lustre mount without the flock option) nothing is held. A run directory it made and the job
    left empty (it stopped before writing anything) goes again."""
    made = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # innermost first
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise ConfigError(
                f"run.name: run {run_dir.name!r} is running already ({holder}). Wait for it to end or stop it, "
                "or choose another run.name."
            ) from None
        except OSError:
            pass  # this filesystem has no flock
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}".encode(), 0)
        yield
    finally:
        os.close(fd)  # and with it the lock
        if made and [p.name for p in run_dir.iterdir()] == [RUN_LOCK]:
            (run_dir / RUN_LOCK).unlink()
            with contextlib.suppress(OSError):  # a directory something else wrote into stays
                for d in made:
                    d.rmdir()


def ray_train_env(cfg: Config) -> dict[str, str]:
    """The Ray Train settings that only environment variables carry."""
    env = {
        # A dead or hung peer ends the attempt within run.gloo_timeout_s wherever the others wait
        # for it: in a gloo collective (compat.ray_backend.GlooConfig), in Ray Train's own barriers
        # (report, preemption checks) or in the controller's health check of a worker that stopped
        # answering.
        "RAY_TRAIN_COLLECTIVE_TIMEOUT_S": str(cfg.run.gloo_timeout_s),
        "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": str(cfg.run.gloo_timeout_s),
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(cfg.run.poll_interval_s),
    }
    if cfg.elastic:
        # After a node loss Ray Train's view of the cluster lags up to 20 s (Ray Data's
        # AutoscalingCoordinator refreshes it), so its first restart may still ask for the lost
        # node's worker: it waits this long for it before taking the size that fits (Ray: 60 s).
        env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "30")
    return env


# Set in the driver and on every Ray worker of the job.
RAY_ENV = {"TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}


def run_on_ray(cfg: Config, model_dir: str, t0: float) -> dict[str, Any]:
    """The job once its files are here: Ray, the data, the model, the TorchTrainer, the summary."""
    quiet = quiet_ray_console(cfg)  # before `import ray`: Ray reads its console knobs on import
    os.environ.update(RAY_ENV)
    restore_stderr = start_ray(cfg, quiet)
    quiet_ray_data()
    cfg = resume_world(cfg)
    sizing = derive_scaling(cfg)
    world = sizing["num_workers"]
    global_batch = cfg.train.derive_global_batch(world)  # ConfigError names the fix
    worlds = check_the_fit(cfg, model_dir, sizing, global_batch)

    # ---- data
    from raytrain_cpu.data.prepare import prepare
    from raytrain_cpu.data.stream import mixture_sources, read_meta

    cache = prepare(cfg, log=lambda m: print(m, flush=True))
    meta = read_meta(cache)
    sources = mixture_sources(cache, meta)
    cfg = steps_of_epochs(cfg, meta, global_batch)
    if cfg.train.epochs and (done := finished_run(cfg)) is not None:
        if restore_stderr is not None:
            restore_stderr()
        return done
    note_the_data(cfg, meta, sources, world, global_batch)

    # ---- model
    from raytrain_cpu.model.loading import count_parameters

    if cfg.model.is_tiny:
        model_dir = write_tiny(cfg, quiet)
    n_params = count_parameters(model_dir)
    # Again for callers of run() (main() did it before Ray), now with the derived worker count,
    # before config.yaml is replaced.
    latest = verify_resume(cfg, check_resume(cfg, world), world)
    model = check_model_unchanged(cfg, model_dir, latest)

    # ---- resolved config and resume position
    cfg_dict = cfg.to_dict()
    (cfg.run.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
    if cfg.train.record_block_ids:
        (cfg.run.run_dir / "block_ids").mkdir(exist_ok=True)
    start = resume_position(latest, meta, global_batch)

    # ---- trainer
    from raytrain_cpu.checkpoint.identity import config_hash

    loop_config = {
        "config": cfg_dict,
        "run_dir": str(cfg.run.run_dir),
        "model_dir": model_dir,
        "config_hash": config_hash(cfg_dict),
        "threads_per_worker": sizing["threads_per_worker"],
        "worker_bundle": {"CPU": sizing["cpus_per_worker"], **cfg.scaling.resources_per_worker},
        "start_position": start,
        "streams": stream_spec(meta, sources, cfg, worlds, start),  # each rank opens its own
        "data_key": meta["key"],  # recorded in the checkpoints: a resume notices data that changed
        "data_cache": str(cache),  # train.dpo_precompute_reference reads the blocks it covers
        "train_blocks": meta["blocks"],  # the metrics rows' epoch counts passes over them
        "record_block_ids": cfg.train.record_block_ids,
        "n_params": n_params,
        "model": model,  # the manifests record it; every attempt checks model_dir still matches it
        "hashed_checkpoint": latest and Path(latest["path"]).name,  # the workers' first attempt checks only its sizes
    }
    trainer = make_trainer(cfg, loop_config, worlds, sizing, latest)
    choices_start = run_log_size(cfg.run.run_dir)  # this attempt's lines of run.log start here
    result = trainer.fit()
    if restore_stderr is not None:
        restore_stderr()
    return write_summary(cfg, result, t0, cache, meta, sizing, choices_start)


def start_ray(cfg: Config, quiet: bool) -> Callable[[], None] | None:
    """ray.init unless the caller started Ray already, with SIGTERM held while it starts and then
    stopping the run as Ctrl-C does. Returns what puts stderr back after a quiet console's
    filtering (None: nothing to put back)."""
    import ray

    restore_stderr = None
    if not ray.is_initialized():
        local = cfg.run.ray_init_address == "local"
        # Joining a running cluster (under `ray job submit` RAY_ADDRESS is its GCS): every process
        # of the job gets the address, so helpers that look the cluster up themselves (Ray Train's
        # placement-group cleaner) don't fail with "multiple active Ray instances" on a machine
        # that runs several Rays.
        joined = {} if local or is_url(cfg.run.ray_init_address) else {"RAY_ADDRESS": cfg.run.ray_init_address}
        ray_logs = quiet_ray_loggers() if quiet else None
        with sigterm_held_while_ray_starts():
            context = ray.init(
                address=cfg.run.ray_init_address,
                num_cpus=local_ray_cpus() if local else None,
                runtime_env={"env_vars": RAY_ENV | joined}
                | ({"worker_process_setup_hook": "raytrain_cpu.launch.driver.quiet_worker_logs"} if local else {}),
                include_dashboard=False,
                log_to_driver=True,
                configure_logging=True,
                logging_level="WARNING",
            )
        logs_dir = Path(context.address_info["session_dir"]) / "logs"
        if ray_logs is not None:
            ray_log_file(ray_logs, logs_dir)
            restore_stderr = hide_core_log_lines()
        verbose_hint = "" if cfg.run.verbose else "; run.verbose=true prints them here too"
        print(f"[raytrain] Ray's own logs: {logs_dir} (on each node){verbose_hint}", flush=True)
    stop_on_sigterm()
    # Helper processes (e.g. Ray Train's placement-group cleaner) find this cluster, not another.
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    return restore_stderr


def quiet_ray_data() -> None:
    """raytrain's [data] lines instead of Ray Data's bars and per-operator logs while it prepares
    the data (it writes them every few seconds when stdout is not a terminal). Set before any
    dataset exists: a dataset keeps a copy of the context it was built with."""
    from ray.data import DataContext

    data_ctx = DataContext.get_current()
    data_ctx.enable_progress_bars = False
    data_ctx.print_on_execution_start = False


def check_the_fit(cfg: Config, model_dir: str, sizing: dict[str, Any], global_batch: int) -> list[int]:
    """The memory and checkpoint room the sized run needs, and its one line; returns the worker
    counts it may have (an elastic run's range, else the one)."""
    from raytrain_cpu.checkpoint.layout import workers

    world = sizing["num_workers"]
    if cfg.scaling.check_memory:
        check_memory(cfg, model_dir, sizing)
    check_checkpoint_room(cfg, model_dir)
    worlds = list(cfg.worker_counts) if cfg.elastic else [world]
    how_many = f"{worlds[0]} to {world} workers (elastic)" if cfg.elastic else workers(world)
    print(
        f"[raytrain] {how_many} x {sizing['cpus_per_worker']} CPUs ({sizing['threads_per_worker']} threads), "
        f"global batch {global_batch} blocks, run dir {cfg.run.run_dir}; nodes: {sizing['node_cpu']['model_name']} "
        f"({sizing['node_cpu']['best_isa']})",
        flush=True,
    )
    return worlds


def note_the_data(
    cfg: Config, meta: dict[str, Any], sources: list[tuple[str, Any, dict[str, Any]]], world: int, global_batch: int
) -> None:
    """The lines about the packed data (epochs, sources that evaluate nothing), and the check that
    a watched metric is measured."""
    if not cfg.train.epochs or "sources" in meta:  # a mixture: how often each source is read
        note_epochs(meta, cfg.train.max_steps * global_batch)
    for name, _, source_meta in sources:
        if source_meta["eval_blocks"] < world:  # else the summary's eval perplexity is n/a without a word why
            print(f"[raytrain] {no_evaluation(source_meta, world, name)}", flush=True)
    check_watched_metric(cfg, sources, world)


def write_tiny(cfg: Config, quiet: bool) -> str:
    """Writes the tiny model under the run directory; returns its directory."""
    from transformers.utils import logging as hf_logging

    from raytrain_cpu.model.loading import write_tiny_model
    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path

    tok = load_tokenizer(resolve_tokenizer_path(cfg.model.tokenizer, "tiny"))
    bars = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()  # its "Writing model shards" bar, for one small shard
    model_dir = str(write_tiny_model(cfg, tok, cfg.run.run_dir / "base_model"))
    if quiet and bars:
        hf_logging.enable_progress_bar()
    return model_dir


def resume_position(latest: dict[str, Any] | None, meta: dict[str, Any], global_batch: int) -> int:
    """The position in the blocks' seeded order the run goes on from (0 for a new run), with a
    line when the data changed since the checkpoint."""
    start = (latest["step"] if latest else 0) * global_batch
    if latest and latest.get("data_key", meta["key"]) != meta["key"]:  # its files changed since (more text?)
        print(
            f"[raytrain] the training data changed since {Path(latest['path']).name} (packed blocks "
            f"{latest['data_key']} then, {meta['key']} now): the run goes on at position {start:,} of the new "
            "blocks' own seeded order, not the old one's, so blocks trained before may come again this epoch "
            "and others not until the next",
            flush=True,
        )
    return start


def make_trainer(
    cfg: Config,
    loop_config: dict[str, Any],
    worlds: list[int],
    sizing: dict[str, Any],
    latest: dict[str, Any] | None,
):
    """The TorchTrainer on gloo that runs train_loop on every worker."""
    import ray.train

    from raytrain_cpu.compat.ray_backend import GlooConfig, LeanTorchTrainer
    from raytrain_cpu.trainer.loop import train_loop

    world = sizing["num_workers"]
    os.environ.update(ray_train_env(cfg))  # the driver's: Ray Train hands them to its controller
    return LeanTorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        # gloo: the CPU collective backend that ships with PyTorch; oneCCL bindings are retired.
        backend_config=GlooConfig(timeout_s=cfg.run.gloo_timeout_s),
        scaling_config=ray.train.ScalingConfig(
            num_workers=(worlds[0], worlds[-1]) if cfg.elastic else world,
            elastic_resize_monitor_interval_s=cfg.scaling.resize_check_s,
            use_gpu=False,
            resources_per_worker=loop_config["worker_bundle"],
        ),
        run_config=ray.train.RunConfig(
            name=cfg.run.name,
            storage_path=str(cfg.run.run_dir.parent),
            checkpoint_config=checkpoint_config(cfg),
            # Restarts resume from the latest reported checkpoint; announced preemptions (spot
            # notices) have their own, unlimited budget.
            failure_config=ray.train.FailureConfig(max_failures=cfg.run.max_failures, max_preemption_failures=-1),
            worker_runtime_env={"env_vars": {**RAY_ENV, **worker_env(cfg, sizing["workers_per_node"])}},
            callbacks=[restart_notice(cfg.run.max_failures, latest and Path(latest["path"]).name)],
        ),
        placement_group_cleaner=cfg.run.placement_group_cleaner,
    )


def write_summary(
    cfg: Config,
    result: Any,
    t0: float,
    cache: Path,
    meta: dict[str, Any],
    sizing: dict[str, Any],
    choices_start: int,
) -> dict[str, Any]:
    """summary.json: the workers' figures with the driver's (wall time, data, scaling, guard
    events and choices over every attempt); returns it."""
    run_dir = cfg.run.run_dir
    worker_summary = json.loads((run_dir / ".worker_summary.json").read_text())
    summary = {
        **worker_summary,
        "wall_s": time.perf_counter() - t0,
        "checkpoint_path": result.checkpoint.path if result.checkpoint else None,
        "run_dir": str(run_dir),
        "data_cache": str(cache),
        **({"data_mix": meta["sources"]} if "sources" in meta else {}),
        "padding_tokens": meta["padding_tokens"],
        "padding_frac": meta.get("padding_frac", 0.0),
        "truncated_examples": meta.get("truncated_examples", 0),
        "eval_truncated_examples": meta.get("eval_truncated_examples", 0),
        "data_format": meta.get("data_format", "text"),
        "skipped_rows": meta["skipped_rows"],
        "scaling": sizing,
        # From metrics.jsonl rather than the worker: it spans every attempt of a resumed run.
        "guard_events": count_events(read_metrics(run_dir)),
        # Which kernel and path each choice took, as the workers wrote them to run.log.
        "choices": read_choices(run_dir, choices_start),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def checkpoint_config(cfg: Config):
    """Ray Train keeps run.num_to_keep checkpoints: the newest, or under run.best_metric those
    with the lowest `checkpoint_score` (the metric at their step; trainer.saving), and always the newest
    beside them, which a resume loads."""
    import ray.train

    if not cfg.run.best_metric:
        return ray.train.CheckpointConfig(num_to_keep=cfg.run.num_to_keep)
    return ray.train.CheckpointConfig(
        num_to_keep=cfg.run.num_to_keep, checkpoint_score_attribute="checkpoint_score", checkpoint_score_order="min"
    )


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
    return ap.parse_intermixed_args(argv)  # overrides on both sides of --config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        validate_before_ray(cfg)
        check_lora_before_ray(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from raytrain_cpu.data.sources import DataError

    try:
        summary = run(cfg)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit):
        # Ray Train turns Ctrl-C into an abort of the run, then exits this process with
        # SystemExit(1) and only a log record (which the quiet console keeps in Ray's log files).
        print_interrupted(cfg)
        return 128 + STOP_SIGNAL[0]
    except Exception as e:
        import ray.train

        if cfg.run.verbose or not isinstance(e, ray.train.TrainingFailedError):
            raise
        print_failed(cfg, e)
        return 1
    print_summary(summary)
    return 3 if summary.get("guard_stop") else 0


if __name__ == "__main__":
    raise SystemExit(main())
