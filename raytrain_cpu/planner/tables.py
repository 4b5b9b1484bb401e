"""The planner's tables: the model shapes it knows by name, the constants calibrated on real
ZeRO-3 runs, and the instance types it sizes nodes from. Bytes, GiB = 2**30."""

from __future__ import annotations

from pathlib import Path

from raytrain_cpu.config import model as config_module
from raytrain_cpu.model.shape import (
    ModelShape,
    shape_from_file,
)

GIB = 2**30


# ----------------------------------------------------------------------------- known shapes

# A model's shape is read by raytrain_cpu.model.shape; these are the ones planning knows by name.


def _shape(name: str, v: int, h: int, i: int, layers: int, heads: int, kv: int, tied: bool = False) -> ModelShape:
    return ModelShape(name, v, h, i, layers, heads, kv, tied)


_LLAMA3_8B = dict(v=128256, h=4096, i=14336, layers=32, heads=32, kv=8)


_LLAMA3_70B = dict(v=128256, h=8192, i=28672, layers=80, heads=64, kv=8)


_LLAMA2_7B = dict(v=32000, h=4096, i=11008, layers=32, heads=32, kv=32)


_TINYLLAMA = dict(v=32000, h=2048, i=5632, layers=22, heads=32, kv=4)


# Hub ids whose config.json we know, so planning needs no download (ids are matched
# case-insensitively). 'tiny' is the project's default model with the bundled 2048-token
# tokenizer (raytrain_cpu.config.model.TinyModelConfig defaults).
KNOWN_SHAPES: dict[str, ModelShape] = {
    s.name.lower(): s
    for s in [
        _shape("meta-llama/Meta-Llama-3-8B", **_LLAMA3_8B),
        _shape("meta-llama/Meta-Llama-3-8B-Instruct", **_LLAMA3_8B),
        _shape("meta-llama/Llama-3.1-8B", **_LLAMA3_8B),
        _shape("meta-llama/Llama-3.1-8B-Instruct", **_LLAMA3_8B),
        _shape("meta-llama/Meta-Llama-3-70B", **_LLAMA3_70B),
        _shape("meta-llama/Llama-3.1-70B", **_LLAMA3_70B),
        _shape("meta-llama/Llama-2-7b-hf", **_LLAMA2_7B),
        _shape("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", **_TINYLLAMA),
        _shape("TinyLlama/TinyLlama_v1.1", **_TINYLLAMA),
        _shape("TinyLlama/TinyLlama-1.1B-Chat-v1.0", **_TINYLLAMA),
        _shape("tiny", v=2048, h=64, i=176, layers=2, heads=4, kv=2),
    ]
}


# The models benchmarks/calibrate_planner.py measures (and tests/unit/test_plan.py predicts): the
# project's tiny default, a ~37M-parameter Llama with the same 2048-token vocabulary, and
# the largest a 2-core, 24 GiB calibration machine trains at world size 2: a 0.5B Llama with
# Llama-2's 32000-token vocabulary, where the model's state, not the process, dominates.
CALIBRATION_SHAPES: dict[str, ModelShape] = {
    "tiny": KNOWN_SHAPES["tiny"],
    "llama-37m": _shape("llama-37m", v=2048, h=640, i=1728, layers=8, heads=10, kv=2),
    "llama-0.5b": _shape("llama-0.5b", v=32000, h=1536, i=4096, layers=16, heads=12, kv=4),
}


CALIBRATION_SEQ_LEN = 256  # configs/local.yaml


# The measurements the constants below are fitted to (written by the script; one folder per machine).
CALIBRATION_FILE = "benchmarks/results/amd-epyc-avx512_bf16/planner_calibration.json"


