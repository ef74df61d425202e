"""The one exception type for a user's mistake: the CLI prints its message as one line (exit code 2)."""
from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix (bad path, unknown key, wrong checkpoint); the message names the fix."""


def check_known_keys(given, known, what: str) -> None:
    """One UserError line naming the keys of `given` not among `known` (a config read from a file: `what`
    says which, e.g. "tower config"), and the keys it may hold."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise UserError(f"unknown {what} keys {unknown}; known keys: {sorted(known)}")


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (a library's may run to a page), or its type's name when it
    has none: what a one-line error quotes of a cause."""
    message = str(error).strip()
    return message.splitlines()[0] if message else type(error).__name__
