"""User-facing errors: anything the user can fix by changing input prints one line and exits 2.

The CLI catches `UserError` and prints `str(err)`; everything else is a crash (exit 1) with a traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 3


class UserError(Exception):
    """A mistake in input (recipe, data, checkpoint, flags): one line, exit code 2."""

    exit_code = EXIT_USER_ERROR


class RecipeError(UserError):
    """A recipe problem, formatted `file: section.key: message` like a compiler diagnostic."""

    def __init__(self, source: str, key: str | None, message: str):
        self.source, self.key, self.message = source, key, message
        where = f"{source}: {key}: " if key else f"{source}: "
        super().__init__(where + message)
