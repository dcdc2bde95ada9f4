"""One writer at a time: the exclusive lock on ``<keys file>.lock``.

The CLI and the daemon's admin endpoints may both change the keys file: every
read-modify-write holds an exclusive ``flock`` on the sibling ``<keys file>.lock`` and
re-reads the file under that lock, so two writers never lose each other's keys.

The directory belongs to the service account while root may run the CLI in it, so the
lock file is never opened through a symlink (``O_EXCL`` to create it, ``O_NOFOLLOW`` to
open it), and the file opened is checked (regular, one link, expected owner) before root
locks or chowns it: a planted ``keys.json.lock -> /etc/shadow``, a hard link or a FIFO is
refused with one line naming the file, and its target is left as it was.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from appliance import fsutil
from appliance.gateway.keys.errors import KeysFileError

LOCK_TIMEOUT_S = 10.0
_RETRY_S = 0.05


def refuse_link(path: Path, what: str) -> KeysFileError:
    return KeysFileError(
        f"refusing to use {what} {path}: it is a symbolic link, which the appliance never "
        "makes (remove it and try again)"
    )


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, keys_path: Path, timeout_s: float) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_path`` (creating it, and the directory, if
    missing) for as long as the block runs; KeysFileError after ``timeout_s``. Not
    re-entrant."""
    try:
        fsutil.ensure_private_dir(keys_path.parent)
    except fsutil.FileWriteError as exc:
        raise KeysFileError.from_write(exc) from None
    fd = _open_lock_file(lock_path, keys_path)
    try:
        fsutil.match_owner(fd, keys_path)  # the keys file's owner, else the directory's
        _flock(fd, keys_path, timeout_s)
        yield
    finally:
        os.close(fd)  # releases the lock


def _flock(fd: int, keys_path: Path, timeout_s: float) -> None:
    """Take the lock, retrying until ``timeout_s`` has passed (another writer holds it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise KeysFileError(
                    f"keys file {keys_path} stayed locked by another process for {timeout_s:g} s"
                ) from None
            time.sleep(_RETRY_S)
        except OSError as exc:
            raise KeysFileError(
                f"cannot lock keys file {keys_path} ({exc.strerror or exc})"
            ) from None


def _check_lock_file(fd: int, lock_path: Path, keys_path: Path) -> None:
    """The lock file opened is one the appliance could have made: a regular file with one
    link, owned by us or by the keys file's owner. Anything else (a hard link to another
    file, a device, someone else's file) is refused before it is chowned or locked."""
    st = os.fstat(fd)
    ref = fsutil.owner_reference(keys_path)
    owners = {os.geteuid()} | ({ref[0]} if ref else set())
    if not stat.S_ISREG(st.st_mode):
        problem = "it is not a regular file"
    elif st.st_nlink != 1:
        problem = f"it has {st.st_nlink} hard links (another file's content)"
    elif st.st_uid not in owners:
        problem = f"it belongs to uid {st.st_uid}, not to the keys file's owner"
    else:
        return
    raise KeysFileError(f"refusing to use lock file {lock_path}: {problem} (remove it)")


def _lock_error(keys_path: Path, lock_path: Path, exc: OSError) -> KeysFileError:
    return KeysFileError(
        f"cannot lock keys file {keys_path} (lock file {lock_path}: {exc.strerror or exc})"
    )


def _open_lock_file(lock_path: Path, keys_path: Path) -> int:
    """Open (creating it 0600 if missing) the lock file, never through a symlink; the fd
    is checked with :func:`_check_lock_file`. KeysFileError naming the file otherwise."""
    flags = os.O_RDWR | fsutil.SAFE_OPEN
    for _ in range(3):  # it may vanish or appear between the two opens
        try:
            return os.open(lock_path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # O_EXCL also fails on a symlink: the next open says which
        except OSError as exc:
            raise _lock_error(keys_path, lock_path, exc) from None
        try:
            fd = os.open(lock_path, flags)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise refuse_link(lock_path, "lock file") from None
            raise _lock_error(keys_path, lock_path, exc) from None
        try:
            _check_lock_file(fd, lock_path, keys_path)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise KeysFileError(f"cannot lock keys file {keys_path}: {lock_path} keeps changing")
