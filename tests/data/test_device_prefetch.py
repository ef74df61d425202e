"""lit_softmoe.data.device_prefetch: batches prepared by a thread ahead of the loop, in order; the thread's
errors raised in the loop; a loop that stops early stops the thread. On the CPU device here (no streams);
tests/test_cuda.py's embed tests run it on a GPU."""
from __future__ import annotations

import threading

import pytest
import torch

from lit_softmoe.data.device_prefetch import DevicePrefetcher

CPU = torch.device("cpu")


def test_batches_come_in_order_each_prepared_once_and_ahead_of_the_loop():
    prepared = []

    def to_device(number):
        prepared.append(number)
        return {"number": number}, torch.full((2,), number)

    seen = []
    for payload, tensor in DevicePrefetcher(range(20), to_device, CPU, depth=3):
        assert torch.equal(tensor, torch.full((2,), payload["number"]))
        seen.append(payload["number"])
    assert seen == list(range(20)) and prepared == list(range(20))


def test_an_error_while_preparing_is_raised_in_the_loop_after_the_batches_before_it():
    def to_device(number):
        if number == 3:
            raise OSError("shard 3 is unreadable")
        return number, None

    seen = []
    with pytest.raises(OSError, match="shard 3 is unreadable"):
        for payload, _ in DevicePrefetcher(range(10), to_device, CPU):
            seen.append(payload)
    assert seen == [0, 1, 2]


def test_a_loop_that_stops_early_stops_the_thread_and_closes_the_source():
    closed = threading.Event()

    def endless():
        try:
            number = 0
            while True:
                yield number
                number += 1
        finally:
            closed.set()

    before = threading.active_count()
    for payload, _ in DevicePrefetcher(endless(), lambda number: (number, None), CPU, depth=2):
        if payload == 5:
            break
    assert threading.active_count() == before  # the prefetch thread has ended
    del payload
    import gc
    gc.collect()
    assert closed.is_set()  # the generator the thread was reading is closed, not left suspended
