"""A spliced stream's head and end, written with the engine's chunks instead of apart.

aiohttp sends a streamed response's head in a write of its own and its end (the
terminal chunk ``0\\r\\n\\r\\n``) in another: two system calls per request on top of one
per chunk. The splice (splice.py) writes to the client's transport itself, so it can
carry both: the head goes out with the first chunk (one segment, as nginx sends it),
the end with the last. strace: 9.1 writes per request instead of 11.0 for 8-token
streams; in CPU a few µs per request, below what the 2-core box resolves
(docs/decisions/0012-stream-head-and-end-in-the-chunks-writes.md).

aiohttp's private names are used here, in this module only: ``StreamResponse``'s class
attribute ``_send_headers_immediately`` (False: ``prepare()`` keeps the head, as its
``Response`` does), and its ``StreamWriter``'s ``_headers_buf``/``_headers_written`` (the
serialized head it holds until the first write) and ``_eof`` (its body has ended).
tests/unit/test_stream_writes.py checks them against aiohttp's real response on a real
socket, so an aiohttp release that moves them fails there, not in production.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

# The end of a chunked body (RFC 9112, 7.1): the client's stream ends with it.
CHUNKED_END = b"0\r\n\r\n"


class HeldHeadResponse(web.StreamResponse):
    """A stream whose head ``prepare()`` keeps for :func:`take_head`."""

    _send_headers_immediately = False


def _writer(resp: web.StreamResponse) -> Any:
    writer = resp._payload_writer
    if writer is None:
        raise RuntimeError("the response is not prepared")
    return writer


def take_head(resp: web.StreamResponse) -> bytes:
    """The prepared response's head, which aiohttp will now never write itself (b"" if
    it already did): the caller must write it before anything else."""
    writer = _writer(resp)
    head: bytes | None = writer._headers_buf
    if not head or writer._headers_written:
        return b""
    writer._headers_buf = None
    writer._headers_written = True
    return head


def ended_by_caller(resp: web.StreamResponse) -> None:
    """The caller wrote the body's end (CHUNKED_END) itself: aiohttp writes nothing more,
    and the connection is kept alive as after any answer."""
    _writer(resp)._eof = True
