"""Where an engine listens, and how the supervisor and the gateway reach it.

An engine listens on a **Unix socket** in a directory only the service's user can
enter (``engine.listen = "unix"``, the default): no other local account can connect
to it, bind its address first, or answer in its place, and vLLM's routes that its own
``--api-key`` leaves open (``/invocations``, ``/tokenize``, ...) are out of their reach
too. With ``engine.listen = "tcp"`` it listens on ``127.0.0.1:port``, which any local
process can connect to or bind while the engine is still importing; then
:func:`tcp_listener_owner` tells, before the engine key is sent anywhere, whether the
socket listening there belongs to the engine's own processes.

The directory (:func:`private_socket_dir`) is systemd's ``RuntimeDirectory=``
(``$RUNTIME_DIRECTORY``) under the unit, checked to be ours and made 0700; outside
systemd a fresh ``mkdtemp`` directory (0700, a name nobody could have planted).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from appliance.errors import ApplianceError

# sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107
RUNTIME_DIR_ENV = "RUNTIME_DIRECTORY"


class SocketDirError(ApplianceError):
    """The engines' socket directory is missing, foreign or too open (exit 1)."""

    exit_code = 1


@dataclass(frozen=True, slots=True)
class EngineAddress:
    """A Unix socket path, or a TCP port on 127.0.0.1 (exactly one of the two)."""

    uds: str | None = None
    port: int | None = None

    def __post_init__(self) -> None:
        if (self.uds is None) == (self.port is None):
            raise ValueError("an engine address is a socket path or a port, not both")

    @property
    def host(self) -> str:
        """The Host header an engine is sent (any value works over a Unix socket)."""
        return "localhost" if self.uds is not None else f"127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}"

    def __str__(self) -> str:
        return f"unix:{self.uds}" if self.uds is not None else f"127.0.0.1:{self.port}"

    def connector(self, **kwargs: object) -> aiohttp.BaseConnector:
        """An aiohttp connector that reaches this engine (and nothing else)."""
        if self.uds is not None:
            return aiohttp.UnixConnector(path=self.uds, **kwargs)  # type: ignore[arg-type]
        return aiohttp.TCPConnector(**kwargs)  # type: ignore[arg-type]

    async def connect(
        self, factory: Callable[[], asyncio.Protocol]
    ) -> tuple[asyncio.BaseTransport, asyncio.Protocol]:
        loop = asyncio.get_running_loop()
        if self.uds is not None:
            return await loop.create_unix_connection(factory, self.uds)
        assert self.port is not None  # __post_init__: one of the two is set
        return await loop.create_connection(factory, "127.0.0.1", self.port)


def private_socket_dir(env: Mapping[str, str]) -> tuple[Path, bool]:
    """The directory for engine sockets, and whether we created it (then we remove it).

    Under systemd, ``$RUNTIME_DIRECTORY`` (the unit's ``RuntimeDirectory=``): it must be
    a real directory owned by us; group and other access is taken away. Otherwise a new
    ``mkdtemp`` directory under ``$XDG_RUNTIME_DIR`` or the temp dir.
    """
    given = env.get(RUNTIME_DIR_ENV, "").split(":")[0]
    if not given:
        base = env.get("XDG_RUNTIME_DIR") or None
        if base is not None and not os.path.isdir(base):
            base = None
        return Path(tempfile.mkdtemp(prefix="llm-appliance-", dir=base)), True
    path = Path(given)
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise SocketDirError(f"${RUNTIME_DIR_ENV} = {given}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SocketDirError(f"${RUNTIME_DIR_ENV} = {given}: not a directory (or a symlink)")
    if st.st_uid != os.geteuid():
        raise SocketDirError(
            f"${RUNTIME_DIR_ENV} = {given}: owned by uid {st.st_uid}, not by us "
            f"(uid {os.geteuid()}); engine sockets must live in a directory of our own"
        )
    if st.st_mode & 0o077:
        # systemd's default RuntimeDirectoryMode is 0755; the unit asks for 0700.
        os.chmod(path, 0o700)
    return path, False


def socket_path(directory: Path, engine_id: int) -> str:
    path = str(directory / f"engine{engine_id}.sock")
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise SocketDirError(
            f"engine socket path {path} is longer than {MAX_SOCKET_PATH} bytes "
            f"(the Unix socket limit): set ${RUNTIME_DIR_ENV} to a shorter directory"
        )
    return path


def remove_stale_socket(path: str) -> None:
    """Remove a socket left by an engine that died (vLLM will not bind over it).

    Only a socket is removed: the directory is ours alone, so anything else there is a
    mistake worth an error from vLLM rather than a silent delete.
    """
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


# ---- TCP: is the listener on our port one of the engine's own processes? ----------------

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
_LOOPBACK_V4 = {"0100007F", "00000000"}  # 127.0.0.1 and 0.0.0.0, as /proc shows them
# ::, ::ffff:0.0.0.0 and ::ffff:127.0.0.1 in /proc/net/tcp6's byte order (dual stack).
_LOOPBACK_V6 = {
    "00000000000000000000000000000000",
    "0000000000000000FFFF000000000000",
    "0000000000000000FFFF00000100007F",
}


def listening_inodes(port: int, proc_net: str = "/proc/net") -> set[int]:
    """Inodes of the sockets listening on 127.0.0.1:``port`` (or on every address)."""
    found: set[int] = set()
    for name, hosts in (("tcp", _LOOPBACK_V4), ("tcp6", _LOOPBACK_V6)):
        try:
            with open(os.path.join(proc_net, name)) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            host, _, hexport = fields[1].partition(":")
            if int(hexport, 16) == port and host in hosts:
                found.add(int(fields[9]))
    return found


def socket_inodes(pids: Iterable[int]) -> set[int]:
    """The socket inodes the given processes hold open (ours: no privilege needed)."""
    inodes: set[int] = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                target = os.readlink(f"{fd_dir}/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def tcp_listener_is_ours(port: int, tree_pids: Iterable[int]) -> bool | None:
    """True: the engine's tree listens on ``port``; False: someone else does; None: no one.

    Checked before every request the supervisor sends with the engine key: once our
    engine holds the listening socket no other user can bind the port, so a True here
    is not undone by a squatter between the check and the request.
    """
    listening = listening_inodes(port)
    if not listening:
        return None
    return bool(listening & socket_inodes(tree_pids))


def describe_listener(port: int) -> str:
    """Who holds ``port``, for the log: "NAME (pid N) of uid U" where /proc lets us see."""
    wanted = listening_inodes(port)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        if wanted & socket_inodes([int(entry)]):
            return f"{_proc_name(int(entry))} (pid {entry}) of uid {_proc_uid(int(entry))}"
    uid = _listener_uid(port)
    return "a process of another user" + (f" (uid {uid})" if uid is not None else "")


def _proc_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _proc_uid(pid: int) -> str:
    try:
        return str(os.stat(f"/proc/{pid}").st_uid)
    except OSError:
        return "?"


def _listener_uid(port: int) -> int | None:
    """The owner's uid of a listener on ``port``, from /proc/net/tcp's "uid" column."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            host, _, hexport = fields[1].partition(":")
            if fields[3] == _LISTEN and int(hexport, 16) == port and host in _LOOPBACK_V4:
                return int(fields[7])
    return None
