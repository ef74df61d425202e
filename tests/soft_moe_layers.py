"""A Soft MoE layer whose routing is sharp and whose experts all differ, and seeded random tensors: shared
by the layer's tests and the tower's."""
from __future__ import annotations

import torch

from lit_softmoe.nn.soft_moe import SoftMoE


def make_layer(dim=8, num_experts=3, slots=2, hidden=12, dtype=torch.float64, seed=0, scale=3.0,
               **kwargs) -> SoftMoE:
    """A SoftMoE whose routing is sharp and whose experts all differ."""
    torch.manual_seed(seed)
    layer = SoftMoE(dim, num_experts, hidden, slots_per_expert=slots, shared_expert_init=False,
                    dtype=dtype, **kwargs)
    with torch.no_grad():
        layer.phi.normal_()
        layer.scale.fill_(scale)
        layer.experts.b1.normal_(std=0.3)
        layer.experts.b2.normal_(std=0.3)
    return layer


def randn(*shape, dtype=torch.float64, seed=1, std=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype) * std
