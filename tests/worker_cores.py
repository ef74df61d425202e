"""pytest-xdist's workers share the machine's cores instead of each taking all of them."""
from __future__ import annotations

import os


def share_cores_among_workers() -> None:
    """Under pytest-xdist (`make test` runs `-n auto`), N workers share the cores: each one's torch, and every
    process a test starts (OMP_NUM_THREADS), gets cores // N threads, not a pool of all the cores each (N pools
    of all the cores would spin against each other)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch  # here: only a worker runs tests (pytest-xdist's controller loads this module too)

        torch.set_num_threads(threads)
