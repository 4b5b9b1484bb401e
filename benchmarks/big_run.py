"""A 1B-parameter Llama fine-tuned with LoRA on 2 workers of one small machine, end to end, with
the planner's prediction beside what it measured.

    python benchmarks/big_run.py                  # the ~1.09B model; an hour or more on 2 vCPUs
    python benchmarks/big_run.py --shape tiny     # the same phases on the tiny default: the script's own check

The other benchmarks time one part at a small model; this one asks whether the whole path holds
at a size where memory and the checkpoint files are real (GBs): a Llama of ~1.09B parameters
built from model.tiny (hidden 2048, 24 layers, 16 heads, 4 key/value heads, MLP 5632, the
bundled 2048-token vocabulary), seq 256, micro batch 1, LoRA rank 16 on all seven projections,
bf16, ZeRO-3, 2 workers of 1 thread. Each phase runs through its real entry point as a child
process (so the driver's fp32 copy of the model it writes, and every phase's memory, leave with
it) and is timed from outside:

1. train 8 steps, a checkpoint at steps 4 and 8: the mean step after the warm-up steps
   (summary.json's step_breakdown, train.profile_breakdown), each worker's peak RSS (sampled
   from /proc beside the run, and the run's own records), each save's seconds and size;
2. the same command with train.max_steps=12: the resume from step 8, its seconds, the losses;
3. the universal conversion of the last checkpoint (checkpoint.universal.to_universal);
4. `python -m raytrain_cpu.export --merge` (adapter and merged model), then
   `python -m raytrain_cpu.generate` from the merged export;
5. `python -m raytrain_cpu.plan` for the same case, with LoRA and as full fine-tuning.

Writes benchmarks/results/<machine>/big_run.{json,md} (bench.common.report_script) and removes
the checkpoints and exports (GBs) unless --keep. A phase that fails is recorded with its exit
status, the memory its processes had reached and the tail of its output; the phases that need
its result are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from bench.common import GB, REPO, model_overrides, report_script  # benchmarks/ is this script's path

from raytrain_cpu.checkpoint import layout as ck_layout
from raytrain_cpu.obs.metrics import read_metrics

GIB = 2**30
SHAPES: dict[str, dict[str, int]] = {
    "1b": {"hidden_size": 2048, "num_layers": 24, "num_heads": 16, "num_kv_heads": 4, "intermediate_size": 5632},
    "tiny": {},  # model.tiny's defaults: every phase in a minute or two, to check the script itself
}
STEPS, RESUMED_STEPS, CHECKPOINT_EVERY = 8, 12, 4
SEQ_LEN, WORKERS = 256, 2
PROMPT = "The history of the"


def run_overrides(workdir: Path, shape: dict[str, int]) -> list[str]:
    """The run's settings, the same for the first run and its resume (a resume refuses a
    changed shape). model.compile=false: per-layer compile would be the bf16 default at this
    size (model.compile=auto), but on 2 shared vCPUs its first build takes minutes inside the
    timed steps' warm-up, and the planner counts no compiled kernels. One evaluation batch at
    the end only: the whole split would take longer than the training. warmup_steps=2, so that
    the 12 steps' losses move enough to show the resume goes on from where it stopped."""
    return [
        f"run.storage_path={workdir / 'runs'}",
        "run.name=big-run",
        f"data.cache_dir={workdir / 'data_cache'}",
        f"model.compile_cache_dir={workdir / 'inductor_cache'}",
        *model_overrides(shape, SEQ_LEN),
        "model.dtype=bf16",
        "model.compile=false",
        "deepspeed.zero_stage=3",
        "lora.rank=16",
        f"scaling.num_workers={WORKERS}",
        "scaling.threads_per_worker=1",
        "train.micro_batch_size=1",
        "train.grad_accum_steps=1",
        "train.warmup_steps=2",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        f"train.checkpoint_every={CHECKPOINT_EVERY}",
        "train.profile_breakdown=true",
        "data.tokenize_actors=1",
        "metrics.tensorboard=false",
    ]


# ----------------------------------------------------------------------------- measuring a child


