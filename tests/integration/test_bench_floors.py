"""bench.floors: each bare relay passes a client's POST to the engine's socket and the
engine's chunked stream back, chunk for chunk, request after request on one connection."""

from __future__ import annotations

import socket
import tempfile
import threading
from pathlib import Path

import pytest

from bench.floors import SERVERS, run_floor

EVENTS = (b"data: one\n\n", b"data: [DONE]\n\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _read_request(conn: socket.socket, buf: bytearray) -> tuple[bytes, bytes] | None:
    """The next request's head and body off ``conn``; None once the client closed."""
    while b"\r\n\r\n" not in buf:
        piece = conn.recv(65536)
        if not piece:
            return None
        buf += piece
    end = buf.index(b"\r\n\r\n")
    head = bytes(buf[:end])
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(buf) < end + 4 + length:
        buf += conn.recv(65536)
    body = bytes(buf[end + 4 : end + 4 + length])
    del buf[: end + 4 + length]
    return head, body


def _engine(path: str, ready: threading.Event, seen: list[tuple[bytes, bytes]]) -> None:
    """A keep-alive HTTP/1.1 engine: each POST answered with EVENTS, one chunk each."""
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        srv.listen()
        ready.set()
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=_serve, args=(conn, seen), daemon=True).start()


def _serve(conn: socket.socket, seen: list[tuple[bytes, bytes]]) -> None:
    buf = bytearray()
    with conn:
        while (request := _read_request(conn, buf)) is not None:
            seen.append(request)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            for event in EVENTS:
                conn.sendall(_chunk(event))
            conn.sendall(b"0\r\n\r\n")


def _post(c: socket.socket, body: bytes) -> bytes:
    """One POST on ``c``; the answer, through the end of its chunked body."""
    c.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer engine-key\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    got = b""
    while not got.endswith(b"\r\n0\r\n\r\n"):
        piece = c.recv(65536)
        assert piece, f"closed after {got!r}"
        got += piece
    return got


@pytest.mark.parametrize("server", SERVERS)
def test_a_stream_goes_through_chunk_for_chunk(server: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "engine.sock")
        ready = threading.Event()
        seen: list[tuple[bytes, bytes]] = []
        threading.Thread(target=_engine, args=(path, ready, seen), daemon=True).start()
        assert ready.wait(5)
        with (
            run_floor(server, path) as floor,
            socket.create_connection(("127.0.0.1", floor.port), 10) as c,
        ):
            for body in (b'{"n": 1}', b'{"n": 2}'):
                answer = _post(c, body)
                head, _, chunks = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200")
                assert b"transfer-encoding: chunked" in head.lower()
                assert chunks == b"".join(_chunk(e) for e in EVENTS) + b"0\r\n\r\n"
        assert [body for _, body in seen] == [b'{"n": 1}', b'{"n": 2}']
        assert all(b"Authorization: Bearer engine-key" in head for head, _ in seen)
