"""The one exception type for a user's mistake (the CLI prints its message as one line, exit code 2),
and the check of an output path that raises it."""
from __future__ import annotations

import tempfile
from pathlib import Path


class UserError(Exception):
    """A problem the user can fix (bad path, unknown key, wrong checkpoint); the message names the fix."""


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
