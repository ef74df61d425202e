"""The one exception type for a user's mistake: the CLI prints its message as one line (exit code 2)."""
from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix (bad path, unknown key, wrong checkpoint); the message names the fix."""
