"""lit_softmoe.utils.distributed: where every layer reads its rank, world size and local rank."""
from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from launch import python_command
from lit_softmoe.errors import UserError
from lit_softmoe.utils.distributed import (
    in_process_group,
    is_main_process,
    local_rank,
    process_rank,
    rank_and_world_size,
)


@pytest.fixture
def no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_without_a_launcher_one_process_of_one(no_launcher):
    assert rank_and_world_size() == (0, 1) and local_rank() == 0 and is_main_process()


def test_the_launchers_variables_are_read(no_launcher):
    no_launcher.setenv("RANK", "3")
    no_launcher.setenv("WORLD_SIZE", "8")
    no_launcher.setenv("LOCAL_RANK", "1")
    assert rank_and_world_size() == (3, 8) and local_rank() == 1 and not is_main_process()


def test_process_rank_takes_each_value_given_else_the_launchers_and_refuses_a_rank_outside(no_launcher):
    no_launcher.setenv("RANK", "1")
    no_launcher.setenv("WORLD_SIZE", "4")
    assert process_rank() == (1, 4) and process_rank(rank=3) == (3, 4) and process_rank(0, 1) == (0, 1)
    with pytest.raises(UserError, match=r"^rank 4 is not in \[0, world size 4\); check RANK and WORLD_SIZE$"):
        process_rank(rank=4)
    with pytest.raises(UserError, match=r"^rank 1 is not in \[0, world size 1\)"):
        process_rank(world_size=1)


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "LOCAL_RANK"])
def test_a_variable_that_is_not_a_number_is_one_line_naming_it(no_launcher, name):
    no_launcher.setenv(name, "two")
    with pytest.raises(UserError, match=f"^{name}='two' is not a whole number; unset it"):
        rank_and_world_size() if name != "LOCAL_RANK" else local_rank()


def test_an_initialized_process_group_wins_over_the_variables(no_launcher):
    # The group is what collectives run over: a stale RANK in the environment must not override it.
    no_launcher.setenv("RANK", "3")
    no_launcher.setenv("WORLD_SIZE", "8")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert in_process_group() and rank_and_world_size() == (0, 1) and is_main_process()
    finally:
        dist.destroy_process_group()
    assert not in_process_group() and rank_and_world_size() == (3, 8)


_CLOSING = """
import sys, time
import torch.distributed as dist
from lit_softmoe.utils.distributed import close_process_group
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=sys.argv[2], rank=rank, world_size=2)
if rank == 0:
    time.sleep(2.0)  # rank 0 evaluates and saves after the others are done
arrived = time.time()
close_process_group()
print(arrived, time.time(), dist.is_initialized())
"""


def test_processes_close_their_group_together(tmp_path):
    """A process that ended well does not tear its connections down while another still works: each leaves
    `close_process_group` only once every process has reached it, and the group is gone after."""
    import subprocess
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = [subprocess.Popen([*python_command(), "-c", _CLOSING, str(rank), f"tcp://127.0.0.1:{port}"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert all(process.returncode == 0 for process in processes), [err[-2000:] for _, err in outputs]
    (arrived_0, left_0, open_0), (arrived_1, left_1, open_1) = (out.split() for out, _ in outputs)
    assert float(left_1) >= float(arrived_0) and float(left_0) >= float(arrived_1)
    assert float(arrived_0) - float(arrived_1) > 1.0  # rank 1 did arrive first: it waited
    assert open_0 == open_1 == "False"
