"""HTTP/1.1 as the gateway speaks it to an engine: a response head, chunked framing,
the request it sends, and how an engine connection fails.

Pure functions on bytes, no I/O: splice.py's connection feeds them what the engine
sent. Only what an engine on loopback answering one POST at a time needs is here; bad
framing raises :class:`UpstreamError`, which the relay treats as a failed engine.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

MAX_HEAD_BYTES = 64 * 1024
MAX_CHUNK_LINE = 1024
# The most one chunk of a stream may hold. vLLM sends one SSE event per chunk, and a
# token event is a few hundred bytes (a few KiB with logprobs); a chunk is held whole
# until its end is here (only whole chunks reach the client), so without a cap an engine
# could make the gateway hold any amount: one 200 MiB chunk raised the daemon's RSS by
# 205 MB. Beyond it the stream fails (docs/security.md).
MAX_CHUNK_BYTES = 4 * 1024 * 1024

# A chunk's size, strictly (RFC 9112 allows leading zeros; 16 digits hold any size a
# 64-bit field can): int(x, 16) alone also took "+5", "0x5", "1_0" and " 5", which then
# reached clients, who would read the framing otherwise.
_SIZE_DIGITS = 16
_SIZE = re.compile(rb"[0-9A-Fa-f]{1,%d}" % _SIZE_DIGITS)
# Size fields the fast path has read, with their sizes: a stream's chunk sizes repeat, so
# a dict look-up replaces the parse (and the strict check) on almost every read. Only
# strict fields go in, at most _SIZES_KEPT of them (a few hundred KB at most).
_SIZES: dict[bytes, int] = {}
_SIZES_KEPT = 4096
# The size line of the careful path: the size, then optionally extensions, which are
# passed on to the client as they are, so only printable ASCII (no stray CR or LF).
_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,%d})(?:[ \t]*;[\t\x20-\x7e]*)?" % _SIZE_DIGITS)


class UpstreamError(Exception):
    """The engine connection failed or spoke bad HTTP; ``str()`` says how.

    ``timed_out`` is set where it is raised, when the engine did not answer in time (a
    connect that timed out, a connection lost to ETIMEDOUT): the relay answers 504 for
    those and 502 for every other failure, from this flag, never from the message.
    """

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class ChunkTooLarge(UpstreamError):
    """A chunk larger than the reader allows, known from its size line (so none of it
    is held): ``size`` is what the engine announced."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the engine sent a chunk of {size} bytes, more than {limit}")
        self.size = size


class AnswerTooLarge(UpstreamError):
    """A non-streamed answer is larger than the caller's limit: not the engine's fault,
    and another engine would answer the same, so the relay does not retry it."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the engine's answer is larger than {limit} bytes")
        self.limit = limit


@dataclass(frozen=True, slots=True)
class Head:
    status: int
    headers: dict[str, str]  # lower-case names; the last value wins

    @property
    def chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    @property
    def keep_alive(self) -> bool:
        return "close" not in self.headers.get("connection", "").lower()


class Framing(enum.Enum):
    """How a response's body ends."""

    CHUNKED = "chunked"
    LENGTH = "length"  # after Content-Length bytes
    UNTIL_CLOSE = "until-close"  # when the engine closes: the connection is not reused


def body_framing(head: Head) -> tuple[Framing, int]:
    """A response's framing, and its length where Content-Length gives it."""
    if head.chunked:
        return Framing.CHUNKED, 0
    if "content-length" in head.headers:
        try:
            return Framing.LENGTH, int(head.headers["content-length"])
        except ValueError:
            raise UpstreamError("bad Content-Length from the engine") from None
    return Framing.UNTIL_CLOSE, 0


