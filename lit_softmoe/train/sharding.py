"""Sharded data parallelism for pretraining (`sharding: fsdp`): PyTorch's FSDP2, `fully_shard`.

With N processes each one holds 1/N of every parameter, of its gradient and of its AdamW moments.
A block's full weights exist only while it runs: FSDP all-gathers them before its forward and again
before its backward, then reduce-scatters (averages) its gradients. The arithmetic is DDP's, so a
sharded run follows the unsharded curve (tests/train/test_sharding.py holds it to 1e-4).

The units are torchtitan's (`apply_fsdp`): one per transformer block, then the root, which gathers
what is left (patch and position embeddings, final norm, head) and keeps it gathered from its
forward to its backward. `fully_shard` is called directly, not through accelerate's FSDP plugin:
accelerate switches FSDP on for GPU process groups only (a CPU gloo group stays `MULTI_CPU`, so
no CPU test could run it), and it picks units by Hugging Face conventions (`_no_split_modules`, the
input and output embeddings) that a ViT tower does not follow. Accelerate still forms the process
group and runs autocast; the sharded tower is not passed to `accelerator.prepare` (DDP would wrap
it again).

The parameters stay float32 and autocast casts the gathered weights, as in an unsharded run (FSDP's
`MixedPrecisionPolicy` would gather bf16 copies: half the traffic, another rounding).
`sharded_checkpoint` saves and restores the sharded state; `gather_tower` gives the main process a
plain tower with the full weights, for evaluation and the tower folder.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lit_softmoe.errors import UserError
from lit_softmoe.models.vit import VisionTransformer


def check_sharding(sharding: str, num_processes: int, precision: str = "auto") -> None:
    """FSDP shards over the processes of a distributed launch: on one process there is nothing to shard.
    fp16's loss scaler is applied by the optimizer accelerate prepares; a sharded tower's optimizer is not prepared."""
    if sharding == "fsdp" and precision == "fp16":
        raise UserError("sharding=fsdp runs in bf16 or fp32, not fp16 (its loss scaler is not wired to sharded "
                        "gradients); set precision=bf16 (GPUs of compute capability 8.0 or more) or precision=fp32")
    if sharding == "fsdp" and num_processes < 2:
        raise UserError("sharding=fsdp shards the tower over the processes of a distributed launch, but this run is "
                        "one process; launch it with `accelerate launch --num_processes N -m lit_softmoe.cli pretrain "
                        "...` or `torchrun --nproc_per_node N -m lit_softmoe.cli pretrain ...`, or set sharding=none")


def _scalars_as_vectors(module: nn.Module) -> None:
    """Hold each 0-d parameter (Soft MoE's `scale`) as a (1,) one, in place: `fully_shard` shards dim 0
    and refuses scalars. The forward broadcasts it to the same values; `gather_tower` gives it back its
    0-d shape, so tower folders keep their format."""
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if param.ndim == 0:
                setattr(owner, name, nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))


def shard_tower(tower: VisionTransformer, device: torch.device) -> VisionTransformer:
    """Shard `tower` in place over every process of the group (the sharded parameters are DTensors on
    `device`); build its optimizer after this, on the sharded parameters."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    _scalars_as_vectors(tower)
    for block in tower.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(tower, mesh=mesh)
    return tower


def gather_tower(tower: VisionTransformer, device: torch.device) -> VisionTransformer | None:
    """Collective (every process calls it): the main process gets a plain, unsharded copy of `tower` with
    its full weights on `device`; the others get None. The sharded tower's forward would all-gather from
    every process, so what the main process runs alone (evaluation, the tower folder) runs on the copy."""
    state = get_model_state_dict(tower, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    plain = VisionTransformer(tower.cfg, device="meta", global_pool=tower.global_pool)
    shapes = {name: value.shape for name, value in plain.state_dict().items()}
    plain.load_state_dict({name: value.reshape(shapes[name]) for name, value in state.items()}, assign=True)
    return plain.to(device).train(tower.training)
