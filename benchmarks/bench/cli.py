"""The suites' command line: `python benchmarks/suites.py <suite> [options] [key=value ...]`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from raytrain_cpu.host import features as host_features
from raytrain_cpu.host import memory as host_memory

from . import __doc__ as SUITES_DOC
from .common import SIZES, chosen_variants, package_versions, portable_args, results_file, write_results
from .gemm import suite_gemm
from .load import suite_load
from .reference import REFERENCE_PRECISIONS, suite_reference, suite_scaling
from .runs import (
    LORA_VARIANTS,
    OPTIONS_VARIANTS,
    Runner,
    dpo_variants,
    suite_dpo,
    suite_lora,
    suite_options,
    suite_placement,
    suite_seed,
    suite_train,
)

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


def result_path(suite: str, args: argparse.Namespace, feats: host_features.CpuFeatures) -> Path:
    """Where `suite`'s results go: --json, or this machine's folder of benchmarks/results."""
    return Path(args.json) if args.json else results_file(result_stem(suite, args.size), feats)


def _unwritable(folder: Path) -> str:
    """Why no file can be written in `folder` (made if missing); '' if one can."""
    from raytrain_cpu.checkpoint.files import cannot_write, existing_folder

    folder = existing_folder(folder)
    if not folder.is_dir():
        return f"{folder} is a file"
    why = cannot_write(folder)
    return f"cannot create files in {folder} ({why})" if why else ""


def thread_counts(text: str) -> list[int]:
    """--threads: comma-separated counts, each a whole number >= 1."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"give whole numbers separated by commas, e.g. 1,2,4, not {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"each count must be >= 1, got {text!r}")
    return counts


def _check_threads(args: argparse.Namespace, suites: list[str], feats: host_features.CpuFeatures) -> None:
    """--threads belongs to the reference suite, and each count's ranks must fit this machine's
    cores: threads beyond them would time the cores' sharing, not the training."""
    if not args.threads:
        return
    if suites != ["reference"]:
        raise ValueError(f"--threads: only the reference suite sweeps threads, not {args.suite}")
    cores = feats.usable_cores
    if too_many := [t for t in args.threads if t * args.workers > cores]:
        raise ValueError(
            f"--threads {too_many[0]}: {args.workers} rank(s) x {too_many[0]} threads is more than this machine's "
            f"{cores} usable cores; give counts up to {cores // args.workers} (or fewer --workers)"
        )


def check_args(args: argparse.Namespace, suites: list[str], runner: Runner, feats: host_features.CpuFeatures) -> None:
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
    _check_threads(args, suites, feats)
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


# OpenMP's settings that change every run's speed and that both sides of a comparison inherit
# (the local Ray's workers and the reference processes): the result's command names them.
OPENMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def env_prefix() -> str:
    """'OMP_WAIT_POLICY=active ' where the bench runs under such a setting, else ''."""
    return "".join(f"{k}={os.environ[k]} " for k in OPENMP_ENV if k in os.environ)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/suites.py", description=SUITES_DOC.split("\n\n")[0])
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
    ap.add_argument(
        "--threads",
        type=thread_counts,
        default=[],
        help="reference: threads per rank to compare at, in turn (e.g. 1,2,4,8,16; with --workers 1, one rank "
        "against plain PyTorch at the same threads at each count)",
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
    feats = host_features.cpu_features()
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
            "command": env_prefix() + "python benchmarks/suites.py " + " ".join(portable_args(argv, args.json)),
            "machine": feats.describe(),
            "cpu": feats.to_dict(),
            # the library, not this machine's path
            "allocator_found": Path(host_memory.find_allocator()[1]).name or "none",
            "versions": package_versions(),
            "size": args.size,
            "bench_wall_s": time.perf_counter() - t0,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        path = write_results(result_stem(name, args.size), result, str(result_path(name, args, feats)), runner.workdir)
        print(f"[bench] {name} -> {path} and {path.with_suffix('.md')}", flush=True)
        print(path.with_suffix(".md").read_text(), flush=True)
    return 0
