"""A new connection to a TCP engine is the engine's only if /proc says its server end is.

The server end of our connection is looked up by its 4-tuple in /proc/net/tcp (or tcp6)
and its inode must be among the engine's fds; one still in the accept queue (inode 0)
counts when every listener on the port is the engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.endpoint import (
    EngineAddress,
    EngineOwner,
    ForeignListener,
    server_side,
    tcp_connection_is_ours,
)

OWN = {os.getpid()}


def own_tree(pid: int) -> set[int]:
    return {pid}


@contextlib.contextmanager
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield sock
    finally:
        sock.close()


def test_an_established_connection_is_found_by_its_four_tuple() -> None:
    with listener() as lsock, socket.create_connection(lsock.getsockname()) as client:
        port = lsock.getsockname()[1]
        ip, local_port = client.getsockname()
        # Not accepted yet: the server end exists, in the listener's queue, with no inode.
        assert server_side(ip, local_port, port) == ("01", 0)
        assert tcp_connection_is_ours(ip, local_port, port, os.getpid(), own_tree)
        accepted, _ = lsock.accept()
        with accepted:
            inode = os.fstat(accepted.fileno()).st_ino
            assert server_side(ip, local_port, port) == ("01", inode)
            assert tcp_connection_is_ours(ip, local_port, port, os.getpid(), own_tree)
            # Any other process is not the engine (a pid with no such fd).
            assert not tcp_connection_is_ours(ip, local_port, port, 1, lambda pid: {pid})


SQUATTER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0))
s.listen(8)
print(s.getsockname()[1], flush=True)
conn, _ = s.accept()
print("accepted", flush=True)
sys.stdin.read()
"""


def test_a_connection_to_another_process_s_listener_is_not_ours() -> None:
    """Before and after that process accepts: its queue and its socket are not ours."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SQUATTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as client:
            ip, local_port = client.getsockname()
            ours = tcp_connection_is_ours(ip, local_port, port, os.getpid(), own_tree)
            assert proc.stdout.readline().strip() == "accepted"
            assert not ours  # in its queue, or already its socket: either way not ours
            assert not tcp_connection_is_ours(ip, local_port, port, os.getpid(), own_tree)
            # ... and it is that process's, whose fds are where its inode is.
            assert tcp_connection_is_ours(ip, local_port, port, proc.pid, lambda pid: {pid})
    finally:
        proc.kill()
        proc.wait()


TCP_HEADER = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
    "timeout inode\n"
)


def proc_line(n: int, local: str, remote: str, state: str, inode: int) -> str:
    return (
        f"   {n}: {local} {remote} {state} 00000000:00000000 00:00000000 00000000  "
        f"65534        0 {inode} 1 0000000000000000 20 4 30 10 -1\n"
    )


def test_proc_net_lines_are_read_by_their_columns(tmp_path: Path) -> None:
    """127.0.0.1:8100 <- 127.0.0.1:50000 as /proc shows it (little-endian address, hex
    port), in tcp, and in tcp6 as a v4-mapped address for a dual-stack listener."""
    (tmp_path / "tcp").write_text(
        TCP_HEADER
        + proc_line(0, "0100007F:1FA4", "00000000:0000", "0A", 111)  # the listener
        + proc_line(1, "0100007F:C350", "0100007F:1FA4", "01", 0)  # our own end
        + proc_line(2, "0100007F:1FA4", "0100007F:C350", "01", 4242)  # the server end
    )
    (tmp_path / "tcp6").write_text(TCP_HEADER)
    assert server_side("127.0.0.1", 50000, 8100, str(tmp_path)) == ("01", 4242)
    assert server_side("127.0.0.1", 50001, 8100, str(tmp_path)) is None
    mapped = "0000000000000000FFFF00000100007F"
    (tmp_path / "tcp").write_text(TCP_HEADER)
    (tmp_path / "tcp6").write_text(
        TCP_HEADER + proc_line(0, f"{mapped}:1FA4", f"{mapped}:C350", "03", 0)
    )
    assert server_side("127.0.0.1", 50000, 8100, str(tmp_path)) == ("03", 0)


def test_a_closed_server_end_or_a_foreign_listener_is_not_ours(tmp_path: Path) -> None:
    """inode 0 counts only while waiting in a listener's queue, and only when every
    listener on the port is the engine's (here: no process holds inode 111)."""
    (tmp_path / "tcp6").write_text(TCP_HEADER)
    for state in ("01", "06"):  # ESTABLISHED in the queue; TIME_WAIT (closed already)
        (tmp_path / "tcp").write_text(
            TCP_HEADER
            + proc_line(0, "0100007F:1FA4", "00000000:0000", "0A", 111)
            + proc_line(1, "0100007F:1FA4", "0100007F:C350", state, 0)
        )
        assert not tcp_connection_is_ours(
            "127.0.0.1", 50000, 8100, os.getpid(), own_tree, str(tmp_path)
        )


async def test_a_refused_connection_is_closed_unsent_and_reported() -> None:
    """EngineAddress.connect with the owner: a listener of another process (here: a pid
    that holds none of its sockets) is refused before a byte, and the owner hears why."""
    got: list[bytes] = []
    all_three = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.read(100))  # b"": closed with nothing written
        writer.close()
        if len(got) == 3:
            all_three.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    told: list[str] = []
    stranger = EngineOwner(pid=lambda: 1, tree=lambda pid: {pid}, on_foreign=told.append)
    gone = EngineOwner(pid=lambda: None, tree=lambda pid: {pid}, on_foreign=told.append)
    mine = EngineOwner(pid=os.getpid, tree=own_tree)
    try:
        address = EngineAddress(port=port)
        for owner in (stranger, gone):
            with pytest.raises(ForeignListener):
                await address.connect(asyncio.Protocol, owner)
        assert told[0].startswith(f"port {port} is answered by ")
        assert told[1] == "the engine is not running"
        transport, _ = await address.connect(asyncio.Protocol, mine)
        transport.close()
        with pytest.raises(ValueError):
            await address.connect(asyncio.Protocol, None)  # no unchecked way in
        with pytest.raises(ValueError):
            address.connector(None)
        await asyncio.wait_for(all_three.wait(), 10)  # each connection seen to its end
    finally:
        server.close()
        await server.wait_closed()
    assert got == [b"", b"", b""]  # not one byte reached it, even on the one that was ours
