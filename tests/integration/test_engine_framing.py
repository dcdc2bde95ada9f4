"""An engine that does not keep to HTTP/1.1's framing, as the streams' clients see it
(security issue #20, item 5; the relay is appliance/gateway/wire/splice.py).

- An engine that answers twice: the next user's stream is its own answer, never the
  stray one (a connection the engine wrote to while idle is closed, not reused).
- A chunk larger than the cap: mid-stream, the client's stream ends with an error event,
  the engine connection is closed (so vLLM aborts) and the daemon does not hold the
  chunk; as the first chunk, a clean 502.

One daemon, one fake engine, asked to misbehave per request (``fake_framing``, see
tests/fakes/fake_engine.py's ``Misframing``).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from appliance.gateway.wire.http1 import MAX_CHUNK_BYTES
from tests.fakes.appliance_proc import Appliance, fake_engine_config, run_appliance

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
HUGE = 20 * 2**20  # five times the cap


@dataclass
class Client:
    app: Appliance
    key: str
    model: str

    def stream(self, version: str = "1.1", **fields: Any) -> tuple[int, list[Any]]:
        """A streamed chat request read to its end: the status, and the events' JSON
        (the whole body's JSON when it is not a stream)."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            **fields,
        }
        port = int(self.app.config["gateway"]["port"])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        if version == "1.0":  # the aiohttp-client path of the relay, not the splice
            conn._http_vsn, conn._http_vsn_str = 10, "HTTP/1.0"  # type: ignore[attr-defined]
        try:
            conn.request(
                "POST",
                CHAT,
                body=json.dumps(body),
                headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
            )
            r = conn.getresponse()
            raw = r.read().decode()
        finally:
            conn.close()
        if not r.headers.get("content-type", "").startswith("text/event-stream"):
            return r.status, [json.loads(raw)]
        return r.status, [event(e.removeprefix("data: ")) for e in raw.split("\n\n") if e]

    def stats(self) -> dict[str, Any]:
        stats = self.app.engine_stats(0)
        assert stats is not None
        return stats


def event(data: str) -> Any:
    """An event's JSON; any other data (``[DONE]``, junk) as a string, cut short."""
    try:
        return json.loads(data)
    except ValueError:
        return data if len(data) < 80 else f"{data[:40]}... ({len(data)} characters)"


def text_of(events: list[Any]) -> str:
    return "".join(
        (choice.get("delta") or {}).get("content") or ""
        for e in events
        if isinstance(e, dict)
        for choice in e.get("choices", ())
    )


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    tmp = tmp_path_factory.mktemp("framing")
    # Health checks rarely: they are not what is tested, and each one costs a request.
    cfg = fake_engine_config(tmp, 1, health={"interval_s": 2.0, "failures_to_restart": 100})
    with run_appliance(tmp, cfg) as app:
        app.wait_all_ready()
        key = (tmp / "admin.key").read_text().strip()
        c = Client(app, key, "")
        port = int(app.config["gateway"]["port"])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        c.model = json.loads(conn.getresponse().read())["data"][0]["id"]
        conn.close()
        app.engine_control(0, token_delay_ms=0)
        yield c


def test_a_second_answer_from_the_engine_never_reaches_the_next_user(client: Client) -> None:
    status, events = client.stream(max_tokens=2, fake_framing={"stray_response": True})
    assert status == 200 and text_of(events) == " tok0 tok1" and events[-1] == "[DONE]"
    # The engine has written its second answer onto the connection the gateway pooled
    # (and would write it again before answering another request there).
    client.app.wait_for(lambda: client.stats()["stray_responses"] >= 1, 10, "the stray answer")
    status, events = client.stream(max_tokens=3)
    assert status == 200, events
    assert text_of(events) == " tok0 tok1 tok2", events  # its own, not "PLANTED"
    assert events[-1] == "[DONE]"
    assert client.stats()["stray_responses"] == 1  # never asked again on that connection
    assert "while no answer was due" in client.app.log()


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_huge_chunk_mid_stream_ends_it_with_an_error_event_and_is_not_held(
    client: Client, version: str
) -> None:
    client.stream(version, max_tokens=2)  # warm: the first streams' allocations not counted
    aborts = client.stats()["aborts"]
    before = peak_rss_kib(client.app.proc.pid)
    status, events = client.stream(
        version, max_tokens=4, fake_framing={"huge_chunk": HUGE, "at_token": 1}
    )
    grown = peak_rss_kib(client.app.proc.pid) - before
    assert status == 200
    assert text_of(events) == " tok0", events  # the chunks before the huge one, whole
    error = events[-1]["error"]
    assert error["code"] == "engine_error" and "incomplete" in error["message"], events
    # The engine connection was closed, which is what makes vLLM abort the generation.
    client.app.wait_for(lambda: client.stats()["aborts"] > aborts, 10, "the engine's abort")
    # Refused at its size line: nothing of the 20 MiB was held (it used to be, twice).
    assert grown < (MAX_CHUNK_BYTES + 4 * 2**20) // 1024, f"peak RSS grew by {grown} KiB"
    status, events = client.stream(max_tokens=2)
    assert status == 200 and text_of(events) == " tok0 tok1"


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_huge_first_chunk_is_a_clean_502(client: Client, version: str) -> None:
    before = peak_rss_kib(client.app.proc.pid)
    status, body = client.stream(
        version, max_tokens=4, fake_framing={"huge_chunk": HUGE, "at_token": 0}
    )
    grown = peak_rss_kib(client.app.proc.pid) - before
    assert status == 502, body
    error = body[0]["error"]
    assert error["code"] == "engine_error" and str(MAX_CHUNK_BYTES) in error["message"], error
    assert grown < (MAX_CHUNK_BYTES + 4 * 2**20) // 1024, f"peak RSS grew by {grown} KiB"
    status, events = client.stream(max_tokens=2)
    assert status == 200 and text_of(events) == " tok0 tok1"
