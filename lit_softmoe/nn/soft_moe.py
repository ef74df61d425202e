"""Soft Mixture of Experts (Puigcerver et al., "From Sparse to Soft Mixtures of Experts", ICLR
2024).

Follows the official JAX router (google-research/vmoe, `vmoe/projects/soft_moe/router.py`) step by
step. One image is one routing group: every softmax runs inside an example, never across the batch.

    x (b, m, d) ──L2-normalize──► logits (b, m, n·p) = scale · <x̂, φ̂>
        dispatch D = softmax over the m tokens      (each slot: a convex mix of tokens)
        combine  C = softmax over all n·p slots     (each token: a convex mix of slot outputs)
    slots X̃ = Dᵀ x (raw x)  ──► expert j on its p slots ──► Ỹ ──► y = C Ỹ

The experts are batched: weights stacked on a leading expert axis, one batched matmul per
projection, no Python loop over experts.

`soft_moe_forward` (what `forward` runs) takes the cosine as <x, φ̂> / |x|, so the normalized tokens
x̂ are never materialized; the routing (norms, logits, both softmaxes and their sums) runs in fp32
while the matmuls run in the activations' dtype (bf16 weights or autocast: one explicit cast per
operand), and the slots go to the experts expert-major as strided views (no copy when p = 1; cuBLAS
reads the strides). `routing_weights` returns the weights of that same computation
(`soft_moe_logits` → `soft_moe_weights`). `SoftMoE(..., compiled=True)` runs it through
`torch.compile`, which fuses the norm, the fp32 routing and the casts into a few kernels around the
five matmuls. The tests hold a step-by-step oracle of the algorithm above that the layer must equal.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lit_softmoe.nn.expert_exchange import experts_in_parallel, local_expert_weights

# The official code adds this inside the square root of both L2 normalizations.
_NORM_EPS = 1e-6


class BatchedExperts(nn.Module):
    """`num_experts` two-layer MLPs (Dense → GELU → Dense) run as one batched matmul per layer.

    Args:
        num_experts: number of experts n.
        dim: input and output width d.
        hidden_dim: expert hidden width.
        shared_init: start every expert from the same weights (the official configs do this,
            `split_rngs=False`); False gives independent inits (the paper's "Uniform" ablation).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, shared_init: bool = True,
                 device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.shared_init = shared_init
        # The process group this layer's experts are split over (`expert_parallel.place_experts`);
        # None: every expert is here.
        self.expert_group = None
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **factory))
        self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory))
        self.b2 = nn.Parameter(torch.empty(num_experts, dim, **factory))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        if self.w1.is_meta:
            return
        # vmoe's MlpBlock: xavier-uniform kernels, N(0, 1e-6) biases.
        n = 1 if self.shared_init else self.num_experts
        for weight in (self.w1, self.w2):
            fan_in, fan_out = weight.shape[1:]
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            # Drawn on the CPU (the same values wherever the layer lives), moved before the expand:
            # an expanded CPU source would first be materialized in full (1.2 GB per B/16 layer) on
            # the host.
            weight.copy_(torch.empty(n, fan_in, fan_out).uniform_(-bound, bound).to(weight)
                         .expand_as(weight))
        for bias in (self.b1, self.b2):
            bias.copy_(torch.empty(n, bias.shape[1]).normal_(std=1e-6).to(bias).expand_as(bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (n, tokens, d), expert-major so each projection is a single bmm → (n, tokens, d)."""
        if self.expert_group is None:
            return self.run_local(x)
        return experts_in_parallel(x, self.run_local, self.expert_group)

    def run_local(self, x: torch.Tensor) -> torch.Tensor:
        """The experts held here on their slots: (local experts, tokens, d) → the same shape."""
        w1, b1, w2, b2 = local_expert_weights(self)
        # Weights cast to x's dtype: a no-op for weights already in it; under autocast x is fp32 or
        # already cast, and autocast casts as before.
        # bmm, then the bias: under torch.compile the first bias add fuses into the GELU kernel and
        # the second into the next pointwise op. baddbmm would broadcast-copy each bias into its
        # whole (n, tokens, ·) output and have the GEMM read it back as strided copies (profiled in
        # docs/benchmarks.md, "What the changes bought").
        # (n, tokens, hidden)
        hidden = torch.bmm(x, w1.to(x.dtype)) + b1.to(x.dtype).unsqueeze(1)
        hidden = F.gelu(hidden, approximate="tanh")  # flax's nn.gelu default is the tanh form
        # (n, tokens, d)
        return torch.bmm(hidden, w2.to(x.dtype)) + b2.to(x.dtype).unsqueeze(1)

    def extra_repr(self) -> str:
        group = ("" if self.expert_group is None
                 else f", expert_parallel={dist.get_world_size(self.expert_group)}")
        return (f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}"
                + group)


def slots_for_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert so that n·p ≈ capacity_factor · m, as the official router derives it."""
    slots = round(num_tokens * capacity_factor / num_experts)
    if slots < 1:
        raise ValueError(
            f"capacity_factor={capacity_factor} with {num_tokens} tokens and {num_experts} experts "
            f"gives {num_tokens * capacity_factor / num_experts:.3f} slots per expert (< 1); "
            "raise the capacity factor or use fewer experts")
    return slots


def _l2_normalize(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t * torch.rsqrt(t.pow(2).sum(dim=dim, keepdim=True) + _NORM_EPS)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The matmuls' dtype: autocast's when it is on for x's device, else x's own."""
    device_type = x.device.type
    if (device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type)
            and x.is_floating_point()):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _autocast_off(x: torch.Tensor):
    return (torch.autocast(x.device.type, enabled=False) if x.device.type in ("cuda", "cpu")
            else contextlib.nullcontext())


def soft_moe_logits(x: torch.Tensor, phi: torch.Tensor, scale: torch.Tensor,
                    noise_std: float = 0.0) -> torch.Tensor:
    """Routing logits scale · cos(x, φ) (+ noise), (b, m, n·p) in fp32 (fp64 for fp64 inputs).

    x: (b, m, d) in the matmuls' dtype, padding already zeroed; phi: (d, n, p); scale: ().
    """
    routing_dtype = torch.promote_types(x.dtype, torch.float32)
    # scale · <x/|x|, φ/|φ|> = (x @ (scale · φ̂)) / |x|: the small (d, n·p) side is normalized and
    # scaled, the tokens only contribute one fp32 norm each.
    # (d, n·p)
    phi_hat = _l2_normalize(phi.to(routing_dtype), dim=0).flatten(1) * scale.to(routing_dtype)
    token_norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=routing_dtype)  # (b, m, 1)
    logits = ((x @ phi_hat.to(x.dtype)).to(routing_dtype)
              * torch.rsqrt(token_norm.square() + _NORM_EPS))
    if noise_std > 0:
        logits = logits + noise_std * torch.randn_like(logits)
    return logits


def soft_moe_weights(logits: torch.Tensor,
                     mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dispatch, combine), each (b, m, n·p) in `logits`' dtype: dispatch is a softmax over the m
    tokens (each slot mixes tokens), combine a softmax over all n·p slots (each token mixes
    slots)."""
    # The most negative finite value, not -inf: an example that is all padding then dispatches
    # (zeroed) padding instead of NaN (a softmax over -inf only), which its zero output discards.
    dispatch_logits = (logits if mask is None
                       else logits.masked_fill(~mask[:, :, None], torch.finfo(logits.dtype).min))
    return dispatch_logits.softmax(dim=1), logits.softmax(dim=2)


def soft_moe_forward(x: torch.Tensor, phi: torch.Tensor, scale: torch.Tensor,
                     experts: "BatchedExperts", mask: torch.Tensor | None = None,
                     noise_std: float = 0.0) -> torch.Tensor:
    """Soft MoE as one function (so `torch.compile` sees all of it).

    x: (b, m, d); phi: (d, n, p); scale: (); experts: maps (n, tokens, d) → (n, tokens, d) in its
    input's dtype; mask: optional (b, m) bool, True for real tokens; noise_std > 0 adds logit noise.
    Returns (b, m, d) in the matmuls' dtype (autocast's, else x's).
    """
    b, m, d = x.shape
    _, n, p = phi.shape
    dtype = _compute_dtype(x)
    with _autocast_off(x):  # every cast below is explicit
        x = x.to(dtype)
        if mask is not None:
            # Zero the padding itself: a zero dispatch weight times an inf or NaN pad is still NaN.
            x = x.masked_fill(~mask[:, :, None], 0.0)
        # (b, m, n·p) each
        dispatch, combine = soft_moe_weights(soft_moe_logits(x, phi, scale, noise_std), mask)
        dispatch, combine = dispatch.to(dtype), combine.to(dtype)
        slots = dispatch.transpose(1, 2) @ x  # (b, n·p, d): weighted sums of the raw tokens
        # Expert-major views: for p = 1 these are strided views, not copies.
        slots = slots.view(b, n, p, d).transpose(0, 1).reshape(n, b * p, d)  # (n, b·p, d)
        slot_outputs = experts(slots)  # (n, b·p, d)
        # (b, n·p, d)
        slot_outputs = slot_outputs.view(n, b, p, d).transpose(0, 1).reshape(b, n * p, d)
        y = combine @ slot_outputs  # (b, m, d)
        if mask is not None:
            y = y * mask[:, :, None].to(y.dtype)
    return y


_COMPILED: dict = {}


def compiled_soft_moe_forward(mode: str | None = None, backend: str = "inductor"):
    """`soft_moe_forward` through `torch.compile` (built once per mode and backend, shared by every
    layer)."""
    key = (mode, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(soft_moe_forward, mode=mode, backend=backend, dynamic=False)
    return _COMPILED[key]


class SoftMoE(nn.Module):
    """Soft MoE layer: a drop-in replacement for a transformer block's MLP.

    Args:
        dim: token width d.
        num_experts: number of experts n.
        hidden_dim: hidden width of each expert MLP.
        slots_per_expert: p. Give it directly (every released config uses 1), or leave it None and
            give `capacity_factor` and `num_tokens`, from which p = round(m · cf / n).
        capacity_factor: total slots over tokens, used only when `slots_per_expert` is None.
        num_tokens: the sequence length the capacity factor refers to. The layer itself has no
            parameter tied to m, so it accepts any sequence length afterwards.
        noise_std: std of Gaussian noise added to the logits in training (0 = off, as released).
        shared_expert_init: all experts start from the same init (default, as released).
        compiled: run the forward through `torch.compile` (`compiled_soft_moe_forward`); the first
            call per shape compiles (seconds). Compiling the whole tower instead has the same
            effect.
    """

    def __init__(self, dim: int, num_experts: int, hidden_dim: int,
                 slots_per_expert: int | None = None, capacity_factor: float | None = None,
                 num_tokens: int | None = None, noise_std: float = 0.0,
                 shared_expert_init: bool = True, compiled: bool = False, device=None, dtype=None):
        super().__init__()
        if slots_per_expert is None:
            if capacity_factor is None or num_tokens is None:
                raise ValueError("give slots_per_expert, or capacity_factor together with "
                                 "num_tokens")
            slots_per_expert = slots_for_capacity(num_tokens, num_experts, capacity_factor)
        if slots_per_expert < 1:
            raise ValueError(f"slots_per_expert must be >= 1, got {slots_per_expert}")
        # `noise_std > 0` switches noise on: a negative one would silently mean none
        if not noise_std >= 0:
            raise ValueError(f"noise_std must be >= 0 (0: no noise), got {noise_std!r}")
        factory = dict(device=device, dtype=dtype)
        self.dim, self.num_experts, self.slots_per_expert = dim, num_experts, slots_per_expert
        self.noise_std = noise_std
        self.compiled = compiled
        self.phi = nn.Parameter(torch.empty(dim, num_experts, slots_per_expert, **factory))
        self.scale = nn.Parameter(torch.ones((), **factory))
        self.experts = BatchedExperts(num_experts, dim, hidden_dim, shared_expert_init, **factory)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        if self.phi.is_meta:
            return
        # lecun-normal with fan_in = n·d (flax treats every axis but the last as fan-in), truncated
        # at ±2σ; 0.8796 is the std of a unit normal truncated there.
        fan_in = self.dim * self.num_experts
        std = 1.0 / math.sqrt(fan_in) / 0.87962566103423978
        nn.init.trunc_normal_(self.phi, std=std, a=-2 * std, b=2 * std)
        self.scale.fill_(1.0)
        self.experts.reset_parameters()

    @property
    def num_slots(self) -> int:
        return self.num_experts * self.slots_per_expert

    def _routing_input(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x as `forward` routes it: in the matmuls' dtype, padding zeroed."""
        x = x.to(_compute_dtype(x))
        return x if mask is None else x.masked_fill(~mask[:, :, None], 0.0)

    def routing_logits(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The logits `forward` routes `x` (b, m, d) with: (b, m, n·p), fp32 or wider; training
        noise included when the layer is training."""
        x = self._routing_input(x, mask)  # outside _autocast_off: autocast's dtype is read from it
        with _autocast_off(x):
            return soft_moe_logits(x, self.phi, self.scale,
                                   self.noise_std if self.training else 0.0)

    def routing_weights(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        """`(dispatch, combine)` that `forward` routes `x` with, each of shape (b, m, n, p), fp32 or
        wider."""
        dispatch, combine = soft_moe_weights(self.routing_logits(x, mask), mask)
        shape = (*x.shape[:2], self.num_experts, self.slots_per_expert)
        return dispatch.view(shape), combine.view(shape)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (b, m, d); mask: optional (b, m) bool, True for real tokens. Returns (b, m, d)."""
        forward = compiled_soft_moe_forward() if self.compiled else soft_moe_forward
        return forward(x, self.phi, self.scale, self.experts, mask,
                       self.noise_std if self.training else 0.0)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_experts={self.num_experts}, "
                f"slots_per_expert={self.slots_per_expert}, noise_std={self.noise_std}"
                + (", compiled=True" if self.compiled else ""))
