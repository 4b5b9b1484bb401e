"""Checks before Ray starts: the storage, what a setting asks to be installed, the model, LoRA
targets and tokenizer, and a resumed run's checkpoint and ranking. Each fails with a ConfigError
that names the key and the fix."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.schema import Config
from raytrain_cpu.launch.resume import check_resume


def check_storage(path: Path, key: str = "run.storage_path") -> None:
    """Fails if the directory `path` (set by config key `key`) can't be created and written;
    leaves nothing behind."""
    from raytrain_cpu.checkpoint.files import cannot_write, existing_folder

    probe_dir = existing_folder(path)
    if probe_dir == Path(path.anchor) and probe_dir != path:
        # A missing top-level directory is a mount that isn't there (/fsx on a node without
        # FSx): creating it would put the run on this node's root disk, where no other node sees it.
        raise ConfigError(
            f"{key}: {Path(path.anchor, path.parts[1])} does not exist. On a cluster it is the shared storage's "
            "mount point: mount it on every node (cluster/README.md); on one machine choose a directory such as "
            "./runs (top-level directories are never created)."
        )
    if not probe_dir.is_dir():
        raise ConfigError(
            f"{key}: {probe_dir} is a file, so {path} can't be created. Choose a directory path for {key}."
        )
    if why := cannot_write(probe_dir):
        raise ConfigError(
            f"{key}: cannot write under {probe_dir} ({why}). "
            f"Point {key} at a writable directory (on a cluster: the shared /fsx mount)."
        )


CHECKPOINT_BYTES_PER_PARAM = 12  # a ZeRO checkpoint: fp32 master weights and Adam's two moments


def check_checkpoint_room(cfg: Config, model_dir: str) -> None:
    """The run's storage must hold its checkpoints: with too little room the first save fails
    after all the steps before it. Stops when not even one fits; warns below run.num_to_keep + 1
    (the one being written beside those kept). LoRA checkpoints hold the adapters only: small."""
    if cfg.lora.rank:
        return
    if cfg.model.is_tiny:  # not written yet: counted from its shape
        from raytrain_cpu.planner.plan import inputs_from_config

        n_params = inputs_from_config(cfg)["model_shape"].num_params
    else:
        from raytrain_cpu.model.loading import count_parameters

        n_params = count_parameters(model_dir)["total"]
    from raytrain_cpu.checkpoint.layout import STAGING

    one = CHECKPOINT_BYTES_PER_PARAM * n_params
    # A save that failed (the storage full) leaves its staged files, which the next save removes
    # before it writes: room it has.
    staged = sum(f.stat().st_size for f in (cfg.run.run_dir / STAGING).rglob("*") if f.is_file())
    free = shutil.disk_usage(cfg.run.run_dir).free + staged
    kept = cfg.run.num_to_keep + bool(cfg.run.best_metric)  # ranked: the newest may be kept beside the best
    which = f"{kept} (the best and the newest)" if cfg.run.best_metric else "that many"
    needed = one * (kept + 1)
    what = (
        f"a checkpoint of this model takes about {_size(one)} ({n_params:,} parameters x "
        f"{CHECKPOINT_BYTES_PER_PARAM} bytes: fp32 master weights and Adam's two moments)"
    )
    if free < one:
        raise ConfigError(
            f"run.storage_path: {cfg.run.run_dir} has {_size(free)} free, and {what}: the next save would fail. "
            "Free space there, or choose a storage path with room."
        )
    if free < needed:
        print(
            f"[raytrain] storage: {_size(free)} free in {cfg.run.run_dir}, and {what}; run.num_to_keep="
            f"{cfg.run.num_to_keep} keeps {which} beside the one being written: {_size(needed)}. Free space, or "
            "lower run.num_to_keep.",
            flush=True,
        )


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_installed(cfg: Config) -> None:
    """What a setting asks for explicitly must be installed, else the workers quietly run without it."""
    from raytrain_cpu.host.features import cpp_compiler, cpp_compiler_name
    from raytrain_cpu.host.memory import find_allocator

    allocator = cfg.scaling.allocator
    if allocator in ("jemalloc", "tcmalloc") and find_allocator(allocator)[0] == "system":
        raise ConfigError(
            f"scaling.allocator: {allocator} is not installed here (apt-get install "
            f"{'libtcmalloc-minimal4' if allocator == 'tcmalloc' else 'libjemalloc2'}); the workers would "
            "run on glibc's malloc. Install it, or use auto (jemalloc, else tcmalloc, else glibc) or system."
        )
    if cfg.model.compile is True and not cpp_compiler():
        raise ConfigError(
            "model.compile: true, and inductor builds C++ on every worker, but this machine has no C++ compiler "
            f"({cpp_compiler_name()} is not on PATH): install one (apt-get install g++; the cluster "
            "images have it), or set model.compile=false (or auto, which compiles only where one is found)."
        )
    if cfg.metrics.mlflow_tracking_uri and importlib.util.find_spec("mlflow") is None:
        raise ConfigError(
            "metrics.mlflow_tracking_uri: set, but mlflow is not installed: pip install -e '.[mlflow]' (on a cluster, "
            "in the nodes' image too), or leave it out."
        )


def check_not_in_job_copy(cfg: Config) -> None:
    """Under `ray job submit --working-dir`, the driver runs in Ray's unpacked copy of that
    directory (<session>/runtime_resources/working_dir_files/...), which Ray deletes: a relative
    storage path would put the run's checkpoints there, to be lost with it."""
    cwd = Path.cwd()
    if "working_dir_files" not in cwd.parts:
        return
    for key, where in (("run.storage_path", cfg.run.storage_path), ("data.cache_dir", cfg.data.cache_dir)):
        if where and not Path(where).expanduser().is_absolute():
            raise ConfigError(
                f"{key}: {where!r} is relative, and this job runs in Ray's copy of its --working-dir ({cwd}), "
                f"which Ray deletes: what the run writes there would go with it. Give {key} an absolute path on "
                "storage every node shares (e.g. /fsx/runs; on one machine $PWD/runs)."
            )


