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
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance import sockdiag
from appliance.endpoint import (
    EngineAddress,
    EngineOwner,
    ForeignListener,
    connection_inodes,
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


@pytest.mark.parametrize("diag", [True, False], ids=["sock_diag", "proc-net-tcp"])
def test_an_established_connection_is_found_by_its_four_tuple(diag: bool) -> None:
    with listener() as lsock, socket.create_connection(lsock.getsockname()) as client:
        port = lsock.getsockname()[1]
        local = client.getsockname()
        listening = {os.fstat(lsock.fileno()).st_ino}
        # Not accepted yet: the server end waits in the listener's queue, with no inode,
        # so the listener is what must be the engine's.
        assert connection_inodes(*local, port, diag) == (0, listening)
        assert tcp_connection_is_ours(local, port, os.getpid(), own_tree)
        accepted, _ = lsock.accept()
        with accepted:
            inode = os.fstat(accepted.fileno()).st_ino
            assert connection_inodes(*local, port, diag) == (inode, listening)
            assert tcp_connection_is_ours(local, port, os.getpid(), own_tree)
            # Any other process is not the engine (a pid with no such fd).
            assert not tcp_connection_is_ours(local, port, 1, lambda pid: {pid})
        # A 4-tuple with no connection: nothing of ours.
        assert connection_inodes(local[0], local[1] ^ 1, port, diag) == (None, listening)


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
            local = client.getsockname()
            ours = tcp_connection_is_ours(local, port, os.getpid(), own_tree)
            assert proc.stdout.readline().strip() == "accepted"
            assert not ours  # in its queue, or already its socket: either way not ours
            assert not tcp_connection_is_ours(local, port, os.getpid(), own_tree)
            # ... and it is that process's, whose fds are where its inode is.
            assert tcp_connection_is_ours(local, port, proc.pid, lambda pid: {pid})
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
    server = ("127.0.0.1", 8100)
    found = sockdiag.find_in_proc(server, ("127.0.0.1", 50000), str(tmp_path))
    assert found is not None and (found.state, found.uid, found.inode) == (1, 65534, 4242)
    assert sockdiag.find_in_proc(server, ("127.0.0.1", 50001), str(tmp_path)) is None
    mapped = "0000000000000000FFFF00000100007F"
    (tmp_path / "tcp").write_text(TCP_HEADER)
    (tmp_path / "tcp6").write_text(
        TCP_HEADER + proc_line(0, f"{mapped}:1FA4", f"{mapped}:C350", "03", 0)
    )
    found = sockdiag.find_in_proc(server, ("127.0.0.1", 50000), str(tmp_path))
    assert found is not None and (found.state, found.inode) == (3, 0)


def test_a_queued_connection_needs_the_listener_a_closed_one_counts_for_none(
    tmp_path: Path,
) -> None:
    """inode 0 counts only while waiting in a listener's queue, and then the listener
    must be the engine's; a server end already closed is no engine's."""
    (tmp_path / "tcp6").write_text(TCP_HEADER)
    for state in ("01", "06"):  # ESTABLISHED in the queue; TIME_WAIT (closed already)
        (tmp_path / "tcp").write_text(
            TCP_HEADER
            + proc_line(0, "0100007F:1FA4", "00000000:0000", "0A", 111)
            + proc_line(1, "0100007F:1FA4", "0100007F:C350", state, 0)
        )
        assert connection_inodes("127.0.0.1", 50000, 8100, False, str(tmp_path)) == (
            0 if state == "01" else None,
            {111},
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


def test_listeners_found_among_the_engine_s_fds_spare_the_next_connections_the_scan() -> None:
    """Once the engine's listener was found in its fds, a connection made after that,
    while it is still all that listens on the port, is the engine's without reading
    the engine's fds again (pid 1 here holds none of these sockets)."""
    with listener() as lsock, socket.create_connection(lsock.getsockname()) as client:
        port = lsock.getsockname()[1]
        known: dict[tuple[int, int], float] = {}
        before = time.monotonic()
        assert tcp_connection_is_ours(client.getsockname(), port, os.getpid(), own_tree, known)
        assert set(known) == {(os.getpid(), os.fstat(lsock.fileno()).st_ino)}
        remembered = {(1, inode): when for (_, inode), when in known.items()}
        with socket.create_connection(lsock.getsockname()) as later:
            since = time.monotonic()
            assert tcp_connection_is_ours(later.getsockname(), port, 1, own_tree, remembered, since)
            # A connection made before the listener was found is checked in full.
            assert not tcp_connection_is_ours(
                later.getsockname(), port, 1, own_tree, remembered, before
            )
