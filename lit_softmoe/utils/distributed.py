"""This process's place in a distributed run, read in one place for every layer: the initialized
process group when there is one, else what the launcher set (`torchrun` and `accelerate launch` set
RANK, WORLD_SIZE and LOCAL_RANK), else a single process."""
from __future__ import annotations

import os
import sys

from lit_softmoe.errors import UserError


def in_process_group() -> bool:
    """Whether a process group is initialized: collectives (all_gather) need one, the launcher's
    variables alone are not enough. Without torch imported there is none (and `--help` stays fast)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def close_process_group() -> None:
    """Destroy a distributed launch's process group, if any, once its command ended well (PyTorch's
    distributed docs, "Shutdown"). Left to interpreter exit, Gloo's threads may abort a process after a
    finished run ("terminate called without an active exception", pytorch/pytorch#190489). Not after an
    error: the other processes may still wait in a collective (torchtitan destroys it on success only)."""
    if in_process_group():
        sys.modules["torch.distributed"].destroy_process_group()


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without a launcher. Not checked against each other:
    a caller may replace either (a config's `data.world_size`) and checks the pair it uses."""
    if in_process_group():
        dist = sys.modules["torch.distributed"]
        return dist.get_rank(), dist.get_world_size()
    return _launcher_int("RANK", 0), _launcher_int("WORLD_SIZE", 1)


def process_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size) of this process: each given, else the launcher's (`rank_and_world_size`);
    a rank outside [0, world size) is a UserError naming the variables."""
    launched_rank, launched_world_size = rank_and_world_size()
    world_size = world_size if world_size is not None else launched_world_size
    rank = rank if rank is not None else launched_rank
    if not 0 <= rank < world_size:
        raise UserError(f"rank {rank} is not in [0, world size {world_size}); check RANK and WORLD_SIZE")
    return rank, world_size


def local_rank() -> int:
    """This process's index on its machine (which GPU it takes); 0 without a launcher."""
    return _launcher_int("LOCAL_RANK", 0)


def is_main_process() -> bool:
    """True in one process of a run: the one that writes run folders and prints closing lines."""
    return rank_and_world_size()[0] == 0


def _launcher_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{name}={value!r} is not a whole number; unset it or fix the launcher's settings") from None
