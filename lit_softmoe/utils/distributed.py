"""This process's place in a distributed run, read in one place for every layer: the initialized
process group when there is one, else what the launcher set (`torchrun` and `accelerate launch` set
RANK, WORLD_SIZE and LOCAL_RANK), else a single process."""
from __future__ import annotations

import os
import sys
import time

from lit_softmoe.errors import UserError


def in_process_group() -> bool:
    """Whether a process group is initialized: collectives (all_gather) need one,
    the launcher's variables alone are not enough. Without torch imported there is none
    (and `--help` stays fast)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def close_process_group() -> None:
    """Destroy a distributed launch's process group, if any, once its command ended well (PyTorch's
    distributed docs, "Shutdown"). Left to interpreter exit, Gloo's threads may abort a process
    after a finished run ("terminate called without an active exception", pytorch/pytorch#190489).
    Every process waits for the others first, as PyTorch's own distributed tests barrier before
    destroying: rank 0 still evaluates and saves after the others are done, and a process tearing
    its connections down while a peer still held them was seen to abort. The wait counts arrivals
    in the launch's store rather than running a collective barrier, which would time out (and, on
    NCCL, abort) when rank 0's final evaluation outlasts the group's timeout. Not after an error:
    the others may still wait in a collective (torchtitan destroys the group on success only);
    the launcher stops them."""
    if not in_process_group():
        return
    dist = sys.modules["torch.distributed"]
    store, rank, world_size = (dist.distributed_c10d._get_default_store(), dist.get_rank(),
                               dist.get_world_size())
    store.add(_ARRIVED, 1)
    _wait_for_count(store, _ARRIVED, world_size)
    # Rank 0 leaves last: without a launcher's own store (torchrun hosts one), the store
    # lives in rank 0.
    if rank == 0:
        _wait_for_count(store, _LEFT, world_size - 1)
    else:
        store.add(_LEFT, 1)
    dist.destroy_process_group()


def _wait_for_count(store, key: str, count: int) -> None:
    while store.add(key, 0) < count:  # add 0: a read of the count that never blocks
        time.sleep(0.05)


# processes that reached, left `close_process_group`
_ARRIVED, _LEFT = "lit_softmoe/closing", "lit_softmoe/closed"


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without a launcher. Not checked against
    each other: a caller may replace either (a config's `data.world_size`) and checks the
    pair it uses."""
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
        raise UserError(f"rank {rank} is not in [0, world size {world_size}); "
                        "check RANK and WORLD_SIZE")
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
        raise UserError(f"{name}={value!r} is not a whole number; "
                        "unset it or fix the launcher's settings") from None
