"""What one key's requests may hold of an engine, as other clients see it (issue 33 item 2).

- A stream whose client reads nothing (a socket with a 4 KiB receive buffer that never
  reads) is ended after ``gateway.stall_timeout_s``: another client's request, queued
  behind it, is served, and ``/admin/status`` shows nothing in flight again. On both relay
  paths: the splice (HTTP/1.1) and aiohttp's client (HTTP/1.0).
- A revoked key's open requests end at the revocation (the admin API's, or `keys revoke`
  picked up by the watcher's reload): its stream under way is cut, its queued request
  gets 401 (a retrieve or cancel of its stored response as well), the engine's slot is
  free at once.
- A key with ``max_inflight`` 1 runs one request at a time; the next one waits (it is not
  refused) while another key's request goes past it to the free slot.

One daemon with one fake engine per test, each configured for what it checks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import CLI, REPO, Appliance, fake_engine_config, run_appliance
from tests.fakes.http_json import call_json

pytestmark = pytest.mark.slow

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
STALL_S = 1.5
HUGE = 3 * 2**20  # one event: the gateway's buffer for the client is over its high water


@dataclass
class Client:
    app: Appliance
    key: str  # the admin key
    model: str

    @property
    def port(self) -> int:
        return int(self.app.config["gateway"]["port"])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def chat(self, key: str | None = None, timeout: float = 60.0, **fields: Any) -> tuple[int, Any]:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], **fields}
        return call_json(self.url, key or self.key, "POST", CHAT, body, timeout=timeout)

    def status(self) -> dict[str, Any]:
        status, doc = call_json(self.url, self.key, "GET", "/admin/status", timeout=5)
        assert status == 200, doc
        return dict(doc)

    def inflight(self) -> int:
        return sum(e["inflight"] for e in self.status()["engines"])

    def new_key(self, **fields: Any) -> tuple[str, str]:
        """A user key made through the admin API: (its secret, its id)."""
        status, doc = call_json(self.url, self.key, "POST", "/admin/keys", {"name": "u", **fields})
        assert status == 201, doc
        return doc["key"], doc["id"]

    def send_stream(
        self, key: str, version: str = "1.1", rcvbuf: int = 0, **fields: Any
    ) -> socket.socket:
        """A streamed completion request sent on a raw socket (``rcvbuf``: its receive
        buffer, set before connecting); nothing of the answer is read here."""
        body = json.dumps({"model": self.model, "prompt": "hi", "stream": True, **fields}).encode()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(30)
        sock.connect(("127.0.0.1", self.port))
        sock.sendall(
            f"POST {COMPLETIONS} HTTP/{version}\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        return sock


def first_event(sock: socket.socket) -> bytes:
    """What came until the stream's first event: the stream is under way."""
    got = b""
    while b"data:" not in got:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    return got


def read_to_end(sock: socket.socket) -> bytes:
    got = b""
    with contextlib.suppress(ConnectionError):
        while chunk := sock.recv(65536):
            got += chunk
    return got


@contextlib.contextmanager
def daemon(tmp: Path, **sections: dict[str, Any]) -> Iterator[Client]:
    """One fake engine taking one request at a time; the admin key as the client's."""
    sections = {"engine": {"max_inflight": 1}, **sections}
    cfg = fake_engine_config(
        tmp, 1, health={"interval_s": 2.0, "failures_to_restart": 100}, **sections
    )
    with run_appliance(tmp, cfg) as app:
        app.wait_all_ready()
        key = (tmp / "admin.key").read_text().strip()
        status, models = call_json(app.url, key, "GET", "/v1/models", timeout=5)
        assert status == 200, models
        app.engine_control(0, token_delay_ms=0)
        yield Client(app, key, models["data"][0]["id"])


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_stream_nobody_reads_is_ended_and_the_next_request_served(
    tmp_path: Path, version: str
) -> None:
    gateway = {"stall_timeout_s": STALL_S, "queue_timeout_s": 20}
    with daemon(tmp_path, gateway=gateway) as c:
        user, _ = c.new_key()
        stalled = c.send_stream(
            user,
            version,
            rcvbuf=4096,
            max_tokens=4000,
            fake_framing={"huge_chunk": HUGE, "at_token": 1},
        )
        try:
            c.app.wait_for(lambda: c.inflight() == 1, 10, "the unread stream admitted")
            # Queued behind it (the engine takes one at a time): served once it is cut.
            began = time.monotonic()
            status, body = c.chat(max_tokens=1, timeout=60)
            assert status == 200, body
            assert time.monotonic() - began >= STALL_S * 0.9  # it did wait for the cut
            c.app.wait_for(lambda: c.inflight() == 0, 10, "nothing in flight")
            assert "the client read nothing for 1.5 s" in c.app.log()
        finally:
            stalled.close()


def test_a_revoked_keys_open_requests_end_at_the_revocation(tmp_path: Path) -> None:
    with daemon(tmp_path) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        user, key_id = c.new_key()
        c.app.engine_control(0, token_delay_ms=20)  # 4000 tokens: 80 s
        stream = c.send_stream(user, max_tokens=4000)
        try:
            head = first_event(stream)
            queued = pool.submit(c.chat, user, 60.0, max_tokens=1)
            c.app.wait_for(lambda: c.status()["queue_depth"] == 1, 10, "its second one queued")
            status, doc = call_json(c.url, c.key, "DELETE", f"/admin/keys/{key_id}")
            assert status == 200, doc
            status, body = queued.result(timeout=20)
            assert status == 401, body
            assert body["error"]["message"] == "this API key was revoked"
            got = head + read_to_end(stream)  # cut, long before its 80 s
            assert got.startswith(b"HTTP/1.1 200"), got[:200]
            assert b"data: [DONE]" not in got
            c.app.wait_for(lambda: c.inflight() == 0, 10, "nothing in flight")
            c.app.engine_control(0, token_delay_ms=0)
            assert c.chat(max_tokens=1, timeout=20)[0] == 200
        finally:
            stream.close()


