"""bench.pipe: what a client sends reaches the engine's socket and the engine's answer
comes back whole, byte for byte, on each connection of its own."""

from __future__ import annotations

import socket
import tempfile
import threading
from pathlib import Path

from bench.pipe import run_pipe


def _engine(path: str, ready: threading.Event) -> None:
    """One connection at a time: reads a message, answers it reversed, in two writes.
    (run_pipe's own readiness probe is a connection too, closed without a byte.)"""
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        srv.listen()
        ready.set()
        while True:
            conn, _ = srv.accept()
            with conn:
                line = conn.recv(1024)
                if line:
                    conn.sendall(line[::-1])
                    conn.sendall(b"|" + line[::-1])


def test_bytes_go_both_ways_per_connection() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "engine.sock")
        ready = threading.Event()
        threading.Thread(target=_engine, args=(path, ready), daemon=True).start()
        assert ready.wait(5)
        with run_pipe(path) as pipe:
            for msg in (b"hello engine", b"second one"):
                with socket.create_connection(("127.0.0.1", pipe.port), 5) as c:
                    c.sendall(msg)
                    want = msg[::-1] + b"|" + msg[::-1]
                    got = b""
                    while len(got) < len(want):
                        piece = c.recv(1024)
                        assert piece, f"closed after {got!r}"
                        got += piece
                    assert got == want
