"""The per-worker training loop: DeepSpeed engine, steps, evaluation, DPO reference, collectives."""
