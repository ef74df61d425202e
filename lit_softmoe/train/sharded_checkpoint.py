"""A sharded training state on disk (`sharding: fsdp`): every process writes its own shards.

    RUN/checkpoints/step_00000500/
        state.rank0-of-2.safetensors   process 0's pieces: model.<name>, optim.<name>.<moment>,
                                       rng.cpu, rng.cuda
        state.rank1-of-2.safetensors   process 1's
        state.json                     as an unsharded checkpoint's (the step, the optimizer's
                                       groups, what the recipe adds), plus "processes"

Frozen parameters (LiT's locked image tower) are left out, as an unsharded checkpoint leaves them
out: no step changes them, and the run rebuilds them from where they came from (the tower folder,
whose weights identity the run checks on resume).

The tensors are each process's local pieces of the sharded parameters and AdamW moments, named as
PyTorch's distributed state-dict API names them (`get_model_state_dict`, `get_optimizer_state_dict`:
by parameter name) and put back through it (`set_state_dict`). Safetensors and JSON, nothing
pickled, as `checkpoint`'s unsharded state. torch.distributed.checkpoint's own files (`dcp.save`)
were not taken: their `.metadata` index is a pickle and non-tensor values (the optimizer's groups)
are torch.save'd; and what they add, loading onto another number of processes, would not resume the
same run (batches, augmentation and mixup draws depend on the process and their number). A
checkpoint of N processes resumes on N; another number is refused in one line.

The guarantees are the unsharded checkpoint's. Atomic: the main process makes the temporary folder
(`write_folder_atomically`) and names it to the others; each writes its file there; once every file
is written the main process adds state.json and renames the folder into place. A process that fails
to write ends the run (the launcher stops the others) before the rename, so no checkpoint under a
final name lacks a file. Verified before resume: every process reads its own file whole, and all of
them learn every process's verdict before anything is restored, so they pass over a damaged
checkpoint together and resume from the same step. The folders must be on a filesystem every process
sees, as for the unsharded checkpoints (which every process reads).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from lit_softmoe.errors import UserError
from lit_softmoe.model_folders import (
    STATE_META,
    DamagedCheckpoint,
    load_step_tensors,
    read_state_meta,
    save_step_tensors,
)
from lit_softmoe.utils.atomic import write_folder_atomically
from lit_softmoe.utils.folder_identity import FOLDER_ID, new_folder_id

_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)


def shard_file(rank: int, world_size: int) -> str:
    return f"state.rank{rank}-of-{world_size}.safetensors"


def _local(value: torch.Tensor) -> torch.Tensor:
    """This process's piece of a sharded tensor; a replicated one (AdamW's step count) whole."""
    value = value.to_local() if isinstance(value, DTensor) else torch.as_tensor(value)
    # safetensors refuses shared or strided storage
    return value.detach().contiguous().cpu().clone()


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """{"model.<name>": tensor, "optim.<name>.<moment>": tensor} as DTensors and step counts, and
    the optimizer's groups (parameters by name); frozen parameters left out. On a fresh optimizer
    the API first makes the moments (a step at lr 0)."""
    model_state = get_model_state_dict(model, options=_TRAINED_ONLY)
    optim_state = get_optimizer_state_dict(model, optimizer)
    tensors = {f"model.{name}": value for name, value in model_state.items()}
    for name, moments in optim_state["state"].items():
        tensors.update({f"optim.{name}.{moment}": value for moment, value in moments.items()})
    return tensors, optim_state["param_groups"]


def save_sharded_state(ckpt_dir: str | Path, step: int, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer, meta: dict | None = None) -> Path:
    """Collective (every process calls it): the sharded model, its AdamW moments and each process's
    RNG at `step`, written atomically into `ckpt_dir`."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sharded, param_groups = _sharded_state(model, optimizer)
    tensors = {name: _local(value) for name, value in sharded.items()}
    # Each process's own generators: the sparse routers' noise is drawn from them.
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    info = {"step": step, "processes": world_size, "param_groups": param_groups, **(meta or {})}

    def write_own(folder: Path, folder_id: str) -> None:
        info[FOLDER_ID] = folder_id  # every process's file carries the one id of the checkpoint
        save_step_tensors(tensors, folder / shard_file(rank, world_size), info, rank=rank)
        dist.barrier()  # every process's file is written

    if rank == 0:
        def write(tmp: Path) -> None:
            folder_id = new_folder_id()
            dist.broadcast_object_list([str(tmp), folder_id], src=0)
            write_own(tmp, folder_id)
            (tmp / STATE_META).write_text(json.dumps(info, indent=2) + "\n")

        # The run owns its checkpoints' names: a link there is replaced, never followed.
        write_folder_atomically(ckpt_dir, write, through_link=False)
    else:
        named = [None, None]
        dist.broadcast_object_list(named, src=0)
        write_own(Path(named[0]), named[1])
    # the folder has its final name before any process goes on (or prunes the old ones)
    dist.barrier()
    return Path(ckpt_dir)


