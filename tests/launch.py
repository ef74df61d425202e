"""How the tests launch several processes as a user does: torchrun, on a port of its own."""
from __future__ import annotations


def torchrun_args(nproc: int = 2) -> list[str]:
    """What follows `python` to start `nproc` processes under torchrun. `--standalone`: the launcher picks a free
    port for its rendezvous, so runs started at the same time (pytest-xdist's workers) never meet on one port."""
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
