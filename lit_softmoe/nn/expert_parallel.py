"""Expert parallelism for Soft MoE: the experts split over a group of processes, the slots moved.

This is how the paper's code runs its large towers (google-research/vmoe: `vmoe/moe.py`'s
`_dispatch` and `_receive`, experts split along an `expert` mesh axis). With an expert group of E
processes, each holds n/E of every layer's n experts. The dispatch and the combine stay local (they
mix the tokens of one image, and each process has its own images); between them two all-to-alls
move the slots:

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

`place_experts` turns every `BatchedExperts` of a model into its chunk: each weight becomes a
DTensor sharded on the expert axis (`Shard(0)` over the group's mesh), whose local tensor is the
process's n/E experts, so that PyTorch's distributed state-dict functions gather a full tower, and
FSDP2 composes with it on a 2-D mesh (`lit_softmoe.train.sharding`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lit_softmoe.errors import UserError


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


def split_experts(model: nn.Module, expert_mesh: DeviceMesh, device=None) -> None:
    """`place_experts`, refusing in one line (UserError) a group that does not divide a layer's
    experts, or a model with no MoE layer to split. Layers placed already are left as they are."""
    if experts_held(model) is not None:
        return
    try:
        placed = place_experts(model, expert_mesh, device)
    except ValueError as error:
        raise UserError(f"{error}; set an expert_parallel that divides it") from None
    if not placed:
        raise UserError(f"expert_parallel={expert_mesh.size()}: this tower has no MoE layer whose "
                        "experts could be split; set expert_parallel=1")


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


def place_experts(model: nn.Module, expert_mesh: DeviceMesh, device=None) -> int:
    """Split every `BatchedExperts` of `model` over the processes of `expert_mesh` (1-D), in place:
    process j keeps experts j·n/E … (j+1)·n/E - 1 of each layer, as a DTensor `Shard(0)` on that
    mesh, and its forward exchanges the slots with the others (`experts_in_parallel`). A parameter
    on the meta device stays there (its chunk shaped, to be filled later, e.g. by FSDP's
    `broadcast_from_rank0`). `device`: where the chunks go (None: where the weights are), so that a
    tower read on the host puts only its chunk on the GPU. Returns the number of layers placed;
    raises ValueError when E does not divide a layer's experts."""
    from lit_softmoe.nn.soft_moe import BatchedExperts  # which imports this module

    group_size, rank = expert_mesh.size(), expert_mesh.get_local_rank()
    placed = 0
    for experts in model.modules():
        if not isinstance(experts, BatchedExperts) or experts.expert_group is not None:
            continue
        if experts.num_experts % group_size:
            raise ValueError(f"expert_parallel={group_size} does not divide the "
                             f"{experts.num_experts} experts of a MoE layer")
        local = experts.num_experts // group_size
        for name, param in list(experts.named_parameters(recurse=False)):
            chunk = param.detach()[rank * local:(rank + 1) * local].clone()
            chunk = chunk if device is None else chunk.to(device)
            sharded = DTensor.from_local(chunk, expert_mesh, [Shard(0)], run_check=False,
                                         shape=param.shape, stride=param.stride())
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.expert_group = expert_mesh.get_group()
        placed += 1
    return placed


def experts_held(model: nn.Module) -> tuple[int, int] | None:
    """(experts this process holds, experts) of the first MoE layer split by `place_experts`; None
    where none is."""
    from lit_softmoe.nn.soft_moe import BatchedExperts  # which imports this module

    for experts in model.modules():
        if isinstance(experts, BatchedExperts) and experts.expert_group is not None:
            return local_expert_weights(experts)[0].shape[0], experts.num_experts
    return None


class GroupLockstep:
    """A tower whose experts are split over `group` (`place_experts`), run in step with the group's
    other processes when each process has batches of its own, of any sizes and number (an embedding
    job: each process reads its own shards).

    The all-to-alls need every process of the group in the same call with the same batch size. So
    each call first learns the group's batch sizes (a small all-gather) and pads this process's
    batch with zero images to the largest: Soft MoE mixes the tokens of one image only, so the
    padding changes no other image's output. Once a process has no batch left, `drain` answers the
    others' calls with padding until every process of the group is done.

    tower: has `forward_pooled`; input_shape: one image's (C, H, W); device: the tower's.
    """

    def __init__(self, tower: nn.Module, group: dist.ProcessGroup, input_shape: tuple[int, ...],
                 device: torch.device):
        self.tower, self.group, self.input_shape, self.device = tower, group, input_shape, device
        self.cfg = getattr(tower, "cfg", None)

    def _group_sizes(self, count: int) -> list[int]:
        """Every process's batch size in this call; -1 for a process that is done."""
        sizes = torch.empty(dist.get_world_size(self.group), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(sizes, torch.tensor([count], device=self.device),
                                    group=self.group)
        return sizes.tolist()

    def _padded_forward(self, images: torch.Tensor, largest: int) -> torch.Tensor:
        padding = images.new_zeros(largest - len(images), *images.shape[1:])
        return self.tower.forward_pooled(torch.cat([images, padding]))[:len(images)]

    def forward_pooled(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, H, W) → pooled features (B, width), as the tower alone computes them."""
        return self._padded_forward(images, max(self._group_sizes(len(images))))

    def drain(self) -> None:
        """Join the group's remaining calls (with padding only) until every process is done."""
        while (largest := max(self._group_sizes(-1))) >= 0:
            self._padded_forward(torch.empty(0, *self.input_shape, device=self.device), largest)
