"""The two refusals of the keys package, kept apart from the code that raises them.

:class:`KeySpecError` is a bad value for one field of a key (from ``keys create``, the
admin API or a hand-edited file); :class:`KeysFileError` is a keys file (or its lock, or
admin.key) that cannot be read, parsed, locked or written. Both are ApplianceErrors, so
the CLI prints one line and exits with their ``exit_code``; the admin API turns them into
OpenAI-shaped errors.
"""

from __future__ import annotations

from appliance.errors import ApplianceError
from appliance.fsutil import FileWriteError


class KeysFileError(ApplianceError):
    """The keys file cannot be read, parsed, locked or written; names the file and why."""

    exit_code = 1
    # The OS error behind a file that cannot be read (None: a parse or lock problem), so
    # that check-config can tell "this user may not read it" from a broken file.
    errno: int | None = None

    @classmethod
    def from_write(cls, exc: FileWriteError) -> KeysFileError:
        """The same failure (and message) from :mod:`appliance.fsutil`, as a keys error:
        what the CLI, the admin API and the watcher catch. ``errno`` comes along, so the
        admin API can tell a full disk (507) from other failures (503)."""
        error = cls(str(exc))
        error.errno = exc.errno
        return error


class KeySpecError(ApplianceError, ValueError):
    """Bad arguments for a new key; ``field`` names the argument (``param`` in an API error)."""

    exit_code = 2

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.reason = message
        super().__init__(f"{field}: {message}")
