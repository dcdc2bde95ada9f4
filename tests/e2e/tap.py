"""A recording pass-through between a client under test and the gateway.

A CLI such as ``codex`` or ``claude`` shows none of the engine's counts, so the test
cannot tell by itself whether the key was charged what the engine counted. The tap
relays every request byte for byte (streams chunk by chunk, as they come) and keeps a
copy of each exchange; :func:`engine_usage` then reads the engine's own counts out of
the answers exactly as a protocol's client would (a whole answer's ``usage``, a
Responses stream's ``response.completed``, a Messages stream's ``message_start`` and
``message_delta``, a chat stream's usage chunk). It also gives the size of what each
client sends (a coding agent's system prompt and tools), which is what decides whether
it fits the model's context. It is also every client's ``HTTPS_PROXY`` (the gateway
itself is in ``NO_PROXY``), so a client that reaches for the internet is noted
(:attr:`Tap.outside`) and refused rather than quietly served by the network.

Threads and the standard library only: the client runs in another process, and the
relay must not depend on the gateway's own code.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@dataclass
class Exchange:
    """One request through the tap and what came back."""

    method: str
    path: str
    request: bytes
    header_names: frozenset[str] = frozenset()
    status: int = 0
    content_type: str = ""
    answer: bytearray = field(default_factory=bytearray)
    answer_headers: dict[str, str] = field(default_factory=dict)  # names in lower case

    def json_request(self) -> Any:
        try:
            return json.loads(self.request)
        except ValueError:
            return None


class Tap:
    """The exchanges seen so far, in order (a lock: the server answers on threads)."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.exchanges: list[Exchange] = []
        self.outside: list[str] = []  # hosts a client asked the tap, as its proxy, to reach
        self.lock = threading.Lock()
        self.url = ""

    def record(self, ex: Exchange) -> None:
        with self.lock:
            self.exchanges.append(ex)

    def reached_for(self, host: str) -> None:
        with self.lock:
            self.outside.append(host)

    def since(self, start: int) -> list[Exchange]:
        with self.lock:
            return list(self.exchanges[start:])

    def mark(self) -> int:
        with self.lock:
            return len(self.exchanges)


def _handler(tap: Tap) -> type[http.server.BaseHTTPRequestHandler]:
    class Relay(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the test prints what matters

        def _relay(self) -> None:
            if not self.path.startswith("/"):  # an absolute URL: asked as a proxy
                self.do_CONNECT()
                return
            size = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(size) if size else b""
            names = frozenset(k.lower() for k in self.headers)
            ex = Exchange(self.command, self.path, body, names)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            conn = http.client.HTTPConnection(tap.host, tap.port, timeout=600)
            try:
                conn.request(self.command, self.path, body or None, headers)
                resp = conn.getresponse()
                ex.status, ex.content_type = resp.status, resp.getheader("Content-Type", "")
                ex.answer_headers = {k.lower(): v for k, v in resp.getheaders()}
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                while chunk := resp.read1(65536):
                    ex.answer += chunk
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            finally:
                conn.close()
                tap.record(ex)
                self.close_connection = True

        do_GET = do_POST = do_DELETE = _relay

        def do_CONNECT(self) -> None:
            """A client that tries the internet through its proxy (the tests set the tap
            as every client's HTTPS_PROXY): noted, and refused."""
            tap.reached_for(self.path)
            self.close_connection = True
            self.send_error(403, "llm-appliance e2e: no internet for clients under test")

    return Relay


@contextlib.contextmanager
def running_tap(upstream: str) -> Iterator[Tap]:
    """A tap on a free loopback port relaying to ``upstream`` (the gateway's URL)."""
    tap = Tap(upstream)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(tap))
    server.daemon_threads = True
    tap.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield tap
    finally:
        server.shutdown()
        server.server_close()


def sse_data(answer: bytes) -> list[Any]:
    """The JSON of each ``data:`` line of an SSE answer (``[DONE]`` left out)."""
    out = []
    for line in answer.decode(errors="replace").splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line[5:]))
    return out


def _counts(usage: Any, prompt: str, completion: str) -> tuple[int, int]:
    if not isinstance(usage, dict):
        return 0, 0
    cached = sum(usage.get(n) or 0 for n in ("cache_read_input_tokens",))
    return int(usage.get(prompt) or 0) + cached, int(usage.get(completion) or 0)


def _event_counts(event: Any) -> tuple[int, int] | None:
    """The final counts an SSE event carries, or None (a Messages stream's
    ``message_start`` is superseded by its ``message_delta``)."""
    if not isinstance(event, dict):
        return None
    kind = event.get("type")
    if kind in ("response.completed", "response.incomplete", "response.failed"):
        return _counts(event["response"].get("usage"), "input_tokens", "output_tokens")
    if kind == "message_delta":
        return _counts(event.get("usage"), "input_tokens", "output_tokens")
    if isinstance(event.get("usage"), dict) and "prompt_tokens" in event["usage"]:
        return _counts(event["usage"], "prompt_tokens", "completion_tokens")
    return None


def exchange_usage(ex: Exchange) -> tuple[int, int]:
    """(prompt, completion) tokens the engine counted in one answer, as the key is
    charged them: count_tokens its ``input_tokens`` as prompt tokens (the tokenizer
    routes are not free against tpm, issue 33); (0, 0) for models and retrieve."""
    if ex.status != 200 or ex.method != "POST":
        return 0, 0
    if ex.path.endswith("/count_tokens"):
        try:
            return int(json.loads(ex.answer)["input_tokens"]), 0
        except (ValueError, KeyError, TypeError):
            return 0, 0
    if ex.content_type.startswith("text/event-stream"):
        prompt = completion = 0
        for event in sse_data(bytes(ex.answer)):
            got = _event_counts(event)
            if got is not None:
                prompt, completion = prompt + got[0], completion + got[1]
        return prompt, completion
    try:
        usage = json.loads(ex.answer).get("usage")
    except (ValueError, AttributeError):
        return 0, 0
    if isinstance(usage, dict) and "input_tokens" in usage:
        return _counts(usage, "input_tokens", "output_tokens")
    return _counts(usage, "prompt_tokens", "completion_tokens")


def engine_usage(exchanges: list[Exchange]) -> tuple[int, int]:
    """The engine's (prompt, completion) counts over ``exchanges``."""
    pairs = [exchange_usage(ex) for ex in exchanges]
    return sum(p for p, _ in pairs), sum(c for _, c in pairs)
