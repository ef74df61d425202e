"""Atomic writes: a file or a folder is written under a temporary name beside its final one and
renamed into place, so a reader (or a rerun after a kill) finds the old version or the new one,
never half of one.

Temporary names are `.NAME.tmp-PID-RANDOM[.SUFFIX]` (and `.NAME.old-PID-RANDOM` for the previous
version of a folder on systems without an atomic exchange): unique per call, and the pid tells a
later call whether their writer is still alive, so what a killed writer left behind is removed by
the next write of the same name.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from lit_softmoe.utils.paths import check_folder_destination

T = TypeVar("T")

_in_flight: set[Path] = set()  # temporary paths this process is writing right now (any thread)


# ---- what killed writers leave -------------------------------------------------------------------

def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        return True
    return True


def _stale_leftovers(final: Path) -> list[re.Match]:
    """Name matches (kind "tmp" | "old", pid, rest) of the temporary siblings that killed
    writes left beside `final`. A leftover is stale when the process named in it is gone,
    or carries this process's pid but is not being written by it: a job rerun in a fresh container
    often gets the same small pid. (Paths on a disk that several machines share are only judged by
    this machine's processes.)"""
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.(tmp|old)-(\d+)-.*$")
    stale = []
    for path in final.parent.iterdir() if final.parent.is_dir() else []:
        match = pattern.match(path.name)
        if match and path not in _in_flight:
            pid = int(match.group(2))
            if pid == os.getpid() or pid <= 0 or not process_alive(pid):
                stale.append(match)
    return stale


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def recover(final: str | Path) -> None:
    """Remove what killed atomic writes left beside `final`; if a folder write was killed between
    its two renames (systems without an atomic exchange), `final` is missing and its previous
    version is put back first."""
    final = Path(final)
    for match in _stale_leftovers(final):
        kind, path = match.group(1), final.parent / match.string
        previous = path / final.name  # an "old" holder keeps the previous version at holder/NAME
        if kind == "old" and not final.exists() and previous.is_dir():
            os.replace(previous, final)
        _remove(path)


# ---- full disks ----------------------------------------------------------------------------------

_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(err: BaseException) -> bool:
    """Whether `err` says the disk (or a quota) is full: an OSError's errno, or safetensors' and
    torch's own words (they keep neither errno nor path)."""
    if isinstance(err, OSError) and err.errno in _FULL:
        return True
    return "No space left on device" in str(err) or "os error 28" in str(err)


@contextlib.contextmanager
def naming_full_disk(path: str | Path) -> Iterator[None]:
    """A full disk met in the block by a write that names no path (a write() on an open file,
    safetensors, torch) is raised as OSError(ENOSPC or EDQUOT, ..., `path`), chained to it:
    the CLI's one line names the path. An error that names its own path, or another error,
    passes unchanged."""
    try:
        yield
    except Exception as err:
        if getattr(err, "filename", None) or not disk_full(err):
            raise
        code = err.errno if isinstance(err, OSError) and err.errno in _FULL else errno.ENOSPC
        raise OSError(code, os.strerror(code), str(path)) from err


def full_disk_message(err: BaseException) -> str | None:
    """The CLI's one line for an error caused by a full disk (or quota), else None. Every writer
    here writes under a temporary name and renames at the end, so what was cut short leaves nothing
    a rerun would trust, and the rerun resumes."""
    for cause in (err, err.__cause__, err.__context__):
        if cause is None or not disk_full(cause):
            continue
        # The writers say which path (`naming_full_disk`); a path-less error of another is
        # said without.
        filename = getattr(cause, "filename", None)
        where = f" while writing {filename}" if filename else ""
        return (f"no space left on the device{where}; free some space (or write to another "
                "disk) and rerun the same command")
    return None


# ---- modes ---------------------------------------------------------------------------------------

def _umask() -> int:
    """The process's umask, read from /proc where it is there (os.umask can only read it by setting
    it, which for a moment changes the mode of files other threads create)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _follow_umask(path: Path) -> None:
    """mkstemp/mkdtemp make their file or folder private (0600/0700), and safetensors its
    files too; what is written here (towers, checkpoints, exports, results) is read by other
    users and programs, so each path gets the mode the umask gives new files and folders
    (0644 / 0755 under 022)."""
    mask = _umask()
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not item.is_symlink():
            item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


# ---- files ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield a new, empty temporary path beside `path` to write; when the block ends without an
    error it takes `path`'s place in one rename, otherwise it is removed. The temporary name keeps
    `path`'s suffix, for writers that choose a format by it (matplotlib's savefig)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    descriptor, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-",
                                        suffix=path.suffix, dir=path.parent)
    os.close(descriptor)
    temporary = Path(name)
    _in_flight.add(temporary)
    try:
        with naming_full_disk(path):
            yield temporary
            _follow_umask(temporary)
            os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)  # gone already after the rename
        _in_flight.discard(temporary)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary name, so a reader never sees
    half a file."""
    with replacing(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


# ---- folders -------------------------------------------------------------------------------------

def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux's renameat2 with RENAME_EXCHANGE);
    False where the system, its C library or the filesystem cannot, and the caller renames
    twice instead."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without the wrapper (glibc < 2.28, older musl)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # e.g. a filesystem without the flag
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


class FolderTakenError(FileExistsError):
    """`write_folder_atomically(..., replace=False)` found its folder filled by another writer."""


def write_folder_atomically(final_dir: str | Path, write: Callable[[Path], T], replace: bool = True,
                            through_link: bool = True) -> Path:
    """Call `write(tmp_dir)`, then move tmp_dir to `final_dir` (replacing an older one).

    On Linux an older folder is swapped out in one atomic step, so a reader finds the old or the
    new folder, never none. Elsewhere it is renamed away first: a run killed between the two
    renames leaves `final_dir` missing, and the next call (or `recover`) puts the old one back.
    `replace=False`: `final_dir` may only be absent or empty; one that another writer filled while
    `write` ran is kept and FolderTakenError raised. The last step is then one rename, which refuses
    a folder holding files, so no check made earlier can be raced.
    A symbolic link at `final_dir`: with `through_link` (a user's --out) the folder it names takes
    the new contents and the link stays; a link that loops, leads nowhere or to a file is refused
    (UserError). `through_link=False` (a folder the caller owns, such as a checkpoint): the link
    itself is replaced, it holds no data.
    """
    final_dir = Path(final_dir)
    if final_dir.is_symlink() and through_link:
        check_folder_destination(final_dir)
        final_dir = final_dir.resolve()
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    recover(final_dir)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-{os.getpid()}-",
                                    dir=final_dir.parent))
    _in_flight.add(tmp_dir)
    try:
        with naming_full_disk(final_dir):
            write(tmp_dir)
        _follow_umask(tmp_dir)
        if final_dir.is_symlink():  # not followed: the link goes, the new folder takes its name
            final_dir.unlink()
        if not replace:
            _rename_onto_empty(tmp_dir, final_dir)
        elif not final_dir.exists():
            os.replace(tmp_dir, final_dir)
        elif _exchange(tmp_dir, final_dir):
            pass  # tmp_dir now holds the old folder: removed below
        else:
            # A fresh, empty holder: the old folder's name there cannot collide with a leftover.
            holder = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.old-{os.getpid()}-",
                                           dir=final_dir.parent))
            _in_flight.add(holder)
            try:
                os.replace(final_dir, holder / final_dir.name)
                os.replace(tmp_dir, final_dir)
            except BaseException:
                if not final_dir.exists():
                    os.replace(holder / final_dir.name, final_dir)
                raise
            finally:
                shutil.rmtree(holder, ignore_errors=True)
                _in_flight.discard(holder)
    finally:
        # after an exchange with a link, the link itself
        if tmp_dir.exists() or tmp_dir.is_symlink():
            _remove(tmp_dir)
        _in_flight.discard(tmp_dir)
    return final_dir


def _rename_onto_empty(src: Path, dst: Path) -> None:
    try:
        os.rename(src, dst)  # POSIX: takes an empty folder's place, refuses a filled one
    except OSError:
        if dst.is_dir() and not any(dst.iterdir()):
            dst.rmdir()  # Windows refuses any existing folder: an empty one is removed first
            os.rename(src, dst)
        elif dst.exists():
            raise FolderTakenError(f"{dst} was filled by another writer") from None
        else:
            raise
