"""What the gateway's HTTP server says to, and logs about, clients that speak bad HTTP.

A malformed request is answered with an OpenAI-shaped error that echoes nothing of what
was sent (aiohttp's own messages quote the raw bytes, which may hold a key), and noted
in a :class:`ThrottledLog`: one short line per kind of error per interval plus a count
of those held back. :func:`raw_error` is the answer for the moments before aiohttp has a
request to answer (a refused connection, a head that never finished). server.py uses
these from its connection handler.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    PayloadEncodingError,
)

from appliance.gateway.errors import GatewayError, error_body, error_response

# Each kind of client error is logged at most once per this; the rest are counted.
LOG_INTERVAL_S = 60.0


@dataclass
class _Kind:
    until: float  # repeats before this are counted, not logged
    level: int
    held: int = 0
    timer: asyncio.TimerHandle | None = None


class ThrottledLog:
    """At most one line per kind of event per interval; repeats are counted and the count
    is logged when the interval ends, so a flood costs at most two lines a minute per
    kind, not one (or eleven) a request. Kinds must come from a small fixed set (error
    classes, never client input): each kind is remembered for the daemon's life."""

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S) -> None:
        self._logger = logger
        self._interval = interval_s
        self._kinds: dict[str, _Kind] = {}

    def note(
        self,
        kind: str,
        level: int,
        message: str,
        *args: object,
        exc_info: BaseException | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        k = self._kinds.get(kind)
        if k is not None and now < k.until:
            k.held += 1
            if k.timer is None:
                k.timer = loop.call_at(k.until, self._flush, kind)
            return
        if k is not None and k.held:
            self._flush(kind)  # its timer is due but has not run yet
        self._logger.log(level, message, *args, exc_info=exc_info)
        self._kinds[kind] = _Kind(until=now + self._interval, level=level)

    def _flush(self, kind: str) -> None:
        k = self._kinds[kind]
        if k.timer is not None:
            k.timer.cancel()
            k.timer = None
        if k.held:
            self._logger.log(k.level, "%d more %s in the last %g s", k.held, kind, self._interval)
            k.held = 0
            # A flood that goes on is reported once per interval, by count only.
            k.until = asyncio.get_running_loop().time() + self._interval

    def close(self) -> None:
        """Log what is still held back (at shutdown) and stop the timers."""
        for kind, k in self._kinds.items():
            if k.held:
                self._flush(kind)
            elif k.timer is not None:
                k.timer.cancel()
                k.timer = None


def describe_protocol_error(exc: BaseException | None, max_line: int) -> str:
    """What was wrong with a request, from the error's class only: aiohttp's messages
    quote the offending bytes, which may be a key."""
    if isinstance(exc, LineTooLong):
        return f"a request line or header is longer than {max_line} bytes"
    if isinstance(exc, BadHttpMethod):
        return "not an HTTP request (bad method; HTTPS sent to an HTTP port?)"
    if isinstance(exc, BadStatusLine):
        return "the request line is not valid HTTP"
    if isinstance(exc, InvalidHeader):
        return "a header is not valid HTTP"
    if isinstance(exc, InvalidURLError):
        return "the request target is not a valid URL"
    if isinstance(exc, PayloadEncodingError):
        return BODY_FRAMING
    return "the request head is not valid HTTP"


def raw_error(status: int, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A complete OpenAI-shaped error answer, for the moments before aiohttp has a request
    to answer (a refused connection, a head that never finished)."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def peer_of(transport: asyncio.BaseTransport | None) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return "a local client"


BODY_FRAMING = "the request body's framing or encoding is not valid HTTP"


def _note_malformed(
    notes: ThrottledLog, peer: str, status: int, exc: HttpProcessingError, what: str
) -> str:
    """One throttled line for a malformed request; what to tell its client."""
    kind = type(exc).__name__
    notes.note(
        f"malformed requests ({kind})",
        logging.INFO,
        "malformed request from %s (%s: %s): answered %d and closed",
        peer,
        kind,
        what,
        status,
    )
    return f"malformed HTTP request: {what}"


def malformed_body(notes: ThrottledLog, peer: str, exc: HttpProcessingError) -> GatewayError:
    """What the read of a body whose framing failed raises (a bad chunk line): the same
    400 and log line as a malformed head, the connection closed with it."""
    message = _note_malformed(notes, peer, 400, exc, BODY_FRAMING)
    return GatewayError(400, message, code="bad_request", reason="bad_request", close=True)


def reply_to_error(
    notes: ThrottledLog, peer: str, status: int, exc: BaseException | None, max_line: int
) -> web.Response:
    """The answer to a request aiohttp failed on, noted in the log by kind: a malformed
    request (its ``status``, 400), a handler timeout (504), an error that escaped the
    middleware (500)."""
    if isinstance(exc, HttpProcessingError):
        message = _note_malformed(notes, peer, status, exc, describe_protocol_error(exc, max_line))
        return error_response(status, message, code="bad_request")
    if status == 504:
        return error_response(504, "the request timed out in the gateway", code="timeout")
    notes.note(
        f"unexpected errors ({type(exc).__name__})",
        logging.ERROR,
        "unexpected error on a request from %s",
        peer,
        exc_info=exc,
    )
    return error_response(500, "internal error in the gateway; see its log", code="internal_error")
