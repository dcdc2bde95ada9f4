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
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import ClientConnectorError
from aiohttp.client_proto import ResponseHandler

from appliance import sockdiag
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
        since = time.monotonic()
        transport, protocol = await loop.create_connection(factory, "127.0.0.1", self.port)
        checked.check(transport, self.port, since)
        return transport, protocol

    def _tcp_owner(self, owner: EngineOwner | None) -> EngineOwner:
        if owner is None:  # no unchecked way to a TCP engine
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
    listening = sockdiag.listening_inodes(port)
    if not listening:
        return None
    return bool(listening & socket_inodes(tree_pids))


def describe_listener(port: int) -> str:
    """Who holds ``port``, for the log: "NAME (pid N) of uid U" where /proc lets us see."""
    wanted = sockdiag.listening_inodes(port)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        if wanted & socket_inodes([int(entry)]):
            return f"{_proc_name(int(entry))} (pid {entry}) of uid {_proc_uid(int(entry))}"
    uid = sockdiag.listener_uid_in_proc(port)
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


# ---- TCP: is this new connection to the engine's port one the engine accepted? ----------

_ESTABLISHED, _SYN_RECV = 1, 3  # the kernel's TCP states


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
    # (pid, inode) of the engine's listeners, and when each was found among its fds.
    known: dict[tuple[int, int], float] = field(default_factory=dict, compare=False)

    def check(self, transport: asyncio.BaseTransport, port: int, since: float) -> None:
        """Close ``transport`` (connected after ``since``, time.monotonic()) and raise
        :class:`ForeignListener` unless its peer is ours."""
        sock = transport.get_extra_info("socket")
        local = sock.getsockname() if sock is not None else None
        why = "no socket to check" if local is None else self.refusal(local, port, since)
        if why is not None:
            transport.close()  # nothing was written: the request never left
            self.on_foreign(why)
            raise ForeignListener(errno.ECONNREFUSED, why)

    def refusal(self, local: tuple[Any, ...], port: int, since: float = 0.0) -> str | None:
        """None when the connection from ``local`` to 127.0.0.1:``port`` is the engine's;
        else why not, in words for the log."""
        pid = self.pid()
        if pid is None:
            return "the engine is not running"
        if any(p != pid for p, _ in self.known):
            self.known.clear()  # a new spawn: its listeners are found afresh
        at = (str(local[0]), int(local[1]))
        ours = tcp_connection_is_ours(at, port, pid, self.tree, self.known, since)
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
        since = time.monotonic()
        transport, proto = await super()._wrap_create_connection(*args, req=req, **kwargs)
        try:
            self._owner.check(transport, self._port, since)
        except ForeignListener as exc:
            raise ClientConnectorError(req.connection_key, exc) from None
        return transport, proto


def tcp_connection_is_ours(
    local: tuple[str, int],
    port: int,
    pid: int,
    tree: Callable[[int], Iterable[int]],
    known: dict[tuple[int, int], float] | None = None,
    since: float = 0.0,
) -> bool:
    """Whether our connection from ``local`` (made after ``since``) to 127.0.0.1:``port``
    reached the engine whose API server is ``pid``.

    The inode :func:`connection_inodes` names must be among the fds of the engine's
    processes (the API server's, else its tree's). That costs a readlink per fd (ms for
    an engine with a thousand connections), so the listeners found there go in
    ``known``, with when: a connection made after that, while they are still all that
    listens on the port, was queued by them (no other user's socket can listen beside
    ours, see :func:`connection_inodes`): the engine's, accepted yet or not.
    """
    known = {} if known is None else known
    end, listening = connection_inodes(local[0], local[1], port)
    if end is None:
        return False
    if listening and all(known.get((pid, i), since) < since for i in listening):
        return True
    wanted = {end} if end else listening
    if not wanted:
        return False
    held = socket_inodes([pid])
    if not wanted <= held:
        held |= socket_inodes(set(tree(pid)) - {pid})
    now = time.monotonic()
    for inode in listening & held:
        known.setdefault((pid, inode), now)
    return wanted <= held


def connection_inodes(
    local_ip: str, local_port: int, port: int, diag: bool = True, proc_net: str = "/proc/net"
) -> tuple[int | None, set[int]]:
    """The inode of our connection's server end (0: not yet accepted; None: no such
    connection now, or one closed already) and those of the sockets listening on the
    port where it could have been queued (127.0.0.1, or every address).

    The server end is looked up by its 4-tuple (:mod:`appliance.sockdiag`; /proc/net/tcp
    where that cannot be used, or ``diag`` is False). One the engine has not yet
    accept()ed has inode 0 and belongs to no fd: it waits in the queue of a listener on
    the port, so then every such listener must be the engine's. That is sound without
    waiting for the accept: a socket of another user cannot listen on a port our
    listener holds (Linux refuses the bind or the listen, and SO_REUSEPORT sharing needs
    the same uid and the option on our socket too), and a listener's queue dies with it
    (its connections are reset, never handed on).
    """
    server, client = ("127.0.0.1", port), (local_ip, local_port)
    if diag:
        with contextlib.suppress(OSError):
            found = sockdiag.find(server, client)
            return _end(found), _diag_listening_inodes(port)
    found = sockdiag.find_in_proc(server, client, proc_net)
    return _end(found), sockdiag.listening_inodes(port, proc_net)


def _end(found: sockdiag.SockInfo | None) -> int | None:
    if found is None:
        return None  # reset already
    if found.inode == 0 and found.state not in (_ESTABLISHED, _SYN_RECV):
        return None  # accepted and closed already: not a connection to send on
    return found.inode


def _diag_listening_inodes(port: int) -> set[int]:
    hosts = {"127.0.0.1", "0.0.0.0", "::", "::ffff:127.0.0.1", "::ffff:0.0.0.0"}
    return {s.inode for s in sockdiag.listeners(port) if s.local[0] in hosts}
