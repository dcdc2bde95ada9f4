"""What one request may make the daemon and the engines do, as a client sees it.

- A non-streamed answer larger than ``gateway.max_answer_bytes`` is a clear 502, and
  the daemon never holds more of it than that (its peak memory does not follow the
  answer's size).
- A queued request too large for the room an engine has now does not hold up smaller
  ones behind it; a body padded with JSON whitespace costs what its text costs; a
  request no engine could ever take is refused with 400 at once.

Each test runs its own daemon with one fake engine, configured for what it checks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import Appliance, fake_engine_config, run_appliance

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
ANSWER_LIMIT = 1024 * 1024


@dataclass
class Client:
    app: Appliance
    key: str
    model: str

    @property
    def port(self) -> int:
        return int(self.app.config["gateway"]["port"])

    def post(
        self, path: str, body: dict[str, Any] | bytes, timeout: float = 20.0
    ) -> tuple[int, Any]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(
                "POST",
                path,
                body=raw,
                headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
            )
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    def chat(self, timeout: float = 20.0, **fields: Any) -> tuple[int, Any]:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], **fields}
        return self.post(CHAT, body, timeout)

    def status(self) -> dict[str, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/admin/status", headers={"Authorization": f"Bearer {self.key}"})
            doc: dict[str, Any] = json.loads(conn.getresponse().read())
            return doc
        finally:
            conn.close()

    def open_stream(self, **fields: Any) -> socket.socket:
        """A streamed chat request whose first event has arrived; close it to hang up."""
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                **fields,
            }
        ).encode()
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        sock.sendall(
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        got = b""
        while b"data:" not in got:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200"), got
        return sock


@contextlib.contextmanager
def daemon(tmp: Path, engines: int = 1, **sections: dict[str, Any]) -> Iterator[Client]:
    """Fake engines with fast tokens; the admin key as the client's."""
    cfg = fake_engine_config(
        tmp, engines, health={"interval_s": 2.0, "failures_to_restart": 100}, **sections
    )
    with run_appliance(tmp, cfg) as app:
        app.wait_all_ready()  # each engine takes its knob below
        key = (tmp / "admin.key").read_text().strip()
        c = Client(app, key, "")
        conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=5)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        c.model = json.loads(conn.getresponse().read())["data"][0]["id"]
        conn.close()
        for i in range(engines):
            app.engine_control(i, token_delay_ms=0)
        yield c


def generated(c: Client) -> int:
    """Tokens every engine has generated so far."""
    engines = int(c.app.config["engine"]["cpu_engines"])
    return sum(c.app.engine_stats(i)["generation_tokens"] for i in range(engines))  # type: ignore[index]


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


# ---- a non-streamed answer is read up to a limit ----------------------------------------


def test_an_answer_past_max_answer_bytes_is_502_and_not_held(tmp_path: Path) -> None:
    with daemon(
        tmp_path,
        2,
        gateway={"max_answer_bytes": ANSWER_LIMIT},
        engine={"max_inflight_tokens": 10_000_000},
    ) as c:
        before = peak_rss_kib(c.app.proc.pid)
        tokens_before = generated(c)
        # 1000 prompts x 4000 tokens: the fake engine answers with about 28 MB of JSON.
        status, body = c.post(
            "/v1/completions",
            {"model": c.model, "prompt": ["x"] * 1000, "max_tokens": 4000},
            timeout=60,
        )
        grown = peak_rss_kib(c.app.proc.pid) - before
        assert status == 502, body
        err = body["error"]
        assert err["code"] == "answer_too_large" and err["type"] == "api_error", err
        assert str(ANSWER_LIMIT) in err["message"] and '"stream": true' in err["message"]
        # Reading it whole took ~55 MB; bounded, the peak moves by about the limit.
        assert grown < 12 * 1024, f"peak RSS grew by {grown} KiB"
        # Not retried, nothing left reserved, and the next request is served.
        # Not retried on the other engine (it would answer the same): generated once,
        # give or take a health probe's token.
        assert 1000 * 4000 <= generated(c) - tokens_before < 1000 * 4000 + 100
        assert all(e["inflight_tokens"] == 0 for e in c.status()["engines"])
        status, body = c.chat(max_tokens=2)
        assert status == 200 and body["choices"][0]["message"]["content"] == " tok0 tok1"


# ---- head of line -------------------------------------------------------------------------


def test_small_requests_pass_a_queued_one_that_does_not_fit_yet(tmp_path: Path) -> None:
    # Budget 3000 tokens: a running 2000-token stream leaves room for small requests but
    # not for a 2500-token one, which must wait for the stream to end.
    with (
        daemon(tmp_path, engine={"max_inflight_tokens": 3000}) as c,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        c.app.engine_control(0, token_delay_ms=20)
        stream = c.open_stream(max_tokens=2000)
        try:
            big = pool.submit(c.chat, 60.0, max_tokens=2500)
            c.app.wait_for(lambda: c.status()["queue_depth"] == 1, 10, "the big one queued")
            # Behind it: a body padded with 600 KB of JSON whitespace (its text is tiny),
            # and a plain small request. Both are answered while the big one still waits.
            padded = json.dumps(
                {"model": c.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            ).encode()
            padded = padded[:-1] + b" " * 600_000 + b"}"
            assert c.post(CHAT, padded, timeout=15)[0] == 200
            assert c.chat(timeout=15, max_tokens=1)[0] == 200
            assert not big.done() and c.status()["queue_depth"] == 1
            # Too large for any engine even when idle: refused at once, never queued.
            status, body = c.chat(timeout=15, max_tokens=2500, n=2)
            assert status == 400 and body["error"]["code"] == "too_many_tokens", body
            assert "fewer tokens" in body["error"]["message"]
        finally:
            c.app.engine_control(0, token_delay_ms=0)
            stream.close()  # the stream's client hangs up: its budget frees the big one
        status, body = big.result(timeout=30)
        assert status == 200 and body["usage"]["completion_tokens"] == 2500, body
