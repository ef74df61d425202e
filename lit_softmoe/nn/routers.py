"""Sparse MoE baselines of the Soft MoE paper: Tokens Choice and Experts Choice.

Puigcerver et al., "From Sparse to Soft Mixtures of Experts" (ICLR 2024) compare Soft MoE against
two sparse routers (§3 and Table 9 / App. "Comparison with sparse MoEs"); the reference code is
google-research/vmoe, `vmoe/nn/routing.py` (routers) and `vmoe/moe.py` (dispatchers); nothing here
is copied from that code.

- **Tokens Choice** (Riquelme et al. 2021, "Scaling Vision with Sparse Mixture of Experts", V-MoE):
  each token picks its top-K experts; each expert has a buffer of C places; all top-1 choices take
  places before any top-2 choice; choices past the buffer are dropped. Batch Priority Routing (BPR)
  lets the tokens with the largest top-1 gate choose first. The combine weight of a kept choice is
  its gate value (not renormalized). Two auxiliary losses balance the experts (V-MoE App. A.2).
- **Experts Choice** (Zhou et al. 2022, "Mixture-of-Experts with Expert Choice Routing"): each
  expert picks its top-C tokens. Loads are balanced by construction, so there is no auxiliary loss,
  but a token may be picked by many experts or by none.

Both route one image at a time (a group = one example's m tokens, as for Soft MoE), use a bias-free
router `x @ W` with W of shape (d, n), softmax gates over the n experts, and in training Gaussian
noise of std `noise_std / n` on the logits (vmoe's default noise_std = 1.0). The expert MLPs are the
same `BatchedExperts` as Soft MoE's, so parameter counts and FLOPs compare like for like.

Interface: `forward(x) -> y` like the dense MLP and `SoftMoE`, so a transformer block calls any of
them the same way. What a sparse layer also produces is stored on the layer by each forward:
`aux_loss` (a scalar tensor with gradient; 0 for Experts Choice) and `dropped_fraction` (a detached
scalar tensor: the fraction of the batch's tokens that no expert processed). Returning a tuple would
make every caller branch on the layer type; attributes keep the block uniform, and the tower sums
them over its layers after the forward (`VisionTransformer.moe_aux_loss()`). They are tensors, not
floats, so reading them costs no device sync until somebody logs them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lit_softmoe.nn.soft_moe import BatchedExperts


def tokens_choice_capacity(num_tokens: int, num_experts: int, num_selected: int,
                           capacity_factor: float, multiple_of: int = 4) -> int:
    """Buffer places per expert: ceil(m·K·cf / n), then rounded up to a multiple of `multiple_of`.

    vmoe rounds to a multiple of 4 to avoid padding on TPUs; it also makes the real capacity factor
    larger than asked when m·K/n is small (16 tokens, 16 experts, K=1, cf=1 → C=4, i.e. cf 4).
    """
    capacity = math.ceil(num_tokens * num_selected * capacity_factor / num_experts)
    if capacity < 1:
        raise ValueError(f"capacity_factor={capacity_factor} gives no buffer place for "
                         f"{num_tokens} tokens and {num_experts} experts")
    if multiple_of > 1:
        capacity += (-capacity) % multiple_of
    return capacity


def experts_choice_capacity(num_tokens: int, num_experts: int, capacity_factor: float,
                            multiple_of: int = 1) -> int:
    """Tokens per expert: round(m·cf / n), as in the Soft MoE paper's comparison (never above m)."""
    capacity = round(num_tokens * capacity_factor / num_experts)
    if capacity < 1:
        raise ValueError(f"capacity_factor={capacity_factor} with {num_tokens} tokens and "
                         f"{num_experts} experts gives "
                         f"{num_tokens * capacity_factor / num_experts:.3f} tokens per expert "
                         "(< 1)")
    if multiple_of > 1:
        capacity += (-capacity) % multiple_of
    return min(capacity, num_tokens)


