"""The model: its shape (parameters, FLOPs, GEMMs), loading (ZeRO-3 sharded), hub files, tokenizer,
chat templates, LoRA, export and generation; ops/ holds the kernels and fused operations."""
