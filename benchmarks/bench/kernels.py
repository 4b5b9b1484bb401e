"""The one-kernel benchmarks' shared parts (benchmarks/attention.py, loss_head.py, norm.py,
mlp.py, document_mask.py): their command line, interleaved child runs, timing and tables."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from statistics import median
from typing import Any

from raytrain_cpu.host import features as host_features
from raytrain_cpu.host import memory as host_memory

from .common import in_rep_order, package_versions, portable_args, run_procs, write_results


def _count(text: str) -> int:
    """argparse type of the kernel benches' counts: 0 repeats or steps would time nothing and
    still write a result file."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def kernel_bench_parser(doc: str, shapes: list[str], steps: int, repeats: int) -> argparse.ArgumentParser:
    """The command line of the one-kernel benchmarks (benchmarks/loss_head.py, benchmarks/norm.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(shapes), help=f"comma-separated: {', '.join(shapes)}")
    ap.add_argument("--tokens", type=_count, default=2048, help="tokens per step (micro batch x seq)")
    ap.add_argument("--threads", type=_count, default=1, help="torch threads: one worker's share")
    ap.add_argument("--steps", type=_count, default=steps, help="timed steps per run, after a warm-up")
    ap.add_argument("--repeats", type=_count, default=repeats, help="interleaved runs of each variant")
    ap.add_argument("--json", default=None, help="where to write the results (default: the machine's folder)")
    return ap


def interleaved_runs(
    child: Callable, args: argparse.Namespace, variants: tuple[str, ...], extra: dict[str, Any] | None = None
) -> list[dict]:
    """child(0, spec, queue) once per shape, repeat and variant of `args` (kernel_bench_parser's),
    each in a fresh spawned process (its allocator and caches start clean) with the allocator
    settings a training worker gets (host_memory.preload_env: which tensors come back as fresh, faulted
    pages depends on them), the variants interleaved so that the host's drift falls on all of
    them; spec holds the shape, variant, tokens, threads and steps (and `extra`); the rows are the
    spec, the repeat and the result."""
    spec = {"tokens": args.tokens, "threads": args.threads, "steps": args.steps} | (extra or {})
    env = host_memory.preload_env()
    rows = []
    for shape in args.shapes.split(","):
        for rep in range(args.repeats):
            for variant in in_rep_order(variants, rep):
                run = spec | {"shape": shape, "variant": variant}
                (res,) = run_procs(child, 1, (run,), env)
                rows.append(run | {"rep": rep} | res)
                print(f"[{child.__module__}] {shape} {variant}: {res}", flush=True)
    return rows


def attention_inputs(b: int, h: int, hk: int, s: int, d: int) -> tuple[Any, Any, Any, Any]:
    """Seeded bf16 q, k, v (leaves) and the output's gradient of one attention call, each a
    (b, heads, s, d) view of (b, s, heads, d) memory: as Hugging Face's Llama hands them over
    from its projections, and o_proj's backward the gradient (benchmarks/attention.py and
    benchmarks/document_mask.py)."""
    import torch

    gen = torch.Generator().manual_seed(0)

    def projected(heads: int) -> torch.Tensor:
        return torch.randn(b, s, heads, d, generator=gen).to(torch.bfloat16).transpose(1, 2)

    q, k, v = (projected(n).requires_grad_() for n in (h, hk, hk))
    return q, k, v, projected(h)


def attention_shape_label(name: str, h: int, hk: int, s: int, d: int, tokens: int) -> str:
    """An attention bench's shape column: 'name (heads h/hk x d, seq s, batch b)', b rows of s
    making up `tokens`."""
    return f"{name} (heads {h}/{hk} x {d}, seq {s}, batch {max(1, tokens // s)})"


def time_kernel_steps(run: Callable[[], Any], leaves: Sequence, steps: int) -> dict[str, float]:
    """A one-kernel bench's timing: `run()` (a forward and backward) once to warm up, then
    `steps` times, the gradients of `leaves` cleared before each; the median milliseconds and
    the minor page faults per step (every fresh allocation the allocator maps anew)."""
    import resource

    def step() -> float:
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        run()
        return time.perf_counter() - t0

    step()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = [step() for _ in range(steps)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    return {"step_ms": 1e3 * median(times), "faults_per_step": faults / steps}


def saved_tensor_bytes(run: Callable[[], Any], exclude: Sequence = ()) -> int:
    """Bytes autograd keeps for the backward while `run()` builds its graph, each storage once,
    those of the tensors in `exclude` (the input, the weights) left out."""
    import torch

    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    own = {t.untyped_storage().data_ptr() for t in exclude}
    return sum(n for ptr, n in saved.items() if ptr not in own)


def time_with_saved_bytes(run: Callable[[], Any], leaves: Sequence, spec: dict[str, Any]) -> dict[str, float]:
    """The norm and MLP benches' result: time_kernel_steps, and the bytes per token autograd
    keeps for the backward besides `leaves` (saved_tensor_bytes)."""
    saved = saved_tensor_bytes(run, leaves)
    return time_kernel_steps(run, leaves, spec["steps"]) | {"saved_bytes_per_token": saved / spec["tokens"]}


def saved_bytes_columns(mine: list[dict], speed: float) -> dict[str, Any]:
    """The norm and MLP benches' table columns for one shape and variant (time_with_saved_bytes rows)."""
    return {
        "ms per forward + backward, each run": ", ".join(f"{r['step_ms']:.2f}" for r in mine),
        "speed vs hugging face (medians)": speed,
        "page faults per step (median)": median(r["faults_per_step"] for r in mine),
        "saved for backward, bytes per token": mine[0]["saved_bytes_per_token"],
    }


def write_kernel_bench(
    name: str, rows: list[dict], title: str, table: list[dict], notes: list[str], json_path: str | None
) -> None:
    """Writes a one-kernel benchmark's JSON and table (benchmarks/<name>.py) and prints the table."""
    # The children's allocator settings, as a training worker's: the preloaded libraries by
    # file name (this machine's paths mean nothing where the results are read).
    env = host_memory.preload_env()
    if "LD_PRELOAD" in env:
        env["LD_PRELOAD"] = ":".join(Path(p).name for p in env["LD_PRELOAD"].split(":"))
    result = {
        "command": f"python benchmarks/{name}.py " + " ".join(portable_args(None, json_path)),
        "machine": host_features.cpu_features().describe(),
        "versions": package_versions(),
        "allocator_env": env,
        "runs": rows,
        "tables": {title: table},
        "notes": notes,
    }
    print(write_results(name, result, json_path).with_suffix(".md").read_text())


def against_baseline(rows: list[dict], key: str, baseline: str) -> Iterator[tuple[str, str, list[dict], float]]:
    """(shape, variant, that variant's rows, median `key` of the baseline / of the variant) for
    each shape and variant in the order run: > 1 means the variant took less."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    for shape in shapes:
        base = median(r[key] for r in rows if r["shape"] == shape and r["variant"] == baseline)
        for variant in variants:
            mine = [r for r in rows if r["shape"] == shape and r["variant"] == variant]
            yield shape, variant, mine, base / median(r[key] for r in mine)
