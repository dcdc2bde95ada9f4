"""Where an engine listens, and how the supervisor and the gateway reach it.

An engine listens on a **Unix socket** in a directory only the service's user can
enter (``engine.listen = "unix"``, the default): no other local account can connect
to it, bind its address first, or answer in its place, and vLLM's routes that its own
``--api-key`` leaves open (``/invocations``, ``/tokenize``, ...) are out of their reach
too. With ``engine.listen = "tcp"`` it listens on ``127.0.0.1:port``, which any local
process can bind while the engine is still importing, or the moment it dies; then
:func:`tcp_listener_is_ours` tells whether the socket listening there belongs to the
engine's own processes, and every new connection to the port is checked to have
reached them before its first byte is written (:func:`tcp_connection_is_ours`). Both
the supervisor's health checks and the gateway's relay reach an engine only through
:meth:`EngineAddress.connect` or :meth:`EngineAddress.connector`, which apply that check
(an :class:`EngineOwner` is required for a TCP engine), so no path reaches a TCP engine
unchecked.

The directory (:func:`private_socket_dir`) is systemd's ``RuntimeDirectory=``
(``$RUNTIME_DIRECTORY``) under the unit, checked to be ours and made 0700; outside
systemd a fresh ``mkdtemp`` directory (0700, a name nobody could have planted).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import ClientConnectorError
from aiohttp.client_proto import ResponseHandler

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

    def connector(self, owner: EngineOwner | None, **kwargs: object) -> aiohttp.BaseConnector:
        """An aiohttp connector that reaches this engine (and nothing else): over TCP,
        each new connection is checked to be ``owner``'s before a byte is written."""
        if self.uds is not None:
            return aiohttp.UnixConnector(path=self.uds, **kwargs)  # type: ignore[arg-type]
        assert self.port is not None  # __post_init__: one of the two is set
        return CheckedTCPConnector(self._tcp_owner(owner), self.port, **kwargs)

    async def connect(
        self, factory: Callable[[], asyncio.Protocol], owner: EngineOwner | None
    ) -> tuple[asyncio.BaseTransport, asyncio.Protocol]:
        """A new connection to the engine; over TCP, checked to be ``owner``'s before its
        first byte (:class:`ForeignListener` when not: closed, nothing sent)."""
        loop = asyncio.get_running_loop()
        if self.uds is not None:
            return await loop.create_unix_connection(factory, self.uds)
        checked = self._tcp_owner(owner)
        assert self.port is not None  # __post_init__: one of the two is set
        transport, protocol = await loop.create_connection(factory, "127.0.0.1", self.port)
        checked.check(transport, self.port)
        return transport, protocol

    def _tcp_owner(self, owner: EngineOwner | None) -> EngineOwner:
        if owner is None:
            raise ValueError(f"{self}: a TCP engine is reached only with its owner to check")
        return owner


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


# ---- TCP: is this new connection to the engine's port one the engine accepted? ----------

_ESTABLISHED, _SYN_RECV = "01", "03"
_V4_MAPPED = "0000000000000000FFFF0000"  # ::ffff:a.b.c.d in /proc/net/tcp6, before a.b.c.d


class ForeignListener(ConnectionRefusedError):
    """A new connection to a TCP engine's port reached someone else's socket: it was
    closed before a byte was written (a connect failure, retried elsewhere)."""


@dataclass(frozen=True, slots=True)
class EngineOwner:
    """Whose a TCP engine's connections must be, and who hears of one that was not.

    ``pid`` is the API server's pid now (None: not running; read at every check, so a
    restart's new process counts and a dead one's never does), ``tree`` every pid of the
    tree under it (``proctree.tree_pids``: this layer cannot import it), ``on_foreign``
    is told why a connection was refused (the gateway takes the engine out of routing).
    """

    pid: Callable[[], int | None]
    tree: Callable[[int], Iterable[int]]
    on_foreign: Callable[[str], None] = lambda why: None

    def check(self, transport: asyncio.BaseTransport, port: int) -> None:
        """Close ``transport`` and raise :class:`ForeignListener` unless its peer is ours."""
        sock = transport.get_extra_info("socket")
        why = "no socket to check" if sock is None else self.refusal(sock.getsockname(), port)
        if why is not None:
            transport.close()  # nothing was written: the request never left
            self.on_foreign(why)
            raise ForeignListener(errno.ECONNREFUSED, why)

    def refusal(self, local: tuple[Any, ...], port: int) -> str | None:
        """None when the connection from ``local`` to 127.0.0.1:``port`` is the engine's;
        else why not, in words for the log."""
        pid = self.pid()
        if pid is None:
            return "the engine is not running"
        ours = tcp_connection_is_ours(str(local[0]), int(local[1]), port, pid, self.tree)
        return None if ours else f"port {port} is answered by {describe_listener(port)}"


