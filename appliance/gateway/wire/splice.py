"""Streamed answers relayed below aiohttp: engine socket to client socket, chunk for chunk.

Why this exists: through aiohttp's client, each token chunk of a stream costs a parse
into a ``StreamReader``, a future, a task step, then a re-encode on the way out; on a
2-core box that was most of the gateway's CPU per relayed chunk
(docs/decisions/0001-splice-streams-below-aiohttp.md).
Here the engine's response is read by a small protocol of our own and, once the stream
is under way, the engine's chunks are written to the client's transport from
``data_received`` as they came: no task wakes up per chunk, nothing is re-encoded. The
client's stream and the engine's use the same framing (HTTP/1.1 chunked), and only whole
chunks are forwarded, so the client's stream always stops at a chunk (for vLLM: an SSE
event) boundary, where an error event can still be appended cleanly.

Scope: one POST at a time per connection, to an engine on loopback that answers
HTTP/1.1; connections are kept alive in a pool per engine (upstream_pool.py). The
relay (relay/handlers.py) uses it for streamed requests from HTTP/1.1 clients; everything else
goes through aiohttp's client. The HTTP/1.1 it reads and writes (heads, chunks, the
request) is in http1.py.

What the engine is trusted with: nothing about framing. A chunk's size must be strict
hex, and a chunk over ``MAX_CHUNK_BYTES`` (http1.py) fails the stream at its size line,
so no more than that is held for a chunk that is not whole yet; a byte beyond an
answer's end, or while no answer is due, closes the connection instead of waiting for
the next request on it (docs/security.md).

Flow control: when a client does not read, its transport's buffer grows; above
``HIGH_WATER`` the engine connection stops reading (so the engine's socket fills and
its own flow control holds tokens back) until the buffer is below ``LOW_WATER``. A
client that takes nothing from that buffer for ``gateway.stall_timeout_s`` is cut off
(:class:`ClientStalled`): its connection is aborted, and so is the engine's, so vLLM
stops generating and the relay gives the request's slot back. The timer runs only
while the engine connection is paused (the drain poll below), never per chunk.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Protocol, cast

from appliance.gateway.wire.http1 import (
    MAX_HEAD_BYTES,
    AnswerTooLarge,
    ChunkTooLarge,
    Framing,
    Head,
    UpstreamError,
    body_framing,
    count_whole_chunks,
    parse_head,
    scan_chunks,
)


class Tap(Protocol):
    """What reads a spliced stream's bytes on their way to the client (the usage tap,
    accounting/stream_tap.py): stated here so the wire imports nothing above it."""

    def wire(self, wire: bytes, chunks: int = 0) -> bytes:
        """What of ``wire`` (whole chunks) goes to the client now."""
        ...

    def last(self, wire: bytes) -> bytes:
        """What the client gets last, at the body's end."""
        ...


log = logging.getLogger(__name__)

HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024  # a non-streamed answer (an error body) read whole
DRAIN_POLL_S = 0.02


class ClientStalled(UpstreamError):
    """The client read none of its stream for ``gateway.stall_timeout_s``."""


class _Phase(enum.Enum):
    IDLE = "idle"  # new: no request sent yet
    HEAD = "head"  # request sent, reading the status line and headers
    BODY = "body"  # reading the body
    DONE = "done"  # body read whole (then it may wait in the pool), or failed (``error``)


