"""Helpers shared by the benchmark scripts."""
from __future__ import annotations

import platform
import statistics
import time

import torch


def cpu_name() -> str:
    """The CPU's model name (for the table header of a CPU run)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step, device: torch.device, warmup: int, iters: int) -> tuple[float, float | None]:
    """Median milliseconds of `step()`, and peak CUDA MiB over the timed steps."""
    for _ in range(warmup):  # also triggers torch.compile's compilation
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return statistics.median(times), peak