def _cv_squared(values: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation along the last axis: var / mean² (population variance)."""
    return values.var(dim=-1, unbiased=False) / values.mean(dim=-1).pow(2)


def importance_loss(gates: torch.Tensor) -> torch.Tensor:
    """V-MoE's importance loss: CV² over experts of each expert's summed gate, per group, averaged.

    gates: (b, m, n) softmax of the noise-free logits. Zero when every expert gets the same total
    gate.
    """
    importance = gates.sum(dim=1)  # (b, n)
    return _cv_squared(importance).mean()


def load_loss(logits: torch.Tensor, noisy_logits: torch.Tensor, noise_std: float,
              num_selected: int) -> torch.Tensor:
    """V-MoE's load loss: CV² over experts of the probability that each expert is among a token's
    top-K if the noise were drawn again, summed over tokens, per group, averaged over groups.

    The K-th largest noisy logit of a token is the bar; expert e clears it with probability
    P(logit_e + ε > bar) = 1 − Φ((bar − logit_e) / noise_std), a smooth stand-in for the hard count.
    logits, noisy_logits: (b, m, n); noise_std: the actual std of the noise.
    """
    threshold = noisy_logits.topk(num_selected, dim=-1).values[..., -1:]  # (b, m, 1)
    prob_selected = 1.0 - torch.special.ndtr((threshold - logits) / noise_std)  # (b, m, n)
    return _cv_squared(prob_selected.mean(dim=1)).mean()


class _SparseMoE(nn.Module):
    """The router weights, gates and experts that both sparse layers share."""

    def __init__(self, dim: int, num_experts: int, hidden_dim: int, noise_std: float,
                 shared_expert_init: bool, device=None, dtype=None):
        super().__init__()
        # `noise_std > 0` switches noise on: a negative one would silently mean none
        if not noise_std >= 0:
            raise ValueError(f"noise_std must be >= 0 (0: no noise), got {noise_std!r}")
        factory = dict(device=device, dtype=dtype)
        self.dim, self.num_experts, self.noise_std = dim, num_experts, noise_std
        # A bare parameter, not nn.Linear: the router has no bias, and the tower's init of its
        # Linear layers (xavier, biases ~ N(0, 1e-6)) is not the router's.
        self.router = nn.Parameter(torch.empty(dim, num_experts, **factory))  # (d, n)
        self.experts = BatchedExperts(num_experts, dim, hidden_dim, shared_expert_init, **factory)
        self.aux_loss = torch.zeros(())
        self.dropped_fraction = torch.zeros(())
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        if self.router.is_meta:
            return
        # flax's Dense default: lecun-normal (fan_in = d), truncated at ±2σ.
        std = 1.0 / math.sqrt(self.dim) / 0.87962566103423978
        nn.init.trunc_normal_(self.router, std=std, a=-2 * std, b=2 * std)
        self.experts.reset_parameters()

    @property
    def logit_noise_std(self) -> float:
        return self.noise_std / self.num_experts  # vmoe: noise_std · (1 / num_experts)

    def _logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(clean, used) logits, each (b, m, n) in fp32 at least; `used` carries noise in
        training."""
        logits = x @ self.router.to(x.dtype)  # (b, m, n)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.training and self.noise_std > 0:
            return logits, logits + self.logit_noise_std * torch.randn_like(logits)
        return logits, logits

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(clean logits, used logits, gates), each (b, m, n); gates = softmax over the experts of
        the used (noisy in training) logits, as in vmoe: they both route and weight the outputs."""
        logits, used_logits = self._logits(x)
        return logits, used_logits, used_logits.softmax(dim=-1)

    def _run_experts(self, buffers: torch.Tensor) -> torch.Tensor:
        """buffers (b, n, C, d) → expert outputs (b, n, C, d), one batched matmul per projection."""
        b, n, capacity, d = buffers.shape
        expert_major = buffers.transpose(0, 1).reshape(n, b * capacity, d)  # (n, b·C, d)
        out = self.experts(expert_major)  # (n, b·C, d)
        return out.view(n, b, capacity, d).transpose(0, 1)  # (b, n, C, d)


class TokensChoiceMoE(_SparseMoE):
    """Top-K Tokens Choice MoE layer (V-MoE), a drop-in replacement for a block's MLP.

    Args:
        dim: token width d.
        num_experts: number of experts n.
        hidden_dim: hidden width of each expert MLP.
        num_selected: K, experts chosen per token.
        capacity_factor: buffer places per expert = ceil(m·K·cf / n), rounded up to
            `capacity_multiple_of`.
        capacity_multiple_of: 4 as in vmoe (1 = no rounding).
        batch_priority: Batch Priority Routing: tokens with the largest top-1 gate are served first
            (otherwise earlier positions are).
        noise_std: logit noise in training has std noise_std / n (vmoe default 1.0; 0 = off).
        importance_weight, load_weight: weights of the two losses inside `aux_loss` (the recipe then
            scales the sum by its `aux_loss_weight`, 0.005 as in V-MoE).
        shared_expert_init: all experts start from the same init (as Soft MoE's released configs).
    """

    def __init__(self, dim: int, num_experts: int, hidden_dim: int, num_selected: int = 1,
                 capacity_factor: float = 1.0, capacity_multiple_of: int = 4,
                 batch_priority: bool = False, noise_std: float = 1.0,
                 importance_weight: float = 1.0, load_weight: float = 1.0,
                 shared_expert_init: bool = True, device=None, dtype=None):
        if not 1 <= num_selected <= num_experts:
            raise ValueError(f"num_selected must be in [1, {num_experts}], got {num_selected}")
        super().__init__(dim, num_experts, hidden_dim, noise_std, shared_expert_init, device, dtype)
        self.num_selected, self.capacity_factor = num_selected, capacity_factor
        self.capacity_multiple_of, self.batch_priority = capacity_multiple_of, batch_priority
        self.importance_weight, self.load_weight = importance_weight, load_weight

    def capacity(self, num_tokens: int) -> int:
        return tokens_choice_capacity(num_tokens, self.num_experts, self.num_selected,
                                      self.capacity_factor, self.capacity_multiple_of)

    def route(self, gates: torch.Tensor, capacity: int):
        """Assign buffer places. gates: (b, m, n).

        Returns `(expert_index, position, kept, gate_values)`, each (b, m, K): the chosen experts,
        the place in each chosen expert's buffer, whether that place is < capacity, and the gates.
        """
        b, m, n = gates.shape
        gate_values, expert_index = gates.topk(self.num_selected, dim=-1)  # (b, m, K)
        if self.batch_priority:
            # Serve tokens in order of their top-1 gate, largest first (stable: ties keep position).
            order = gate_values[..., 0].argsort(dim=1, descending=True, stable=True)  # (b, m)
        else:
            order = torch.arange(m, device=gates.device).expand(b, m)
        # (b, m, K)
        ordered = expert_index.gather(1, order[..., None].expand(-1, -1, self.num_selected))
        # K-major: every token's top-1 choice is counted before any top-2 choice.
        choices = ordered.transpose(1, 2).reshape(b, self.num_selected * m)  # (b, K·m)
        one_hot = F.one_hot(choices, n)  # (b, K·m, n)
        # Place in the expert's buffer = how many earlier choices picked the same expert.
        position = (one_hot.cumsum(dim=1) - 1).gather(2, choices[..., None]).squeeze(-1)  # (b, K·m)
        position = position.view(b, self.num_selected, m).transpose(1, 2)  # (b, m, K), in `order`
        # Back to token order: token order[i] got the places computed at row i.
        position = torch.empty_like(position).scatter_(
            1, order[..., None].expand(-1, -1, self.num_selected), position)
        kept = position < capacity
        return expert_index, position, kept, gate_values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (b, m, d) → (b, m, d). Sets `aux_loss` and `dropped_fraction`."""
        b, m, d = x.shape
        n, capacity = self.num_experts, self.capacity(m)
        logits, used_logits, gates = self._gates(x)  # (b, m, n) each
        aux = self.importance_weight * importance_loss(logits.softmax(dim=-1))
        if used_logits is not logits and self.load_weight > 0:
            aux = aux + self.load_weight * load_loss(logits, used_logits, self.logit_noise_std,
                                                     self.num_selected)
        self.aux_loss = aux

        expert_index, position, kept, gate_values = self.route(gates, capacity)
        # Flat place in the (n·C + 1)-long buffer; every dropped choice goes to the last, discarded
        # place.
        place = torch.where(kept, expert_index * capacity + position, n * capacity)  # (b, m, K)
        place = place.reshape(b, m * self.num_selected)  # (b, m·K)
        tokens = x.repeat_interleave(self.num_selected, dim=1)  # (b, m·K, d), row i·K + k = token i
        buffers = x.new_zeros(b, n * capacity + 1, d).scatter_add(
            1, place[..., None].expand(-1, -1, d), tokens)
        outputs = self._run_experts(buffers[:, :-1].view(b, n, capacity, d)).reshape(
            b, n * capacity, d)
        # the discard place outputs 0
        outputs = torch.cat([outputs, outputs.new_zeros(b, 1, d)], dim=1)
        picked = outputs.gather(1, place[..., None].expand(-1, -1, d)).view(
            b, m, self.num_selected, d)
        weights = (gate_values * kept).to(x.dtype)  # (b, m, K): the gate itself, 0 where dropped
        y = (weights[..., None] * picked).sum(dim=2)  # (b, m, d)
        self.dropped_fraction = (~kept.any(dim=-1)).float().mean().detach()
        return y

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_experts={self.num_experts}, "
                f"num_selected={self.num_selected}, capacity_factor={self.capacity_factor}, "
                f"batch_priority={self.batch_priority}, noise_std={self.noise_std}")


class ExpertsChoiceMoE(_SparseMoE):
    """Experts Choice MoE layer (Zhou et al. 2022): each expert takes its top-C tokens.

    Args:
        dim, num_experts, hidden_dim, noise_std, shared_expert_init: as for `TokensChoiceMoE`.
        capacity_factor: tokens per expert C = round(m·cf / n), rounded up to
            `capacity_multiple_of`.
    """

    def __init__(self, dim: int, num_experts: int, hidden_dim: int, capacity_factor: float = 1.0,
                 capacity_multiple_of: int = 1, noise_std: float = 1.0,
                 shared_expert_init: bool = True, device=None, dtype=None):
        super().__init__(dim, num_experts, hidden_dim, noise_std, shared_expert_init, device, dtype)
        self.capacity_factor, self.capacity_multiple_of = capacity_factor, capacity_multiple_of

    def capacity(self, num_tokens: int) -> int:
        return experts_choice_capacity(num_tokens, self.num_experts, self.capacity_factor,
                                       self.capacity_multiple_of)

    def route(self, gates: torch.Tensor, capacity: int):
        """gates (b, m, n) → (token_index, gate_values), each (b, n, C): each expert's chosen
        tokens."""
        gate_values, token_index = gates.transpose(1, 2).topk(capacity, dim=-1)  # (b, n, C)
        return token_index, gate_values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (b, m, d) → (b, m, d). Sets `aux_loss` (always 0) and `dropped_fraction`."""
        b, m, d = x.shape
        n, capacity = self.num_experts, self.capacity(m)
        _, used_logits, gates = self._gates(x)  # (b, m, n) each
        token_index, gate_values = self.route(gates, capacity)
        flat_index = token_index.reshape(b, n * capacity)  # (b, n·C)
        buffers = x.gather(1, flat_index[..., None].expand(-1, -1, d)).view(b, n, capacity, d)
        outputs = self._run_experts(buffers).reshape(b, n * capacity, d)
        weighted = outputs * gate_values.reshape(b, n * capacity, 1).to(x.dtype)
        y = x.new_zeros(b, m, d).scatter_add(1, flat_index[..., None].expand(-1, -1, d), weighted)
        times_picked = torch.zeros(b, m, device=x.device).scatter_add_(
            1, flat_index, torch.ones(flat_index.shape, device=x.device))  # (b, m)
        self.aux_loss = used_logits.new_zeros(())
        self.dropped_fraction = (times_picked == 0).float().mean()
        return y

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_experts={self.num_experts}, "
                f"capacity_factor={self.capacity_factor}, noise_std={self.noise_std}")