class CheckedTCPConnector(aiohttp.TCPConnector):
    """aiohttp's TCP connector, checking each new connection with :class:`EngineOwner`
    before aiohttp writes a request on it (a refusal is a connect error to aiohttp)."""

    def __init__(self, owner: EngineOwner, port: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._owner = owner
        self._port = port

    async def _wrap_create_connection(
        self, *args: Any, req: aiohttp.ClientRequest, **kwargs: Any
    ) -> tuple[asyncio.Transport, ResponseHandler]:
        # aiohttp's own step from a connected socket to a transport (no byte written yet);
        # overriding it is how a connector may look at the connection before use.
        transport, proto = await super()._wrap_create_connection(*args, req=req, **kwargs)
        try:
            self._owner.check(transport, self._port)
        except ForeignListener as exc:
            raise ClientConnectorError(req.connection_key, exc) from None
        return transport, proto


def tcp_connection_is_ours(
    local_ip: str,
    local_port: int,
    port: int,
    pid: int,
    tree: Callable[[int], Iterable[int]],
    proc_net: str = "/proc/net",
) -> bool:
    """Whether our connection from ``local_ip:local_port`` to 127.0.0.1:``port`` reached
    a socket of the engine whose API server is ``pid``.

    The server side of the connection is looked up by its 4-tuple in /proc/net/tcp (and
    tcp6, for a dual-stack listener); its inode must be among the fds of the engine's
    processes (the API server's first, the whole tree only when that misses). A
    connection the engine has not yet accept()ed shows inode 0 and belongs to no fd
    yet: it sits in the queue of a listener on that port, so then every listener there
    must be the engine's. That is sound without waiting for the accept: a socket of
    another user cannot listen on a port our listener holds (Linux refuses the bind, and
    SO_REUSEPORT sharing needs the same uid and the option on our socket too), and a
    listener's queue dies with it (its connections are reset, never handed on).
    """
    found = server_side(local_ip, local_port, port, proc_net)
    if found is None:
        return False  # reset or closed already: nobody of ours holds it
    state, inode = found
    if inode == 0:
        if state not in (_ESTABLISHED, _SYN_RECV):
            return False  # accepted and closed already: not a connection to send on
        wanted = listening_inodes(port, proc_net)
    else:
        wanted = {inode}
    if not wanted:
        return False
    held = socket_inodes([pid])
    if wanted <= held:
        return True
    return wanted <= held | socket_inodes(set(tree(pid)) - {pid})


def server_side(
    local_ip: str, local_port: int, port: int, proc_net: str = "/proc/net"
) -> tuple[str, int] | None:
    """The state and inode of the server's end of our connection from ``local_ip:
    local_port`` to 127.0.0.1:``port`` (its local address is our remote one), from
    /proc/net/tcp or tcp6; None when the kernel has no such socket."""
    v4 = socket.inet_aton(local_ip)[::-1].hex().upper()
    server_v4 = "0100007F"
    for name, prefix in (("tcp", ""), ("tcp6", _V4_MAPPED)):
        needle = f" {prefix}{server_v4}:{port:04X} {prefix}{v4}:{local_port:04X} "
        try:
            with open(os.path.join(proc_net, name)) as f:
                text = f.read()
        except OSError:
            continue
        at = text.find(needle)
        if at < 0:
            continue
        fields = text[at : text.find("\n", at)].split()
        return fields[2], int(fields[8])
    return None
