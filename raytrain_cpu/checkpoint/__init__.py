"""Checkpoints: writing, manifest and verification, universal conversion."""
