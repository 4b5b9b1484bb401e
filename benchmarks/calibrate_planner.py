"""Measure peak RSS per rank of real ZeRO training, to calibrate ``raytrain_cpu.planner.memory``.

Starts ``--world-size`` Ray Train workers (or plain processes, gloo on 127.0.0.1), and in each
one does what a worker of this project does: start with the worker's allocator settings
(``raytrain_cpu.host.memory.preload_env``), then the training loop's own ``train.load_model`` (the sharded loader:
built under ZeRO-3's ``zero.Init``, each rank reading only its bytes; the attention pick) and
``train.build_engine`` (the project's DeepSpeed config, torch's fused AdamW, bf16, the kept
gradient and reduce-scatter buffers), then a few optimizer steps on random tokens. Each rank
records its resident set size (VmRSS) after every stage of start-up and its high-water mark
(VmHWM); rank-wise maxima are written, with the planner's prediction for the same case next to them, to
``benchmarks/results/<machine>/planner_calibration.json``.

    python benchmarks/calibrate_planner.py                          # every case in plan_tables.CALIBRATION_CASES
    python benchmarks/calibrate_planner.py --case llama-37m:8:ac    # one case (model:micro_batch[:ac])
    python benchmarks/calibrate_planner.py --no-write --launcher mp # print only; plain processes

The cases live in ``raytrain_cpu.planner.tables`` (CALIBRATION_SHAPES, CALIBRATION_CASES) so the planner's
unit tests predict exactly what is measured here. Keep it small: each rank gets one thread.
HfDeepSpeedConfig needs ``accelerate`` installed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere

import torch
import torch.multiprocessing as mp

from raytrain_cpu.host.features import cpu_features
from raytrain_cpu.host.memory import GLIBC_MMAP_THRESHOLD, preload_env
from raytrain_cpu.model.shape import ModelShape
from raytrain_cpu.planner import plan
from raytrain_cpu.planner import tables as plan_tables
from raytrain_cpu.trainer.engine import free_port, init_local_group

REPO = Path(__file__).resolve().parents[1]

# jemalloc where installed, as on the cluster; else glibc with a fixed mmap threshold, which
# measured the same peak RSS as jemalloc (its dynamic default fragments: ~30% more).
ALLOCATOR_ENV = preload_env("auto", GLIBC_MMAP_THRESHOLD)
# This machine's folder; the planner's constants were fitted on plan_tables.CALIBRATION_FILE's machine.
RESULTS = REPO / "benchmarks" / "results" / cpu_features().slug / "planner_calibration.json"


# ----------------------------------------------------------------------------- memory probes


def _status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: now, VmHWM: peak since start)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rss_gib() -> float:
    return _status_kib("VmRSS") / 2**20


def _hwm_gib() -> float:
    return _status_kib("VmHWM") / 2**20


# ----------------------------------------------------------------------------- one rank


def _worker(rank: int, world_size: int, case: dict[str, Any], out_dir: str):
    """A worker of this project with this case's settings: the training loop's own load_model and
    build_engine run on it, so what is measured is what a worker does."""
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.trainer.state import Worker

    cfg = load_config(
        None,
        [
            "model.dtype=bf16",  # a worker resolves 'auto' before building its config; bf16 is planned
            f"model.activation_checkpointing={case['activation_checkpointing']}",
            f"train.micro_batch_size={case['micro_batch']}",
            "train.grad_accum_steps=1",
            f"data.seq_len={case['seq_len']}",
            f"deepspeed.zero_stage={case['zero_stage']}",
            # Fitted on gloo: the shared-memory collectives' slots are the planner's arithmetic
            # (plan_tables.SHM_SLOT_BYTES), not a fitted constant.
            "deepspeed.shm_collectives=false",
            f"model.fused_loss={case['fused_loss']}",
            f"model.fused_norm={case['fused_norm']}",
            f"model.fused_mlp={case['fused_mlp']}",
        ],
    )
    log = print if rank == 0 else (lambda msg: None)
    batch = cfg.train.derive_global_batch(world_size)
    return Worker(cfg, {"model_dir": case["model_dir"]}, rank, world_size, Path(out_dir), batch, log)


def _rank_main(rank: int, world_size: int, port: int, case: dict[str, Any], out_dir: str) -> None:
    """torch.multiprocessing entry point: a gloo group on 127.0.0.1, then the measurement."""
    # The imports a Ray Train worker of this project carries, so the baseline is honest.
    import ray.train  # noqa: F401

    init_local_group(rank, world_size, port)
    _measure_rank(rank, case, out_dir)
    torch.distributed.destroy_process_group()


def _ray_train_loop(case: dict[str, Any]) -> None:
    """Ray Train entry point: Ray has set up the gloo group already."""
    import ray.train

    _measure_rank(ray.train.get_context().get_world_rank(), case, case["out_dir"])


def _measure_rank(rank: int, case: dict[str, Any], out_dir: str) -> None:
    """Load, initialize and train one rank, recording resident memory at each stage."""
    torch.set_num_threads(1)  # 2 cores shared by 2 ranks (and by other people's tests)
    importlib.import_module("torch._dynamo")  # before zero.Init patches Tensor.__new__

    from raytrain_cpu.compat.deepspeed_zero3 import kept_fp32_grad_buffer_bytes
    from raytrain_cpu.host.memory import malloc_setting
    from raytrain_cpu.trainer.engine import build_engine, deepspeed_config
    from raytrain_cpu.trainer.loading import load_model

    points: dict[str, float] = {"imports": _rss_gib()}
    w = _worker(rank, torch.distributed.get_world_size(), case, out_dir)
    ds_config = deepspeed_config(w.cfg, w.world)
    # The workers' loader: partitioned under zero.Init, each rank reading only its bytes; then
    # the attention pick and activation checkpointing as configured.
    loaded = load_model(w, ds_config)
    hf_config = loaded.model.config
    points["after_load"] = _rss_gib()
    points["load_peak"] = _hwm_gib()

    # The workers' engine: weight-decay groups (ZeRO-3 makes sub groups within each), the fp32
    # gradient buffer the optimizer step reuses and the kept reduce-scatter buffer.
    engine, _ = build_engine(w, loaded.model, ds_config)  # ends with the phase-end purge
    points["after_initialize"] = _rss_gib()

    gen = torch.Generator().manual_seed(1234 + rank)
    vocab, seq_len, micro_batch = hf_config.vocab_size, case["seq_len"], case["micro_batch"]
    step_times, phases = [], []
    for step in range(case["steps"]):
        tokens = torch.randint(0, vocab, (micro_batch, seq_len), generator=gen)
        t0 = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        fwd = (_rss_gib(), _hwm_gib())
        engine.backward(loss)
        bwd = (_rss_gib(), _hwm_gib())
        engine.step()
        step_times.append(time.perf_counter() - t0)
        phases.append({"fwd": fwd, "bwd": bwd, "step": (_rss_gib(), _hwm_gib())})
        if step == 0:
            points["after_first_step"] = _rss_gib()
    points["end"] = _rss_gib()
    points["peak"] = _hwm_gib()

    result = {
        "rank": rank,
        "malloc": malloc_setting(),
        "fused_adamw": ds_config["optimizer"]["params"]["fused"],
        "fp32_grad_buffer_bytes": kept_fp32_grad_buffer_bytes(engine),
        "rss_gib": points,
        "phases": phases,
        "step_s": step_times,
        "loss": loss.item(),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


# ----------------------------------------------------------------------------- one case


def _save_model(shape: ModelShape, path: str) -> None:
    """Writes a randomly initialised Llama of this shape as safetensors, like the 'tiny' model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape.llama_config(),
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def _launch_mp(world_size: int, case: dict[str, Any], out_dir: str) -> None:
    os.environ.update(ALLOCATOR_ENV)  # read by the children at start
    args = (world_size, free_port(), case, out_dir)
    mp.start_processes(_rank_main, args=args, nprocs=world_size, join=True, start_method="spawn")


