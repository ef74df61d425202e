"""Sharded data parallelism (`sharding: fsdp`) for pretraining and LiT: PyTorch's FSDP2,
`fully_shard`.

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

LiT (`shard_lit_model`) shards what trains: the text tower's layers, the image tower's unlocked
blocks, and at the root the rest (embeddings, final norms, heads, the scale and bias). The locked
part of the image tower is left out (`ignored_params`): it has no gradients and no optimizer
moments, the states sharding divides, and whole on every GPU it runs with no all-gather at all (its
weights, in the dtype it runs in, are what the memory plan counts whole). The main process keeps a
plain copy of the model (`plain_copy`, sharing that locked tower) into which `gather_into` puts the
trained weights, for evaluation and the model folder.
"""
from __future__ import annotations

import copy
import functools
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lit_softmoe.errors import UserError
from lit_softmoe.models.lit import LiTModel
from lit_softmoe.models.tower_layers import modules_of, tower_layers
from lit_softmoe.models.vit import VisionTransformer
from lit_softmoe.nn.expert_parallel import split_experts
from lit_softmoe.nn.soft_moe import BatchedExperts
from lit_softmoe.utils.distributed import in_process_group
from lit_softmoe.utils.hashing import weights_sha256


def check_sharding(sharding: str, precision: str = "auto", command: str = "COMMAND",
                   expert_parallel: int = 1) -> None:
    """FSDP shards over the processes of a distributed launch: it needs the launch's process group,
    which accelerate forms under torchrun and `accelerate launch --multi_gpu`, for one process too.
    Decided by the group, not by the number of processes: `torchrun --nproc_per_node 1` is how a
    one-GPU machine runs the sharded path and writes sharded checkpoints (its one shard is the whole
    tower); a process started without a launcher has no group to shard over. `command`: the CLI
    command the launch lines name. fp16's loss scaler is applied by the optimizer accelerate
    prepares; a sharded tower's optimizer is not prepared. `expert_parallel` must come with fsdp and
    divide the processes."""
    if sharding == "fsdp" and precision == "fp16":
        raise UserError("sharding=fsdp runs in bf16 or fp32, not fp16 (its loss scaler is not "
                        "wired to sharded gradients); set precision=bf16 (GPUs of compute "
                        "capability 8.0 or more) or precision=fp32")
    if sharding == "fsdp" and not in_process_group():
        raise UserError("sharding=fsdp shards the tower over the processes of a distributed "
                        "launch, but this run was not launched as one; launch it with `torchrun "
                        f"--nproc_per_node N -m lit_softmoe.cli {command} ...` (N=1 included) or "
                        "`accelerate launch --multi_gpu --num_processes N -m lit_softmoe.cli "
                        f"{command} ...` (N of 2 or more), or set sharding=none")
    if expert_parallel > 1 and sharding != "fsdp":
        raise UserError(f"expert_parallel={expert_parallel} splits the experts inside FSDP's "
                        "sharded path (the other weights sharded over every process); set "
                        "sharding=fsdp too, or expert_parallel=1")
    check_expert_groups(expert_parallel, dist.get_world_size() if expert_parallel > 1 else 1)


def _scalars_as_vectors(module: nn.Module, keep: set[nn.Parameter] = frozenset()) -> None:
    """Hold each 0-d parameter (Soft MoE's `scale`, LiT's logit scale and bias) but those in `keep`
    as a (1,) one, in place: `fully_shard` shards dim 0 and refuses scalars. The forward broadcasts
    it to the same values; `gather_tower` and `gather_into` give it back its 0-d shape, so saved
    folders keep their format."""
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if param.ndim == 0 and param not in keep:
                setattr(owner, name, nn.Parameter(param.detach().reshape(1),
                                                  requires_grad=param.requires_grad))


def _mesh(device: torch.device):
    return init_device_mesh(device.type, (dist.get_world_size(),))


@functools.cache  # one mesh per run: the tower placed at its loading and FSDP must share it
def _expert_meshes(device: torch.device, expert_parallel: int) -> tuple[DeviceMesh, DeviceMesh,
                                                                         DeviceMesh]:
    """(every process, the expert group, the replicas) for expert parallel: a 2-D mesh
    (replicate R, expert E), R·E processes. Process r is in expert group r // E at place r % E:
    the groups are consecutive processes, so that the all-to-alls stay within a node when E
    divides its GPU count (vmoe's mesh puts the expert axis within a host too). The replicas hold
    the same experts (place r % E of every group)."""
    world = dist.get_world_size()
    # DTensor warns, at every gather of a tensor sharded on both axes (an expert chunk sharded over
    # its replicas), that it takes two all-gathers: expected here, and no concern of the user's.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh(device.type, (world // expert_parallel, expert_parallel),
                            mesh_dim_names=("replicate", "expert"))
    return mesh._flatten("world"), mesh["expert"], mesh["replicate"]