def _status_kib(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


class TreePeaks:
    """Every process under a child (its Ray, Ray's workers, a conversion's own child), sampled
    from /proc twice a second: the peak RSS (VmHWM, which the kernel keeps, so a sample late in
    a process's life still sees a peak between samples) and the name of each. Ray Train's
    workers are told by their process title (`ray::RayTrainWorker...`), which is how their
    peaks are found per rank; the run's own records give only the highest rank's training peak
    and each rank's peak while loading.

    It also stamps each line a run adds to its run.log with the time it appeared: the workers
    write their choice lines (the engine's set-up among them) there, unstamped, and not to the
    console, and the resume's seconds are measured from one of them (resume_seconds)."""

    def __init__(self, root: int, t0: float, run_log: Path | None = None, interval_s: float = 0.5):
        self.root, self.t0, self.interval_s = root, t0, interval_s
        self.procs: dict[int, dict[str, Any]] = {}
        self.machine_used_peak = 0
        self.run_log, self.run_log_lines = run_log, []
        self._run_log_at = run_log.stat().st_size if run_log and run_log.is_file() else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        """run.log ten times a second (a line's stamp is as good as this), /proc every interval_s."""
        last = 0.0
        while not self._stop.is_set():
            self._read_run_log()
            if time.perf_counter() - last >= self.interval_s:
                self.sample()
                last = time.perf_counter()
            self._stop.wait(0.1)
        self._read_run_log()
        self.sample()

    def sample(self) -> None:
        try:
            tree = [psutil.Process(self.root), *psutil.Process(self.root).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        vm = psutil.virtual_memory()
        self.machine_used_peak = max(self.machine_used_peak, vm.total - vm.available)
        for p in tree:
            hwm, rss = _status_kib(p.pid, "VmHWM:"), _status_kib(p.pid, "VmRSS:")
            if hwm is None:
                continue
            rec = self.procs.setdefault(p.pid, {"pid": p.pid, "name": "", "hwm": 0, "rss": 0})
            with contextlib.suppress(psutil.Error):
                rec["name"] = " ".join(p.cmdline())[:120] or rec["name"]
            rec["hwm"], rec["rss"] = max(rec["hwm"], hwm * 1024), max(rec["rss"], (rss or 0) * 1024)

    def _read_run_log(self) -> None:
        if self.run_log is None or not self.run_log.is_file():
            return
        with self.run_log.open("rb") as f:
            f.seek(self._run_log_at)
            chunk = f.read()
        whole = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next sample
        self._run_log_at += len(whole)
        now = time.perf_counter() - self.t0
        self.run_log_lines += [(now, ln) for ln in whole.decode(errors="replace").splitlines() if ln]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def train_workers(self) -> list[dict[str, Any]]:
        """Ray Train's worker processes, by pid (their rank is not in /proc)."""
        return sorted((r for r in self.procs.values() if "RayTrainWorker" in r["name"]), key=lambda r: r["pid"])

    def largest(self) -> dict[str, Any] | None:
        return max(self.procs.values(), key=lambda r: r["hwm"], default=None)


def run_child(name: str, argv: list[str], workdir: Path, run_log: Path | None = None) -> dict[str, Any]:
    """`python *argv` from the repository root, its process tree sampled and each line of its
    stdout stamped with the seconds since its start (both kept in <workdir>/<name>.log, stderr
    in <name>.err); the wall seconds, exit status, peaks, stamped lines and the output's tail."""
    log, err = workdir / f"{name}.log", workdir / f"{name}.err"
    print(f"[big_run] {name}: python {' '.join(argv)[:300]}", flush=True)
    t0 = time.perf_counter()
    lines: list[tuple[float, str]] = []
    with log.open("w") as out, err.open("w") as errors:
        child = subprocess.Popen(
            [sys.executable, *argv],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # else a pipe holds the lines and their stamps are late
        )
        peaks = TreePeaks(child.pid, t0, run_log)
        for line in child.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))
            out.write(f"{lines[-1][0]:8.2f} {line}")
            out.flush()  # to follow a long phase with tail -f
        rc = child.wait()
        peaks.stop()
    wall = time.perf_counter() - t0
    stderr_tail = err.read_text(errors="replace").strip().splitlines()[-10:]
    res = {
        "phase": name,
        "rc": rc,
        "wall_s": wall,
        "peaks": peaks,
        "lines": lines,
        "output": "\n".join(ln for _, ln in lines),
        "tail": [ln for _, ln in lines[-10:]] + stderr_tail,
        "machine_used_peak_gib": peaks.machine_used_peak / GIB,
    }
    top = peaks.largest()
    print(
        f"[big_run] {name}: exit {rc} after {wall:.1f}s; largest process peak "
        f"{(top['hwm'] if top else 0) / GIB:.2f} GiB; machine's used memory peak {res['machine_used_peak_gib']:.1f} GiB",
        flush=True,
    )
    return res


