"""Expensive fixtures (trained tiny towers, shards, exports) built once per test run.

`make test` runs the suite on several pytest-xdist workers, and each worker is a session of its own: a
session- or module-scoped fixture would be built again by every worker whose tests ask for it (and again
within one worker when its tests of one module are not consecutive). `built_once` builds it in the run's
shared base folder instead, under a file lock: the first worker to ask builds it, the others wait for it
and read the same files (xdist's documented pattern). The fixtures built this way are only read by the
tests; a test that changes one copies it first, and `changed_builds` (checked when a worker ends) names any
that a test changed in place.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock

_AS_BUILT: dict[Path, str] = {}  # each shared folder this worker used: the listing it had then


def run_base_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base temporary folder of the whole run: the parent of a worker's own under xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder `name`, filled by `build(folder)` the first time any worker of this run asks for it.

    A build that failed (or whose worker died) leaves no `.done` mark: the next caller starts it afresh.
    """
    shared = run_base_folder(tmp_path_factory) / "shared"
    shared.mkdir(exist_ok=True)
    folder, done = shared / name, shared / f"{name}.done"
    with FileLock(shared / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
        _AS_BUILT.setdefault(folder, _listing(folder))
    return folder


def _listing(folder: Path) -> str:
    """Every file under `folder` by name, size and modification time, hashed."""
    files = sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in folder.rglob("*") if p.is_file())
    return hashlib.sha256(repr(files).encode()).hexdigest()


def changed_builds() -> list[Path]:
    """The shared folders whose files are no longer those they had when this worker first used them."""
    return [folder for folder, listing in _AS_BUILT.items() if folder.exists() and _listing(folder) != listing]
