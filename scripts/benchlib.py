"""Helpers shared by the benchmark scripts."""
from __future__ import annotations

import platform


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