def failed(res: dict[str, Any]) -> dict[str, Any]:
    """What a failed phase leaves in the results: its status, its memory, its last lines."""
    top = res["peaks"].largest()
    oom = res["rc"] in (-9, 137) or any(re.search(r"out of memory|OOM|Killed|MemoryError", ln) for ln in res["tail"])
    return {
        "phase": res["phase"],
        "failed": True,
        "rc": res["rc"],
        "wall_s": round(res["wall_s"], 1),
        "looks_like_memory": oom,
        "largest_process_peak_gib": round(top["hwm"] / GIB, 2) if top else None,
        "machine_used_peak_gib": round(res["machine_used_peak_gib"], 2),
        "workers_peak_gib": [round(r["hwm"] / GIB, 2) for r in res["peaks"].train_workers()],
        "tail": res["tail"],
    }


# ----------------------------------------------------------------------------- reading the run


def size_bytes(path: Path) -> int:
    """Bytes of every file under path (apparent sizes, as the checkpoint's manifest counts them)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def save_seconds(ckpt: Path) -> float:
    """One save's seconds: from the manifest's "time" (taken as the save starts, before any rank
    writes) to the manifest file's own mtime (written last, once every rank's shards are
    written, hashed and fsynced: checkpoint.save._seal). Ray Train's report after it is not in it."""
    manifest = json.loads((ckpt / ck_layout.MANIFEST).read_text())
    return (ckpt / ck_layout.MANIFEST).stat().st_mtime - manifest["time"]


def save_gap_seconds(rows: list[dict[str, Any]], step: int, step_s: float) -> float | None:
    """The loop's whole pause for the save at `step`: the metrics rows' times around it less one
    step (the row after is written after the next step). It holds the Ray Train report and the
    release of the save's buffers too."""
    by_step = {r["step"]: r["time"] for r in rows}
    if step in by_step and step + 1 in by_step:
        return by_step[step + 1] - by_step[step] - step_s
    return None


# What a run says as it goes, in the order it says it: console lines and run.log's choice lines.
MARKS = {
    "driver_ready": "global batch",  # the driver's line once its checks are done (a resume's hashing of the checkpoint among them)
    "model_loaded": "sharded load done",
    "engine_built": "[engine] MFU against",  # run.log: the last line of the engine's set-up
    "resumed": "resumed from",
    "first_step": "] step ",
}


def timeline(res: dict[str, Any]) -> dict[str, float]:
    """Seconds from the child's start to the first line of each of MARKS, as stamped when read."""
    stamped = sorted([*res["lines"], *res["peaks"].run_log_lines])
    out = {}
    for mark, text in MARKS.items():
        hit = next((t for t, line in stamped if text in line), None)
        if hit is not None:
            out[mark] = round(hit, 2)
    return out


def resume_seconds(marks: dict[str, float]) -> float | None:
    """The checkpoint's load into the engine at a resume (checkpoint.load's load_into: every
    rank's shards and optimizer state, verified): from the engine's last set-up line to the
    'resumed from' line, which the loader writes as soon as it is done. Stamped when read (run.log
    polled ten times a second, the console through Ray's log forwarding): within about a second.
    The sharded load's end to the same line bounds it from above (the engine's set-up in it)."""
    if "engine_built" in marks and "resumed" in marks:
        return marks["resumed"] - marks["engine_built"]
    return None


