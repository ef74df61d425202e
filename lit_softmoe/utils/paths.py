"""Checks of output paths, made before the work rather than after it."""
from __future__ import annotations

import tempfile
from pathlib import Path

from lit_softmoe.errors import UserError


def check_writable(path: str | Path, flag: str, folder: bool) -> None:
    """Fail before the work, not after it, where `flag`'s path (a folder, or a file) cannot be written."""
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file; give a folder path")
    if not folder and path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file path, e.g. {path / 'results.json'}")
    start = path if folder else path.parent
    existing = next(p for p in (start, *start.parents) if p.exists())  # the rest is made inside it
    if not existing.is_dir():
        raise UserError(f"{flag} {path}: {existing} is a file, not a folder; choose another {flag}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot write in {existing} ({err.strerror or err}); "
                        f"choose another {flag}") from None