def parse_head(raw: bytes) -> Head:
    """Status line and headers of an HTTP/1.x response (``raw`` stops before CRLF CRLF)."""
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise UpstreamError(f"bad status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name.strip():
            raise UpstreamError(f"bad header line {line[:80]!r}")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return Head(int(parts[1]), headers)


def is_whole_chunks(data: bytes) -> bool:
    """Whether ``data`` is exactly whole, non-terminal chunks (none at all counts)."""
    return not data or count_whole_chunks(data) > 0


def count_whole_chunks(data: bytes) -> int:
    """How many whole, non-terminal chunks ``data`` is exactly, else 0: the common case of
    one read holding one token event, checked without copying anything. Anything unusual
    (an extension, a bad size, a chunk over MAX_CHUNK_BYTES) is 0: the careful path
    (:func:`scan_chunks`) decides."""
    n = len(data)
    pos = 0
    count = 0
    while pos < n:
        eol = data.find(b"\r\n", pos, pos + _SIZE_DIGITS + 2)
        if eol <= pos:
            return 0
        field = data[pos:eol]
        size = _SIZES.get(field)  # one dict look-up: a stream's sizes repeat
        if size is None:
            size = _strict_size(field)
        if size <= 0 or size > MAX_CHUNK_BYTES:
            return 0
        pos = eol + 2 + size + 2
        if pos > n or data[pos - 2 : pos] != b"\r\n":
            return 0
        count += 1
    return count


def _strict_size(field: bytes) -> int:
    """The size ``field`` says when it is strictly hex digits, else -1; remembered (up to
    _SIZES_KEPT of them) so the fast path parses a size it has seen before not at all."""
    if _SIZE.fullmatch(field) is None:
        return -1
    size = int(field, 16)
    if len(_SIZES) < _SIZES_KEPT:
        _SIZES[field] = size
    return size


def scan_chunks(
    buf: bytes | bytearray, max_chunk: int = MAX_CHUNK_BYTES
) -> tuple[int, list[bytes], int]:
    """The whole chunks at the start of a chunked body.

    Returns ``(end, payloads, terminal)``: ``buf[:end]`` is whole chunks in wire form,
    ``payloads`` their data; ``terminal`` is where the terminal (size 0) chunk starts
    when it, with its trailers, ends the body at ``end``, else -1. Raises UpstreamError
    on bad framing, and ChunkTooLarge at the size line of a chunk over ``max_chunk``
    bytes (before any of it is held); trailers over MAX_HEAD_BYTES are bad framing.
    """
    pos = 0
    payloads: list[bytes] = []
    n = len(buf)
    while pos < n:
        eol = buf.find(b"\r\n", pos, pos + MAX_CHUNK_LINE)
        if eol < 0:
            if n - pos >= MAX_CHUNK_LINE:
                raise UpstreamError("chunk size line too long")
            break
        line = _SIZE_LINE.fullmatch(buf, pos, eol)
        if line is None:
            raise UpstreamError(f"bad chunk size line {bytes(buf[pos : min(eol, pos + 20)])!r}")
        size = int(line[1], 16)
        if size > max_chunk:
            raise ChunkTooLarge(size, max_chunk)
        if size == 0:
            return _terminal(buf, pos, eol, payloads)
        data_end = eol + 2 + size
        if data_end + 2 > n:
            break
        if buf[data_end : data_end + 2] != b"\r\n":
            raise UpstreamError("chunk data not followed by CRLF")
        payloads.append(bytes(buf[eol + 2 : data_end]))
        pos = data_end + 2
    return pos, payloads, -1


def _terminal(
    buf: bytes | bytearray, pos: int, eol: int, payloads: list[bytes]
) -> tuple[int, list[bytes], int]:
    """scan_chunks' answer at a terminal chunk (at ``pos``, its size line ending at
    ``eol``): the body's end once its trailers are whole, else the chunks before it."""
    if buf[eol + 2 : eol + 4] == b"\r\n":  # no trailers: the usual end
        return eol + 4, payloads, pos
    end = buf.find(b"\r\n\r\n", eol)
    if end >= 0:
        return end + 4, payloads, pos
    if len(buf) - eol > MAX_HEAD_BYTES:  # held until whole: bounded like a head
        raise UpstreamError("the engine's chunk trailers are too large")
    return pos, payloads, -1


def request_bytes(path: str, host: str, headers: dict[str, str], body: bytes) -> bytes:
    """A POST as the engine is sent it; ``host`` is the Host header's value."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
