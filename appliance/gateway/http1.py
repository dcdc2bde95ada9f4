"""HTTP/1.1 as the gateway speaks it to an engine: a response head, chunked framing,
the request it sends, and how an engine connection fails.

Pure functions on bytes, no I/O: splice.py's connection feeds them what the engine
sent. Only what an engine on loopback answering one POST at a time needs is here; bad
framing raises :class:`UpstreamError`, which the relay treats as a failed engine.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_HEAD_BYTES = 64 * 1024
MAX_CHUNK_LINE = 1024


class UpstreamError(Exception):
    """The engine connection failed or spoke bad HTTP; ``str()`` says how.

    ``timed_out`` is set where it is raised, when the engine did not answer in time (a
    connect that timed out, a connection lost to ETIMEDOUT): the relay answers 504 for
    those and 502 for every other failure, from this flag, never from the message.
    """

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


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
    one read holding one token event, checked without copying anything."""
    n = len(data)
    pos = 0
    count = 0
    while pos < n:
        eol = data.find(b"\r\n", pos, pos + MAX_CHUNK_LINE)
        if eol <= pos:
            return 0
        try:
            size = int(data[pos:eol], 16)  # a chunk extension (rare) takes the slow path
        except ValueError:
            return 0
        if size <= 0:
            return 0
        pos = eol + 2 + size + 2
        if pos > n or data[pos - 2 : pos] != b"\r\n":
            return 0
        count += 1
    return count


def scan_chunks(buf: bytes | bytearray) -> tuple[int, list[bytes], int]:
    """The whole chunks at the start of a chunked body.

    Returns ``(end, payloads, terminal)``: ``buf[:end]`` is whole chunks in wire form,
    ``payloads`` their data; ``terminal`` is where the terminal (size 0) chunk starts
    when it, with its trailers, ends the body at ``end``, else -1. Raises UpstreamError
    on bad framing.
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
        size_field = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
        try:
            size = int(size_field, 16)
        except ValueError:
            raise UpstreamError(f"bad chunk size {size_field[:20]!r}") from None
        if size < 0:
            raise UpstreamError("bad chunk size (negative)")
        if size == 0:
            if buf[eol + 2 : eol + 4] == b"\r\n":  # no trailers: the usual end
                return eol + 4, payloads, pos
            end = buf.find(b"\r\n\r\n", eol)
            if end < 0:
                break
            return end + 4, payloads, pos
        data_end = eol + 2 + size
        if data_end + 2 > n:
            break
        if buf[data_end : data_end + 2] != b"\r\n":
            raise UpstreamError("chunk data not followed by CRLF")
        payloads.append(bytes(buf[eol + 2 : data_end]))
        pos = data_end + 2
    return pos, payloads, -1


def request_bytes(path: str, host: str, headers: dict[str, str], body: bytes) -> bytes:
    """A POST as the engine is sent it; ``host`` is the Host header's value."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
