"""Expert parallelism for Soft MoE: the experts split over a group of processes, the slots moved.

This is how the paper's code runs its large towers (google-research/vmoe: `vmoe/moe.py`'s
`_dispatch` and `_receive`, experts split along an `expert` mesh axis). With an expert group of E
processes, each holds n/E of every layer's n experts. The dispatch and the combine stay local (they
mix the tokens of one image, and each process has its own images); between them two all-to-alls
move the slots (`nn.expert_exchange`, which the layer runs).

`place_experts` turns every `BatchedExperts` of a model into its chunk: each weight becomes a
DTensor sharded on the expert axis (`Shard(0)` over the group's mesh), whose local tensor is the
process's n/E experts, so that PyTorch's distributed state-dict functions gather a full tower, and
FSDP2 composes with it on a 2-D mesh (`lit_softmoe.train.sharding`). `GroupLockstep` runs a split
tower where each process has batches of its own.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lit_softmoe.errors import UserError
from lit_softmoe.nn.soft_moe import BatchedExperts


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


def place_experts(model: nn.Module, expert_mesh: DeviceMesh, device=None) -> int:
    """Split every `BatchedExperts` of `model` over the processes of `expert_mesh` (1-D), in place:
    process j keeps experts j·n/E … (j+1)·n/E - 1 of each layer, as a DTensor `Shard(0)` on that
    mesh, and its forward exchanges the slots with the others (`expert_exchange`). A parameter
    on the meta device stays there (its chunk shaped, to be filled later, e.g. by FSDP's
    `broadcast_from_rank0`). `device`: where the chunks go (None: where the weights are), so that a
    tower read on the host puts only its chunk on the GPU. Returns the number of layers placed;
    raises ValueError when E does not divide a layer's experts."""
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
    for experts in model.modules():
        if isinstance(experts, BatchedExperts) and experts.expert_group is not None:
            return experts.w1.to_local().shape[0], experts.num_experts
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