# (model, micro batch, activation checkpointing), 2 ranks, ZeRO-3, bf16. The first two fit the
# fixed overheads and FRAGMENTATION below; the others are held out to check the fit.
CALIBRATION_CASES: list[tuple[str, int, bool]] = [
    ("tiny", 8, False),
    ("llama-37m", 8, False),
    ("llama-37m", 8, True),
    ("llama-37m", 2, False),
    ("llama-0.5b", 2, False),
    ("llama-0.5b", 8, False),  # 2,048 tokens x 32,000 entries: the output layer and loss count
]


def resolve_shape(model: str) -> ModelShape:
    """'tiny', a known hub id, a config.json file, or a directory holding one."""
    known = KNOWN_SHAPES.get(model.lower())
    if known:
        return known
    p = Path(model).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return shape_from_file(p, model)
    if _looks_like_a_path(model):
        where = f"{p.parent} has no config.json" if p.parent.is_dir() else f"{p} does not exist"
        raise ValueError(f"model {model!r}: {where}; give a Hugging Face config.json (or its directory)")
    raise ValueError(
        f"unknown model {model!r}: give a local config.json (or a directory with one), or one of "
        f"{', '.join(s.name for s in KNOWN_SHAPES.values())}."
    )


def _looks_like_a_path(model: str) -> bool:
    """A file name rather than a hub id ('org/name' is both, and stays 'unknown model')."""
    return model.startswith(("/", ".", "~")) or model.endswith(".json")


# ----------------------------------------------------------------------------- calibrated constants


# Resident memory of one Ray Train worker before the model exists: Python, torch, transformers,
# DeepSpeed and Ray's core worker imported, the gloo process group up.
BASELINE_BYTES = int(0.48 * GIB)


# Fixed costs that do not grow with the model: the module objects and zero.Init hooks (load),
# the DeepSpeed engine (initialize), autograd / oneDNN state of a step. The load's includes what
# the attention pick leaves resident (its custom operators' code, heap it does not give back),
# as the calibration measures the workers' own load_model.
LOAD_OVERHEAD_BYTES = int(0.055 * GIB)


# model.attention=auto's start-up timing of both attentions, forward and backward at the run's
# shape: its high-water mark over the resident model, in units of the queries' bytes (the causal
# blocks' regrouped copies, per-block probabilities and fp32 dK/dV; SDPA takes about half).
ATTENTION_PICK_FACTOR = 14


INIT_OVERHEAD_BYTES = int(0.04 * GIB)


STEP_OVERHEAD_BYTES = int(0.04 * GIB)


# A step's transients cost this many times their live size. With glibc's own dynamic mmap
# threshold they fragment its heap (well above 1, and more for LoRA's mid-size fp32
# temporaries). The planner plans for jemalloc (the cluster images preload it) or glibc with the
# fixed 1 MiB threshold (scaling.glibc_mmap_threshold; the workers' 32 MiB default keeps more
# on the heap), which reach the same peak: the cases of CALIBRATION_FILE fit 1.0 with
# STEP_OVERHEAD_BYTES, but for activations made of tensors under the threshold, which stay on
# the heap.
FRAGMENTATION = 1.0


# The workers' jemalloc keeps the pages a step frees for the next step (host.memory.JEMALLOC_CONF:
# no faults on the tensors made again) instead of handing each large block back as the
# calibration's glibc does; a tensor made again in pages kept from a larger one leaves their
# tail resident. Its training peak settles this much above the calibration's (fitted with
# `python benchmarks/calibrate_planner.py --no-write --case ...` under the workers' default
# allocator: benchmarks/results/*/planner_jemalloc_kept.json). Only the training peak, which
# decides the fit, counts it.
KEPT_PAGES = 1.09


# LoRA's mid-size fp32 temporaries (each adapter's input cast to fp32, B's output, its scaled
# copy, their sum with the base output) still leave some holes: fitted on a llama-37m run at
# micro batch 8 (full fine-tuning's peak there matched the prediction).
LORA_FRAGMENTATION = 1.16


