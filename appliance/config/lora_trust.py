"""Whether another local account could change a LoRA adapter before the engine loads it.

The appliance checks an adapter's folder (check-config, the admin's add, each load on an
engine), then vLLM opens the folder by its path, later and in another process. Nothing
can hold the folder still between the two, so the appliance asks instead who *could*
change it: every directory from ``/`` down to the folder, each symbolic link met on the
way (followed, as vLLM follows it), the folder itself and each entry in it (what vLLM
reads) must belong to a trusted account (root, the account the daemon runs as, and
:data:`~appliance.paths.SERVICE_USER`), and none may be writable by its group or by
others. A directory on the way with the sticky bit (``/tmp``) may be writable by all:
nobody can then rename or remove an entry that is not theirs, and the next entry is
judged in turn; the adapter folder itself may not (anyone could add a weights file vLLM
prefers). Only a trusted account can then swap the adapter, and those accounts already
run the engine. The rule reads mode bits (as :mod:`appliance.permissions` does), not ACLs.

Each problem is one sentence naming the path and the command that fixes it.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import stat
from collections.abc import Iterable
from pathlib import PurePosixPath

from appliance import paths

MAX_LINKS = 40  # the kernel's own limit on links followed in one path (ELOOP)
_WHY = "could change {what} between the appliance's check and the engine's load"
ADAPTER = "the adapter"


def trusted_owners() -> frozenset[int]:
    """Root, the account this runs as (the daemon's: its service account), and the
    service account the role creates (check-config run as root judges as the daemon)."""
    uids = {0, os.geteuid()}
    with contextlib.suppress(KeyError):
        uids.add(pwd.getpwnam(paths.SERVICE_USER).pw_uid)
    return frozenset(uids)


def untrusted(folder: str, trusted: Iterable[int] | None = None, what: str = ADAPTER) -> str | None:
    """Why an account other than ``trusted`` (default :func:`trusted_owners`) could change
    what vLLM loads from the folder ``folder`` (absolute), or None. OSError when the
    folder (or a path on the way) cannot be looked at. ``what`` names it in the sentence
    ("the adapter", "the model"). The same rule serves models, the engine python and
    the caches (:mod:`appliance.config.model_places`); a plain file (a GGUF model, the
    python) is judged on its way and by itself."""
    owners = trusted_owners() if trusted is None else frozenset(trusted)
    real, problem = _walk(PurePosixPath(folder), owners, what)
    if problem is not None:
        return problem
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        return None  # judged on the way, as the last entry
    if stat.S_IMODE(st.st_mode) & 0o022:  # no sticky pass here: see the module's doc
        return _writable(real, st, what)
    for entry in sorted(os.listdir(real)):
        problem = _walk(real / entry, owners, what)[1]
        if problem is not None:
            return problem
    return None


def _walk(
    path: PurePosixPath, owners: frozenset[int], what: str = ADAPTER
) -> tuple[PurePosixPath, str | None]:
    """``path`` resolved as the kernel resolves it, and the first entry on the way that
    an untrusted account could change (None: none)."""
    here = PurePosixPath("/")
    problem = _judge(here, os.lstat(here), owners, what)
    todo = list(path.parts[1:])
    links = 0
    while todo and problem is None:
        part = todo.pop(0)
        if part == "..":
            here = here.parent  # judged already, on the way down
            continue
        there = here / part
        st = os.lstat(there)
        problem = _judge(there, st, owners, what)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise OSError(f"{path}: too many levels of symbolic links")
            target = PurePosixPath(os.readlink(there))
            if target.is_absolute():
                here, todo = PurePosixPath("/"), [*target.parts[1:], *todo]
            else:
                todo = [*target.parts, *todo]
            continue
        here = there
    return here, problem


def _judge(
    path: PurePosixPath, st: os.stat_result, owners: frozenset[int], what: str = ADAPTER
) -> str | None:
    """Whether an untrusted account could change this one entry (a link: replace it)."""
    if st.st_uid not in owners:
        return (
            f"{path} belongs to {_user(st.st_uid)}, who {_WHY.format(what=what)}; make it "
            f"root's (chown root: {path}) or the service account's, or copy {what} to a "
            "folder that is"
        )
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or not mode & 0o022:
        return None
    if stat.S_ISDIR(st.st_mode) and mode & stat.S_ISVTX:
        return None  # like /tmp: only an entry's owner may rename or remove it
    return _writable(path, st, what)


def _writable(path: PurePosixPath, st: os.stat_result, what: str = ADAPTER) -> str:
    mode = stat.S_IMODE(st.st_mode)
    who = "every account" if mode & 0o002 else f"the group {_group(st.st_gid)}"
    why = _WHY.format(what=what)
    return f"{path} is writable by {who} (mode {mode:04o}), which {why}; chmod go-w {path}"


def _user(uid: int) -> str:
    with contextlib.suppress(KeyError):
        return pwd.getpwuid(uid).pw_name
    return f"uid {uid}"


def _group(gid: int) -> str:
    with contextlib.suppress(KeyError):
        return grp.getgrgid(gid).gr_name
    return f"gid {gid}"
