"""Set-up run as root leaves no root-owned file in the service's state directory.

``sudo llm-appliance setup`` (apt-get for the CPU engine's libraries wants root) writes
into ``/var/lib/llm-appliance``, which belongs to the service user: every file root made
there would be one the daemon cannot rewrite (the stamp, the marker, a re-run's logs) or
remove. So when set-up ends, as it ends, :func:`give_back` hands everything root made
under the home to the home's owner. ``sudo llm-appliance models pull`` does the same for
the model store it writes to (``under``: only the store, not the whole home).

The home belongs to the service account, so anything in it may have been planted there
while root works: the walk never follows a symbolic link (``os.fwalk`` without
following, a link's own owner changed, never its target's), a file is changed through
a descriptor opened without following links and checked to be the one looked at, and a
regular file with more than one hard link is left alone (it may be a link to a file
elsewhere, such as /etc/shadow, that must never change hands). The walk goes bottom-up,
so a directory stays root's until everything in it is done.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

ROOT = 0
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


@dataclass(frozen=True)
class Handed:
    """What :func:`give_back` did: to whom, how many entries, and what it left alone."""

    owner: tuple[int, int]  # (uid, gid) the entries now have
    count: int
    left: tuple[str, ...] = ()  # "path (why)" for each root entry not handed over


def give_back(home: Path, euid: int | None = None, *, under: Path | None = None) -> Handed | None:
    """Hand every entry under ``home`` that root owns to the home's owner and group;
    with ``under`` (a folder in the home: ``models pull``'s store) only that folder and
    what is under it.

    None when there is nothing to do: not run as root, or the home is root's own (or not
    a directory).
    """
    if (os.geteuid() if euid is None else euid) != ROOT:
        return None
    owner = home_owner(home)
    if owner is None or owner[0] == ROOT:
        return None
    return hand_over(home if under is None else under, owner, with_top=under is not None)


def home_owner(home: Path) -> tuple[int, int] | None:
    """(uid, gid) of the directory ``home``, or None when it is not one."""
    try:
        st = os.lstat(home)
    except OSError:
        return None
    return (st.st_uid, st.st_gid) if stat.S_ISDIR(st.st_mode) else None


def hand_over(top: Path, owner: tuple[int, int], *, with_top: bool = False) -> Handed:
    """Hand every entry under ``top`` that root owns (and ``top`` itself with
    ``with_top``) to ``owner``, bottom-up, by the rules of the module's docstring."""
    count, left = 0, []
    for dirpath, dirnames, filenames, dir_fd in os.fwalk(top, topdown=False):
        for name in (*dirnames, *filenames):
            why = _try_hand_over(name, dir_fd, owner)
            if why is None:
                count += 1
            elif why:
                left.append(f"{Path(dirpath) / name} ({why})")
    if with_top and os.path.lexists(top):
        # Last: a directory stays root's until everything in it is done.
        parent = os.open(top.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            why = _try_hand_over(top.name, parent, owner)
        finally:
            os.close(parent)
        if why is None:
            count += 1
        elif why:
            left.append(f"{top} ({why})")
    return Handed(owner, count, tuple(left))


def _try_hand_over(name: str, dir_fd: int, owner: tuple[int, int]) -> str | None:
    try:
        return _hand_over(name, dir_fd, owner)
    except OSError as exc:  # gone meanwhile, or a file system that refuses
        return exc.strerror or str(exc)


def _hand_over(name: str, dir_fd: int, owner: tuple[int, int]) -> str | None:
    """None: handed over; "": not root's (nothing to do); else why it was left alone."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if st.st_uid != ROOT:
        return ""
    if stat.S_ISLNK(st.st_mode):
        os.chown(name, *owner, dir_fd=dir_fd, follow_symlinks=False)  # the link, not its target
        return None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return "not a file or a directory"  # root makes no FIFOs, sockets or devices here
    fd = os.open(name, _OPEN, dir_fd=dir_fd)
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or now.st_uid != ROOT:
            return "replaced while root worked"
        if stat.S_ISREG(now.st_mode) and now.st_nlink > 1:
            return f"{now.st_nlink} hard links"
        os.fchown(fd, *owner)
    finally:
        os.close(fd)
    return None