def _launch_ray(world_size: int, case: dict[str, Any], out_dir: str) -> None:
    """The same measurement inside Ray Train workers (adds the Ray core worker to each rank)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # Workers import this file as a module (a function from __main__ would be pickled by value):
    # here by its own folder, first on sys.path as for any script; there through PYTHONPATH.
    here = str(Path(__file__).parent)
    calibrate = importlib.import_module(Path(__file__).stem)
    pythonpath = os.pathsep.join(p for p in (str(REPO), here, os.environ.get("PYTHONPATH", "")) if p)
    env = ALLOCATOR_ENV | {"PYTHONPATH": pythonpath}
    ray.init(num_cpus=world_size, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        TorchTrainer(
            calibrate._ray_train_loop,
            train_loop_config=case | {"out_dir": out_dir},
            scaling_config=ScalingConfig(num_workers=world_size, resources_per_worker={"CPU": 1}),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(name="calibrate", storage_path=os.path.join(out_dir, "ray")),
        ).fit()
    finally:
        ray.shutdown()


def measure(
    name: str,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    steps: int,
    ac: bool,
    launcher: str = "mp",
    fused_loss: bool = True,
    fused_norm: bool = True,
    fused_mlp: bool = False,
) -> dict[str, Any]:
    """Runs one calibration case and returns measured (max over ranks) next to predicted GiB."""
    shape = plan_tables.CALIBRATION_SHAPES[name]
    with tempfile.TemporaryDirectory(prefix="calib-") as tmp:
        model_dir = os.path.join(tmp, "model")
        _save_model(shape, model_dir)
        case = dict(
            model_dir=model_dir,
            micro_batch=micro_batch,
            seq_len=seq_len,
            steps=steps,
            zero_stage=3,
            activation_checkpointing=ac,
            fused_loss=fused_loss,
            fused_norm=fused_norm,
            fused_mlp=fused_mlp,
        )
        t0 = time.perf_counter()
        (_launch_ray if launcher == "ray" else _launch_mp)(world_size, case, tmp)
        wall = time.perf_counter() - t0
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]

    measured = {k: max(r["rss_gib"][k] for r in ranks) for k in ranks[0]["rss_gib"]}
    # Per step, the high-water mark reached by the end of forward / backward / optimizer step.
    hwm = [
        {ph: round(max(r["phases"][i][ph][1] for r in ranks), 4) for ph in ("fwd", "bwd", "step")} for i in range(steps)
    ]
    return {
        "model": name,
        "params": shape.num_params,
        "launcher": launcher,
        "world_size": world_size,
        "zero_stage": 3,
        "offload": "none",
        "dtype": "bf16",
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "activation_checkpointing": ac,
        "fused_loss": fused_loss,
        "fused_norm": fused_norm,
        "fused_mlp": fused_mlp,
        "malloc": ranks[0]["malloc"],
        "fused_adamw": ranks[0]["fused_adamw"],
        "fp32_grad_buffer_bytes": max(r["fp32_grad_buffer_bytes"] for r in ranks),
        "steps": steps,
        "measured_rss_gib": {k: round(v, 4) for k, v in measured.items()},
        "hwm_by_phase_gib": hwm,
        "median_step_s": round(sorted(ranks[0]["step_s"])[len(ranks[0]["step_s"]) // 2], 3),
        "final_loss": round(ranks[0]["loss"], 4),
        "wall_s": round(wall, 1),
    }


# ----------------------------------------------------------------------------- CLI


# Each phase the planner predicts, against what the ranks measured: the load's high-water
# mark, resident memory once deepspeed.initialize has returned, the training high-water mark.
PHASES = {
    "load": ("after_load", "load_peak"),
    "initialize": ("after_master", "after_initialize"),
    "training peak": ("peak", "peak"),
}


def add_prediction(case: dict[str, Any]) -> dict[str, Any]:
    """The planner's estimate for a measured case, and predicted / measured peak."""
    predicted = plan.plan(
        plan_tables.CALIBRATION_SHAPES[case["model"]],
        world_size=case["world_size"],
        zero_stage=case["zero_stage"],
        micro_batch=case["micro_batch"],
        seq_len=case["seq_len"],
        activation_checkpointing=case["activation_checkpointing"],
        fused_loss=case.get("fused_loss", False),  # cases measured before it existed ran Hugging Face's
        fused_norm=case.get("fused_norm", False),  # likewise
        fused_mlp=case.get("fused_mlp", False),  # likewise
    )["memory_gib"]
    case["predicted_gib"] = {k: round(v, 4) for k, v in predicted.items()}
    case["predicted_over_measured"] = {
        phase: round(predicted[p] / case["measured_rss_gib"][m], 4) for phase, (p, m) in PHASES.items()
    }
    case.pop("peak_ratio_predicted_over_measured", None)  # the older files' single ratio
    return case


