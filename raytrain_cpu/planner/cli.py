"""`python -m raytrain_cpu.plan`: the capacity planner's command line and its table.

    python -m raytrain_cpu.plan --model meta-llama/Meta-Llama-3-8B --world-size 4 --seq-len 1024 -c
    python -m raytrain_cpu.plan --config configs/llama3-8b-c7i.yaml      # everything from a run config
    python -m raytrain_cpu.plan --model path/to/config.json --zero-stage 2 --json

Flags override what --config says.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from raytrain_cpu.model.shape import LORA_TARGETS
from raytrain_cpu.planner.plan import DPO_WITHOUT_FORWARD, inputs_from_run_config, plan
from raytrain_cpu.planner.tables import (
    DS_MAX_LIVE_PARAMETERS,
    FREE_MEMORY_GROWTH_MIB,
    KEEP_PROBS_SHARE,
    KEPT_PAGES,
    KNOWN_SHAPES,
    LOW_LIVE_STEP_COST,
    PRICES_AS_OF,
    resolve_shape,
)


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(int(n))


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report."""
    m, i, mem = result["model"], result["inputs"], result["memory_gib"]
    rec = result["recommendation"]
    offload = "" if i["offload"] == "none" else f" + offload {i['offload']}"
    lines = [
        f"model       {m['name']}  ({_count(m['num_params'])} params, {m['num_layers']} layers, "
        f"hidden {m['hidden_size']}, vocab {m['vocab_size']})",
        f"setup       {i['world_size']} ranks, ZeRO-{i['zero_stage']}{offload}, {i['dtype']}, micro batch "
        f"{i['micro_batch']} x seq {i['seq_len']}, grad accum {i['grad_accum_steps']}, activation checkpointing "
        f"{'on' if i['activation_checkpointing'] else 'off'}, AdamW {'fused' if i['fused_adamw'] else 'per-tensor'}, "
        f"loss {'fused' if i['fused_loss'] else 'unfused'}, norms {'fused' if i['fused_norm'] else 'unfused'}, "
        f"MLP activations {'fused' if i['fused_mlp'] else 'unfused'}, "
        f"attention {i['attention']} (probabilities {i['attention_probs']})",
        f"trainable   {_count(m['trainable_params'])} params"
        + (
            f" (LoRA rank {i['lora_rank']} on {', '.join(i['lora_targets'])}"
            + (f", dropout {i['lora_dropout']:g}" if i["lora_dropout"] else "")
            + ": "
            f"{m['trainable_params'] / m['num_params']:.2%} of the model; the base is frozen)"
            if i["lora_rank"]
            else " (full fine-tuning)"
        )
        + (
            "; DPO: a reference forward each micro batch, "
            + ("the base with the adapters off" if i["lora_rank"] else "a frozen copy of the starting model")
            if i["reference_forward"]
            else DPO_WITHOUT_FORWARD.get(i.get("dpo_reference", ""), "")
        ),
        "",
        "memory per rank (GiB, resident)",
        f"  after sharded load        {mem['after_load']:10.2f}",
        f"  after fp32 master         {mem['after_master']:10.2f}",
        f"  after optimizer states    {mem['after_optimizer']:10.2f}",
        f"  peak during training      {mem['peak']:10.2f}",
        "  of which: " + ", ".join(f"{k} {v:.2f}" for k, v in result["components_gib"].items() if v >= 0.005),
        (
            f"  (for the workers' jemalloc, which keeps freed pages: x{KEPT_PAGES} at the peak; glibc with"
            " scaling.glibc_mmap_threshold=1048576 is --no-kept-pages, its 32 MiB default ~25% higher)"
            if i.get("kept_pages", True)
            else "  (for glibc with scaling.glibc_mmap_threshold=1048576; its 32 MiB default measured ~25% higher)"
        ),
        (
            f"  fits leave {result['release_margin_gib']:.2f} GiB per rank above the peak: malloc's kept pages go back"
            " to the OS only past that growth (scaling.free_memory_growth_mib)"
            if result["release_margin_gib"]
            else "  fits leave no margin above the peak: scaling.free_memory_growth_mib=0 never hands kept pages back,"
            " so a rank's memory is not bounded by this estimate"
        ),
        "",
        f"communication per rank per step   {result['comm_gib_per_step']:.3g} GiB "
        f"(>= {result['comm_seconds_per_step_min']:.2f} s at {result['network_node']}'s line rate)",
        f"compute per rank per step         {result['train_tflop_per_rank_per_step']:.3g} TFLOP",
        "",
        "same run per ZeRO stage (peak GiB / comm GiB per step): "
        + ", ".join(
            f"ZeRO-{z} {v['peak_gib']:.1f} / {v['comm_gib_per_step']:.1f}"
            for z, v in result["zero_stages_compared"].items()
        ),
    ]
    if result["zero3_max_live_parameters_compared"]:
        lines.append(
            "ZeRO-3 peak by deepspeed.max_live_parameters: "
            + ", ".join(f"{k} {v:.1f} GiB" for k, v in result["zero3_max_live_parameters_compared"].items())
            + f" (the lower re-gathers in the backward: {LOW_LIVE_STEP_COST})"
        )
    lines += [
        "",
        f"recommendation    {rec['note']}",
        *([f"  {result['zero_stage_advice']}"] if result["zero_stage_advice"] else []),
        *([f"  {result['micro_batch_advice']}"] if result["micro_batch_advice"] else []),
        "  fewest workers per c7i size: "
        + ", ".join(f"{k.split('.')[1]} {v if v else '-'}" for k, v in rec["min_workers_per_c7i_size"].items()),
    ]
    lines += ["", *format_step(result)]
    if "fits_instance" in rec:
        verdict = "fits" if rec["fits_instance"] else "does NOT fit"
        lines.append(f"  on {result['network_node']}: {verdict} ({i['ranks_per_node']} rank(s) per node)")
    if i["offload"] == "cpu":
        lines.append("  note: offload to 'cpu' saves nothing on a CPU node (the states are in RAM either way).")
    return "\n".join(lines)


