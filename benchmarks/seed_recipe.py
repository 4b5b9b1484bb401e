"""The recipe raytrain_cpu replaces, reproduced to measure against it on the same model, text and cores.

Hugging Face `Trainer` on CPUs: `TrainingArguments(use_cpu=True, bf16=True, ddp_backend="gloo",
per_device_train_batch_size=1, gradient_accumulation_steps=4, deepspeed=<json>)` launched with
`torchrun --nproc_per_node=2`; every line of the text (blank lines kept) is one sample,
`tokenizer(text, truncation=True, max_length=512, padding="max_length")`; DeepSpeed ZeRO-3 with
optimizer and parameters offloaded to the CPU, `overlap_comm`, `contiguous_gradients`,
`stage3_max_live_parameters` 1e9, `stage3_prefetch_bucket_size` 5e8,
`stage3_param_persistence_threshold` 1e6, batch sizes `auto`.

    torchrun --nproc_per_node=2 benchmarks/seed_recipe.py --model_dir DIR --max_steps 10 --out seed.json

It counts *useful* tokens (non-padding: the attention mask's ones) in the batches trained and
reports their rate in steady state (after the first WARMUP_STEPS optimizer steps, as the
trainers' step clock), summed over ranks.
DeepSpeed's CPU Adam (needed by optimizer offload) is compiled from C++ on first use: that
build is timed on its own (`cpu_adam_build_s`, a fresh TORCH_EXTENSIONS_DIR unless
--reuse_build) and not counted in the throughput.

The DeepSpeed JSON names an optimizer ("AdamW", hyper-parameters "auto"): with offload and no
optimizer in the JSON, DeepSpeed refuses the Trainer's torch AdamW (zero_force_ds_cpu_optimizer),
so the recipe as used in practice lets DeepSpeed build its CPU Adam.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 2  # raytrain_cpu.obs.timing.WARMUP_STEPS: this script runs without importing raytrain_cpu
TEXT = REPO / "raytrain_cpu" / "assets" / "wikitext-2" / "test.txt"

DS_CONFIG = {
    "bf16": {"enabled": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1e9,
        "stage3_prefetch_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 1e6,
    },
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_dir", required=True, help="a Llama saved as safetensors (config.json + weights)")
    ap.add_argument("--tokenizer", default=str(REPO / "raytrain_cpu" / "assets" / "tokenizer"))
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--max_steps", type=int, default=10)
    ap.add_argument("--out", default="seed_recipe.json")
    ap.add_argument("--output_dir", default=None, help="Trainer output dir (default: a temporary one)")
    ap.add_argument("--reuse_build", action="store_true", help="keep the default torch extensions cache")
    return ap.parse_args()


def build_cpu_adam(rank: int, reuse: bool) -> float:
    """Compiles DeepSpeed's CPU Adam once (rank 0 first, the others load it); returns seconds."""
    import torch.distributed as dist

    if not reuse:
        os.environ["TORCH_EXTENSIONS_DIR"] = os.environ.get("SEED_EXT_DIR") or "/tmp/seed_recipe_ext"
    from deepspeed.ops.op_builder import CPUAdamBuilder

    t0 = time.perf_counter()
    if rank == 0:
        CPUAdamBuilder().load()
    dist.barrier()
    if rank != 0:
        CPUAdamBuilder().load()
    return time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist
    from datasets import load_dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    ds_path = Path(tempfile.gettempdir()) / f"seed_ds_config_{os.getpid() if world == 1 else 'dist'}.json"
    ds_path.write_text(json.dumps(DS_CONFIG))
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="seed_recipe_")
    targs = TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        bf16=True,
        ddp_backend="gloo",
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        deepspeed=str(ds_path),
        max_steps=args.max_steps,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=1234,
    )
    build_s = build_cpu_adam(rank, args.reuse_build)

    # ---- data: one sample per line, blank lines kept, padded to 512
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    raw = load_dataset("text", data_files=args.text, split="train")
    ds = raw.map(
        lambda b: tok(b["text"], truncation=True, max_length=512, padding="max_length"),
        batched=True,
        remove_columns=["text"],
    )
    # TrainingArguments' CPU path starts torch.distributed but not deepspeed.comm, so zero.Init
    # (entered by from_pretrained under the Trainer's DeepSpeed config) would count 1 rank and
    # reject the batch sizes; the recipe needs this one line to start at all.
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir)

    # ---- the Trainer, counting useful tokens and timing optimizer steps
    class CountingTrainer(Trainer):
        useful_tokens = 0

        def training_step(self, model, inputs, num_items_in_batch=None):
            CountingTrainer.useful_tokens += int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, num_items_in_batch)

    marks: list[tuple[float, int]] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            marks.append((time.perf_counter(), CountingTrainer.useful_tokens))

    trainer = CountingTrainer(
        model=model,
        args=targs,
        train_dataset=ds,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        callbacks=[StepClock()],
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0

    # ---- steady state: from the end of the last warm-up optimizer step to the end of the last
    (t_first, tok_first), (t_last, tok_last) = marks[WARMUP_STEPS - 1], marks[-1]
    steady = len(marks) - WARMUP_STEPS
    local = torch.tensor(
        [tok_last - tok_first, t_last - t_first, CountingTrainer.useful_tokens, len(marks)], dtype=torch.float64
    )
    totals = local.clone()
    dist.all_reduce(totals)
    seq_tokens = 512 * targs.per_device_train_batch_size * targs.gradient_accumulation_steps * world
    if rank == 0:
        steady_s = float(totals[1]) / world
        result = {
            "recipe": "HF Trainer + DeepSpeed ZeRO-3 offload (cpu), bf16, torchrun x2, pad to 512",
            "world_size": world,
            "threads_per_rank": torch.get_num_threads(),
            "max_steps": args.max_steps,
            "steady_steps": steady,
            "useful_tokens_steady": float(totals[0]),
            "useful_tokens_per_s": float(totals[0]) / steady_s if steady_s > 0 else None,
            "padded_tokens_per_s": seq_tokens * steady / steady_s if steady_s > 0 else None,
            "useful_fraction": float(totals[0]) / (seq_tokens * steady) if steady else None,
            "step_s": steady_s / max(steady, 1),
            "train_wall_s": wall,
            "cpu_adam_build_s": build_s,
            "final_loss": trainer.state.log_history[-1].get("train_loss") if trainer.state.log_history else None,
            "ds_config": DS_CONFIG,
        }
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps({k: v for k, v in result.items() if k != "ds_config"}, indent=2), flush=True)


if __name__ == "__main__":
    main()
