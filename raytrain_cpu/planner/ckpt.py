"""What a checkpoint costs: its size, and the seconds to save, load, convert to the universal form
(a resume on another number of workers) and export, from seconds per GB measured end to end on
a 1.09B Llama (benchmarks/big_run.py; its machine's results folder holds the table).

Each rank writes and reads its own shards at once, so save and load scale with a rank's share of
the checkpoint; ZeRO-1/2 keep the whole bf16 model once, written by rank 0 alone. The
universal conversion and the export are one process over the whole checkpoint.
"""

from __future__ import annotations

from typing import Any

from raytrain_cpu.model.shape import LORA_TARGETS, ModelShape

GB = 1e9

# Seconds per GB (1e9 bytes) measured on the 2-vCPU AMD EPYC host (benchmarks/big_run.py, LoRA r16,
# 2 ranks, local disk): save and load per GB of one rank's share, conversion and export per GB of
# the whole. A node with more cores and a shared file system (FSx) differs: rerun the script there.
SAVE_S_PER_RANK_GB = 4.0
LOAD_S_PER_RANK_GB = 2.1
UNIVERSAL_S_PER_GB = 5.7
EXPORT_S_PER_GB = 22.1
MEASURED_ON = "benchmarks/results/amd-epyc-avx512_bf16/big_run.md"


def checkpoint_cost(
    shape: ModelShape,
    world_size: int,
    zero_stage: int = 3,
    lora_rank: int = 0,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    checkpoint_every: int = 0,
    step_time_s: float = 0.0,
) -> dict[str, Any]:
    """A checkpoint's GB (bf16 weights; fp32 master and AdamW's two moments of what trains) and
    the seconds of each operation on it; with `checkpoint_every` and `step_time_s`, the share of
    the run's time the saves take."""
    trainable = shape.lora_params(lora_rank, lora_targets) if lora_rank else shape.num_params
    weights, states = 2.0 * shape.num_params / GB, 12.0 * trainable / GB
    total = weights + states
    # ZeRO-3: every rank its shard; ZeRO-1/2: rank 0 writes the whole model beside its optimizer partition
    rank_gb = total / world_size if zero_stage == 3 else weights + states / world_size
    out = {
        "gb": total,
        "save_s": rank_gb * SAVE_S_PER_RANK_GB,
        "load_s": rank_gb * LOAD_S_PER_RANK_GB,
        "universal_s": total * UNIVERSAL_S_PER_GB,
        "export_s": weights * EXPORT_S_PER_GB,
        "measured_on": MEASURED_ON,
    }
    if checkpoint_every and step_time_s:
        out["save_share_of_run"] = out["save_s"] / (out["save_s"] + checkpoint_every * step_time_s)
    return out