def losses(run_dir: Path) -> list[dict[str, Any]]:
    return [{"step": r["step"], "loss": round(r["loss"], 4)} for r in read_metrics(run_dir).train if "loss" in r]


# ----------------------------------------------------------------------------- the phases


def phase_train(workdir: Path, base: list[str], run_dir: Path) -> dict[str, Any]:
    res = run_child(
        "train", ["-m", "raytrain_cpu.main", *base, f"train.max_steps={STEPS}"], workdir, run_dir / "run.log"
    )
    if res["rc"] != 0:
        return failed(res)
    s = json.loads((run_dir / "summary.json").read_text())
    bd = s["step_breakdown"]
    rows = read_metrics(run_dir).train
    workers = res["peaks"].train_workers()
    ckpts = {}
    for step in range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY):
        ckpt = run_dir / ck_layout.checkpoint_dir_name(step)
        if ckpt.is_dir():
            ckpts[step] = {
                "save_s": save_seconds(ckpt),
                "save_gap_s": save_gap_seconds(rows, step, bd["step_wall_s"]) if step < STEPS else None,
                "bytes": size_bytes(ckpt),
            }
    return {
        "phase": "train",
        "wall_s": res["wall_s"],
        "summary_wall_s": s["wall_s"],
        "steps": s["steps"],
        "n_params": s["n_params"],
        "trainable_params": s["trainable_params"],
        "attention": s["attention"],
        "dtype": s["cpu"]["dtype"]["dtype"],
        "malloc": s["cpu"].get("malloc", s["cpu"].get("allocator")),
        "model_load_s": s["load_s"],
        "step_s": bd["step_wall_s"],
        "steps_timed": bd["steps"],
        "step_breakdown": bd,
        "tokens_per_s": bd["tokens_per_s"],
        "final_loss": s["final_loss"],
        "eval_loss": s["eval_loss"],
        "load_peak_rss_gib_per_rank": [b / GIB for b in s["cpu"]["load_peak_rss_bytes"]],
        "train_peak_rss_gib_max_rank": max(
            (r["mem_peak_max_gib"] for r in rows if "mem_peak_max_gib" in r), default=None
        ),
        "workers_sampled": [
            {"pid": r["pid"], "peak_rss_gib": r["hwm"] / GIB, "max_sampled_rss_gib": r["rss"] / GIB} for r in workers
        ],
        "driver_peak_rss_gib": res["peaks"].procs[res["peaks"].root]["hwm"] / GIB,  # it writes the fp32 model
        "machine_used_peak_gib": res["machine_used_peak_gib"],
        "checkpoints": ckpts,
        "timeline_s": timeline(res),
        "losses": losses(run_dir),
    }


def phase_resume(workdir: Path, base: list[str], run_dir: Path) -> dict[str, Any]:
    argv = ["-m", "raytrain_cpu.main", *base, f"train.max_steps={RESUMED_STEPS}"]
    res = run_child("resume", argv, workdir, run_dir / "run.log")
    if res["rc"] != 0:
        return failed(res)
    marks = timeline(res)
    s = json.loads((run_dir / "summary.json").read_text())
    ckpt = run_dir / ck_layout.checkpoint_dir_name(RESUMED_STEPS)
    return {
        "phase": "resume",
        "wall_s": res["wall_s"],
        "resumed_from_step": s["resumed_from_step"],
        "optimizer_step_at_resume": s["optimizer_step_at_resume"],
        "steps": s["steps"],
        "model_load_s": s["load_s"],
        "step_s": s["step_breakdown"]["step_wall_s"],
        "steps_timed": s["step_breakdown"]["steps"],
        "final_loss": s["final_loss"],
        "resumed_line": next((ln for _, ln in res["lines"] if "resumed from" in ln), None),
        "timeline_s": marks,
        "checkpoint_load_s": resume_seconds(marks),
        "model_loaded_to_resumed_s": marks["resumed"] - marks["model_loaded"]
        if {"resumed", "model_loaded"} <= marks.keys()
        else None,
        "workers_sampled": [{"pid": r["pid"], "peak_rss_gib": r["hwm"] / GIB} for r in res["peaks"].train_workers()],
        "machine_used_peak_gib": res["machine_used_peak_gib"],
        "checkpoint": {"save_s": save_seconds(ckpt), "bytes": size_bytes(ckpt)} if ckpt.is_dir() else None,
        "losses": losses(run_dir),
    }


