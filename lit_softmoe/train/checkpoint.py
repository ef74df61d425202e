"""Training state on disk: model weights, optimizer moments and RNG at a step, enough to resume
exactly.

    RUN/checkpoints/step_00000500/
        state.safetensors   model.* (frozen parts left out), optim.<param id>.<moment>, rng.cpu,
                            rng.cuda.<i>
        state.json          the step, the optimizer's param groups and the names behind their
                            parameters, plus what the recipe adds (data counts, training
                            seconds, ...)

Safetensors for every tensor, JSON for everything else, nothing pickled. Each checkpoint is written
into a temporary sibling folder and renamed into place, so a run killed mid-write never leaves a
half-written checkpoint under the final name. (The image tower's own folder format is
`lit_softmoe.models.tower_folder`.)
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from lit_softmoe.errors import UserError
from lit_softmoe.model_folders import (
    # the checkpoint folder's format: read by eval and export too
    STATE_META,
    STATE_TENSORS,
    DamagedCheckpoint,
    checkpoint_order,
    read_checkpoint_tensors,
    require_keys,
    save_step_tensors,
)
from lit_softmoe.models.tower_folder import check_state_dict, contiguous_state
from lit_softmoe.utils.atomic import write_folder_atomically
from lit_softmoe.utils.folder_identity import FOLDER_ID, new_folder_id


def save_training_state(ckpt_dir: str | Path, step: int, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, meta: dict | None = None,
                        skip_prefixes: tuple[str, ...] = ()) -> Path:
    """Model weights, optimizer moments and RNG at `step`, written atomically.

    `skip_prefixes` leaves out frozen parts (a locked image tower) that the run never changes.
    """
    tensors = {f"model.{k}": v for k, v in contiguous_state(model, skip_prefixes).items()}
    opt_state = optimizer.state_dict()
    for param_id, param_state in opt_state["state"].items():
        for name, value in param_state.items():
            tensors[f"optim.{param_id}.{name}"] = (torch.as_tensor(value).detach().contiguous()
                                                   .clone())
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, rng in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = rng
    # The names behind the optimizer's numbered parameters: a resume maps the moments by name, so a
    # parameter frozen since (or a model whose parameter order changed) still finds its own.
    info = {"step": step, FOLDER_ID: new_folder_id(), "param_groups": opt_state["param_groups"],
            "param_names": _optimizer_param_names(model, optimizer), **(meta or {})}

    def write(tmp: Path):
        save_step_tensors({k: v.cpu() for k, v in tensors.items()}, tmp / STATE_TENSORS, info)
        (tmp / STATE_META).write_text(json.dumps(info, indent=2) + "\n")

    # The run owns its checkpoints' names: a link there (even one that loops) is replaced, never
    # followed.
    return write_folder_atomically(ckpt_dir, write, through_link=False)


def read_training_state(ckpt_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(state.json, the tensors) of a checkpoint folder, read whole; DamagedCheckpoint says what is
    wrong."""
    info, tensors = read_checkpoint_tensors(ckpt_dir)
    if "rng.cpu" not in tensors:
        raise DamagedCheckpoint(f"{STATE_TENSORS} holds no random number generator state")
    return info, tensors


def load_training_state(ckpt_dir: str | Path, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer,
                        skip_prefixes: tuple[str, ...] = ()) -> dict:
    """Restore what `save_training_state` wrote; returns its JSON metadata (with "step").
    A damaged checkpoint raises DamagedCheckpoint before anything is restored."""
    ckpt_dir = Path(ckpt_dir)
    info, tensors = read_training_state(ckpt_dir)
    model_state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    check_state_dict(model, model_state, str(ckpt_dir), skip_prefixes)
    model.load_state_dict(model_state, strict=not skip_prefixes)
    opt_state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, param_id, name = key.split(".", 2)
            opt_state.setdefault(int(param_id), {})[name] = value
    optimizer.load_state_dict(_optimizer_state_by_name(ckpt_dir, info, opt_state, model, optimizer))
    torch.set_rng_state(tensors["rng.cpu"])
    cuda_states = [tensors[f"rng.cuda.{i}"] for i in range(torch.cuda.device_count())
                   if f"rng.cuda.{i}" in tensors]
    if cuda_states and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
    return info


def _optimizer_param_names(model: torch.nn.Module,
                           optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = {id(param): name for name, param in model.named_parameters()}
    return [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]


# An optimizer group's keys that say how it runs, not what it computes: a resume keeps the new
# optimizer's.
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


def _optimizer_state_by_name(ckpt_dir: Path, info: dict, opt_state: dict[int, dict],
                             model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The checkpoint's optimizer state renumbered for `optimizer`, matching parameters by name.

    Moments of parameters the model does not train are dropped (a frozen parameter never gets a
    gradient). A trained parameter the checkpoint lacks means another model: refused."""
    now = _optimizer_param_names(model, optimizer)
    saved_groups = info["param_groups"]
    saved = require_keys(info, ("param_names",), ckpt_dir / STATE_META,
                         "its optimizer state cannot be matched to the parameters by name; start "
                         "this run with another run_dir=...")["param_names"]
    if len(saved_groups) != len(now) or \
            [len(g["params"]) for g in saved_groups] != [len(names) for names in saved]:
        raise UserError(f"{ckpt_dir} holds the optimizer of another model "
                        f"({sum(len(g['params']) for g in saved_groups)} trained tensors, this one "
                        f"trains {sum(map(len, now))}); resume with the run's own settings, or "
                        "start a new run_dir")
    saved_ids = {name: param_id for group, names in zip(saved_groups, saved)
                 for param_id, name in zip(group["params"], names)}
    missing = [name for names in now for name in names if name not in saved_ids]
    if missing:
        raise UserError(f"{ckpt_dir} has no optimizer state for {missing[0]}"
                        f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}, "
                        "which this model trains; resume with the run's own settings, or start a "
                        "new run_dir")
    state, groups, next_id = {}, [], 0
    for saved_group, names, group in zip(saved_groups, now, optimizer.param_groups):
        ids = list(range(next_id, next_id + len(names)))
        next_id += len(names)
        for param_id, name in zip(ids, names):
            if saved_ids[name] in opt_state:
                state[param_id] = opt_state[saved_ids[name]]
        # The saved hyperparameters, but this optimizer's implementation (fused, foreach): how it
        # runs here.
        implementation = {key: group[key] for key in _IMPLEMENTATION if key in group}
        groups.append({**saved_group, **implementation, "params": ids})
    return {"state": state, "param_groups": groups}


def prune_checkpoints(checkpoints_dir: str | Path, keep: int) -> None:
    # A link at a step's name is not one of the `keep` (the next save there replaces it).
    done = sorted((p for p in Path(checkpoints_dir).glob("step_*") if not p.is_symlink()),
                  key=checkpoint_order)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