# A worker hands malloc's kept pages back only once its resident size has grown
# scaling.free_memory_growth_mib past its size after the first steps (train.FreePages: jemalloc's
# kept pages can creep up a step at a time at a constant live size). Until then a rank
# may hold up to that much above the training peak, so a fit leaves it free on every rank.
FREE_MEMORY_GROWTH_MIB = 512  # config.ScalingConfig.free_memory_growth_mib's default


# model.attention_probs=auto: the causal blocks keep their probabilities for the backward (no
# recomputed scores and softmax: one batched GEMM of seven and half the softmax work, faster in
# benchmarks/attention.py) when that adds at most this share to the activations the run keeps.
# They grow with the sequence (heads x ~seq/2 elements a token a layer): kept at moderate
# sequence lengths, not at long ones unless activation checkpointing keeps one layer's
# activations at a time.
KEEP_PROBS_SHARE = 0.25


# Queries a causal block where the planner cannot know model.attention=auto's timed pick: the
# larger of raytrain_cpu.model.ops.attention.BLOCKS (more probabilities).
PROBS_BLOCK = 128


CAUSAL_BLOCKS_DEFAULT = config_module.CAUSAL_BLOCKS_DEFAULT


# model.fused_norm: activation bytes per token per layer per hidden unit that the fused
# RMSNorms do not keep (two norms: 12h under Hugging Face's, 4h fused, in bf16 and in fp32);
# autograd's saved tensors of a 50M bench layer measured 10h less, the layer input included
# (which the next layer's fused norm keeps: 2h of those 10 come back).
FUSED_NORM_SAVED_PER_HIDDEN = 8


# Logits per token: the bf16 logits, their fp32 copy in the loss, log-softmax's fp32 output
# and its fp32 gradient live together at the start of backward (Hugging Face's loss,
# model.fused_loss=false).
LOGITS_BYTES_PER_VOCAB = 2 + 4 + 4 + 4


# The fused loss (raytrain_cpu.model.ops.loss) runs one chunk of tokens at a time through the same
# kernels: at most three fp32 tensors of the chunk's logits' size live at once. It keeps the
# logits' gradient of every token in the training dtype for the output layer's weight gradient,
# which it makes at the end of the forward. The chunk size mirrors loss.CHUNK_BYTES
# (tests/unit/test_plan.py checks).
FUSED_LOSS_CHUNK_BYTES_PER_VOCAB = 3 * 4


LOSS_CHUNK_BYTES = 256 << 20


# Without ZeRO-3 every rank loads the whole model with from_pretrained, which maps the
# checkpoint; the pages of the shard being read count as resident (Hugging Face checkpoints
# are sharded at about 5 GB). ZeRO-3's sharded load maps nothing (model.load_sharded).
CHECKPOINT_SHARD_BYTES = 5 * 10**9


# ZeRO settings as raytrain_cpu.trainer.engine.deepspeed_config writes them (tests/unit/test_plan.py checks);
# the persistence threshold is deepspeed.param_persistence_threshold's default.
DS_REDUCE_BUCKET_SIZE = 50_000_000


DS_PREFETCH_BUCKET_SIZE = 50_000_000


DS_MAX_LIVE_PARAMETERS = 1_000_000_000  # deepspeed.max_live_parameters' default


LIVE_CHOICES = {"1e9": DS_MAX_LIVE_PARAMETERS, "1e8": 100_000_000}  # the peaks the report compares


# What 1e8 costs: the backward re-gathers what forward released (measured at 0.5B).
LOW_LIVE_STEP_COST = "+16% step time measured at 0.5B"


DS_PARAM_PERSISTENCE_THRESHOLD = 10_000


DS_MAX_REUSE_DISTANCE = 1_000_000_000  # stage3_max_reuse_distance: DeepSpeed's default, which the trainers keep


DS_SUB_GROUP_SIZE = 100_000_000  # deepspeed.sub_group_size's default


# raytrain_cpu.trainer.collectives' slot size: ranks on one machine map 2 x world slots, and each rank
# touches them all (tests/unit/test_plan.py checks it is the same number).
SHM_SLOT_BYTES = 16 << 20

