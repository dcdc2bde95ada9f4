"""Two boxes behind a real vllm-router: what a team sees when it outgrows one box.

Two appliance daemons stand for two boxes (fake engines, each its own state directory,
gateway port and keys file, the keys files copied from one source as the Ansible role
provisions them), and a real ``vllm-router`` (PyPI) fronts them on loopback, configured
as the role's front host runs it. The router waits for ``GET /health`` on a worker
before it starts (whatever its ``--health-check-endpoint``), so these tests also prove
the gateway answers it; its runtime checks ask ``/readyz``.

The tests share the boxes and run in file order; killing box A comes last.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import (
    CLI,
    REPO,
    STEADY_HEALTH,
    Appliance,
    fake_engine_config,
    run_appliance,
    write_config,
)
from tests.fakes.router_proc import Router, http, install_router, run_router

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
KEY_RE = re.compile(r"sk-la-[0-9a-f]{8}-[A-Za-z0-9_-]+")
CHAT = "/v1/chat/completions"


@dataclass
class Boxes:
    a: Appliance
    b: Appliance
    router: Router
    source: Path  # the control node's config: its keys file is the one source
    keys: dict[str, str]  # name -> secret

    def chats(self, box: Appliance) -> int:
        stats = box.engine_stats(0) or {}
        return int(stats.get("requests_by_route", {}).get(CHAT, 0))

    def push_keys(self) -> None:
        """As the role does: the source's keys file replaces each box's, atomically."""
        src = self.source.parent / "keys.json"
        for box in (self.a, self.b):
            dest = Path(box.config["gateway"]["keys_file"])
            tmp = dest.with_name(".keys.json.push")
            shutil.copy2(src, tmp)
            os.replace(tmp, dest)


def keys_cli(source: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*CLI, "keys", *args, "--config", str(source)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def create_key(source: Path, name: str, *scope: str) -> str:
    found = KEY_RE.search(keys_cli(source, "create", "--name", name, *scope))
    assert found, name
    return found.group(0)


def chat(url: str, key: str, max_tokens: int = 4, stream: bool = False) -> tuple[int | None, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return http("POST", url + CHAT, body, key, timeout=60)


@pytest.fixture(scope="module")
def boxes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Boxes]:
    exe = install_router()
    if isinstance(exe, str):
        pytest.skip(f"no vllm-router: {exe}")
    tmp = tmp_path_factory.mktemp("boxes")
    (tmp / "source").mkdir()
    source = write_config(
        tmp / "source" / "config.toml",
        {"gateway": {"keys_file": str(tmp / "source" / "keys.json")}},
    )
    keys = {
        "admin": create_key(source, "admin", "--scope", "admin"),
        "dev": create_key(source, "dev"),
        "leaver": create_key(source, "leaver"),
    }
    with contextlib.ExitStack() as stack:
        apps = []
        for name in ("a", "b"):
            (tmp / name).mkdir()
            shutil.copy2(tmp / "source" / "keys.json", tmp / name / "keys.json")
            cfg = fake_engine_config(tmp / name, 1, health=STEADY_HEALTH)
            apps.append(stack.enter_context(run_appliance(tmp / name, cfg)))
        for app in apps:
            app.wait_all_ready(60)
        router = stack.enter_context(run_router(exe, tmp, [a.url for a in apps]))
        out = Boxes(apps[0], apps[1], router, source, keys)
        router.wait_for(
            lambda: router.healthy() == {a.url: True for a in apps}, 60, "both boxes healthy"
        )
        yield out


def test_requests_spread_over_both_boxes(boxes: Boxes) -> None:
    before = boxes.chats(boxes.a), boxes.chats(boxes.b)
    codes = [chat(boxes.router.url, boxes.keys["dev"])[0] for _ in range(10)]
    assert codes == [200] * 10
    got = boxes.chats(boxes.a) - before[0], boxes.chats(boxes.b) - before[1]
    assert sum(got) == 10
    assert min(got) >= 3, got  # round robin: both boxes take their share


def test_health_answers_like_readyz(boxes: Boxes) -> None:
    """What the router probes at start: 200 with the same body as /readyz, no key."""
    assert http("GET", boxes.a.url + "/health")[0] == 200
    assert http("GET", boxes.a.url + "/health")[1]["status"] == "ready"


def test_draining_box_a_sends_all_new_requests_to_b_with_none_failed(boxes: Boxes) -> None:
    router, a = boxes.router, boxes.a
    admin, dev = boxes.keys["admin"], boxes.keys["dev"]
    # Requests keep coming while A drains: the router retries A's 503 on B.
    stop = threading.Event()
    during: list[int | None] = []

    def load() -> None:
        while not stop.is_set():
            during.append(chat(router.url, dev)[0])

    worker = threading.Thread(target=load)
    worker.start()
    try:
        status, body = http("POST", a.url + "/admin/engines/0/drain?force=true", {}, admin)
        assert status == 200, body
        # /health says what /readyz says: the box takes no new work.
        assert http("GET", a.url + "/health")[0] == 503
        router.wait_for(lambda: router.healthy().get(a.url) is False, 30, "the router to see A out")
    finally:
        stop.set()
        worker.join(60)
    on_a = boxes.chats(a)
    after = [chat(router.url, dev)[0] for _ in range(10)]
    assert after == [200] * 10
    assert boxes.chats(a) == on_a  # nothing new reached A
    assert [c for c in during if c != 200] == [], f"{len(during)} requests while A drained"
    # A comes back: the router sends to it again.
    assert http("POST", a.url + "/admin/engines/0/resume", {}, admin)[0] == 200
    router.wait_for(lambda: router.healthy().get(a.url) is True, 30, "the router to take A back")


def test_a_key_revoked_at_the_source_is_refused_by_both_boxes(boxes: Boxes) -> None:
    leaver = boxes.keys["leaver"]
    assert chat(boxes.router.url, leaver)[0] == 200
    ident = leaver.split("-")[2]
    keys_cli(boxes.source, "revoke", ident)
    boxes.push_keys()
    for box in (boxes.a, boxes.b):
        box.wait_for(lambda box=box: chat(box.url, leaver)[0] == 401, 10, "the key refused")
    codes = [chat(boxes.router.url, leaver)[0] for _ in range(6)]
    assert codes == [401] * 6
    assert chat(boxes.router.url, boxes.keys["dev"])[0] == 200  # the others still work


def test_killing_box_a_fails_at_most_the_requests_that_were_on_it(boxes: Boxes) -> None:
    router, a, b = boxes.router, boxes.a, boxes.b
    dev, admin = boxes.keys["dev"], boxes.keys["admin"]
    results: list[tuple[int | None, Any]] = []

    def stream() -> None:
        # A stream cut when its box dies may break the client's HTTP parsing in any way
        # (a chunk size that never came): any exception is that stream failing.
        try:
            results.append(chat(router.url, dev, 2000, True))
        except Exception as exc:  # every way a cut stream can end
            results.append((None, repr(exc)))

    # Long streams (2 ms a token), so some are on A when it dies.
    threads = [threading.Thread(target=stream) for _ in range(6)]
    for t in threads:
        t.start()

    def inflight(box: Appliance) -> int:
        status, body = http("GET", box.url + "/admin/status", key=admin, timeout=2)
        return sum(e["inflight"] for e in body["engines"]) if status == 200 else 0

    a.wait_for(lambda: inflight(a) + inflight(b) == 6, 30, "six streams in flight")
    on_a = inflight(a)
    a.remember_tree()  # so its engines are cleaned up after the daemon is killed
    a.proc.kill()
    a.proc.wait(10)
    for t in threads:
        t.join(60)
    whole = [r for r in results if r[0] == 200 and str(r[1]).rstrip().endswith("data: [DONE]")]
    assert len(results) == 6
    assert len(results) - len(whole) <= on_a, (on_a, [str(r)[-80:] for r in results])
    router.wait_for(lambda: router.healthy().get(a.url) is False, 30, "the router to see A gone")
    before_b = boxes.chats(b)
    assert [chat(router.url, dev)[0] for _ in range(6)] == [200] * 6
    assert boxes.chats(b) == before_b + 6
    assert json.dumps(router.healthy())  # the router itself still answers
