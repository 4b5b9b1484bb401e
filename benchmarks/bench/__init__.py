"""`python benchmarks/suites.py [gemm|train|load|scaling|placement|options|seed|lora|dpo|reference|all]`: CPU benchmarks.

Every comparison is measured side by side in one invocation (the machines this runs on are
often shared, so absolute figures drift; ratios taken minutes apart hold). Results go to
benchmarks/results/<machine>/<suite>.json and a markdown table next to it (or --json PATH),
<machine> naming the CPU model and its best matrix ISA (e.g. amd-epyc-avx512_bf16).

* gemm      bf16 and fp32 GEMM FLOP/s at the model's own training GEMM shapes (forward,
            input-gradient and weight-gradient products), in one process per worker running
            at the same time with each worker's threads: the peak MFU is measured against.
* train     tokens/s, MFU and the step-time breakdown (data wait, forward, backward,
            optimizer step, and the collectives inside them) of the ~50M Llama at seq 512.
* load      peak RSS of each rank during ZeRO-3 sharded loading, against a naive full load
            of the same model, and the bound 2*params/world + largest tensor + 1.5 GB.
* scaling   tokens/s at 1 and 2 workers with the same threads per worker, beside the host's
            own ceiling: plain PyTorch in 1 process against 2 at once (--repeats N: N rounds
            in turn, the median round's figures).
* placement this project's thread placement against Ray's plain settings (and pinning).
* options   torch.compile (per layer or the whole model), per-module ZeRO-3 gathers,
            activation checkpointing, bf16, the per-tensor AdamW loop and glibc malloc
            (fixed or dynamic mmap threshold) against the defaults.
* seed      this project against the seed recipe (HF Trainer + DeepSpeed ZeRO-3 with CPU
            offload, padded batches), interleaved ours, seed, ours: useful and raw tokens/s.
* lora      LoRA (r=16, every projection) against full fine-tuning: tokens/s, peak RSS per
            rank, optimizer state bytes per rank, trainable parameters.
* dpo       DPO and SimPO against SFT on the same pairs (SFT on the chosen answers), full
            fine-tuning (a frozen copy of the model as DPO's reference; SimPO has none) and
            LoRA r=16 (adapters off), each DPO also with its reference precomputed, and full
            DPO against LoRA DPO: tokens/s, step breakdown, peak RSS per rank, the precomputing
            pass's seconds (`--variants` picks some: SFT,DPO,SimPO,...).
* reference the 2-worker ZeRO-3 run against plain single-process PyTorch (no DeepSpeed, no
            Ray) on the same model, dtype, tokens per step and cores, interleaved zero3,
            reference, zero3: tokens/s per core and their ratio (issue 12's goal: >= 0.95).
            bf16 runs get two references, autocast and bf16 weights with fp32 master
            weights; `--variants compile` adds torch.compile on the faster of them.
            `--threads 1,2,4,...` repeats it at each count of threads per rank (with
            --workers 1: one rank against plain PyTorch at the same threads; goal >= 0.9).

--size tiny runs everything on a 0.4M-parameter model in seconds (the smoke test).
"""