def _step_line(s: dict[str, Any]) -> str:
    return (
        f"{s['step_time_s']:.3g} s = compute {s['compute_s']:.3g} + optimizer {s['optimizer_s']:.3g} + exposed "
        f"communication {s['comm_exposed_s']:.3g} (in node {s['comm_in_node_s']:.3g}, network {s['comm_network_s']:.3g}); "
        f"{s['tokens_per_s']:,.0f} tokens/s"
    )


def format_step(result: dict[str, Any]) -> list[str]:
    """The step model's lines: the plan's step on its nodes, this machine's (--measure), and the
    fastest and cheapest variant that fits."""
    s, i = result["step"], result["inputs"]
    lines = [
        f"step on {s['nodes']} x {result['network_node']} ({i['ranks_per_node']} rank(s) a node, "
        f"{s['rates']['threads']} threads a rank): {_step_line(s)}; "
        f"${s['usd_per_million_tokens']:.2f} per million tokens at ${s['usd_per_node_hour']:.2f}/h "
        f"(on-demand, {PRICES_AS_OF}); {s['network_gib_per_step']:.3g} GiB a step leave each node, "
        f"bound by {s['bound_by']}",
        f"  rates: {s['rates']['source']}",
    ]
    if "step_here" in result:
        h = result["step_here"]
        lines.append(
            f"step on this machine ({i['world_size']} ranks, {h['rates']['threads']} thread(s) each): {_step_line(h)}"
        )
        lines.append(f"  rates: {h['rates']['source']}")
    c = result["checkpoint"]
    share = f"; saves take {c['save_share_of_run']:.1%} of the run" if "save_share_of_run" in c else ""
    lines.append(
        f"checkpoint {c['gb']:.3g} GB: save {c['save_s']:.0f} s, load {c['load_s']:.0f} s, universal conversion "
        f"{c['universal_s']:.0f} s, export {c['export_s']:.0f} s{share} (s/GB measured on a 1B run: {c['measured_on']})"
    )
    for key, what in (("recommended_by_time", "fastest"), ("recommended_by_cost", "cheapest")):
        r = result[key]
        if r:
            lines.append(
                f"{what} that fits: {r['variant']} on {r['nodes']} x {r['instance']}: {r['step_time_s']:.3g} s a step, "
                f"${r['usd_per_million_tokens']:.2f} per million tokens ({r['peak_gib']:.1f} GiB a rank)"
            )
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m raytrain_cpu.plan",
        description="Estimate memory per rank, communication per step and the c7i nodes for a ZeRO run.",
        epilog="Model: 'tiny', a known hub id (" + ", ".join(s.name for s in KNOWN_SHAPES.values()) + ") "
        "or a local config.json. Flags override what --config says.",
    )
    p.add_argument("--config", help="a raytrain run config (YAML) to read model, workers and batch from")
    p.add_argument("--model", help="'tiny', a known hub id, or a config.json path (or its directory)")
    p.add_argument("--world-size", "-w", type=int, help="ranks (training workers); default 2 or from --config")
    p.add_argument("--zero-stage", "-z", type=int, choices=(1, 2, 3))
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), help="optimizer offload (default none)")
    p.add_argument("--micro-batch", "-b", type=int, help="blocks per rank per forward pass")
    p.add_argument("--seq-len", "-s", type=int, help="tokens per block")
    p.add_argument("--grad-accum", type=int, help="micro batches per optimizer step")
    p.add_argument(
        "--activation-checkpointing", "-c", action=argparse.BooleanOptionalAction, default=None, help="recompute"
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"))
    p.add_argument("--lora-rank", type=int, help="plan LoRA fine-tuning with adapters of this rank (0 = full)")
    p.add_argument(
        "--lora-targets",
        help="comma-separated projections that get adapters (default: all of q,k,v,o,gate,up,down _proj)",
    )
    p.add_argument("--lora-dropout", type=float, help="adapter dropout (> 0 keeps more activations; default 0)")
    p.add_argument(
        "--fused-adamw",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="PyTorch's fused AdamW (the default, train.fused_adamw); --no-fused-adamw adds its 8 B/param temporaries",
    )
    p.add_argument(
        "--fused-loss",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the output layer and loss a chunk of tokens at a time (the default, model.fused_loss); "
        "--no-fused-loss counts Hugging Face's logits for every token",
    )
    p.add_argument(
        "--fused-norm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="RMSNorms as one autograd operation (the default, model.fused_norm); "
        "--no-fused-norm counts Hugging Face's fp32 copies",
    )
    p.add_argument(
        "--fused-mlp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count model.fused_mlp=true (the SwiGLU activation as one autograd operation, which "
        "keeps no silu(gate)); the default counts Hugging Face's, as model.fused_mlp defaults to false",
    )
    p.add_argument(
        "--attention-probs",
        choices=("auto", "keep", "recompute"),
        help="model.attention_probs: whether the causal blocks keep their probabilities for the "
        f"backward (auto, the default: while they add at most {KEEP_PROBS_SHARE * 100:.0f}%% to the activations)",
    )
    p.add_argument(
        "--kept-pages",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"count the workers' jemalloc keeping freed pages for the next step (x{KEPT_PAGES} at the "
        "peak; the default); --no-kept-pages plans for glibc with scaling.glibc_mmap_threshold=1048576",
    )
    p.add_argument(
        "--free-memory-growth-mib",
        type=int,
        help="scaling.free_memory_growth_mib: the growth a rank may hold above its peak before malloc's kept "
        f"pages go back; every fit leaves it free per rank (default {FREE_MEMORY_GROWTH_MIB})",
    )
    p.add_argument(
        "--max-live-parameters",
        type=float,
        help="ZeRO-3 parameters kept gathered (deepspeed.max_live_parameters; default 1e9)",
    )
    p.add_argument(
        "--dpo",
        nargs="?",
        const="each-step",
        choices=("each-step", "precomputed"),
        help="plan DPO (data.format=preference). each-step (the default): a reference forward each micro "
        "batch, and without --lora-rank a frozen copy of the starting model too; precomputed "
        "(train.dpo_precompute_reference=true): the reference's log-likelihoods computed before training, "
        "so training plans as SFT",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        help="ranks a node (default 1, or one a socket of --config's scaling.instance_type: 2 on a 48xlarge)",
    )
    p.add_argument("--instance", help="check the fit on this node and predict the step on its network")
    p.add_argument(
        "--hpz-partition-size",
        type=int,
        help="deepspeed.hpz_partition_size: ZeRO-3's gathers kept in groups of this many ranks (0: a node's)",
    )
    p.add_argument(
        "--placement-group",
        choices=("cluster", "none"),
        default="cluster",
        help="whether the nodes share a cluster placement group: AWS caps one TCP flow at 10 Gbit/s in one, 5 outside",
    )
    p.add_argument("--usd-per-hour", type=float, help="a node's price (default: the on-demand table's, us-east-1)")
    p.add_argument(
        "--measure",
        action="store_true",
        help="time this machine's rates (the run's ranks at once, each a decoder layer, the head and GEMMs at the "
        "run's shapes on its share of the cores; the optimizer; copies; gloo over loopback) and predict its own "
        "step; on an AMX (c7i-class) host they replace the assumed c7i rates",
    )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return p


# Flags that count something (args attribute: the flag as the user typed it).
COUNT_FLAGS = {
    "world_size": "--world-size (-w)",
    "micro_batch": "--micro-batch (-b)",
    "seq_len": "--seq-len (-s)",
    "grad_accum": "--grad-accum",
    "ranks_per_node": "--ranks-per-node",
    "max_live_parameters": "--max-live-parameters",
}


LORA_ONLY_FLAGS = {"lora_targets": "--lora-targets", "lora_dropout": "--lora-dropout"}


def check_flags(args: argparse.Namespace, inputs: dict[str, Any]) -> None:
    """Every flag's range, and the flags that mean nothing without another, in one place, each
    error naming the flag and its value (plan() checks its own arguments by their names);
    `inputs` is the plan's inputs with --config's merged in, which may supply the LoRA rank."""
    for dest, flag in COUNT_FLAGS.items():
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value:g}")
    if args.lora_rank is not None and args.lora_rank < 0:
        raise ValueError(f"--lora-rank must be >= 0 (0 plans full fine-tuning), got {args.lora_rank}")
    if args.lora_dropout is not None and not 0.0 <= args.lora_dropout < 1.0:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if args.free_memory_growth_mib is not None and args.free_memory_growth_mib < 0:
        raise ValueError(f"--free-memory-growth-mib must be >= 0, got {args.free_memory_growth_mib}")
    for dest, flag in LORA_ONLY_FLAGS.items():
        if getattr(args, dest) is not None and not inputs["lora_rank"]:
            raise ValueError(
                f"{flag} sets LoRA's adapters and this plan has none (no --lora-rank): give --lora-rank "
                "(e.g. 16) too, or a --config with a lora: section"
            )
    if args.max_live_parameters is not None and inputs["zero_stage"] != 3:
        raise ValueError(
            f"--max-live-parameters is ZeRO-3's (deepspeed.max_live_parameters) and this plan is "
            f"ZeRO-{inputs['zero_stage']}: drop it, or plan ZeRO-3 (-z 3)"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    inputs: dict[str, Any] = dict(
        model_shape=None,
        world_size=2,
        zero_stage=3,
        offload="none",
        micro_batch=1,
        seq_len=1024,
        activation_checkpointing=False,
        dtype="bf16",
        grad_accum_steps=1,
        lora_rank=0,
        lora_targets=LORA_TARGETS,
        lora_dropout=0.0,
        fused_adamw=True,
        fused_loss=True,
        fused_norm=True,
        fused_mlp=False,
        attention="auto",
        attention_probs="auto",
        kept_pages=True,
        free_memory_growth_mib=FREE_MEMORY_GROWTH_MIB,
        max_live_parameters=DS_MAX_LIVE_PARAMETERS,
        dpo_reference="",
        hpz_partition_size=1,
        ranks_per_node=1,
        instance=None,
    )
    try:
        if args.config:
            inputs |= inputs_from_run_config(args.config)
        flags = dict(
            world_size=args.world_size,
            zero_stage=args.zero_stage,
            offload=args.offload,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            activation_checkpointing=args.activation_checkpointing,
            dtype=args.dtype,
            grad_accum_steps=args.grad_accum,
            lora_rank=args.lora_rank,
            lora_targets=tuple(t.strip() for t in args.lora_targets.split(",")) if args.lora_targets else None,
            lora_dropout=args.lora_dropout,
            fused_adamw=args.fused_adamw,
            fused_loss=args.fused_loss,
            fused_norm=args.fused_norm,
            fused_mlp=args.fused_mlp,
            attention_probs=args.attention_probs,
            kept_pages=args.kept_pages,
            free_memory_growth_mib=args.free_memory_growth_mib,
            max_live_parameters=None if args.max_live_parameters is None else int(args.max_live_parameters),
            dpo_reference=args.dpo,
            hpz_partition_size=args.hpz_partition_size,
        )
        inputs |= {k: v for k, v in flags.items() if v is not None}
        check_flags(args, inputs)
        if args.model:
            inputs["model_shape"] = resolve_shape(args.model)
        if inputs["model_shape"] is None:
            raise ValueError("give --model or --config")
        if args.usd_per_hour is not None and args.usd_per_hour <= 0:
            raise ValueError(f"--usd-per-hour must be > 0, got {args.usd_per_hour:g}")
        rates = _measured(inputs) if args.measure else None
        if args.ranks_per_node is not None:
            inputs["ranks_per_node"] = args.ranks_per_node
        if args.instance:
            inputs["instance"] = args.instance
        result = plan(
            **inputs,
            rates=rates if rates and _c7i_class() else None,
            rates_here=rates,
            placement_group=args.placement_group,
            usd_per_hour=args.usd_per_hour,
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def _c7i_class() -> bool:
    """An AMX host (Sapphire Rapids or later): its measured rates stand for a c7i rank's."""
    from raytrain_cpu.host.features import cpu_features

    return bool(cpu_features().flags.get("amx_bf16"))


def _measured(inputs: dict[str, Any]):
    from raytrain_cpu.host.features import cpu_features
    from raytrain_cpu.planner.measure import measure_rates

    feats = cpu_features()
    # The run's ranks on this machine at once, each on its share of the physical cores, as the
    # workers' threads are placed (host.threads); a world larger than the cores times one rank.
    ranks = inputs["world_size"] if inputs["world_size"] <= feats.physical_cores else 1
    threads = max(1, feats.physical_cores // ranks)
    print(f"measuring this machine's rates: {ranks} rank(s) x {threads} thread(s) (about a minute)...", file=sys.stderr)
    rates, _ = measure_rates(
        inputs["model_shape"],
        inputs["micro_batch"],
        inputs["seq_len"],
        inputs["activation_checkpointing"],
        lora_rank=inputs["lora_rank"],
        threads=threads,
        host=feats.slug,
        ranks=ranks,
    )
    return rates


if __name__ == "__main__":
    sys.exit(main())
