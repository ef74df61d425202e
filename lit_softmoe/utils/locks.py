"""One writer per folder: an advisory lock held while a command writes a dataset or a run folder.

The lock is `flock` on FOLDER/.lit-softmoe.lock, which holds the holder's pid for messages. The
kernel releases it when its process exits, killed or not, so a crashed run never leaves a stale
lock behind. Systems without `fcntl` (Windows) run without it.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator

from lit_softmoe.errors import UserError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK_FILE = ".lit-softmoe.lock"
logger = logging.getLogger(__name__)
_held: set = set()  # the open lock files of this process


def _close_in_child() -> None:
    """A forked child (a DataLoader worker) closes its copies of the held lock files: a flock lasts
    while any copy is open, so a run killed with SIGKILL otherwise stayed locked until its orphaned
    workers noticed (seconds later), refusing the rerun meanwhile. Closing a copy leaves the
    parent's lock in place."""
    for handle in list(_held):
        handle.close()
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def _holder(lock_path: Path) -> str:
    try:
        pid = lock_path.read_text().strip()
    except OSError:
        pid = ""
    return f"process {pid}" if pid else "another process"


def _is_current(handle, lock_path: Path) -> bool:
    """Whether the file locked through `handle` is still the one at `lock_path`: a holder that
    removed its lock file on the way out (a run folder it created and leaves empty) may have done so
    between our open and our lock, and a lock on the removed file excludes nobody."""
    try:
        return os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def folder_lock(folder: str | Path, refuse: str | None = None) -> Iterator[None]:
    """Hold the lock of `folder` (created if missing) for the block.

    When another process holds it: with `refuse` (the fix to name), raise UserError at once;
    without, say so and wait for it (writers of one dataset folder then run one after the other,
    each seeing what the one before wrote).
    """
    folder = Path(folder)
    if fcntl is None:
        folder.mkdir(parents=True, exist_ok=True)
        yield
        return
    lock_path = folder / LOCK_FILE
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a+")
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if refuse is not None:
                    raise UserError(
                        f"{folder} is in use by {_holder(lock_path)}; {refuse}") from None
                logger.warning("waiting for %s, which is writing %s", _holder(lock_path), folder)
                fcntl.flock(handle, fcntl.LOCK_EX)
            if _is_current(handle, lock_path):
                break
            if refuse is not None:  # the file we locked was removed meanwhile by another process
                raise UserError(f"{folder} is in use by another process; {refuse}")
        except BaseException:
            handle.close()
            raise
        handle.close()  # releases the lock of the removed file; take the one there now
    with handle:
        _held.add(handle)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            yield
        finally:
            _held.discard(handle)
            fcntl.flock(handle, fcntl.LOCK_UN)