def phase_universal(workdir: Path, ckpt: Path) -> dict[str, Any]:
    """The conversion through to_universal, in a child as every phase (to_universal starts its own
    child for DeepSpeed's conversion; the peaks cover both)."""
    code = f"from raytrain_cpu.checkpoint.universal import to_universal; print(to_universal({str(ckpt)!r}))"
    res = run_child("universal", ["-c", code], workdir)
    if res["rc"] != 0:
        return failed(res)
    text, wall = res["output"], res["wall_s"]
    top = res["peaks"].largest()
    return {
        "phase": "universal",
        "wall_s": wall,
        "said": text.strip().splitlines()[-1] if text.strip() else "",
        "bytes": size_bytes(ckpt / ck_layout.UNIVERSAL),
        "checkpoint_bytes": size_bytes(ckpt / ck_layout.DS_TAG),
        "largest_process_peak_gib": top["hwm"] / GIB if top else None,
    }


def phase_export(workdir: Path, ckpt: Path, out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    res = run_child("export", ["-m", "raytrain_cpu.export", "--merge", str(ckpt), str(out)], workdir)
    if res["rc"] != 0:
        return failed(res)
    top = res["peaks"].largest()
    merged = out / "merged"
    return {
        "phase": "export",
        "wall_s": res["wall_s"],
        "bytes": size_bytes(out),
        "merged_bytes": size_bytes(merged),
        "adapter_bytes": size_bytes(out) - size_bytes(merged),
        "largest_process_peak_gib": top["hwm"] / GIB if top else None,
    }


def phase_generate(workdir: Path, model: Path) -> dict[str, Any]:
    argv = ["-m", "raytrain_cpu.generate", str(model), "--prompt", PROMPT, "--max-new-tokens", "16"]
    res = run_child("generate", argv, workdir)
    if res["rc"] != 0:
        return failed(res)
    top = res["peaks"].largest()
    return {
        "phase": "generate",
        "wall_s": res["wall_s"],
        "prompt": PROMPT,
        "text": res["output"].strip(),  # generate prints the completion alone on stdout
        "largest_process_peak_gib": top["hwm"] / GIB if top else None,
    }


def phase_plan(config_json: Path, lora: bool) -> dict[str, Any]:
    """`plan` for the run's case: the run's own config.json, its workers, batch and dtype."""
    argv = [sys.executable, "-m", "raytrain_cpu.plan", "--model", str(config_json), "-w", str(WORKERS)]
    argv += ["-b", "1", "-s", str(SEQ_LEN), "--dtype", "bf16", "-z", "3", "--ranks-per-node", str(WORKERS), "--json"]
    argv += ["--lora-rank", "16"] if lora else []
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=True)
    plan = json.loads(done.stdout)
    return {
        "command": " ".join(["python", *argv[1:]]).replace(str(config_json), "<run>/base_model/config.json"),
        "memory_gib": plan["memory_gib"],
        "components_gib": plan["components_gib"],
        "num_params": plan["model"]["num_params"],
        "trainable_params": plan["model"]["trainable_params"],
    }


# ----------------------------------------------------------------------------- results


def per_gb(seconds: float | None, nbytes: int | None) -> float | None:
    return seconds / (nbytes / GB) if seconds is not None and nbytes else None


def r(x: float | None, nd: int = 2) -> float | None:
    return round(x, nd) if isinstance(x, float) else x


