"""Small files written safely: no links followed, owner kept, replaced atomically.

These helpers know nothing of what a file holds; the keys store (keys.json, admin.key)
uses them, and so may anything else that writes a small file which both the daemon and
root touch.

Why no links are followed: the state directory belongs to the service account, so when
root runs ``sudo llm-appliance keys ...`` anything in it may have been planted there (a
symlink to /etc/shadow, a FIFO that would block an open forever). Files are opened with
:data:`SAFE_OPEN` (no symbolic link in the last component, no blocking on a FIFO) and
written by creating a new file (``O_EXCL``) that is renamed over the old one, so a link
in the way is replaced, never written through.

Why atomic: a reader (the daemon's keys watcher, or a power cut) must see the old file or
the new one, never half of one: temp file in the same directory, fsync, rename, fsync the
directory.

Why the owner is kept: when root edits the daemon's files, a 0600 file that root took
over would lock the service account out, so a file keeps its owner (or takes the
directory's).

A failure is a :class:`FileWriteError` naming the path and why; a caller with an error of
its own (the keys store's ``KeysFileError``) re-raises it as that, with the same message.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from appliance.errors import ApplianceError

# Files are opened without following a symbolic link in their last component, and never
# block on a FIFO: the directory belongs to the service account, so when root runs
# `sudo llm-appliance keys ...` anything in it may have been planted there.
SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class FileWriteError(ApplianceError):
    """A directory or file could not be created or written; the message names it and why.

    ``errno`` and ``reason`` (the OS's words, "No space left on device") are the OSError
    behind it, when there was one: callers tell a full disk (ENOSPC, EDQUOT) from other
    failures by ``errno``, and count or show episodes by ``reason``."""

    exit_code = 1

    def __init__(self, message: str, cause: OSError | None = None) -> None:
        super().__init__(message)
        self.errno: int | None = cause.errno if cause is not None else None
        self.reason: str = (cause.strerror or str(cause)) if cause is not None else message


# The disk (or the user's quota) is full: nothing to fix but space, so callers say so.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def ensure_private_dir(directory: Path) -> None:
    """Create the directory 0700 if missing (its parents with the usual mode)."""
    if directory.is_dir():
        return
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=0o700)
        os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
    except FileExistsError:
        if not directory.is_dir():
            raise FileWriteError(f"{directory} exists and is not a directory") from None
    except OSError as exc:
        raise FileWriteError(
            f"cannot create directory {directory} ({exc.strerror or exc})", exc
        ) from None


def owner_reference(path: Path) -> tuple[int, int] | None:
    """Whose file this should stay: the file's owner when it is a plain file of its own
    (lstat: a symlink planted in its place must not choose), else the directory's."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            return st.st_uid, st.st_gid
    with contextlib.suppress(OSError):
        st = os.stat(path.parent)
        return st.st_uid, st.st_gid
    return None


def match_owner(fd: int, path: Path) -> None:
    """When root edits the daemon's files (`sudo llm-appliance keys ...`), keep them the
    daemon's: a 0600 file that root took over would lock the service user out. ``fd``
    must be a file this process made or checked (never one opened through a link)."""
    if os.geteuid() != 0:
        return
    ref = owner_reference(path)
    if ref is not None and ref != (0, 0):
        with contextlib.suppress(OSError):
            os.fchown(fd, *ref)


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` so readers see the old or the new file, never half.

    The temp file is created with ``mode`` from the start (O_EXCL), so the content is never
    readable by others, not even for a moment. Raises FileWriteError naming the file.
    """
    directory = path.parent
    ensure_private_dir(directory)
    tmp = directory / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        # O_EXCL: a new file of ours, never an existing one or a symlink's target.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_OPEN, mode)
    except OSError as exc:
        raise FileWriteError(
            f"cannot write {path} (creating a file in {directory}: {exc.strerror or exc})", exc
        ) from None
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have taken bits; never adds any here
            match_owner(fd, path)
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        # A full disk fails here (write, flush or fsync): the temp file goes, and the good
        # file was never touched (only the rename replaces it).
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise FileWriteError(f"cannot write {path} ({exc.strerror or exc})", exc) from None
    fsync_directory(directory)


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` survive a power cut, as far as the disk allows.

    Best effort: the rename has happened either way, only its durability is unsure, so a
    failure here is not an error."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
