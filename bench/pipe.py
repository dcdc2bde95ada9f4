"""The floor of a Python relay: a byte pipe on uvloop, no HTTP at all.

Each client connection (TCP, loopback) gets its own connection to the engine's Unix
socket, and bytes are copied both ways as they come, one ``transport.write`` per read:
what any relay in Python pays per chunk for its event loop, its wake-ups and its system
calls, and nothing for HTTP, keys, routing or accounting. ``bench.vs_nginx --pipe``
puts it beside the appliance and nginx: the appliance's distance to the pipe is what its
per-request and per-chunk Python costs, the pipe's distance to nginx what the
interpreter and uvloop cost. It is no proxy: it sends the engine's bytes unchecked and
never reuses an engine connection.

    .venv/bin/python -m bench.pipe --uds ENGINE.sock --port PORT
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import uvloop


class _Side(asyncio.Protocol):
    """One end of a pipe: what it reads goes to its peer's transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.early: list[bytes] = []  # client bytes before the engine connection is up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.early.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


async def serve(uds: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    connecting: set[asyncio.Task[None]] = set()  # referenced until done (tasks are weak)

    async def connect(client: _Side) -> None:
        engine = _Side()
        engine.peer, client.peer = client, engine
        await loop.create_unix_connection(lambda: engine, uds)
        assert engine.transport is not None
        for data in client.early:
            engine.transport.write(data)
        client.early.clear()

    def accept() -> _Side:
        client = _Side()
        task = loop.create_task(connect(client))
        connecting.add(task)
        task.add_done_callback(connecting.discard)
        return client

    server = await loop.create_server(accept, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


@dataclass
class RelayProcess:
    """A bench relay (this pipe, bench.floors' relays) in a process of its own."""

    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def processes(self) -> list[psutil.Process]:
        return [psutil.Process(self.proc.pid)]


@contextlib.contextmanager
def run_relay(module: list[str], upstream_socket: str) -> Iterator[RelayProcess]:
    """``python -m MODULE... --uds SOCKET --port PORT`` on a free loopback port, once it
    listens; killed after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    argv = [sys.executable, "-m", *module, "--uds", upstream_socket, "--port", str(port)]
    proc = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{module[0]} did not listen (exit {proc.poll()})")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            time.sleep(0.05)
        yield RelayProcess(proc, port)
    finally:
        proc.kill()
        proc.wait()


def run_pipe(upstream_socket: str) -> contextlib.AbstractContextManager[RelayProcess]:
    """The pipe in a process of its own on a free loopback port; stopped after."""
    return run_relay(["bench.pipe"], upstream_socket)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--uds", required=True, help="the engine's Unix socket")
    ap.add_argument("--port", type=int, required=True, help="loopback TCP port to listen on")
    args = ap.parse_args()
    uvloop.run(serve(args.uds, args.port))


if __name__ == "__main__":
    main()
