"""The engines' doors: the Unix sockets' private directory, or the TCP ports' holders."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from appliance.doctor.result import Account, Result, fail, na, octal_mode, ok

RUNTIME_DIR_ENV = "RUNTIME_DIRECTORY"
UNIT_RUNTIME_DIR = Path("/run/llm-appliance")  # the unit's RuntimeDirectory=llm-appliance


def runtime_dir(env: Mapping[str, str]) -> Path:
    given = env.get(RUNTIME_DIR_ENV, "").split(":")[0]
    return Path(given) if given else UNIT_RUNTIME_DIR


def check_socket_dir(directory: Path, account: Account) -> Result:
    """engine.listen = "unix": the sockets' directory is the service's alone (0700)."""
    name = "engine sockets"
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return na(
            name,
            f"{directory} does not exist: systemd makes it (0700) when the service starts; "
            "outside systemd the daemon uses a fresh private directory",
        )
    except OSError as exc:
        return fail(name, f"{directory}: {exc.strerror}", f"check {directory}'s parent")
    if not stat.S_ISDIR(st.st_mode):
        return fail(
            name,
            f"{directory} is not a directory (or is a symbolic link)",
            f"remove {directory}; systemd makes the right one when the service starts",
        )
    mode = octal_mode(st.st_mode)
    if st.st_uid != account.uid:
        return fail(
            name,
            f"{directory} belongs to {account.owner_name(st.st_uid)}, not {account.name}",
            f"stop the service, remove {directory}, start it (systemd makes it anew)",
        )
    if st.st_mode & 0o077:
        return fail(
            name,
            f"{directory} has mode {mode}: other accounts may reach the engines",
            f"chmod 700 {directory} (the unit's RuntimeDirectoryMode=0700 does it at start)",
        )
    try:
        socks = sorted(p.name for p in directory.iterdir() if p.is_socket())
    except OSError:
        socks = []
    there = ", ".join(socks) if socks else "no engine socket yet"
    return ok(name, f"{directory}: {account.name}, {mode}; {there}", sockets=socks)


def check_ports(
    ports: Sequence[int],
    *,
    holder: Callable[[int], tuple[int | None, str] | None],
    is_ours: Callable[[int], bool],
) -> Result:
    """engine.listen = "tcp": each engine port is free or held by one of our engines."""
    free, ours, foreign = [], [], []
    for port in ports:
        who = holder(port)
        if who is None:
            free.append(port)
        elif who[0] is not None and is_ours(who[0]):
            ours.append(f"{port} (engine, pid {who[0]})")
        else:
            pid = "" if who[0] is None else f" (pid {who[0]})"
            foreign.append(f"{port} held by {who[1]}{pid}")
    parts = ([f"free: {', '.join(map(str, free))}"] if free else []) + ours
    data = {"ports": list(ports), "free": free}
    if foreign:
        return fail(
            "engine ports",
            "; ".join(foreign + parts),
            'stop that process, change engine.port_base, or use engine.listen = "unix" '
            "(the default)",
            **data,
        )
    return ok("engine ports", "; ".join(parts), **data)
