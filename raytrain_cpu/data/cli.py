"""`python -m raytrain_cpu.data prepare ...` (and `raytrain-cpu prepare`): build a config's block cache."""

from __future__ import annotations

import json
import sys

from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.schema import load_config
from raytrain_cpu.data.prepare import prepare
from raytrain_cpu.data.sources import DataError, check_sources
from raytrain_cpu.data.stream import read_meta

# What `python -m raytrain_cpu.data prepare` prints of a cache's meta.json, where it says them
# (a mixture's has no tokens_per_s, a text cache no padding; only a mixture lists its sources).
PREPARED_FIGURES = (
    "blocks",
    "eval_blocks",
    "tokens",
    "skipped_rows",
    "tokens_per_s",
    "truncated_examples",
    "eval_truncated_examples",
    "padding_frac",
    "loss_tokens",
    "sources",
)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m raytrain_cpu.data",
        description="Tokenize and pack a text source into the parquet block cache that training streams from.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the cache for a config (no-op when it exists)")
    p.add_argument("--config", default=None, help="YAML config (default: the embedded local default)")
    p.add_argument(
        "--force",
        action="store_true",
        help="rebuild even if the cache exists (a new version; the old one stays for runs reading it)",
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.seq_len=512")
    argv = sys.argv[1:] if argv is None else argv
    # Overrides on both sides of --config, as main takes them (argparse mixes positionals and
    # options only without subparsers, so the command's own parser reads the rest).
    args = p.parse_intermixed_args(argv[1:]) if argv[:1] == ["prepare"] else ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        check_sources(cfg.data)  # fail on missing paths before Ray starts
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    from raytrain_cpu.obs.console import quiet_local_console

    quiet_local_console()  # a Ray of its own; its progress and notices go to its log files
    ray.init(address=cfg.run.ray_init_address, log_to_driver=False, include_dashboard=False)
    try:
        cache = prepare(cfg, force=args.force)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = read_meta(cache)
    print(
        json.dumps(
            {
                "cache": str(cache),
                **{k: meta[k] for k in PREPARED_FIGURES if k in meta},
            },
            indent=2,
        )
    )
    return 0
