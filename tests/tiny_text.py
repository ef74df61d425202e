"""A tiny CLIP text tower config and random token ids, shared by the text-tower and LiTModel tests."""
from __future__ import annotations

import torch

from lit_softmoe.models.text import TextTowerConfig

TINY_TEXT = TextTowerConfig(kind="transformer", width=32, layers=2, heads=2, context_length=16, vocab_size=49408)


EOT = 49407  # CLIP BPE's <end_of_text>, the largest id


def token_ids(batch: int = 4, length: int = 16, seed: int = 0) -> torch.Tensor:
    """Random texts of different lengths: <start> tokens... <end> then zero padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch, length, dtype=torch.long)
    for row in range(batch):
        n = 3 + row % (length - 4)
        ids[row, 0] = 49406
        ids[row, 1:n] = torch.randint(1, 49000, (n - 1,), generator=g)
        ids[row, n] = EOT
    return ids
