"""Doors to peer projects: CLIP_benchmark's loader for our models and the `--peer` cross-check."""
