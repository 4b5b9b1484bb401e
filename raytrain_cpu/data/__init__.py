"""Data: sources, tokenize and pack (plain text, SFT and DPO rows), per-rank streams (read in each worker)."""
