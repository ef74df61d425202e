"""Batches put on the device ahead of the loop that uses them, by a thread of their own.

A loop that runs a locked tower spends host time on each batch before the tower can start on it:
copying pixels to the device, and with `gpu_jpeg` decoding and resizing JPEGs there, a few kernels
per image launched from Python. Done in the loop, that time adds to the tower's. `DevicePrefetcher`
does it in a thread, `depth` batches ahead, while the loop launches the tower on the batch before:
on a GPU, PyTorch releases the GIL in each kernel launch and copy, so the two threads interleave.

Streams: the thread works on a CUDA stream of its own (copies and decodes there do not queue behind
the tower). The loop's stream waits for each batch's event before using it, and the batch's tensors
are marked as used on the loop's stream, so the caching allocator does not hand their memory to the
thread's next batch while the tower still reads it.

`ToHost` is the way back: a batch's results copied to the host without waiting for them.
"""
from __future__ import annotations

import queue
import threading
from contextlib import nullcontext
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch


class DevicePrefetcher:
    """Iterates `to_device(batch)` for each batch of `batches`, computed in a thread up to `depth`
    batches ahead. `to_device` returns (anything, tensor on `device` or None); the tensor is what
    the consumer's stream must wait for. Order is kept; an exception in the thread is raised in the
    consumer; a consumer that stops early (an exception, a break) stops the thread."""

    def __init__(self, batches: Iterable,
                 to_device: Callable[[Any], tuple[Any, torch.Tensor | None]],
                 device: torch.device, depth: int = 2):
        self.batches, self.to_device, self.device, self.depth = batches, to_device, device, depth

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor | None]]:
        on_cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if on_cuda else None
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def offer(item) -> bool:
            """Put `item` once there is room; False when the consumer has gone."""
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                with torch.cuda.stream(stream) if on_cuda else nullcontext():
                    for batch in self.batches:
                        payload, tensor = self.to_device(batch)
                        event = None
                        if on_cuda:
                            event = torch.cuda.Event()
                            event.record(stream)
                        if not offer((payload, tensor, event)):
                            return
            except BaseException as error:  # noqa: BLE001 — handed to the consumer, which raises it
                offer(_Failed(error))
                return
            offer(_DONE)

        thread = threading.Thread(target=produce, name="device-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is _DONE:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                payload, tensor, event = item
                if event is not None:
                    consumer = torch.cuda.current_stream(self.device)
                    consumer.wait_event(event)
                    if tensor is not None:
                        tensor.record_stream(consumer)
                yield payload, tensor
        finally:
            stop.set()
            thread.join()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_DONE = object()


class ToHost:
    """A batch's features on their way to the host, with the batch's keys, captions and classes.

    On a GPU the copy is asynchronous (into pinned memory, then a CUDA event), so the loop queues
    the next batch on the GPU before it waits for this one: the GPU computes while the host writes
    samples and shards, instead of each waiting for the other as with a `.cpu()` after every batch.
    """

    def __init__(self, batch: dict, features: torch.Tensor):
        self.batch = batch
        self.features = features.to("cpu", non_blocking=True)  # pinned memory when from a GPU
        self.event = None
        if features.is_cuda:
            self.event = torch.cuda.Event()
            # On the features' GPU, where the copy was queued: not the current device (cuda:0 unless
            # set), which LOCAL_RANK's GPU need not be.
            self.event.record(torch.cuda.current_stream(features.device))

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.features.numpy()
