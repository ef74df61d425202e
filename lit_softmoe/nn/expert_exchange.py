"""The exchange of expert parallelism, as a Soft MoE layer's experts run it (`BatchedExperts`): the
slots moved to the processes that hold their experts and back, and the expert weights as this
process holds them. Where the experts are placed, and what runs a split tower, is
`nn.expert_parallel`'s.

    slots (n, b·p, d) on every process, expert-major (`soft_moe_forward`'s view)
        ──all-to-all──► (E, n/E, b·p, d): chunk j of the expert axis went to process j, which
                        received its n/E experts' slots from every process of the group
        ──► (n/E, E·b·p, d) ──its experts, one bmm per projection──► (n/E, E·b·p, d)
        ──all-to-all──► (n, b·p, d): every process has its own slots' outputs back

Soft MoE makes the exchange regular: every expert gets exactly p slots per image, so with the same
b on every process each sends and receives equal chunks (no capacity, no dropping, no split sizes
to agree on). The all-to-alls are differentiable (`torch.distributed`'s functional collectives, as
torchtitan's `distributed/expert_parallel.py` uses them): the backward of the first brings each
expert the gradients of every slot it processed, from every process of the group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor


def _all_to_all(chunks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """chunks (n, tokens, d), the n rows in E equal chunks: chunk j goes to process j of `group`.
    Returns (n, tokens, d): chunk i from process i."""
    received = all_to_all_single_autograd(chunks.contiguous(), None, None, group)
    # A functional collective returns a tensor that waits on first use; wait once, here.
    return torch.ops._c10d_functional.wait_tensor(received)


def experts_in_parallel(slots: torch.Tensor, local_experts,
                        group: dist.ProcessGroup) -> torch.Tensor:
    """The experts of a Soft MoE layer run by the E processes of `group`, each on its n/E.

    slots: (n, tokens, d), this process's slots of all n experts, expert-major; `local_experts` maps
    (n/E, tokens', d) → (n/E, tokens', d). Every process of the group must call it with the same
    shape (the same batch). Returns (n, tokens, d): the outputs of this process's slots.
    """
    num_experts, tokens, dim = slots.shape
    group_size = dist.get_world_size(group)
    if group_size == 1:  # nothing to exchange: the plain layer's work, at its cost
        return local_experts(slots)
    local = num_experts // group_size
    # Chunk j of the expert axis (experts j·n/E … (j+1)·n/E - 1) goes to process j, which gets
    # (E·n/E, tokens, d): its experts' slots from each process in turn.
    received = _all_to_all(slots, group)
    # (n/E, E·tokens, d): each local expert's slots from every process, process-major (a copy)
    received = received.view(group_size, local, tokens, dim).transpose(0, 1)
    outputs = local_experts(received.reshape(local, group_size * tokens, dim))
    # (E·n/E, tokens, d) again, chunk i holding the outputs of process i's slots (a copy)
    outputs = outputs.view(local, group_size, tokens, dim).transpose(0, 1).reshape(
        num_experts, tokens, dim)
    # (n, tokens, d): from process j, the outputs of its experts for this process's slots. Not a
    # view: FSDP's hooks on the experts' module must see their own output.
    return _all_to_all(outputs, group)


class _GradientShare(torch.autograd.Function):
    """Identity forward; backward scales the gradient by `share`."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, share: float) -> torch.Tensor:
        ctx.share = share
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.share, None


def local_expert_weights(experts) -> tuple[torch.Tensor, ...]:
    """(w1, b1, w2, b2) of a `BatchedExperts` as its forward uses them: the process's own experts.

    Split over an expert group of E processes, each weight is a DTensor whose local tensor is this
    process's experts, and its gradient is scaled by 1/E. Data parallelism averages gradients over
    the processes, each process's loss being the mean over its own batch; an expert's weights get
    the gradients of all E processes' slots through the all-to-all's backward, a sum over E
    batches, so 1/E makes it their mean, and the average over the processes that hold the same
    experts (FSDP's, over the other mesh axis) then makes it the mean over every process's batch,
    as for any other weight.
    """
    weights = (experts.w1, experts.b1, experts.w2, experts.b2)
    if experts.expert_group is None:
        return weights
    group_size = dist.get_world_size(experts.expert_group)
    weights = tuple(weight.to_local() if isinstance(weight, DTensor) else weight
                    for weight in weights)
    if group_size == 1:
        return weights
    return tuple(_GradientShare.apply(weight, 1.0 / group_size) for weight in weights)
