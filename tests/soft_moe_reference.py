"""A step-by-step oracle of the Soft MoE layer (Puigcerver et al., ICLR 2024; google-research/vmoe,
`vmoe/projects/soft_moe/router.py`): the algorithm written the plain way, x̂ materialized and the
scale multiplied into the smaller operand as the official code does, so `SoftMoE.forward` (the
fused, fp32-routing implementation) can be checked against it. Tests and `scripts/bench_gpu.py`
(its "step by step" row) use it; the package does not.
"""
from __future__ import annotations

import torch

from lit_softmoe.nn.soft_moe import SoftMoE

_NORM_EPS = 1e-6  # inside the square root of both L2 normalizations, as the official code adds it


def _l2_normalize(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t * torch.rsqrt(t.pow(2).sum(dim=dim, keepdim=True) + _NORM_EPS)


def reference_logits(layer: SoftMoE, x: torch.Tensor) -> torch.Tensor:
    """scale · <x̂, φ̂> (+ noise when training): (b, m, n·p) in x's dtype."""
    x_hat = _l2_normalize(x, dim=-1)  # (b, m, d)
    phi_hat = _l2_normalize(layer.phi, dim=0).flatten(1)  # (d, n·p)
    # Multiply the scalar into whichever operand is smaller (as the official code does).
    if phi_hat.numel() <= x_hat.numel():
        phi_hat = layer.scale * phi_hat
    else:
        x_hat = layer.scale * x_hat
    logits = x_hat @ phi_hat.to(x_hat.dtype)  # (b, m, n·p)
    if layer.training and layer.noise_std > 0:
        logits = logits + layer.noise_std * torch.randn_like(logits)
    return logits


def reference_forward(layer: SoftMoE, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's output for x (b, m, d), step by step; mask: optional (b, m) bool, True for real tokens."""
    b, m, d = x.shape
    n, p = layer.num_experts, layer.slots_per_expert
    if mask is not None:
        x = x.masked_fill(~mask[:, :, None], 0.0)  # a zero weight times an inf or NaN pad is still NaN
    logits = reference_logits(layer, x)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # softmaxes in fp32 at least
    # A padding token is never dispatched (exp(min - max) is exactly 0); -inf would give an
    # all-padding example NaN weights.
    dispatch_logits = logits if mask is None else logits.masked_fill(~mask[:, :, None], torch.finfo(logits.dtype).min)
    dispatch = dispatch_logits.softmax(dim=1).to(x.dtype)  # (b, m, n·p): each slot mixes tokens
    combine = logits.softmax(dim=2).to(x.dtype)  # (b, m, n·p): each token mixes slots
    slots = dispatch.transpose(1, 2) @ x  # (b, n·p, d): weighted sums of the raw tokens
    slots = slots.view(b, n, p, d).transpose(0, 1).reshape(n, b * p, d)  # expert-major
    slot_outputs = layer.experts(slots)  # (n, b·p, d)
    slot_outputs = slot_outputs.view(n, b, p, d).transpose(0, 1).reshape(b, n * p, d)
    y = combine @ slot_outputs  # (b, m, d)
    if mask is not None:
        y = y * mask[:, :, None].to(y.dtype)
    return y
