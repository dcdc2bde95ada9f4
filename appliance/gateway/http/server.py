"""The gateway's HTTP server: aiohttp's, with bounds on what one client can hold or log.

aiohttp's own ``RequestHandler``, left as it is, lets any client that can connect:

- write into the journal at will: each malformed request is logged at ERROR with a
  traceback whose message quotes the raw request line or header (an ``Authorization``
  value with a stray CR put the whole key in the log), about 11 lines a request, so a
  junk flood outruns journald's rate limit and real messages are dropped;
- hold a connection for an hour (its default keep-alive, 3630 s) by sending its
  request head a byte at a time, or a body a byte at a time for ever;
- open as many connections as it likes.

:class:`GatewayRunner` builds the app's server with :class:`GatewayRequestHandler`
instead, which

- answers a malformed request with an OpenAI-shaped 400 that echoes nothing of what was
  sent, and notes it in a :class:`ThrottledLog`: one short line per kind of error per
  minute plus a count of those held back, never any header or body content (both in
  protocol_errors.py); requests pipelined before it in the same read are answered
  first (``_parse``), and a body being read whose framing fails (a bad chunk line)
  fails that read with the same 400 (``_fail_open_bodies``);
- closes a connection whose request head is not complete ``header_timeout_s`` after it
  opened, or after the first byte of a later head, answering 408;
- fails the body read of a request whose body is not complete ``body_timeout_s`` after
  its head with :class:`BodyTimeout` (the gateway's middleware answers 408);
- refuses a connection beyond ``max_connections`` with a 503; open ones carry on.

Nothing here times a *response*: a long generation streamed to a slow reader runs as
long as it needs. A keep-alive connection idle between requests is closed after
:data:`KEEPALIVE_TIMEOUT_S`, aiohttp's own mechanism.

A few of aiohttp's private ``RequestHandler`` attributes are read here (``_waiter``: the
handler waits for a request head; ``_messages`` and ``_request_count``: heads parsed,
and ``_ErrInfo``, the parse error queued in their place;
``_force_close`` and ``_close``) and ``web.Server``'s ``_kwargs``.
tests/unit/test_gateway_server.py drives each path through real sockets, on asyncio's
loop and uvloop, so an aiohttp release that moves them fails there rather than in
production.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import _ErrInfo

from appliance.gateway.errors import Shape, error_response
from appliance.gateway.http.protocol_errors import (
    ThrottledLog,
    malformed_body,
    peer_of,
    raw_error,
    reply_to_error,
)

if TYPE_CHECKING:
    from aiohttp.streams import StreamReader

    from appliance.config import GatewayConfig

log = logging.getLogger("appliance.gateway")

# Between requests on one connection; the same as aiohttp's run_app and nginx. Clients
# drop their own idle connections sooner (httpx 5 s, aiohttp's client 15 s), so the
# server's close rarely races a request sent on a connection it is closing.
KEEPALIVE_TIMEOUT_S = 75.0
# After a last answer (503 refused, 408 head timeout) a connection waits this long at
# most for its client to read it and close; no more than MAX_LINGERING wait at once.
CLOSE_LINGER_S = 1.0
MAX_LINGERING = 256
HEAD_END = b"\r\n\r\n"


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S

    @classmethod
    def from_config(cls, g: GatewayConfig) -> ConnectionLimits:
        return cls(g.max_connections, g.header_timeout_s, g.body_timeout_s)


class BodyTimeout(TimeoutError):
    """A request body that was not complete within ``body_timeout_s`` of its head.

    Raised by the body read (``request.read()`` and friends). A ``TimeoutError`` so that
    aiohttp's read-and-discard of an unread body after the answer (its "lingering
    close") ends on it and closes the connection instead of logging it as unhandled.
    """

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"request body not complete within {timeout_s:g} s")
        self.timeout_s = timeout_s

    def response(self, shape: Shape = "openai") -> web.Response:
        resp = error_response(
            408,
            f"the request body did not arrive within {self.timeout_s:g} s (gateway.body_timeout_s)",
            code="body_timeout",
            type_="invalid_request_error",
            shape=shape,
        )
        resp.force_close()
        return resp


class GatewayRequestHandler(web.RequestHandler):
    """One client connection: aiohttp's handler plus the gateway's limits (module doc)."""

    __slots__ = (
        "_body",
        "_body_timer",
        "_counted",
        "_gw",
        "_head_timer",
        "_lingering",
        "_refused",
    )

    def __init__(self, manager: GatewayServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._gw = manager  # aiohttp drops its own reference when the connection is lost
        self._refused = False
        self._lingering = False
        self._counted = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body: StreamReader | None = None

    # ---- connection limit ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gw = self._gw
        if gw.open_connections >= gw.limits.max_connections:
            # cast, not isinstance: uvloop's transports do not subclass asyncio's.
            self._refuse(cast(asyncio.Transport, transport))
            return
        gw.open_connections += 1
        self._counted = True
        super().connection_made(transport)
        self._start_head_timer()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 and close, without ever parsing what the client sends."""
        gw = self._gw
        self._refused = True
        gw.notes.note(
            "connections refused at gateway.max_connections",
            logging.WARNING,
            "refused a connection from %s: gateway.max_connections (%d) are open",
            peer_of(transport),
            gw.limits.max_connections,
        )
        self._answer_and_close(
            transport,
            raw_error(
                503,
                f"the gateway has {gw.limits.max_connections} connections open, its "
                "limit; retry shortly",
                "too_many_connections",
                retry_after=1,
            ),
        )

    def _answer_and_close(self, transport: asyncio.Transport, answer: bytes) -> None:
        """Send a last answer and close, so that the client gets to read it.

        Closing a socket with unread data in it, or that receives more once closed,
        sends a reset, which can destroy the answer before the client reads it (a client
        trickling its request is still sending). So the write side is shut (FIN after
        the answer) and whatever still arrives is discarded until the client closes or
        CLOSE_LINGER_S passes. At most MAX_LINGERING connections do that at once, so a
        flood cannot hold many descriptors this way; the rest are closed at once.
        """
        transport.write(answer)
        gw = self._gw
        if gw.lingering < MAX_LINGERING and transport.can_write_eof():
            # aiohttp's eof_received returns None, so the client's close closes this too.
            transport.write_eof()
            gw.lingering += 1
            self._lingering = True
            # The head timer's slot: this connection waits for no more request heads.
            self._head_timer = self._loop.call_later(CLOSE_LINGER_S, transport.close)
        else:
            transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_timer()
        if self._lingering:
            self._lingering = False
            self._gw.lingering -= 1
        if self._refused:
            return
        self._stop_body_timer()
        if self._counted:
            self._counted = False
            self._gw.open_connections -= 1
        super().connection_lost(exc)

    # ---- header and body timeouts ----------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        waiting_for_head = self._waiter is not None and not self._waiter.done()
        if data and waiting_for_head and self._head_timer is None:
            self._start_head_timer()  # the first byte of a later request's head
        heads_before = self._request_count
        self._parse(data)
        if self._parse_failed():
            self._fail_open_bodies()
        if self._body is not None and self._body.is_eof():
            self._stop_body_timer()
        if self._request_count != heads_before:
            self._stop_head_timer()
            payload = self._messages[-1][1] if self._messages else None
            if payload is not None and not payload.is_eof():
                self._start_body_timer(payload)

    def _parse(self, data: bytes) -> None:
        """aiohttp's parse of ``data``; head by head when it holds more than one.

        aiohttp's parser raises on the first malformed request in a read and drops every
        request it parsed before it in that read: a valid request pipelined before
        garbage lost its answer. Fed one head end at a time, the requests before the bad
        one are answered first, in order; the usual cost is one or two byte searches.
        """
        first = data.find(HEAD_END)
        if first < 0 or data.find(HEAD_END, first + 4) < 0:
            super().data_received(data)
            return
        start = 0
        while start < len(data):
            end = data.find(HEAD_END, start)
            end = len(data) if end < 0 else end + 4
            super().data_received(data[start:end])
            if self._force_close or self._close or self._parse_failed():
                return  # the parser is done with this connection: the rest is not read
            start = end

    def _parse_failed(self) -> bool:
        return bool(self._messages) and isinstance(self._messages[-1][0], _ErrInfo)

    def _fail_open_bodies(self) -> None:
        """The parser failed inside a body it was reading (a bad chunk line): aiohttp
        queues the error as the next request but leaves that body open, so its handler
        waited in ``read()`` for ever, a connection slot held, no timer running when the
        head and the bad chunk came in one read. The body's read fails instead, with the
        400 a malformed head gets, and the connection closes with the answer."""
        info = self._messages[-1][0]
        bodies = [p for m, p in self._messages if not isinstance(m, _ErrInfo)]
        bodies += [] if self._body is None else [self._body]  # a head read before this
        bodies = [p for p in bodies if not p.is_eof()]
        exc = info.exc if isinstance(info, _ErrInfo) else None
        if not bodies or not isinstance(exc, HttpProcessingError):
            return
        failed = malformed_body(self._gw.notes, peer_of(self.transport), exc)
        for payload in bodies:
            payload.set_exception(failed)
            payload.feed_eof()  # ended: aiohttp reads nothing more of it after the answer

    def _start_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = self._loop.call_later(
            self._gw.limits.header_timeout_s, self._head_timed_out
        )

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        transport = self.transport
        if transport is None or self._force_close or self._close:
            return
        timeout = self._gw.limits.header_timeout_s
        self._gw.notes.note(
            "request heads not complete in time",
            logging.INFO,
            "closed a connection from %s: no complete request head within %g s "
            "(gateway.header_timeout_s)",
            peer_of(transport),
            timeout,
        )
        self.close()  # aiohttp's: parse nothing more, take no further request
        self._answer_and_close(
            transport,
            raw_error(
                408,
                f"the request head did not arrive within {timeout:g} s (gateway.header_timeout_s)",
                "header_timeout",
            ),
        )

    def _start_body_timer(self, payload: StreamReader) -> None:
        self._stop_body_timer()
        self._body = payload
        self._body_timer = self._loop.call_later(
            self._gw.limits.body_timeout_s, self._body_timed_out
        )

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._body = None

    def _body_timed_out(self) -> None:
        payload, self._body, self._body_timer = self._body, None, None
        if payload is None or payload.is_eof():
            return
        timeout = self._gw.limits.body_timeout_s
        self._gw.notes.note(
            "request bodies not complete in time",
            logging.INFO,
            "request body from %s not complete within %g s (gateway.body_timeout_s); "
            "the connection is closed",
            peer_of(self.transport),
            timeout,
        )
        payload.set_exception(BodyTimeout(timeout))

    # ---- errors aiohttp answers itself -----------------------------------------------
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Malformed requests (400), handler timeouts (504) and errors that escaped the
        middleware (500): an OpenAI-shaped answer and a throttled log line. ``message``
        (aiohttp's text, which quotes the raw request) is never used."""
        if request.writer.output_size > 0:
            # As aiohttp: part of an answer is out; the connection is beyond repair.
            raise ConnectionError("an answer was already started; cannot send an error")
        peer = request.remote or "a local client"
        max_line = max(self.max_line_size, self.max_field_size)
        resp = reply_to_error(self._gw.notes, peer, status, exc, max_line)
        resp.force_close()
        return resp

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # aiohttp's other error paths ("Unhandled exception", ...): throttled like the rest.
        exc = kw.get("exc_info")
        self._gw.notes.note(
            "unexpected errors in the HTTP server",
            logging.ERROR,
            "HTTP server: %s",
            args[0] if args else "error",
            exc_info=exc if isinstance(exc, BaseException) else None,
        )


class GatewayServer(web.Server):
    """aiohttp's server, making :class:`GatewayRequestHandler` connections and counting
    them."""

    def __init__(self, base: web.Server, limits: ConnectionLimits, notes: ThrottledLog) -> None:
        super().__init__(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            **base._kwargs,
        )
        self.limits = limits
        self.notes = notes
        self.open_connections = 0
        self.lingering = 0  # connections reading out their client's bytes after a last answer

    def __call__(self) -> GatewayRequestHandler:
        return GatewayRequestHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """``web.AppRunner`` whose server is a :class:`GatewayServer`."""

    __slots__ = ("limits", "notes")

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=limits.keepalive_timeout_s, **kwargs)
        self.limits = limits
        self.notes = ThrottledLog(log)

    async def _make_server(self) -> web.Server:
        return GatewayServer(await super()._make_server(), self.limits, self.notes)

    async def cleanup(self) -> None:
        await super().cleanup()
        self.notes.close()


# ---- room for the connections in the open-files limit ---------------------------------
# File descriptors the daemon needs besides client connections (engines, pipes, files).
FD_HEADROOM = 256


def ensure_fd_room(max_connections: int) -> str | None:
    """Raise the soft open-files limit to fit max_connections, up to the hard limit.

    Outside systemd (whose unit sets LimitNOFILE) the soft limit is often 1024, below the
    default cap: connections past it would fail in accept() instead of getting a 503.
    Returns a warning when the hard limit is too low, else None.
    """
    need = max_connections + MAX_LINGERING + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            target = soft
    if target >= need:
        return None
    return (
        f"gateway.max_connections = {max_connections} but this process may open only "
        f"{target} files (ulimit -n; hard limit {hard}): connections beyond about "
        f"{max(target - MAX_LINGERING - FD_HEADROOM, 0)} will fail; raise LimitNOFILE or lower "
        "gateway.max_connections"
    )
