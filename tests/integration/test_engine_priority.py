"""The key's class reaches the engine's scheduler (issue 35 item 3), on fake engines that
record what they are sent: with ``engine.scheduling = "priority"`` (the default) a
``batch`` key's requests carry ``priority`` 10 (in the body; Messages: vLLM's
X-Vllm-Priority header), an ``interactive`` key's none (vLLM's default, 0), and a
client's own ``priority`` never reaches the engine; with ``"fcfs"`` nothing is sent.

One daemon: ``chat`` (priority scheduling) and ``plain`` (fcfs), one engine each.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.fakes.appliance_proc import STEADY_HEALTH, Appliance, fake_engine_config, run_appliance

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]


@dataclass
class Box:
    app: Appliance
    admin: str

    def call(self, path: str, key: str, body: Any) -> tuple[int, Any]:
        req = urllib.request.Request(
            self.app.url + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def key(self, priority: str) -> str:
        body = {"name": priority, "priority": priority}
        code, made = self.call("/admin/keys", self.admin, body)
        assert code == 201, made
        return str(made["key"])

    def sent(self, model: str, path: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
        """What the model's engine received for ``body`` sent on ``path``."""
        code, answer = self.call(path, key, {"model": model, **body})
        assert code == 200, answer
        engine = 0 if model == "chat" else 1
        for _ in range(3):  # a health probe may not overwrite it, but be sure it is ours
            stats = self.app.engine_stats(engine)
            assert stats is not None
            last = stats["last_request"]
            if last is not None and last["path"] == path:
                return dict(last)
        raise AssertionError(f"engine{engine} did not record {path}")


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("engine_priority")
    cfg: dict[str, Any] = fake_engine_config(tmp, 2, health=STEADY_HEALTH)
    cfg["models"] = [
        {"name": "chat", "cpu_engines": 1},
        {"name": "plain", "cpu_engines": 1, "scheduling": "fcfs"},
    ]
    with run_appliance(tmp, cfg) as app:
        app.wait_ready()
        yield Box(app, (tmp / "admin.key").read_text().strip())


CHAT = ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})
COMPLETION = ("/v1/completions", {"prompt": "hi", "max_tokens": 2})
MESSAGES = ("/v1/messages", {"messages": MSGS, "max_tokens": 2})


@pytest.mark.parametrize(
    ("key_class", "route", "own", "body", "header"),
    [
        ("batch", CHAT, None, 10, None),
        ("batch", COMPLETION, -7, 10, None),  # the client's own is replaced
        ("batch", MESSAGES, None, None, "10"),  # Messages: vLLM reads the header
        ("interactive", CHAT, None, None, None),  # 0, vLLM's default: nothing written
        ("interactive", CHAT, -7, None, None),  # the client's own is taken out
        ("interactive", MESSAGES, -7, None, None),
    ],
)
def test_the_keys_class_reaches_the_engine_never_the_clients_priority(
    box: Box,
    key_class: str,
    route: tuple[str, dict[str, Any]],
    own: int | None,
    body: int | None,
    header: str | None,
) -> None:
    path, fields = route
    extra = {} if own is None else {"priority": own}
    last = box.sent("chat", path, box.key(key_class), {**fields, **extra})
    assert last["body"].get("priority") == body and ("priority" in last["body"]) == (
        body is not None
    )
    assert last["priority_header"] == header


def test_fcfs_sends_no_priority(box: Box) -> None:
    key = box.key("batch")
    for path, fields in (CHAT, MESSAGES):
        last = box.sent("plain", path, key, {**fields, "priority": -7})
        assert "priority" not in last["body"] and last["priority_header"] is None, last