def check_expert_groups(expert_parallel: int, world_size: int) -> None:
    """An expert group is E processes of a launch: E must divide their number (one line if not)."""
    if world_size % expert_parallel:
        raise UserError(f"expert_parallel={expert_parallel} must divide the {world_size} processes "
                        "(each group of that many consecutive processes splits the experts); "
                        f"launch a multiple of {expert_parallel} processes or set another "
                        "expert_parallel")


def expert_group_mesh(device: torch.device, expert_parallel: int) -> DeviceMesh:
    """This process's expert group (a 1-D mesh) for a command that runs a tower: forms the launch's
    process group if the command has none (NCCL on GPUs, gloo on the CPU). `load_tower(...,
    expert_mesh=)` then reads only this process's chunk of the experts."""
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return _expert_meshes(device, expert_parallel)[1]


def _shard_blocks(blocks, mesh: DeviceMesh, replica_mesh: DeviceMesh | None) -> None:
    """One FSDP unit per block (a module, or a list of modules that are one) over `mesh`; with
    expert parallel, each block's expert chunks that train a unit of their own over `replica_mesh`,
    the processes that hold the same experts."""
    for block in blocks:
        if replica_mesh is not None:
            for part in block if isinstance(block, list) else [block]:
                for experts in part.modules():
                    if isinstance(experts, BatchedExperts) and experts.w1.requires_grad:
                        fully_shard(experts, mesh=replica_mesh)
        fully_shard(block, mesh=mesh)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for sharded parameters: the total norm of all gradients,
    each sharded one counted once (its pieces on every process), then every gradient scaled by
    max_norm / total where that is below 1. Under expert parallel the expert chunks live on another
    mesh than the other weights, which torch's own function cannot stack into one norm; the norm is
    then taken per mesh and the squares added."""
    by_mesh: dict = {}
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(param)
    norms = [torch.nn.utils.get_total_norm([param.grad for param in params])
             for params in by_mesh.values()]
    norms = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]
    total = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def shard_tower(tower: VisionTransformer, device: torch.device,
                expert_parallel: int = 1) -> VisionTransformer:
    """Shard `tower` in place over every process of the group (the sharded parameters are DTensors
    on `device`); build its optimizer after this, on the sharded parameters.

    The main process's tower holds the weights; the others' may be on the meta device (built without
    memory): each process's shards are then sent from the main process's weights (a broadcast,
    FSDP's `broadcast_from_rank0`), so no process but the main one ever holds the whole tower.

    `expert_parallel` E > 1: each group of E processes splits every MoE layer's experts
    (`place_experts`), and each chunk is sharded over the processes that hold it."""
    if expert_parallel > 1:
        mesh, expert_mesh, replica_mesh = _expert_meshes(device, expert_parallel)
    else:
        mesh, expert_mesh, replica_mesh = _mesh(device), None, None
    _scalars_as_vectors(tower)
    on_meta = [name for name, param in tower.named_parameters() if param.is_meta]
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(on_meta))
    if dist.get_rank() == 0 and on_meta:
        raise ValueError(f"the main process's tower must hold the weights, but {on_meta[0]} is on "
                         "the meta device")
    full = tower.state_dict() if any(flags) and dist.get_rank() == 0 else {}  # the weights to send
    if expert_mesh is not None:
        split_experts(tower, expert_mesh)
    _shard_blocks(tower.blocks, mesh, replica_mesh)
    fully_shard(tower, mesh=mesh)
    if any(flags):
        if on_meta:
            tower.to_empty(device=device)  # this process's shards, in memory, filled below
        set_model_state_dict(tower, full, options=StateDictOptions(full_state_dict=True,
                                                                   broadcast_from_rank0=True))
    return tower


def plain_copy(model: LiTModel) -> LiTModel:
    """A deep copy of `model` made before it is sharded, sharing its locked image parameters
    (nothing of a locked tower is copied): what `gather_into` fills with the trained weights."""
    shared = [*model.locked_image_parameters().values(),
              *(experts.expert_group for experts in model.modules()  # a group is not copied
                if isinstance(experts, BatchedExperts) and experts.expert_group is not None)]
    return copy.deepcopy(model, memo={id(item): item for item in shared})


def shard_lit_model(model: LiTModel, device: torch.device, expert_parallel: int = 1,
                    keep_plain: bool = False) -> LiTModel | None:
    """Shard what trains in `model` in place over every process of the group: one unit per text
    layer and per unlocked image block, the root for the rest; the locked image parameters stay
    whole. The model is moved to `device` first. Build the optimizer after this, on the sharded
    parameters. Returns, with `keep_plain` (the main process), the plain copy that `gather_into`
    fills (`plain_copy`), made before the model is sharded.

    `expert_parallel` E > 1: first each group of E processes splits the image tower's experts
    (`place_experts`), locked ones included: a locked expert chunk stays whole on its process, a
    trained one is sharded over the processes that hold it. The image tower then runs only with
    every process of its group (`expert_features`); the plain copy shares the locked chunks, so
    the main process never holds the whole locked tower, and holds the trained experts whole."""
    replica_mesh = None
    if expert_parallel > 1:
        mesh, expert_mesh, replica_mesh = _expert_meshes(device, expert_parallel)
        # placed already where `load_tower` read only this process's chunks (`train`)
        split_experts(model.image_tower, expert_mesh, device)
    else:
        mesh = _mesh(device)
    model.to(device)
    plain = plain_copy(model) if keep_plain else None
    if plain is not None and expert_parallel > 1:
        _whole_trained_experts(plain)
    locked = set(model.locked_image_parameters().values())  # whole on every process, never sharded
    _scalars_as_vectors(model, keep=locked)
    units = list(model.text_tower.blocks())
    # each unlocked block by the tower's own layer numbering: its modules, one unit
    if model.unlocked_blocks:
        layers = tower_layers(model.image_tower)
        units += [modules_of(model.image_tower, layers.block_parameters(i))
                  for i in range(-model.unlocked_blocks, 0)]
    _shard_blocks(units, mesh, replica_mesh)
    fully_shard(model, mesh=mesh, ignored_params=locked or None)
    return plain


def _whole_trained_experts(plain: LiTModel) -> None:
    """The plain copy's trained expert chunks (copies of the placed model's) become whole, unsplit
    weights for `gather_into` to fill; its locked chunks stay shared with the model."""
    for experts in plain.image_tower.modules():
        if isinstance(experts, BatchedExperts) and experts.expert_group is not None \
                and experts.w1.requires_grad:
            for name, param in list(experts.named_parameters(recurse=False)):
                setattr(experts, name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype,
                                                                device=param.device)))
            experts.expert_group = None


@torch.no_grad()  # not inference_mode: FSDP's buffers filled here are written in training
def expert_features(model: LiTModel, pixels: torch.Tensor) -> torch.Tensor:
    """Collective: the sharded `model`'s image tower's pooled features of `pixels` (every process of
    an expert group must call it with the same batch). Its root's sharded weights (the trained
    norms, the head) are gathered for the call, as the model's own forward would."""
    model.unshard()
    try:
        return model.image_tower.forward_pooled(pixels)
    finally:
        model.reshard()


