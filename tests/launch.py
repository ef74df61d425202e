"""How the tests launch several processes as a user does: torchrun, on a port of its own."""
from __future__ import annotations


def torchrun_args(nproc: int = 2) -> list[str]:
    """What follows `python` to start `nproc` processes under torchrun. `--standalone`: the launcher picks a free
    port for its rendezvous, so runs started at the same time (pytest-xdist's workers) never meet on one port."""
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it): a rendezvous port of a test's own, so
    that tests run at the same time (pytest-xdist's workers) never meet on one."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_node_args(node_rank: int, port: int, nnodes: int = 2, nproc: int = 1) -> list[str]:
    """What follows `python` to start node `node_rank` of `nnodes` nodes of `nproc` processes each, as the runbook
    starts them (docs/training.md, "Several nodes"): torchrun's static rendezvous at the master's address and port,
    here 127.0.0.1, every simulated node on this machine."""
    return ["-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
            f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}"]