def _like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as the piece of a tensor sharded as `template` is."""
    if isinstance(template, DTensor):
        return DTensor.from_local(local.to(template.device), template.device_mesh,
                                  template.placements, run_check=False, shape=template.shape,
                                  stride=template.stride())
    return local.to(template.device)


def _read_own(ckpt_dir: Path, model, optimizer) -> tuple[dict, dict, dict, dict]:
    """(state.json, the model's sharded state, the optimizer's, the file's tensors) from this
    process's file, checked whole before anything is restored; DamagedCheckpoint or UserError says
    what is wrong."""
    info = read_state_meta(ckpt_dir)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if info.get("processes") != world_size:
        raise UserError(f"{ckpt_dir} was written by {info.get('processes')} processes and this run "
                        f"has {world_size}; resume it with {info.get('processes')} (each process's "
                        "batches depend on their number), or start a new run_dir")
    tensors = load_step_tensors(ckpt_dir / shard_file(rank, world_size), info, rank=rank)
    if "rng.cpu" not in tensors:
        raise DamagedCheckpoint(f"{shard_file(rank, world_size)} holds no random number generator "
                                "state")
    templates, _ = _sharded_state(model, optimizer)
    wrong = sorted(set(templates) ^ (set(tensors) - {"rng.cpu", "rng.cuda"})) + [
        f"{name} {tuple(tensors[name].shape)} vs {tuple(_local(value).shape)}"
        for name, value in templates.items()
        if name in tensors and tensors[name].shape != _local(value).shape]
    if wrong:
        raise UserError(f"{ckpt_dir} holds the training state of another model "
                        f"({', '.join(wrong[:3])}"
                        f"{f' and {len(wrong) - 3} more' if len(wrong) > 3 else ''}); resume with "
                        "the run's own settings, or start a new run_dir")
    restored = {name: _like(template, tensors[name]) for name, template in templates.items()}
    model_state = {name[len("model."):]: value for name, value in restored.items()
                   if name.startswith("model.")}
    optim_state: dict[str, dict] = {}
    for name, value in restored.items():
        if name.startswith("optim."):
            param, moment = name[len("optim."):].rsplit(".", 1)
            optim_state.setdefault(param, {})[moment] = value
    return info, model_state, {"state": optim_state, "param_groups": info["param_groups"]}, tensors


def load_sharded_state(ckpt_dir: str | Path, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer,
                       skip_prefixes: tuple[str, ...] = ()) -> dict:
    """Collective: restore what `save_sharded_state` wrote; returns its state.json (with "step"). A
    checkpoint damaged on any process raises DamagedCheckpoint on every process before anything is
    restored (`runtime.resume_state` then tries the one before, on all of them). `skip_prefixes`,
    the parts an unsharded checkpoint leaves out, must name frozen parameters only: a sharded one
    leaves every frozen parameter out."""
    trained = [name for name, param in model.named_parameters()
               if skip_prefixes and param.requires_grad and name.startswith(skip_prefixes)]
    if trained:
        raise ValueError(f"skip_prefixes {skip_prefixes} name trained parameters ({trained[0]}, "
                         "...), which a sharded checkpoint holds")
    ckpt_dir = Path(ckpt_dir)
    try:
        info, model_state, optim_state, tensors = _read_own(ckpt_dir, model, optimizer)
        problem = None
    except (DamagedCheckpoint, UserError) as err:
        problem = err
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)  # one verdict for all
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise first
    # Not strict: the frozen parameters are missing on purpose (`_read_own` checked every other
    # name).
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return info
