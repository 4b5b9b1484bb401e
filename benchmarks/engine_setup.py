"""A worker's engine set-up with and without DeepSpeed's Muon module, side by side in one run.

Building any ZeRO engine makes DeepSpeed import its Muon optimizer module, only to ask whether
the optimizer is one; that module compiles kernels with torch.compile at import, which loads
inductor. `compat.deepspeed_zero3.keep_muon_unimported` puts a stand-in in its place (runs never use Muon). Each
measurement is a fresh process, as a worker is: it loads the default tiny model into ZeRO-3
partitions (one rank, a real gloo group) and builds the engine with the run's DeepSpeed config;
"DeepSpeed's Muon import" imports the real module first, inside the timed span, which is what
DeepSpeed does without the stand-in. The ways alternate, `--reps` times each. Writes the medians
(set-up seconds, and the whole process from start to engine) and their ratios to
benchmarks/results/<machine>/engine_setup.{json,md} (bench.common.write_results).

    python benchmarks/engine_setup.py    # about 1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WAYS = {"stand-in (keep_muon_unimported)": "stand_in", "DeepSpeed's Muon import (before)": "muon"}


def child(way: str, model_dir: str) -> None:
    """One worker's set-up in this fresh process; prints {setup_s, inductor_loaded} as JSON."""
    import torch

    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.model.loading import load_sharded
    from raytrain_cpu.trainer.engine import deepspeed_config, free_port, init_deepspeed, init_local_group, param_groups

    torch.set_num_threads(1)
    init_local_group(0, 1, free_port())
    cfg = load_config(None, ["model.dtype=bf16"])
    ds_config = deepspeed_config(cfg, 1)
    t0 = time.perf_counter()
    if way == "muon":
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    init_deepspeed()
    import deepspeed

    model, hf_ds_config = load_sharded(model_dir, ds_config, torch.bfloat16)
    deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1), config=ds_config)
    setup_s = time.perf_counter() - t0
    print(json.dumps({"setup_s": setup_s, "inductor_loaded": "torch._inductor.compile_fx" in sys.modules}))
    del hf_ds_config


def measure(way: str, model_dir: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, __file__, "--child", way, str(model_dir)], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1]) | {"process_s": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="processes each way")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)

    from bench.common import write_results

    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.host.features import cpu_features
    from raytrain_cpu.model.loading import write_tiny_model
    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path
    from raytrain_cpu.obs.metrics import markdown_table

    root = Path(tempfile.mkdtemp(prefix="engine_setup_"))
    tok = load_tokenizer(resolve_tokenizer_path("bundled", "tiny"))
    model_dir = write_tiny_model(load_config(None, []), tok, root / "model")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in WAYS}
    for rep in range(args.reps):
        for name in list(WAYS) if rep % 2 == 0 else list(reversed(WAYS)):  # neither way always goes first
            runs[name].append(measure(WAYS[name], model_dir))
    assert not any(r["inductor_loaded"] for r in runs[next(iter(WAYS))]), "the stand-in still loaded inductor"
    median = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("setup_s", "process_s")} for name, rs in runs.items()
    }
    new, old = (median[name] for name in WAYS)
    ratios = {k: round(new[k] / old[k], 3) for k in new}
    table = [
        {
            "way": name,
            "median set-up s": median[name]["setup_s"],
            "median process s": median[name]["process_s"],
            "inductor loaded": "yes" if all(r["inductor_loaded"] for r in rs) else "no",
        }
        for name, rs in runs.items()
    ]
    note = (
        f"{args.reps} fresh processes each way, alternating; the default tiny model, ZeRO-3, one rank. "
        f"Stand-in / before: set-up {ratios['setup_s']:.2f}x, whole process {ratios['process_s']:.2f}x"
    )
    print(markdown_table(table) + "\n\n" + note)
    if not args.no_write:
        result = {
            "command": f"python benchmarks/engine_setup.py --reps {args.reps}",
            "machine": cpu_features().describe(),  # the cores too: a timing figure depends on them
            "runs": {name: [{k: round(v, 3) for k, v in r.items()} for r in rs] for name, rs in runs.items()},
            "stand_in_over_before": ratios,
            "tables": {"A worker's engine set-up: the Muon stand-in against DeepSpeed's Muon import": table},
            "notes": [note],
        }
        print(write_results("engine_setup", result, None))


if __name__ == "__main__":
    main()