def test_a_revoked_keys_queued_stored_response_reads_get_401(tmp_path: Path) -> None:
    """A retrieve (plain and ``?stream=true``) and a cancel of the key's stored response,
    queued behind its stream, end at the revocation too: they are open requests like the
    others (before: they were not in the table, and ran once the stream was cut)."""
    with daemon(tmp_path) as c, concurrent.futures.ThreadPoolExecutor(3) as pool:
        user, key_id = c.new_key()
        body = {"model": c.model, "input": "hi", "max_output_tokens": 1}
        status, made = call_json(c.url, user, "POST", "/v1/responses", body)
        assert status == 200, made
        rid = made["id"]
        c.app.engine_control(0, token_delay_ms=20)  # 4000 tokens: 80 s
        stream = c.send_stream(user, max_tokens=4000)
        try:
            first_event(stream)
            reads = [
                ("GET", f"/v1/responses/{rid}"),
                ("GET", f"/v1/responses/{rid}?stream=true"),
                ("POST", f"/v1/responses/{rid}/cancel"),
            ]
            queued = [pool.submit(call_json, c.url, user, m, p, None, 60.0) for m, p in reads]
            c.app.wait_for(lambda: c.status()["queue_depth"] == 3, 10, "its reads queued")
            status, doc = call_json(c.url, c.key, "DELETE", f"/admin/keys/{key_id}")
            assert status == 200, doc
            for (_, path), future in zip(reads, queued, strict=True):
                status, got = future.result(timeout=20)
                assert status == 401, (path, got)
                assert got["error"]["message"] == "this API key was revoked", (path, got)
            c.app.wait_for(lambda: c.inflight() == 0, 10, "nothing in flight")
        finally:
            stream.close()


def test_a_key_revoked_from_the_command_line_ends_its_stream_at_the_reload(
    tmp_path: Path,
) -> None:
    """The keys file changed by another process (`keys revoke`): the watcher's reload
    ends the key's open stream, as the admin API's revoke does."""
    with daemon(tmp_path) as c:
        user, key_id = c.new_key()
        c.app.engine_control(0, token_delay_ms=20)  # 4000 tokens: 80 s
        stream = c.send_stream(user, max_tokens=4000)
        try:
            head = first_event(stream)
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            env.pop("LLM_APPLIANCE_CONFIG", None)
            subprocess.run(
                [*CLI, "keys", "revoke", key_id, "--config", str(tmp_path / "config.toml")],
                check=True,
                capture_output=True,
                env=env,
                cwd=REPO,
                timeout=30,
            )
            got = head + read_to_end(stream)  # cut within the watcher's 2 s, not 80 s
            assert b"data: [DONE]" not in got
            c.app.wait_for(lambda: c.inflight() == 0, 10, "nothing in flight")
            assert "ended 1 open request(s) of revoked or expired keys" in c.app.log()
        finally:
            stream.close()


def test_a_key_past_its_max_inflight_waits_while_others_pass(tmp_path: Path) -> None:
    with (
        daemon(tmp_path, engine={"max_inflight": 4}) as c,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        user, key_id = c.new_key(max_inflight=1)
        c.app.engine_control(0, token_delay_ms=20)
        stream = c.send_stream(user, max_tokens=4000)
        try:
            c.app.wait_for(lambda: c.inflight() == 1, 10, "its first request running")
            second = pool.submit(c.chat, user, 60.0, max_tokens=1)
            c.app.wait_for(lambda: c.status()["queue_depth"] == 1, 10, "its second one waits")
            assert c.status()["keys_inflight"] == [{"id": key_id, "name": "u", "inflight": 1}]
            # The engine has room: another key's request goes past the waiting one.
            assert c.chat(max_tokens=1, timeout=20)[0] == 200
            assert not second.done() and c.inflight() == 1
        finally:
            stream.close()  # its first one ends: the second runs
        status, body = second.result(timeout=30)
        assert status == 200, body


def test_another_keys_request_goes_to_the_next_free_slot_not_behind_a_flood(
    tmp_path: Path,
) -> None:
    """Issue 35 item 2: one key queues 20 requests of about 1 s on 4 slots; another key's
    one request is served at the next free slot, while most of the flood still waits
    (before: behind all of it, with the queue empty by then)."""
    with (
        daemon(tmp_path, engine={"max_inflight": 4}) as c,
        concurrent.futures.ThreadPoolExecutor(21) as pool,
    ):
        flooder, _ = c.new_key()
        other, _ = c.new_key()
        c.app.engine_control(0, token_delay_ms=50)  # 20 tokens: about 1 s each
        flood = [pool.submit(c.chat, flooder, 120.0, max_tokens=20) for _ in range(20)]
        c.app.wait_for(lambda: c.status()["queue_depth"] >= 12, 20, "the flood queued")
        status, body = c.chat(other, 60.0, max_tokens=20)
        assert status == 200, body
        left = c.status()["queue_depth"]
        assert left >= 8, f"only {left} of the flood still waited: it was not passed"
        assert all(f.result(120)[0] == 200 for f in flood)  # the flood is all served too
