"""The universal conversion's own cost (a resume on another number of workers, an elastic
resize): `checkpoint.to_universal`, which runs DeepSpeed's conversion and the slimming of its
shard copy in one child process, against the two children it used before (DeepSpeed's
`ds_to_universal`, then `python -m raytrain_cpu.checkpoint` to slim), side by side in one run.

Trains a Llama-shaped model for 2 steps on 2 workers through the real entry point, then
converts fresh copies of its checkpoint both ways, alternating, `--reps` times each. Each child
process imports torch and DeepSpeed, which costs seconds whatever the checkpoint's size: the
tests' tiny model shows that cost alone, `--shape 88m` (universal_resume.py's model) next to a
conversion with real work in it. Writes the median seconds of each way and their ratio to
benchmarks/results/<machine>/universal_conversion[-88m].{json,md} (bench.common.write_results).

    python benchmarks/universal_conversion.py               # about 1 minute on 2 cores
    python benchmarks/universal_conversion.py --shape 88m   # about 2 minutes
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_results

from raytrain_cpu.checkpoint import layout as ck_layout
from raytrain_cpu.checkpoint import universal as ck_universal
from raytrain_cpu.checkpoint import verify as ck_verify
from raytrain_cpu.host.features import cpu_features
from raytrain_cpu.obs.metrics import markdown_table

REPO = Path(__file__).resolve().parents[1]

SHAPES = {
    "tiny": {},  # the default tiny model (model.tiny), as the tests train it
    "88m": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 12, "intermediate_size": 2048},
}


def train(storage: Path, shape: dict[str, int]) -> Path:
    """A 2-step, 2-worker run; its checkpoint."""
    args = [f"model.tiny.{k}={v}" for k, v in shape.items()]
    args += ["train.micro_batch_size=1", "train.warmup_steps=1", "train.max_steps=2"]
    args += ["train.eval_every=0", "train.eval_batches=1"]  # the end's evaluation: one batch, not the split
    args += ["scaling.num_workers=2", "run.name=bench", f"run.storage_path={storage}"]
    args += [f"data.cache_dir={storage.parent / 'cache'}"]
    subprocess.run([sys.executable, "-m", "raytrain_cpu.main", *args], cwd=REPO, check=True, capture_output=True)
    return storage / "bench" / ck_layout.checkpoint_dir_name(2)


def two_children(ckpt: Path) -> None:
    """The former to_universal's children: DeepSpeed's conversion, then the slimming."""
    out = ckpt / f"{ck_layout.UNIVERSAL}.partial"
    argv = ["--input_folder", str(ckpt / ck_layout.DS_TAG), "--output_folder", str(out), "--inject_missing_state"]
    argv += ["--num_extract_workers", "1", "--num_merge_workers", "1"]
    run = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", *argv]
    subprocess.run(run, check=True, capture_output=True)
    slim = f"from pathlib import Path; from raytrain_cpu.checkpoint.universal import slim_common_state; slim_common_state(Path('{out}'))"
    subprocess.run([sys.executable, "-c", slim], check=True, capture_output=True, cwd=REPO)
    out.rename(ckpt / ck_layout.UNIVERSAL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--reps", type=int, default=3, help="conversions each way")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="universal_conversion_"))
    trained = train(root / "trained", SHAPES[args.shape])
    ways = {"one child (to_universal)": lambda c: ck_universal.to_universal(c), "two children (before)": two_children}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(args.reps):
        order = list(ways) if rep % 2 == 0 else list(reversed(ways))  # neither way always goes first
        for name in order:
            ckpt = root / f"copy{rep}-{len(seconds[name])}-{name.split()[0]}"
            shutil.copytree(trained, ckpt)
            t0 = time.perf_counter()
            ways[name](ckpt)
            seconds[name].append(time.perf_counter() - t0)
            assert ck_layout.universal_ready(ckpt)
            shutil.rmtree(ckpt)
    shards_mib = ck_verify.shard_bytes(ck_verify.read_manifest(trained)) / 2**20
    shutil.rmtree(root)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    ratio = median["one child (to_universal)"] / median["two children (before)"]
    table = [
        {"conversion": name, "median s": median[name], "each run (s)": ", ".join(f"{x:.2f}" for x in s)}
        for name, s in seconds.items()
    ]
    note = f"{shards_mib:,.1f} MiB of ZeRO shards (2 workers); one child / two: {ratio:.2f}x"
    print(markdown_table(table) + "\n\n" + note)
    if not args.no_write:
        result = {
            "command": f"python benchmarks/universal_conversion.py --shape {args.shape} --reps {args.reps}",
            "machine": cpu_features().describe(),
            "shape": args.shape,
            "shards_mib": round(shards_mib, 1),
            "seconds": {name: [round(x, 2) for x in s] for name, s in seconds.items()},
            "median_s": {name: round(m, 2) for name, m in median.items()},
            "one_over_two": round(ratio, 3),
            "tables": {"Universal conversion of a 2-worker checkpoint: one child process or two": table},
            "notes": [note],
        }
        print(write_results("universal_conversion" + ("" if args.shape == "tiny" else f"-{args.shape}"), result, None))


if __name__ == "__main__":
    main()
