"""The installed version of a distribution, from its metadata (a module's own `__version__` is not
always kept up to date: clip-benchmark 1.6.2 says 0.1.0), for the records and cache keys that name
versions."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def distribution_version(name: str) -> str:
    """`name`'s installed version (e.g. "clip-benchmark"); "unknown" where it is not installed."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"
