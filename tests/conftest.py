"""Shared test set-up."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Benchmark scripts run in-process set torch's thread count; restore it after every test.

    Otherwise a later test comparing an in-process run with a subprocess run (the exact-resume tests)
    would compare 1-thread with 2-thread reductions: equal to the last bit only by luck.
    """
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
