"""The one exception type for a user's mistake: the CLI prints its message as one line (exit code
2); and the words for an error that is the machine's limit, not a bug (memory ran out), which the
CLI says in one line too."""
from __future__ import annotations

import re
from typing import Mapping


class UserError(Exception):
    """A problem the user can fix (bad path, unknown key, wrong checkpoint); the message names the
    fix."""


def check_known_keys(given, known, what: str) -> None:
    """One UserError line naming the keys of `given` not among `known` (a config read from a file:
    `what` says which, e.g. "tower config"), and the keys it may hold."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise UserError(f"unknown {what} keys {unknown}; known keys: {sorted(known)}")


def setting(names: Mapping[str, str] | None, parameter: str, value: object = None) -> str:
    """How a message names `parameter`, in the caller's words: `names` maps parameters to the
    names the caller knows them by (the CLI passes its flags, {"out_dir": "--out"}); a parameter
    not in it goes by its own name. With `value`, the setting as the caller writes it (`spelled`):
    the fix a message names."""
    return spelled((names or {}).get(parameter, parameter), value)


def spelled(name: str, value: object = None) -> str:
    """A setting `name` with `value` as its caller writes it: `--layout classes` for a flag (a
    switch's True: the flag alone), `layout=classes` for a parameter or config key; the name alone
    without a value."""
    if value is None:
        return name
    if name.startswith("-"):
        return name if value is True else f"{name} {value}"
    return f"{name}={value}"


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (a library's may run to a page), or its type's name
    when it has none: what a one-line error quotes of a cause."""
    message = str(error).strip()
    return message.splitlines()[0] if message else type(error).__name__


_CPU_ALLOCATION = re.compile(r"you tried to allocate (\d+) bytes")
_GPU_ALLOCATION = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")


def out_of_memory(error: BaseException) -> str | None:
    """Words for an error that says memory ran out ("out of memory on the CPU (an allocation of
    3.0 GiB failed)"), else None: Python's MemoryError, torch's CPU allocator failing (a
    RuntimeError that says "can't allocate memory") and CUDA's `torch.OutOfMemoryError`. The caller
    adds the run's size and its levers."""
    message = str(error)
    if isinstance(error, MemoryError) or "can't allocate memory" in message:
        where, found = "CPU", _CPU_ALLOCATION.search(message)
        size = f"{int(found.group(1)) / 2**30:.1f} GiB" if found else None
    elif type(error).__name__ == "OutOfMemoryError" or "CUDA out of memory" in message:
        where, found = "GPU", _GPU_ALLOCATION.search(message)
        size = found.group(1) if found else None
    else:
        return None
    return f"out of memory on the {where}" + (f" (an allocation of {size} failed)" if size else "")
