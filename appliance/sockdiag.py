"""One TCP socket, or a port's listeners, looked up in the kernel by address (sock_diag).

What ``ss`` uses (``NETLINK_SOCK_DIAG``, ``inet_diag``). Reading ``/proc/net/tcp``
instead makes the kernel print every TCP socket on the box: measured at 6 to 16 ms per
read with 2,500 sockets on the test VM, which would have been the cost of every new
connection to a TCP engine. A lookup by 4-tuple here is one hash lookup in the kernel
(tens of microseconds from Python, ``bench/connection_check.py``). No privilege is
needed: any process may ask about any socket's owner uid and inode. Where sock_diag is
not available (OSError: a seccomp filter, a kernel without it), :func:`find_in_proc`
reads the same answer from ``/proc/net/tcp`` and ``tcp6``, slowly.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
TCP_LISTEN = 10
NO_COOKIE = 0xFFFFFFFF

_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
# struct inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid
# (ports and addresses in network order, interface and cookie in host order).
_REQUEST = struct.Struct("=BBBBI")
_SOCKID = struct.Struct("!HH16s16s")
_SOCKID_TAIL = struct.Struct("=III")
# struct inet_diag_msg: family, state, timer, retrans (1 byte each), the sockid (48
# bytes), expires, rqueue, wqueue, then uid and inode at offset 64.
_UID_INODE = struct.Struct("=II")


@dataclass(frozen=True, slots=True)
class SockInfo:
    state: int  # the kernel's TCP state: 1 ESTABLISHED, 3 SYN_RECV, 10 LISTEN, ...
    uid: int
    inode: int  # 0: no file holds it (in a listener's accept queue, or orphaned)
    local: tuple[str, int]  # (address, port) as the socket sees itself


def _addr(family: int, ip: str) -> bytes:
    return socket.inet_pton(family, ip).ljust(16, b"\0")


def _request(family: int, states: int, flags: int, sockid: bytes) -> bytes:
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, states) + sockid
    return _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, flags, 1, 0) + body


def _ask(request: bytes, dump: bool) -> list[SockInfo]:
    """Send one request; every socket the kernel answers with (raises OSError)."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.sendall(request)
        found: list[SockInfo] = []
        while True:
            data = nl.recv(65536)
            at = 0
            while at + _HEADER.size <= len(data):
                length, kind, _, _, _ = _HEADER.unpack_from(data, at)
                if kind == NLMSG_DONE or length < _HEADER.size:
                    return found
                if kind == NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", data, at + _HEADER.size)
                    if err in (0, -errno.ENOENT):
                        return found
                    raise OSError(-err, os.strerror(-err))
                if kind == SOCK_DIAG_BY_FAMILY:
                    found.append(_info(data, at + _HEADER.size))
                at += (length + 3) & ~3
            if not dump:  # one answer, no NLMSG_DONE after it
                return found


def _info(data: bytes, at: int) -> SockInfo:
    family, state = data[at], data[at + 1]
    sport, _, src, _ = _SOCKID.unpack_from(data, at + 4)
    uid, inode = _UID_INODE.unpack_from(data, at + 64)
    size = 4 if family == socket.AF_INET else 16
    return SockInfo(state, uid, inode, (socket.inet_ntop(family, src[:size]), sport))


def find(local: tuple[str, int], remote: tuple[str, int]) -> SockInfo | None:
    """The IPv4 TCP socket whose own address is ``local`` and peer ``remote`` (None: no
    such socket). Raises OSError when sock_diag cannot be used."""
    sockid = _SOCKID.pack(
        local[1], remote[1], _addr(socket.AF_INET, local[0]), _addr(socket.AF_INET, remote[0])
    ) + _SOCKID_TAIL.pack(0, NO_COOKIE, NO_COOKIE)
    found = _ask(_request(socket.AF_INET, 0xFFFFFFFF, NLM_F_REQUEST, sockid), dump=False)
    # With no such connection the kernel's lookup falls back to the port's listener.
    return next((s for s in found if s.state != TCP_LISTEN), None)


def listeners(port: int) -> list[SockInfo]:
    """Every TCP socket listening on ``port``, on any address, IPv4 and IPv6."""
    sockid = _SOCKID.pack(0, 0, bytes(16), bytes(16)) + _SOCKID_TAIL.pack(0, NO_COOKIE, NO_COOKIE)
    found: list[SockInfo] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        req = _request(family, 1 << TCP_LISTEN, NLM_F_REQUEST | NLM_F_DUMP, sockid)
        found += [s for s in _ask(req, dump=True) if s.local[1] == port]
    return found


_V4_MAPPED = "0000000000000000FFFF0000"  # ::ffff:a.b.c.d in /proc/net/tcp6, before a.b.c.d


def find_in_proc(
    local: tuple[str, int], remote: tuple[str, int], proc_net: str = "/proc/net"
) -> SockInfo | None:
    """:func:`find` from /proc/net/tcp, or tcp6 for a dual-stack socket (its IPv4
    addresses mapped); ``uid`` and ``inode`` from their columns."""
    ours = socket.inet_aton(local[0])[::-1].hex().upper()
    theirs = socket.inet_aton(remote[0])[::-1].hex().upper()
    for name, prefix in (("tcp", ""), ("tcp6", _V4_MAPPED)):
        needle = f" {prefix}{ours}:{local[1]:04X} {prefix}{theirs}:{remote[1]:04X} "
        try:
            with open(os.path.join(proc_net, name)) as f:
                text = f.read()
        except OSError:
            continue
        at = text.find(needle)
        if at >= 0:
            # local remote st tx:rx tr:when retrnsmt uid timeout inode ...
            fields = text[at : text.find("\n", at)].split()
            return SockInfo(int(fields[2], 16), int(fields[6]), int(fields[8]), local)
    return None


# ---- /proc/net/tcp: who listens on a port (the supervisor's listener check) ------------

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


def listener_uid_in_proc(port: int) -> int | None:
    """The owner's uid of a listener on 127.0.0.1:``port`` (or every address), from
    /proc/net/tcp's "uid" column."""
    with contextlib.suppress(OSError):
        with open("/proc/net/tcp") as f:
            lines = f.read().splitlines()[1:]
        for line in lines:
            fields = line.split()
            host, _, hexport = fields[1].partition(":")
            if fields[3] == _LISTEN and int(hexport, 16) == port and host in _LOOPBACK_V4:
                return int(fields[7])
    return None
