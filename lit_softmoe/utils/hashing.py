"""sha256 of files, computed once per file version in a process."""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    # Keyed by size and mtime too: a rewritten file is hashed again, an unchanged one once per
    # process (a 27B-parameter tower is 55 GB, tens of seconds to hash).
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of the file's bytes."""
    path = Path(path).resolve()
    stat = os.stat(path)
    return _sha256(str(path), stat.st_size, stat.st_mtime_ns)
