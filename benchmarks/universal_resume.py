"""A resume on another number of workers: DeepSpeed's universal conversion as it comes vs as
raytrain leaves it (checkpoint.slim_common_state empties the copy of rank 0's optimizer shard
that DeepSpeed's ZeRO-3 conversion keeps, and every new rank loads), side by side in one run.

Trains a Llama-shaped model (default ~88M parameters) for 2 steps on 2 workers, copies the run
twice, converts one copy's checkpoint with `checkpoint.to_universal` and the other with
DeepSpeed's `ds_to_universal` alone, then resumes each for one step on 1 worker (twice the
accumulation, the same global batch) through the real entry point. Writes the conversion time,
the sizes on disk, the resumed rank's peak RSS and the loss of each to
benchmarks/results/<machine>/universal_resume.{json,md} (bench.common.write_results).

    python benchmarks/universal_resume.py          # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import shutil
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
from raytrain_cpu.obs.metrics import markdown_table, read_metrics

REPO = Path(__file__).resolve().parents[1]

SHAPE = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 12, "intermediate_size": 2048}


def main_cli(storage: Path, *extra: str) -> None:
    args = [f"model.tiny.{k}={v}" for k, v in SHAPE.items()]
    args += ["train.micro_batch_size=1", "train.warmup_steps=1", "train.log_every=1"]
    # Each run's evaluation at the end: one batch. Over the whole split it took most of the
    # benchmark's time (21 minutes in all, 2 with one batch), and measures nothing this compares.
    args += ["train.eval_every=0", "train.eval_batches=1"]
    args += ["run.name=bench", f"run.storage_path={storage}", f"data.cache_dir={storage.parent / 'cache'}", *extra]
    subprocess.run([sys.executable, "-m", "raytrain_cpu.main", *args], cwd=REPO, check=True, capture_output=True)


def du(path: Path) -> int:
    """The universal directory's size (a checkpoint's manifest lists only what the run wrote)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def resume_on_one_worker(storage: Path) -> dict[str, float]:
    main_cli(storage, "train.max_steps=3", "scaling.num_workers=1", "train.grad_accum_steps=2")
    row = read_metrics(storage / "bench").train[-1]
    return {"loss_step3": row["loss"], "peak_rss_gib": row["mem_peak_max_gib"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="universal_resume_"))
    main_cli(root / "trained", "train.max_steps=2")
    out: dict[str, dict[str, float]] = {}
    for variant in ("raytrain", "deepspeed"):
        storage = root / variant
        shutil.copytree(root / "trained", storage)
        ckpt = storage / "bench" / ck_layout.checkpoint_dir_name(2)
        t0 = time.perf_counter()
        if variant == "raytrain":
            ck_universal.to_universal(ckpt)
        else:  # DeepSpeed's conversion as it comes, where to_universal would put it
            argv = ["--input_folder", str(ckpt / ck_layout.DS_TAG), "--output_folder", str(ckpt / ck_layout.UNIVERSAL)]
            subprocess.run(
                [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", *argv], check=True, capture_output=True
            )
        common = ckpt / ck_layout.UNIVERSAL / "zero" / "optimizer_state.pt"
        out[variant] = {
            "convert_s": time.perf_counter() - t0,
            "shards_mib": ck_verify.shard_bytes(ck_verify.read_manifest(ckpt)) / 2**20,
            "universal_mib": du(ckpt / ck_layout.UNIVERSAL) / 2**20,
            "common_state_mib": common.stat().st_size / 2**20,
            **resume_on_one_worker(storage),
        }
    shutil.rmtree(root)
    columns = {"raytrain": "raytrain (slimmed)", "deepspeed": "DeepSpeed as it comes"}
    table = [{"": key, **{columns[v]: out[v][key] for v in columns}} for key in out["raytrain"]]
    ratio = out["raytrain"]["peak_rss_gib"] / out["deepspeed"]["peak_rss_gib"]
    note = f"Peak RSS of the resumed rank, slimmed / as it comes: {ratio:.2f}"
    print(markdown_table(table) + "\n\n" + note)
    if not args.no_write:
        result = {
            "command": "python benchmarks/universal_resume.py",
            "machine": cpu_features().describe(),
            "shape": SHAPE,
            "variants": out,
            "tables": {"Resume 2 workers -> 1: the universal conversion, slimmed or as DeepSpeed leaves it": table},
            "notes": [note],
        }
        print(write_results("universal_resume", result, None))


if __name__ == "__main__":
    main()