def validate_before_ray(cfg: Config) -> None:
    from raytrain_cpu.data.prepare import cache_root
    from raytrain_cpu.data.sources import DataError, check_sources
    from raytrain_cpu.model.loading import check_causal_lm, check_context_length, check_model_path

    if not cfg.model.is_tiny:
        check_model_path(cfg.model.name_or_path)
        local = Path(cfg.model.name_or_path).expanduser()
        if local.is_dir():  # a hub id is checked once downloaded
            check_causal_lm(str(local))
            check_context_length(str(local), cfg.data.seq_len)
    if cfg.model.tokenizer not in ("bundled", ""):
        p = Path(cfg.model.tokenizer).expanduser()
        if cfg.model.tokenizer.startswith((".", "/", "~")) and not p.is_dir():
            raise ConfigError(
                f"model.tokenizer: {cfg.model.tokenizer!r} does not exist; use 'bundled', '' or a tokenizer directory."
            )
    check_installed(cfg)
    check_not_in_job_copy(cfg)
    check_storage(cfg.run.run_dir)
    if cfg.data.cache_dir:  # else it lies under run.storage_path, just checked
        check_storage(cache_root(cfg), "data.cache_dir")
    if cfg.model.compile_cache_dir:  # made absolute when the config loaded
        check_storage(Path(cfg.model.compile_cache_dir), "model.compile_cache_dir")
    try:
        check_sources(cfg.data)  # a hub dataset's file list: the hub answers before Ray starts
    except DataError as e:
        raise ConfigError(str(e)) from None
    check_resume(cfg)
    check_ranking(cfg)