class _Consumer(enum.Enum):
    PENDING = "pending"  # the relay has not decided yet: keep the bytes
    COLLECT = "collect"  # read the body whole (read_body)
    SPLICE = "splice"  # whole chunks go straight to the client's transport


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to an engine, one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray()
        self._phase = _Phase.IDLE
        self._framing = Framing.CHUNKED
        self._consumer = _Consumer.PENDING
        self._remaining = 0
        self._collected: list[bytes] = []
        self._collected_bytes = 0
        self._body_limit = MAX_BODY_BYTES
        self._closed = False
        self._head: asyncio.Future[Head] | None = None
        self._event: asyncio.Future[None] | None = None
        self._sink: asyncio.WriteTransport | None = None
        self.paused = False
        self.error: UpstreamError | None = None
        self.reusable = False
        self.idle_since = 0.0
        self.tap: Tap | None = None  # reads the spliced events' usage (stream_tap)
        self._head_out = b""  # the client's response head: goes with the first chunk
        self._end_out = b""  # the client's body end: goes with the last chunk
        self.ended_stream = False  # the end went out: the client's answer is whole

    # ---- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports quack like asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.reusable = False
        if self._phase is _Phase.BODY and self._framing is Framing.UNTIL_CLOSE:
            self._advance()  # the close is the end of this body
            return
        if self._phase in (_Phase.HEAD, _Phase.BODY):
            why = "the engine closed the connection"
            if exc is not None:
                why = f"the engine connection failed ({type(exc).__name__})"
            # The kernel gave up on an unanswered engine (ETIMEDOUT): a timeout, not a refusal.
            self._fail(UpstreamError(why, timed_out=isinstance(exc, TimeoutError)))

    def data_received(self, data: bytes) -> None:
        # The hot path, a stream under way: whole chunks go out as they came.
        if self._consumer is _Consumer.SPLICE and not self._buf:
            chunks = count_whole_chunks(data)
            if chunks:
                self._emit(data if self.tap is None else self.tap.wire(data, chunks))
                return
        if self._phase is _Phase.DONE or self._phase is _Phase.IDLE:
            self._stray(data)
            return
        self._buf += data
        self._advance()

    def eof_received(self) -> bool | None:
        return False  # close our side as well; connection_lost follows

    # ---- the relay's side ----------------------------------------------------------------
    def send(self, request: bytes) -> asyncio.Future[Head]:
        """Send one request; the future is its response head."""
        assert self.transport is not None and self._phase in (_Phase.IDLE, _Phase.DONE)
        self._buf.clear()
        self._collected, self._collected_bytes = [], 0
        self._consumer = _Consumer.PENDING
        self._sink = None
        self.tap = None
        self.paused = False
        self.error = None
        self.reusable = False
        self._phase = _Phase.HEAD
        self._head = self._loop.create_future()
        if self._closed or self.transport.is_closing():  # no answer would ever come
            self._fail(UpstreamError("the engine closed the connection"))
        else:
            self.transport.write(request)
        return self._head

    def abort(self, reason: str) -> None:
        """Give up on this request (engine abandoned, client gone, bad HTTP)."""
        self._fail(UpstreamError(reason))
        if self.transport is not None:
            self.transport.close()

    async def read_body(self, limit: int = MAX_BODY_BYTES) -> bytes:
        """The whole body of a non-streamed answer; AnswerTooLarge (and the connection
        closed) once it passes ``limit`` bytes, so no more than that is ever held."""
        self._body_limit = limit
        if self._framing is Framing.LENGTH and self._remaining > limit:
            self.abort("the engine's answer is too large")  # said up front: read none
            raise AnswerTooLarge(limit)
        self._consumer = _Consumer.COLLECT
        self._advance()
        while self._phase is not _Phase.DONE:
            await self._wait()
        if self._collected_bytes > limit:
            raise AnswerTooLarge(limit)
        if self.error is not None:
            raise self.error
        return b"".join(self._collected)

    async def wait_first_chunk(self) -> None:
        """Until a whole chunk (or the body's end) of a chunked body is here."""
        while self._phase is _Phase.BODY and not self._has_chunk():
            await self._wait()
        if self.error is not None:
            raise self.error

    def splice_to(self, sink: asyncio.WriteTransport, head: bytes = b"", end: bytes = b"") -> None:
        """From now on whole chunks go straight to ``sink``; what is here goes now.
        ``head`` goes with the first of them, ``end`` with the last once the engine's body
        ended well (then ``ended_stream``): one write each fewer (stream_writes.py)."""
        self._sink = sink
        self._head_out, self._end_out, self.ended_stream = head, end, False
        self._consumer = _Consumer.SPLICE
        self._advance()

    def unsent_head(self) -> bytes:
        """The head, if it has not gone out yet (the stream failed first): the caller's."""
        head, self._head_out = self._head_out, b""
        return head

    async def wait_spliced(self, stall_s: float = float("inf")) -> None:
        """Until the spliced body has ended, keeping the client's buffer bounded; a
        client that takes nothing from it for ``stall_s`` ends it (ClientStalled)."""
        while self._phase is not _Phase.DONE:
            if self.paused:
                await self._drained(stall_s)
                self.paused = False
                if self.transport is not None and not self._closed:
                    self.transport.resume_reading()
                continue
            await self._wait()
        if self.error is not None:
            raise self.error

    @property
    def finished(self) -> bool:
        """The answer was read whole and the connection may serve another request: it
        is open, and nothing came beyond the answer (see _stray and _finish)."""
        return (
            self._phase is _Phase.DONE
            and self.error is None
            and self.reusable
            and not self._closed
            and not self._buf
            and self.transport is not None
            and not self.transport.is_closing()
        )

    # ---- internals -------------------------------------------------------------------
    async def _drained(self, stall_s: float) -> None:
        """Until the client's buffer is below LOW_WATER. Polled, and only while a client
        is not reading: the client transport's protocol is aiohttp's, which offers no
        public "drained" to wait on. The buffer only shrinks while the engine connection
        is paused, so a poll that finds it no smaller than at the last one is a client
        that read nothing since; for ``stall_s`` in a row: both connections are cut."""
        sink = self._sink
        last = sink.get_write_buffer_size() if sink is not None else 0
        since = self._loop.time()
        while self._client_backed_up():
            await asyncio.sleep(DRAIN_POLL_S)
            if sink is None or sink.is_closing():
                return
            size, now = sink.get_write_buffer_size(), self._loop.time()
            if size < last:
                last, since = size, now
            elif now - since >= stall_s:
                sink.abort()  # what it never read is dropped with it
                stalled = ClientStalled(f"the client read nothing for {stall_s:g} s")
                self._fail(stalled)
                if self.transport is not None:
                    self.transport.close()  # closing is what makes vLLM abort
                raise stalled

    def _client_backed_up(self) -> bool:
        sink = self._sink
        return (
            sink is not None
            and not sink.is_closing()
            and sink.get_write_buffer_size() > LOW_WATER
            and self._phase is not _Phase.DONE
        )

    def _has_chunk(self) -> bool:
        try:
            end, _, terminal = scan_chunks(self._buf)
        except UpstreamError as exc:
            self.abort(str(exc))
            return True
        return end > 0 or terminal >= 0

    def _wait(self) -> asyncio.Future[None]:
        if self._event is None or self._event.done():
            self._event = self._loop.create_future()
        return self._event

    def _notify(self) -> None:
        if self._event is not None and not self._event.done():
            self._event.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self._phase is _Phase.DONE:
            return
        self.error = error
        self.reusable = False
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: nobody may be waiting any more
        self._done()

    def _finish(self) -> None:
        if self._buf:
            # Bytes beyond the answer's end, in the read that ended it: the start of an
            # answer nobody asked for, which the next request on this connection would
            # read as its own. Not reused (release() closes it).
            self.reusable = False
            self._buf.clear()
        self._done()

    def _done(self) -> None:
        self._phase = _Phase.DONE
        # Nothing more goes to the client: a later byte takes data_received's careful
        # path (a stray), never the splice's fast one into this client's socket.
        self._consumer = _Consumer.PENDING
        self._sink = None
        self._notify()

    def _stray(self, data: bytes) -> None:
        """Bytes while no answer is due (IDLE, DONE: in the pool, say). Kept, or read
        after the next request went out, they would be another user's answer: dropped,
        and the connection closed, never reused."""
        if self.error is None and self.transport is not None and not self.transport.is_closing():
            log.warning(
                "the engine sent %d bytes while no answer was due; its connection is "
                "closed, not reused",
                len(data),
            )
        self.reusable = False
        self._buf.clear()
        if self.transport is not None:
            self.transport.close()

    def _emit(self, wire: bytes) -> None:
        sink = self._sink
        assert sink is not None
        if sink.is_closing():
            self.abort("the client disconnected")  # closing is what makes vLLM abort
            return
        if self._head_out:
            wire, self._head_out = self._head_out + wire, b""
        sink.write(wire)
        if not self.paused and sink.get_write_buffer_size() > HIGH_WATER:
            self.paused = True
            if self.transport is not None:
                self.transport.pause_reading()
            self._notify()

    def _advance(self) -> None:
        try:
            self._advance_or_raise()
        except UpstreamError as exc:
            self.abort(str(exc))

    def _advance_or_raise(self) -> None:
        if self._phase is _Phase.HEAD and not self._read_head():
            return
        if self._phase is not _Phase.BODY:
            return
        if self._consumer is _Consumer.PENDING:
            self._notify()  # the relay may be waiting for its first chunk
        elif self._consumer is _Consumer.SPLICE:
            self._splice_whole_chunks()
        elif self._framing is Framing.CHUNKED:
            self._collect_chunks()
        elif self._framing is Framing.LENGTH:
            take = min(self._remaining, len(self._buf))
            self._keep([bytes(self._buf[:take])])
            del self._buf[:take]
            self._remaining -= take
            if self._remaining == 0:
                self._finish()
        else:
            self._keep([bytes(self._buf)])
            self._buf.clear()
            if self._closed:
                self._finish()

    def _read_head(self) -> bool:
        """Take the response head off the buffer once it is all here; whether it was."""
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD_BYTES:
                raise UpstreamError("the engine's response headers are too large")
            return False
        head = parse_head(bytes(self._buf[:end]))
        del self._buf[: end + 4]
        self._framing, self._remaining = body_framing(head)
        self.reusable = head.keep_alive and self._framing is not Framing.UNTIL_CLOSE
        self._phase = _Phase.BODY
        assert self._head is not None
        if not self._head.done():
            self._head.set_result(head)
        return True

    def _splice_whole_chunks(self) -> None:
        """The whole chunks in the buffer go to the client; the terminal one ends it."""
        end, _, terminal = scan_chunks(self._buf)
        if terminal >= 0:
            # The data goes out, not the engine's terminal chunk: the gateway ends
            # the client's stream itself (after an error event, if need be).
            last = bytes(self._buf[:terminal])
            if self.tap is not None:
                last = self.tap.last(last)
            if self._end_out:
                last, self.ended_stream = last + self._end_out, True
            if last:
                self._emit(last)
            del self._buf[:end]
            self._finish()
        elif end:
            wire = bytes(self._buf[:end])
            del self._buf[:end]
            self._emit(wire if self.tap is None else self.tap.wire(wire))

    def _collect_chunks(self) -> None:
        """The whole chunks in the buffer are kept; a chunk larger than the room left
        under the body's limit is refused at its size line, before any of it is held."""
        try:
            end, payloads, terminal = scan_chunks(
                self._buf, self._body_limit - self._collected_bytes
            )
        except ChunkTooLarge as exc:
            self._collected_bytes += exc.size  # read_body says why: AnswerTooLarge
            raise UpstreamError("the engine's answer is too large") from None
        del self._buf[:end]
        self._keep(payloads)
        if terminal >= 0:
            self._finish()

    def _keep(self, pieces: list[bytes]) -> None:
        for piece in pieces:
            self._collected.append(piece)
            self._collected_bytes += len(piece)
        if self._collected_bytes > self._body_limit:
            self._collected.clear()  # the count stays: read_body says why
            raise UpstreamError("the engine's answer is too large")
