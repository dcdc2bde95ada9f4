"""Responses and Messages streams, as vLLM 0.32 writes them, through the usage tap.

The streams in ``tests/data/vllm-0.32-streams`` are a real engine's bytes. Each reader
must count them exactly (the engine's own numbers, read here by parsing the last event
as JSON) on its fast path: the events that cannot carry counts are skipped by their
``event:`` line and the ones that do are read off their bytes, none parsed. Other
shapes (an echoed object holding "usage", a string with an escape, no event line) are
parsed and stay exact; generated text that looks like usage is never counted; an event
split across reads is counted once, whole, on both relay paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from appliance.endpoint import EngineAddress
from appliance.gateway.accounting.stream_tap import StreamTap
from appliance.gateway.protocols import ROUTES, messages, responses
from appliance.gateway.protocols.counts import EventUsage, Usage
from appliance.gateway.wire.http1 import count_whole_chunks, request_bytes
from appliance.gateway.wire.upstream_pool import UpstreamPool
from tests.fakes.owners import in_process

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32-streams"
PROTOCOLS = ("responses", "messages")
FAKE = '"usage":{"input_tokens":999,"output_tokens":999}'  # generated text, as the model wrote it


def events(route: str) -> list[bytes]:
    raw = (DATA / f"{route}.sse").read_bytes()
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


def named(route: str, name: str) -> bytes:
    """The first event called ``name``."""
    return next(e for e in events(route) if e.startswith(b"event: " + name.encode() + b"\n"))


def data_of(event: bytes) -> Any:
    return json.loads(event.split(b"data: ", 1)[1])


def redo(event: bytes, change: Any) -> bytes:
    """``event`` with its data changed by ``change`` and written back as vLLM writes it
    (compact, non-ASCII as is, fields in order)."""
    head, body = event.split(b"data: ", 1)
    obj = json.loads(body)
    assert json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() == body.strip()
    change(obj)
    return head + b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def engines_count(route: str) -> Usage:
    """The engine's own counts in its stream, read as JSON."""
    if route == "responses":
        usage = data_of(named(route, "response.completed"))["response"]["usage"]
    else:
        usage = data_of(named(route, "message_delta"))["usage"]
    return Usage(usage["input_tokens"], usage["output_tokens"])


def tap_for(route: str) -> StreamTap:
    spec = ROUTES[route]
    return StreamTap(strip=False, preamble=spec.preamble, reader=spec.event_usage)


def wire(payloads: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in payloads)


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The events the readers parse as JSON (their slow path), in order."""
    seen: list[bytes] = []
    for module in (responses, messages):
        real = module.sse_data

        def recording(payload: bytes, real: Any = real) -> Any:
            seen.append(payload)
            return real(payload)

        monkeypatch.setattr(module, "sse_data", recording)
    return seen


# ---- vLLM's own streams ------------------------------------------------------------------
@pytest.mark.parametrize("route", PROTOCOLS)
@pytest.mark.parametrize("per_read", [1, 3, 1000])
def test_vllms_stream_is_counted_exactly_and_parsed_nowhere(
    route: str, per_read: int, parses: list[bytes]
) -> None:
    evs, tap = events(route), tap_for(route)
    out = []
    for i in range(0, len(evs), per_read):
        piece = wire(evs[i : i + per_read])
        out.append(tap.wire(piece, count_whole_chunks(piece)))
    out.append(tap.last(b""))
    assert b"".join(out) == wire(evs)  # the client's stream, byte for byte
    assert tap.usage == engines_count(route)
    assert parses == []


@pytest.mark.parametrize("route", PROTOCOLS)
@pytest.mark.parametrize("cut", [1, 7, 100, 1000])
def test_an_event_split_across_reads_is_counted_once_http10_path(route: str, cut: int) -> None:
    raw = b"".join(events(route))
    tap, pending = tap_for(route), bytearray()
    out = [tap.sse(raw[i : i + cut], pending) for i in range(0, len(raw), cut)]
    out.append(tap.flush_sse(pending))
    assert b"".join(out) == raw
    assert tap.usage == engines_count(route)


OK_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


@contextlib.asynccontextmanager
async def engine_writing(pieces: list[bytes]) -> AsyncIterator[int]:
    """An engine on loopback that answers one request with ``pieces``, each its own write."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)  # its own read at the gateway's end
        await reader.read()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