def _print_case(case: dict[str, Any]) -> None:
    name = f"{case['model']} mb{case['micro_batch']}{' ac' if case['activation_checkpointing'] else ''}"
    name += "" if case.get("fused_loss", False) else " unfused"
    name += "" if case.get("fused_norm", False) else " hf-norm"
    name += " fused-mlp" if case.get("fused_mlp", False) else ""
    cols = []
    for phase, (p, m) in PHASES.items():
        measured, predicted = case["measured_rss_gib"][m], case["predicted_gib"][p]
        cols.append(f"{phase} {measured:.3f} / {predicted:.3f} (x{predicted / measured:.3f})")
    print(f"{name:18} measured / predicted GiB: " + ", ".join(cols), flush=True)


def _parse_case(text: str) -> tuple[str, int, bool]:
    """'llama-37m:8' or 'llama-37m:8:ac' -> (model, micro batch, activation checkpointing)."""
    name, mb, *rest = text.split(":")
    if name not in plan_tables.CALIBRATION_SHAPES or rest not in ([], ["ac"]):
        raise argparse.ArgumentTypeError(
            f"{text!r}: use MODEL:MICRO_BATCH[:ac], MODEL in {list(plan_tables.CALIBRATION_SHAPES)}"
        )
    return name, int(mb), rest == ["ac"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--case",
        action="append",
        type=_parse_case,
        help="MODEL:MICRO_BATCH[:ac] (repeatable); default: plan_tables.CALIBRATION_CASES",
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=plan_tables.CALIBRATION_SEQ_LEN)
    p.add_argument("--steps", type=int, default=6, help="the high-water mark settles after ~4 steps")
    p.add_argument("--launcher", choices=("ray", "mp"), default="ray", help="Ray Train or torch.multiprocessing")
    p.add_argument(
        "--unfused-loss", action="store_true", help="Hugging Face's loss (model.fused_loss=false) in every case"
    )
    p.add_argument(
        "--unfused-norm", action="store_true", help="Hugging Face's RMSNorms (model.fused_norm=false) in every case"
    )
    p.add_argument(
        "--fused-mlp", action="store_true", help="the fused SwiGLU activation (model.fused_mlp=true) in every case"
    )
    p.add_argument("--no-write", action="store_true", help=f"print only; do not rewrite {RESULTS.name}")
    p.add_argument(
        "--repredict", action="store_true", help=f"measure nothing: refresh the predictions in {RESULTS.name}"
    )
    args = p.parse_args(argv)

    if args.repredict:
        doc = json.loads(RESULTS.read_text())
        for case in doc["cases"]:
            add_prediction(case)
            _print_case(case)
        RESULTS.write_text(json.dumps(doc, indent=2) + "\n")
        return

    cases = []
    for name, micro_batch, ac in args.case or plan_tables.CALIBRATION_CASES:
        print(f"measuring {name}, micro batch {micro_batch}, activation checkpointing {ac} ...", flush=True)
        r = add_prediction(
            measure(
                name,
                args.world_size,
                micro_batch,
                args.seq_len,
                args.steps,
                ac,
                args.launcher,
                not args.unfused_loss,
                not args.unfused_norm,
                args.fused_mlp,
            )
        )
        print(json.dumps(r, indent=2), flush=True)
        _print_case(r)
        cases.append(r)

    if not args.no_write:
        import deepspeed
        import transformers

        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "what": "peak RSS per rank (VmHWM, max over ranks) of ZeRO-3 bf16 training, measured vs raytrain_cpu.planner.memory",
            "command": " ".join(
                ["python benchmarks/calibrate_planner.py", *(argv if argv is not None else sys.argv[1:])]
            ),
            "host": {
                "cpu": cpu_features().describe(),
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "python": platform.python_version(),
            },
            "versions": {
                "torch": torch.__version__,
                "deepspeed": deepspeed.__version__,
                "transformers": transformers.__version__,
                "ray": importlib.import_module("ray").__version__,
            },
            "cases": cases,
        }
        RESULTS.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