# ----------------------------------------------------------------------------- instances


# (vCPUs, GiB, network Gbit/s) for the c7i family; m7i has 4 GiB per vCPU and r7i 8, at the
# same sizes and network bandwidth.
C7I_SIZES: dict[str, tuple[int, int, float]] = {
    "c7i.8xlarge": (32, 64, 12.5),
    "c7i.12xlarge": (48, 96, 18.75),
    "c7i.16xlarge": (64, 128, 25.0),
    "c7i.24xlarge": (96, 192, 37.5),
    "c7i.48xlarge": (192, 384, 50.0),
}


GIB_PER_VCPU = {"c7i": 2, "m7i": 4, "r7i": 8}


# Sockets per size: the 48xlarge is a two-socket node (2 x 48 cores), the smaller sizes one
# socket's share. A rank per socket keeps its threads and memory on one NUMA domain
# (host.threads.default_workers_per_node).
C7I_SOCKETS = {"8xlarge": 1, "12xlarge": 1, "16xlarge": 1, "24xlarge": 1, "48xlarge": 2}


def sockets_of(instance: str) -> int:
    return C7I_SOCKETS.get(instance.partition(".")[2], 1)


# What a node keeps for itself: OS, page cache, raylet / GCS / dashboard agent, Ray Data's
# tokenizing actors (data preparation). Ray's memory monitor kills workers above 95% of node memory,
# so training plans to stay under 90%.
NODE_RESERVE_BYTES = 4 * GIB


NODE_USABLE_FRACTION = 0.90


def instance_catalog(family: str = "c7i") -> dict[str, tuple[int, int, float]]:
    """{instance type: (vCPUs, GiB, Gbit/s)} for c7i, m7i or r7i."""
    per_vcpu = GIB_PER_VCPU[family]
    return {f"{family}.{k.split('.')[1]}": (cpu, cpu * per_vcpu, net) for k, (cpu, _, net) in C7I_SIZES.items()}


def usable_bytes(instance_gib: float) -> float:
    return instance_gib * GIB * NODE_USABLE_FRACTION - NODE_RESERVE_BYTES


# What one TCP flow between two instances carries at most (AWS, "Amazon EC2 instance network
# bandwidth": https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-instance-network-bandwidth.html):
# 10 Gbit/s inside a cluster placement group, 5 Gbit/s outside one. Gloo opens one connection
# between two ranks, so a ring's link between two nodes is one flow.
SINGLE_FLOW_GBPS = {"cluster": 10.0, "none": 5.0}


# On-demand prices, USD per instance hour, Linux, US East (N. Virginia): AWS's published rates
# (PRICES_SOURCE; c7i.large $0.08925, m7i.large $0.1008, r7i.large $0.1323), recorded on
# PRICES_AS_OF without a copy of the page at hand (the machine that wrote them reaches no web
# page), so check them there before leaning on a cost. Each family's price is linear in its size
# (the .large price x vCPUs / 2); `plan --usd-per-hour` overrides it for another region, a
# savings plan or spot.
PRICES_AS_OF = "2026-12-04"
PRICES_SOURCE = "https://aws.amazon.com/ec2/pricing/on-demand/ (Linux, us-east-1)"
USD_PER_VCPU_HOUR = {"c7i": 0.08925 / 2, "m7i": 0.1008 / 2, "r7i": 0.1323 / 2}


def on_demand_usd_per_hour(instance: str) -> float:
    """The on-demand price of a c7i, m7i or r7i size of C7I_SIZES."""
    family, _, size = instance.partition(".")
    if family not in USD_PER_VCPU_HOUR or f"c7i.{size}" not in C7I_SIZES:
        raise ValueError(f"no price for {instance!r}: use a c7i, m7i or r7i size from 8xlarge to 48xlarge")
    return round(C7I_SIZES[f"c7i.{size}"][0] * USD_PER_VCPU_HOUR[family], 4)