def check_ranking(cfg: Config) -> None:
    """Under run.best_metric Ray Train ranks the run's checkpoints by the score each was reported
    with: one scored by another metric, or by none (Ray Train puts those first), would keep its
    place over better ones, and a better one (the best, which export --best reads) could be the
    one deleted. So a resume may rank only by the metric its checkpoints were scored with."""
    from raytrain_cpu.checkpoint.record import rank_unscored_last, scored_metrics

    if not cfg.run.best_metric:
        return  # Ray Train keeps the newest: no score read
    if unscored := rank_unscored_last(cfg.run.run_dir):
        print(
            f"[raytrain] {', '.join(unscored)}: saved at a step without an evaluation, so with no score in Ray "
            "Train's record; ranked last now",
            flush=True,
        )
    others = {name: m for name, m in scored_metrics(cfg.run.run_dir).items() if m != cfg.watched_metric}
    if not others:
        return
    scored_by = sorted({m for m in others.values() if m})
    how = " and ".join(
        ([f"scored by {', '.join(scored_by)}"] if scored_by else [])
        + (["saved without a score (before checkpoints carried one)"] if None in others.values() else [])
    )
    fixes = (
        [f"set run.best_metric={scored_by[0]} (theirs)"] if len(scored_by) == 1 and None not in others.values() else []
    )
    fixes += [
        "leave run.best_metric out (the newest are kept)",
        "export this run and rank in a new one (another run.name)",
    ]
    fix = "; or ".join(fixes)
    raise ConfigError(
        f"run.best_metric: run {cfg.run.name!r}'s checkpoints {', '.join(sorted(others))} were {how}, not by "
        f"{cfg.watched_metric}: ranked against it, Ray Train would keep them over better ones and could delete the "
        f"best. {fix[0].upper()}{fix[1:]}."
    )


def check_lora_before_ray(cfg: Config, model_dir: str | None = None) -> dict[str, int] | None:
    """LoRA targets that match nothing, or layers peft can't wrap, fail here (a meta-device model:
    no weights, no memory), not minutes later on every worker. A hub model is checked once run()
    has fetched it (`model_dir`), still before Ray starts."""
    if not cfg.lora.enabled:
        return None
    from raytrain_cpu.model.lora import check_lora

    local = Path(model_dir or cfg.model.name_or_path).expanduser()
    if cfg.model.is_tiny:
        from raytrain_cpu.model.loading import tiny_llama_config

        model_config = tiny_llama_config(cfg, vocab_size=2048, eos_token_id=0)
    elif local.is_dir():
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(str(local))
    else:
        return None
    return check_lora(model_config, cfg.lora, cfg.model.name_or_path)


def check_tokenizer_fits(cfg: Config, model_dir: str) -> None:
    """The tokenizer must load, and its ids must fit a given model's embedding (the tiny model is
    built for its tokenizer)."""
    from raytrain_cpu.data.prepare import materialize_tokenizer
    from raytrain_cpu.data.sources import DataError
    from raytrain_cpu.model.loading import check_vocab
    from raytrain_cpu.model.tokenizer import resolve_tokenizer_path

    tokenizer = resolve_tokenizer_path(cfg.model.tokenizer, model_dir)
    fix = "Set model.tokenizer to a tokenizer directory or hub id, or 'bundled'."
    files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if Path(tokenizer).is_dir() and not any((Path(tokenizer) / f).is_file() for f in files):
        raise ConfigError(f"model.tokenizer: {tokenizer} holds no tokenizer ({', '.join(files)}). {fix}")
    try:
        tokenizer_json, _ = materialize_tokenizer(tokenizer, cfg)
    except DataError as e:
        raise ConfigError(str(e)) from None
    except (OSError, ValueError) as e:  # files transformers cannot make a fast tokenizer of
        raise ConfigError(f"model.tokenizer: {tokenizer}: {str(e).strip().splitlines()[0]} {fix}") from None
    if not cfg.model.is_tiny:
        check_vocab(model_dir, tokenizer_json, cfg.model.tokenizer)
