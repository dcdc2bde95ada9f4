"""Prefix routing end to end on the daemon with two fake engines of one model (issue 35
item 1): a conversation's later turn, sent with no hint, goes to the engine its earlier
turns went to while that engine is busy with a stream and the other is idle (where
least-loaded would move it), on chat, completions, Responses and Messages; with
``gateway.prefix_routing = false`` it moves; with ``user`` set the hint decides.

Which engine answered is read from the fake engines' request counts and the last request
each recorded (health checks are requests too; they are rare here, and never carry the
test's prompt).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from tests.fakes.appliance_proc import STEADY_HEALTH, Appliance, fake_engine_config, run_appliance

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"  # the default config's model
DOC = " ".join(f"word{i}" for i in range(1500))  # ~13 kB: 25 blocks of prompt text
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


def turn(route: str, n: int, conversation: str, **extra: Any) -> dict[str, Any]:
    """Turn ``n`` of ``conversation`` (each turn resends the earlier ones) on ``route``."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"{conversation}: {DOC}"}]
    for t in range(1, n):
        msgs += [
            {"role": "assistant", "content": f"answer {t}"},
            {"role": "user", "content": f"question {t}?"},
        ]
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, **extra}
    if route == "completions":
        body["prompt"] = " ".join(str(m["content"]) for m in msgs)
    elif route == "responses":
        body["input"] = msgs
        body["max_output_tokens"] = body.pop("max_tokens")
    else:
        body["messages"] = msgs
    return body


@dataclass
class Box:
    app: Appliance
    key: str

    def counts(self) -> list[int]:
        out = []
        for i in range(2):
            stats = self.app.engine_stats(i)
            assert stats is not None
            out.append(int(stats["requests"]))
        return out

    def served_by(self, route: str, body: dict[str, Any]) -> int:
        """The engine that answered ``body`` (sent without streaming)."""
        before = self.counts()
        req = urllib.request.Request(
            self.app.url + PATHS[route],
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{e.code}: {e.read()!r}") from None
        after = self.counts()
        moved = [i for i in range(2) if after[i] > before[i] and self.last_was(i, body)]
        assert len(moved) == 1, (before, after)
        return moved[0]

    def last_was(self, engine: int, body: dict[str, Any]) -> bool:
        """The engine's last request carried ``body``'s prompt (not a health check's)."""
        stats = self.app.engine_stats(engine)
        last = (stats or {}).get("last_request") or {}
        sent = last.get("body") or {}
        return any(k in body and sent.get(k) == body[k] for k in ("messages", "prompt", "input"))

    @contextmanager
    def streaming(self, route: str, body: dict[str, Any]) -> Iterator[None]:
        """``body`` streamed, admitted (its head read) and held open meanwhile."""
        host, port = self.app.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request(
                "POST",
                PATHS[route],
                json.dumps({**body, "stream": True}),
                {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            assert resp.status == 200
            resp.read1(1)  # its first event: it holds an engine now
            yield
        finally:
            conn.close()  # the client goes away: the engine stops generating it


@pytest.fixture(scope="module", params=[True, False], ids=["prefix_routing", "least_loaded"])
def box(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("prefix_routing")
    cfg: dict[str, Any] = fake_engine_config(
        tmp,
        2,
        "--token-delay-ms",
        "100",
        # No health probes after start: they are completions too, and would be counted.
        health={**STEADY_HEALTH, "interval_s": 600},
        gateway={"prefix_routing": request.param},
    )
    with run_appliance(tmp, cfg) as app:
        app.wait_all_ready(timeout=90)  # both in routing before the first turn
        yield Box(app, (tmp / "admin.key").read_text().strip())


def prefix_on(box: Box) -> bool:
    return bool(box.app.config["gateway"]["prefix_routing"])


@pytest.mark.parametrize("route", sorted(PATHS))
def test_a_later_turn_stays_where_its_prefix_is_while_that_engine_is_busy(
    box: Box, route: str
) -> None:
    conversation = f"conversation-{route}"
    first = box.served_by(route, turn(route, 1, conversation))
    # A long stream on that engine (least-loaded places it there too: both are idle).
    with box.streaming(route, turn(route, 2, conversation, max_tokens=200)):
        second = box.served_by(route, turn(route, 3, conversation))
    if prefix_on(box):
        assert second == first  # its prefix' engine, though busy
    else:
        assert second != first  # least-loaded: the idle one


def test_a_hint_decides_not_the_prefix(box: Box) -> None:
    first = box.served_by("chat", turn("chat", 1, "hinted"))
    with box.streaming("chat", turn("chat", 2, "hinted", max_tokens=200)):
        # A new session (its first request) goes to the least-loaded engine.
        assert box.served_by("chat", turn("chat", 3, "hinted", user="alice")) != first
