"""Whether the daemon's state files (usage.json, audit.log, keys.json) can be written.

A running daemon knows best: its ``/readyz`` body (no key needed, the doctor sends
none) lists each file it failed to write on its last try, why and since when
(:mod:`appliance.state_writes`). With no daemon answering (or an older one that does not
say), the doctor judges the directory beside the keys file itself, without writing in it
(the doctor changes no file): a read-only file system, no free inode, less free space
than rewriting those files takes, or a directory the service account cannot write.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from appliance.doctor.result import Account, Result, fail, gib, na, ok

NAME = "state writes"
FILES = ("usage.json", "audit.log", "keys.json")
MARGIN_BYTES = 1 << 20  # audit lines and admin.key beside a fresh copy of each file


def check_state_writes(
    keys_file: Path,
    readyz: Mapping[str, Any] | None,
    account: Account,
    *,
    statvfs: Callable[[str], Any] = os.statvfs,
) -> Result:
    """From the running daemon's own account when it gives one, else from the disk."""
    directory = keys_file.parent
    if isinstance(readyz, Mapping) and isinstance(readyz.get("state_write_failures"), list):
        return _from_daemon(directory, readyz["state_write_failures"])
    return _from_disk(directory, account, statvfs)


def _from_daemon(directory: Path, failing: Sequence[Any]) -> Result:
    if not failing:
        return ok(NAME, f"the running daemon writes {', '.join(FILES)} in {directory}")
    said = "; ".join(
        f"{f.get('file')}: {f.get('error')} since {f.get('since')} ({f.get('failures')} tries)"
        for f in failing
        if isinstance(f, Mapping)
    )
    return fail(
        NAME,
        f"the running daemon cannot write {said} (in {directory}); it keeps serving",
        f"free space on that file system (`df -h {directory}`); the daemon writes the files "
        "again by itself and says so in the journal (usage and audit lines kept in memory "
        "meanwhile: docs/runbook.md, Disk full)",
        failing=list(failing),
    )


def _from_disk(directory: Path, account: Account, statvfs: Callable[[str], Any]) -> Result:
    if not directory.is_dir():
        return na(NAME, f"{directory} is not there yet: `serve` creates it")
    fix = f"free space on the file system of {directory} (`df -h {directory}`)"
    v = statvfs(str(directory))
    free = int(v.f_bavail) * int(v.f_frsize)
    need = MARGIN_BYTES + sum(_size(directory / f) for f in FILES if f != "audit.log")
    data = {"path": str(directory), "free_bytes": free, "needed_bytes": need}
    if v.f_flag & os.ST_RDONLY:
        return fail(NAME, f"{directory} is on a read-only file system", "remount it rw", **data)
    if v.f_files and not v.f_favail:
        return fail(NAME, f"no free inode on the file system of {directory}", fix, **data)
    if free < need:
        return fail(
            NAME,
            f"{gib(free)} free beside {directory}, under the {gib(need)} that rewriting "
            f"{', '.join(FILES)} takes (no daemon answered to say how its writes go)",
            fix,
            **data,
        )
    st = os.stat(directory)
    if not _writable(st, account):
        return fail(
            NAME,
            f"{account.name} cannot write in {directory}",
            f"chown {account.chown_spec} {directory} && chmod 700 {directory}",
            **data,
        )
    return ok(NAME, f"{gib(free)} free beside {directory}; {account.name} can write there", **data)


def _size(path: Path) -> int:
    with contextlib.suppress(OSError):
        return os.stat(path).st_size
    return 0


def _writable(st: os.stat_result, account: Account) -> bool:
    """Whether ``account`` may create files in a directory of this owner and mode."""
    if account.uid == 0:
        return True
    if st.st_uid == account.uid:
        return bool(st.st_mode & stat.S_IWUSR and st.st_mode & stat.S_IXUSR)
    if st.st_gid in account.groups or st.st_gid == account.gid:
        return bool(st.st_mode & stat.S_IWGRP and st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IWOTH and st.st_mode & stat.S_IXOTH)
