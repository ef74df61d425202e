"""Checks of output paths, made before the work rather than after it."""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from lit_softmoe.errors import UserError


def check_writable(path: str | Path, what: str, folder: bool) -> None:
    """Fail before the work, not after it, where `path` (a folder, or a file) cannot be written.
    Messages call it `what`, the name the caller knows it by: a setting (`run_dir`) or, from the
    CLI, a flag (`--out`)."""
    path = Path(path)
    # a link that leads nowhere, at the path or a folder on the way
    for part in (path, *path.parents):
        if part.exists():
            break
        problem = broken_link(part)
        if problem:
            where = f"{what} {path}" if part == path else f"{what} {path}: {part}"
            raise UserError(f"{where} {problem}; "
                            f"remove the link (rm {part}) or give another {what}")
    if folder and path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} is a file; give a folder path")
    if not folder and path.is_dir():
        raise UserError(f"{what} {path} is a folder; "
                        f"give a file path, e.g. {path / 'results.json'}")
    start = path if folder else path.parent
    existing = next(p for p in (start, *start.parents) if p.exists())  # the rest is made inside it
    if not existing.is_dir():
        raise UserError(f"{what} {path}: {existing} is a file, not a folder; choose another {what}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise UserError(f"{what} {path}: cannot write in {existing} ({err.strerror or err}); "
                        f"choose another {what}") from None


def check_folder_destination(path: str | Path) -> None:
    """Refuse (one line) a path a folder cannot be written at: a symbolic link that loops,
    leads nowhere or to a file, or a file. A link to a folder is fine: the folder it names takes the
    new contents. Called where the folder is written, and before the work for a folder written at
    its end (a run's tower/ or model/)."""
    path = Path(path)
    if path.is_symlink() and not path.is_dir():
        problem = broken_link(path) or f"is a symbolic link to {os.readlink(path)}, not to a folder"
        raise UserError(f"{path} {problem}; remove the link (rm {path}) or write to another path")
    if path.exists() and not path.is_dir():
        raise UserError(f"{path} is a file, not a folder; remove it or write to another path")


def broken_link(path: str | Path) -> str | None:
    """What is wrong with a symbolic link at `path` that leads to nothing
    ("is a symbolic link that loops", or to a missing target), for an error line; None for no link
    or one that leads to something."""
    path = Path(path)
    if not path.is_symlink():
        return None
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "is a symbolic link that loops"
        missing = err.errno in (errno.ENOENT, errno.ENOTDIR)
        return (f"is a symbolic link to {os.readlink(path)}, which "
                f"{'does not exist' if missing else err.strerror}")
    return None


def cache_root() -> Path:
    """Where lit-softmoe keeps what it can make again: `$LIT_SOFTMOE_CACHE`, else
    ~/.cache/lit_softmoe. The eval suite's image features go in its `eval/`, the towers written for
    `timm:` specs in `towers/timm/`."""
    return Path(os.environ.get("LIT_SOFTMOE_CACHE") or Path.home() / ".cache" / "lit_softmoe")