@pytest.mark.parametrize("route", PROTOCOLS)
async def test_an_event_split_across_reads_is_counted_once_splice_path(route: str) -> None:
    """The default relay: the engine's last events arrive cut mid-size-line and mid-usage;
    the client still gets every byte, and the counts are the engine's."""
    evs = events(route)
    body = wire(evs) + b"0\r\n\r\n"
    last = body.rfind(b'"usage"')
    size_line = body.rfind(b"\r\n", 0, body.rfind(b"event: ")) + 3  # inside a size line
    cuts = sorted({len(wire(evs[:2])), size_line, last + 3, last + 20, len(body) - 4})
    pieces = [OK_HEAD + body[: cuts[0]]]
    pieces += [body[a:b] for a, b in zip(cuts, [*cuts[1:], len(body)], strict=True)]
    async with engine_writing(pieces) as port:
        pool = UpstreamPool(in_process)
        address = EngineAddress(port=port)
        conn = await pool.acquire(address)
        await conn.send(request_bytes(ROUTES[route].path, f"127.0.0.1:{port}", {}, b"{}"))
        conn.tap = tap = tap_for(route)
        await conn.wait_first_chunk()
        near, far = socket.socketpair()
        far.setblocking(False)
        transport, _ = await asyncio.get_running_loop().connect_accepted_socket(
            asyncio.Protocol, near
        )
        try:
            conn.splice_to(transport)  # type: ignore[arg-type]
            await conn.wait_spliced()
            got = b""
            while len(got) < len(wire(evs)):
                await asyncio.sleep(0.01)
                with contextlib.suppress(BlockingIOError):
                    got += far.recv(65536)
        finally:
            transport.close()
            far.close()
            pool.close()
    assert got == wire(evs)
    assert tap.usage == engines_count(route)


# ---- one event at a time: other shapes, look-alikes ----------------------------------------
def _text(obj: Any) -> None:
    """The answer's text (in the response, as the completed event repeats it) says FAKE."""
    obj["response"]["output"][0]["content"][0]["text"] = f"he wrote {FAKE} then"


def _echo(obj: Any) -> None:
    # An object the engine echoes after the usage, holding a "usage" of its own.
    obj["response"]["kv_transfer_params"] = json.loads("{" + FAKE + "}")


def _user(obj: Any) -> None:
    obj["response"]["user"] = 'a "quoted" user'


def _cached(obj: Any) -> None:
    obj["usage"] = {
        "input_tokens": 10,
        "output_tokens": 16,
        "cache_creation_input_tokens": 2,
        "cache_read_input_tokens": 26,
    }


def _stop(obj: Any) -> None:
    obj["delta"]["stop_sequence"] = 'the "end"'


def _cases() -> list[tuple[str, str, bytes, EventUsage | None, bool]]:
    done = named("responses", "response.completed")
    start, delta = named("messages", "message_start"), named("messages", "message_delta")
    return [
        # (what, route, event, what the reader says, read without parsing)
        ("completed", "responses", done, EventUsage(38, 16), True),
        ("usage-like text in the answer", "responses", redo(done, _text), EventUsage(38, 16),
         True),
        ("an echoed usage after the real one", "responses", redo(done, _echo),
         EventUsage(38, 16), False),
        ("a user with escapes", "responses", redo(done, _user), EventUsage(38, 16), False),
        # The final event's own end says what it is: no event line is needed
        ("no event line", "responses", done.split(b"\n", 1)[1], EventUsage(38, 16), True),
        ("an event line without its space, CRLF", "responses",
         done.replace(b"event: ", b"event:").replace(b"\n", b"\r\n", 1), EventUsage(38, 16),
         True),
        ("in_progress, spaced: skipped by its name", "responses",
         named("responses", "response.in_progress").replace(b'":', b'": '), None, True),
        ("message_delta without its event line", "messages", delta.split(b"\n", 1)[1],
         EventUsage(38, 16), False),
        ("created: usage null, skipped", "responses", named("responses", "response.created"),
         None, True),
        ("message_start", "messages", start, EventUsage(38, None), True),
        ("message_delta", "messages", delta, EventUsage(38, 16), True),
        ("cached prompt tokens", "messages", redo(delta, _cached), EventUsage(38, 16), True),
        ("a stop sequence with escapes", "messages", redo(delta, _stop), EventUsage(38, 16),
         False),
        ("a text delta saying usage", "messages",
         redo(named("messages", "content_block_delta"),
              lambda o: o["delta"].update(text=FAKE)), None, True),
    ]  # fmt: skip


CASES = _cases()


@pytest.mark.parametrize(
    ("route", "event", "expect", "fast"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_event_shape_is_read_exactly(
    route: str, event: bytes, expect: EventUsage | None, fast: bool, parses: list[bytes]
) -> None:
    reader = ROUTES[route].event_usage
    assert reader is not None
    assert reader(event) == expect
    assert (parses == []) is fast


@pytest.mark.parametrize("route", PROTOCOLS)
def test_usage_like_text_in_a_token_never_reaches_the_reader(
    route: str, parses: list[bytes]
) -> None:
    """A token event whose text says FAKE passes on the tap's fast path: its quotes are
    escaped, so the ``"usage"`` mark is not in its bytes."""
    if route == "responses":
        fake = redo(named(route, "response.output_text.delta"), lambda o: o.update(delta=FAKE))
    else:
        fake = redo(named(route, "content_block_delta"), lambda o: o["delta"].update(text=FAKE))
    assert b'\\"usage\\"' in fake
    tap, piece = tap_for(route), wire([fake])
    assert tap.wire(piece, 1) is piece
    assert tap.usage is None and tap.prompt is None and parses == []
