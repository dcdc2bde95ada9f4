"""One line for a file a command may not use: which file, and what would let you use it.

A user outside the service group who runs ``llm-appliance status`` reads::

    llm-appliance: cannot read /etc/llm-appliance/config.toml: permission denied (join
    the group llm-appliance or use sudo)

never a traceback. :func:`denied_line` builds that line from the ``PermissionError``
(its ``filename``) and the modes on the way to the file. The advice comes from the
first thing in the way (a directory the user may not enter, else the file itself): join
its group only where the group's bits would let the user through, log in again where
the user was added to that group after logging in, else sudo (the file is its owner's
alone). A command never works around the modes; this only says what they are.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Need = Literal["read", "write", "enter"]
# The permission bits each class of user needs, per kind of access.
_BITS: dict[Need, tuple[int, int, int]] = {
    "read": (stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH),
    "write": (stat.S_IWUSR, stat.S_IWGRP, stat.S_IWOTH),
    "enter": (stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH),
}


@dataclass(frozen=True)
class Viewer:
    """Who is asking: a user id and the groups this process holds."""

    uid: int
    groups: frozenset[int]

    @classmethod
    def current(cls) -> Viewer:
        return cls(os.geteuid(), frozenset({os.getegid(), *os.getgroups()}))

    def may(self, st: os.stat_result, need: Need) -> bool:
        """What the mode bits allow (ACLs aside; this only advises)."""
        if self.uid == 0:
            return True
        user, group, other = _BITS[need]
        if st.st_uid == self.uid:
            return bool(st.st_mode & user)
        if st.st_gid in self.groups:
            return bool(st.st_mode & group)
        return bool(st.st_mode & other)


def denied_line(exc: PermissionError, viewer: Viewer | None = None) -> str | None:
    """``cannot read PATH: permission denied (ADVICE)``; None when ``exc`` names no file."""
    if exc.filename is None:
        return None
    path = Path(os.fsdecode(exc.filename)).absolute()
    viewer = viewer or Viewer.current()
    blocker = _blocker(path, viewer)
    if blocker is None:
        # The modes let this user through: something else refused (an ACL, a security
        # module, chown on a file not theirs); say what the system said.
        return f"cannot use {path}: {(exc.strerror or 'permission denied').lower()}"
    where, need, st = blocker
    # A directory on the way hides the file; a directory withholding its write bit
    # keeps the file from being made.
    verb = "read" if need == "enter" else "create" if where != path else need
    return f"cannot {verb} {path}: permission denied ({_advice(where, need, st, viewer)})"


def _blocker(path: Path, viewer: Viewer) -> tuple[Path, Need, os.stat_result] | None:
    """The first thing in the way, what it withholds, and its status; None: nothing."""
    for directory in reversed(path.parents):
        st = _lstat(directory)
        if st is None:
            return None
        if stat.S_ISDIR(st.st_mode) and not viewer.may(st, "enter"):
            return directory, "enter", st
    st = _lstat(path)
    if st is None:  # it is not there: creating it needs the directory's write bit
        parent = _lstat(path.parent)
        if parent is not None and not viewer.may(parent, "write"):
            return path.parent, "write", parent
        return None
    needs: tuple[Need, ...] = ("read", "write")
    for need in needs:
        if not viewer.may(st, need):
            return path, need, st
    return None


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _advice(where: Path, need: Need, st: os.stat_result, viewer: Viewer) -> str:
    """Join the group where its bits would let the user through, else sudo."""
    group_bit = _BITS[need][1]
    group = _group_name(st.st_gid)
    if st.st_mode & group_bit and st.st_gid not in viewer.groups:
        if _listed_in(st.st_gid, viewer.uid):
            return (
                f"you were added to the group {group} after logging in: log in again, or use sudo"
            )
        return f"join the group {group} or use sudo"
    owner = _user_name(st.st_uid)
    if need == "enter":
        return f"only {owner} may enter {where}: use sudo"
    if stat.S_ISDIR(st.st_mode):
        return f"only {owner} may write in {where}: use sudo"
    return f"only {owner} may {need} it: use sudo"


def _user_name(uid: int) -> str:
    """The user's name, or the number when the system has no name for it."""
    with contextlib.suppress(KeyError):
        return pwd.getpwuid(uid).pw_name
    return str(uid)


def _group_name(gid: int) -> str:
    with contextlib.suppress(KeyError):
        return grp.getgrgid(gid).gr_name
    return str(gid)


def _listed_in(gid: int, uid: int) -> bool:
    """Whether /etc/group lists the user in the group (though this process lacks it)."""
    try:
        return pwd.getpwuid(uid).pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False