def tables(train: dict, resume: dict, uni: dict, export: dict, gen: dict, plans: dict) -> dict[str, list[dict]]:
    """The phase table (seconds, GB, s/GB), the memory table (measured per worker vs the plan), losses."""
    phases: list[dict[str, Any]] = []
    ck = train.get("checkpoints", {})
    for step, c in ck.items():
        phases.append(
            {
                "phase": f"save (step {step})",
                "seconds": r(c["save_s"]),
                "GB": r(c["bytes"] / GB, 3),
                "s_per_GB": r(per_gb(c["save_s"], c["bytes"])),
                "note": f"loop paused {c['save_gap_s']:.1f}s" if c.get("save_gap_s") is not None else "",
            }
        )
    last_bytes = ck.get(STEPS, {}).get("bytes")
    load_s = resume.get("checkpoint_load_s")
    phases.append(
        {
            "phase": f"resume (load step {STEPS})",
            "seconds": r(load_s),
            "GB": r(last_bytes / GB, 3) if last_bytes else None,
            "s_per_GB": r(per_gb(load_s, last_bytes)),
            "note": f"whole resumed run {resume['wall_s']:.0f}s" if "wall_s" in resume else "failed",
        }
    )
    phases.append(
        {
            "phase": f"universal conversion (step {RESUMED_STEPS})",
            "seconds": r(uni.get("wall_s")),
            "GB": r(uni["bytes"] / GB, 3) if uni.get("bytes") else None,
            "s_per_GB": r(per_gb(uni.get("wall_s"), uni.get("bytes"))),
            "note": "failed" if uni.get("failed") else "GB written",
        }
    )
    phases.append(
        {
            "phase": "export --merge",
            "seconds": r(export.get("wall_s")),
            "GB": r(export["bytes"] / GB, 3) if export.get("bytes") else None,
            "s_per_GB": r(per_gb(export.get("wall_s"), export.get("bytes"))),
            "note": "failed" if export.get("failed") else "GB written (adapter + merged)",
        }
    )
    phases.append(
        {
            "phase": "generate (16 tokens)",
            "seconds": r(gen.get("wall_s")),
            "GB": None,
            "s_per_GB": None,
            "note": "failed" if gen.get("failed") else "",
        }
    )
    predicted = plans.get("lora", {}).get("memory_gib", {}).get("peak")
    memory = [
        {
            "worker (pid order)": i,
            "measured peak RSS GiB": r(w["peak_rss_gib"]),
            "planner peak GiB": r(predicted),
            "measured / planned": r(w["peak_rss_gib"] / predicted, 3) if predicted else None,
            "load peak GiB (run's record)": r(load) if load is not None else None,
        }
        for i, (w, load) in enumerate(
            zip(
                train.get("workers_sampled", []), train.get("load_peak_rss_gib_per_rank", []) + [None] * 8, strict=False
            )
        )
    ]
    plan_rows = [
        {"case": name, **{k: r(v) for k, v in p["memory_gib"].items()}, "trainable_params": p["trainable_params"]}
        for name, p in plans.items()
        if "memory_gib" in p
    ]
    step_rows = [
        {
            "run": name,
            "step_s": r(ph.get("step_s")),
            "steps_timed": ph.get("steps_timed"),
            "model_load_s": r(ph.get("model_load_s")),
            "wall_s": r(ph.get("wall_s"), 1),
            "final_loss": r(ph.get("final_loss"), 4),
        }
        for name, ph in (("train 0-8", train), ("resume 8-12", resume))
        if not ph.get("failed")
    ]
    return {
        "phases (GB = 1e9 bytes)": phases,
        "training steps (s per optimizer step after the warm-up steps)": step_rows,
        "peak RSS per worker: measured (VmHWM sampled from /proc) vs the planner's memory_gib.peak": memory,
        "the planner per rank (GiB), LoRA r16 and full fine-tuning": plan_rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument(
        "--workdir", default="/tmp/bigrun", help="the runs, data cache and exports (GBs; removed at the end)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and exports")
    ap.add_argument("--json", default=None, help="write the result here instead of benchmarks/results/<machine>/")
    ap.add_argument("overrides", nargs="*", help="key=value settings for both runs (after the script's own)")
    args = ap.parse_args()

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = workdir / "runs" / "big-run"
    export_dir = workdir / "export"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time: the resume must be this script's own
    shutil.rmtree(export_dir, ignore_errors=True)
    base = run_overrides(workdir, SHAPES[args.shape]) + args.overrides
    mem = psutil.virtual_memory()
    print(f"[big_run] {psutil.cpu_count()} vCPUs, {mem.total / GIB:.1f} GiB ({mem.available / GIB:.1f} available)")

    train = phase_train(workdir, base, run_dir)
    resume = phase_resume(workdir, base, run_dir) if not train.get("failed") else {"failed": True, "skipped": True}
    last = run_dir / ck_layout.checkpoint_dir_name(RESUMED_STEPS if not resume.get("failed") else STEPS)
    have_ckpt = (last / ck_layout.MANIFEST).is_file()
    uni = phase_universal(workdir, last) if have_ckpt else {"failed": True, "skipped": True}
    export = phase_export(workdir, last, export_dir) if have_ckpt else {"failed": True, "skipped": True}
    gen = (
        phase_generate(workdir, export_dir / "merged")
        if not export.get("failed")
        else {"failed": True, "skipped": True}
    )
    plans = {}
    config_json = run_dir / "base_model" / "config.json"
    if config_json.is_file():
        plans = {"lora": phase_plan(config_json, lora=True), "full": phase_plan(config_json, lora=False)}

    notes = [
        f"{args.shape} model: model.tiny {SHAPES[args.shape] or 'defaults'}, vocabulary 2048, seq {SEQ_LEN}, "
        f"micro batch 1, {WORKERS} workers x 1 thread, ZeRO-3, bf16, LoRA r16 on all seven projections, uncompiled.",
        "Each phase is a child process through its real entry point, timed from outside (start-up and imports included, "
        "except save and resume: those are read from the run's manifest and log).",
        "save: manifest time (taken as the save starts) to the manifest file's mtime (written last); 'loop paused' adds "
        "Ray Train's report and the release of the save's buffers.",
        "resume: from the engine's last set-up line (run.log) to 'resumed from' (the checkpoint's shards and optimizer "
        "state into the engine, verified), as stamped when read (within about a second); s/GB over the checkpoint's "
        "size. Before it the driver hashes the checkpoint's files (timeline_s: driver_ready).",
        "Measured peak RSS is each Ray Train worker's VmHWM over its life (load included); the run's own record of "
        "the highest rank's training peak is train_peak_rss_gib_max_rank.",
        "The machine's 2 vCPUs were shared with other processes while this ran: times are noisy.",
    ]
    if plans.get("full"):
        need = plans["full"]["memory_gib"]["peak"]
        total = psutil.virtual_memory().total / GIB
        notes.append(
            f"Full fine-tuning of this model on {WORKERS} ranks: the planner's peak is {need:.2f} GiB per rank, "
            f"{need * WORKERS:.1f} GiB for both against this machine's {total:.1f} GiB."
        )
    for ph in (train, resume, uni, export, gen):
        if ph.get("failed") and not ph.get("skipped"):
            notes.append(
                f"{ph['phase']} FAILED (exit {ph['rc']}; memory-like: {ph['looks_like_memory']}): {ph['tail'][-1:]}"
            )

    result_tables = tables(train, resume, uni, export, gen, plans)
    result_tables["losses (train then resume)"] = [{"run": "train", **row} for row in train.get("losses", [])] + [
        {"run": "resume", **row} for row in resume.get("losses", []) if row["step"] > STEPS
    ]
    if gen.get("text"):
        notes.append(f"generate from the merged export: {gen['text']!r}")
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(export_dir, ignore_errors=True)
    # This machine's scratch paths (in the phases' lines and results) mean nothing where results are read.
    fields = json.loads(
        json.dumps(
            {
                "shape": args.shape,
                "model": SHAPES[args.shape],
                "overrides": base,
                "train": train,
                "resume": resume,
                "universal": uni,
                "export": export,
                "generate": gen,
                "plan": plans,
                "tables": result_tables,
                "notes": notes,
            },
            default=str,
        ).replace(str(workdir), "<workdir>")
    )
    report_script("big_run", args.json, **fields)


if __name__ == "__main__":
    sys.exit(main())