def local_weights_sha256(params: dict[str, torch.Tensor]) -> str:
    """The identity of this process's pieces of `params` (DTensors by their local tensors): under
    expert parallel a process holds its locked chunks, which it checks did not change."""
    return weights_sha256({name: param.to_local() if isinstance(param, DTensor) else param
                           for name, param in params.items()})


def gather_into(plain: nn.Module | None, model: nn.Module,
                frozen: bool = False) -> nn.Module | None:
    """Collective (every process calls it): the main process's `plain` copy (`plain_copy`) gets the
    sharded `model`'s current weights and is returned; the others pass and get None. Frozen
    parameters are gathered only with `frozen`: they never change, and the copy holds them
    (or shares them) already, but a check that they did not change needs the model's own."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                               ignore_frozen_params=not frozen)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() != 0:
        return None
    current = plain.state_dict()
    with torch.no_grad():
        for name, value in state.items():
            current[name].copy_(value.reshape(current[name].shape))
    return plain


def gather_tower(tower: VisionTransformer, device: torch.device) -> VisionTransformer | None:
    """Collective (every process calls it): the main process gets a plain, unsharded copy of `tower`
    with its full weights on `device`; the others get None. The sharded tower's forward would
    all-gather from every process, so what the main process runs alone
    (evaluation, the tower folder) runs on the copy."""
    state = get_model_state_dict(tower, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    plain = VisionTransformer(tower.cfg, device="meta", global_pool=tower.global_pool)
    shapes = {name: value.shape for name, value in plain.state_dict().items()}
    plain.load_state_dict({name: value.reshape(shapes[name]) for name, value in state.items()},
                          assign=True)
    return plain.to(device).train(tower.training)
