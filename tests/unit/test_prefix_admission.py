"""Prefix routing through admission, without HTTP: a request body as the relay parses it
(request_body.parse_body), admitted as the relay admits it. A conversation's later
turns stay on the engine its earlier ones went to, under load where least-loaded would
move them; hints win; heat, draining and a restart take locality away;
``gateway.prefix_routing = false`` is least-loaded only."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from appliance.config import Config, EngineConfig, GatewayConfig
from appliance.control import EngineStatus
from appliance.endpoint import EngineAddress
from appliance.engine import EngineState
from appliance.gateway.admission.gate import Admission
from appliance.gateway.relay.request_body import ParsedRequest, parse_body

DOC = " ".join(f"word{i}" for i in range(3000))  # ~27 kB: a long document
SYSTEM = "You are a careful assistant. " * 20


class Box:
    """Two READY engines of one model and an Admission over them."""

    def __init__(self, prefix_routing: bool = True) -> None:
        self.gateway = GatewayConfig(prefix_routing=prefix_routing, max_tokens_cap=64)
        self.config = Config(
            engine=EngineConfig(
                max_inflight=16, max_inflight_tokens=1_000_000, max_model_len=32768
            ),
            gateway=self.gateway,
        )
        self.snaps = [
            EngineStatus(i, None, EngineAddress(port=9000 + i), EngineState.READY, "k", pid=100 + i)
            for i in range(2)
        ]
        self.adm = Admission(lambda: self.config, lambda: self.snaps, lambda: True)
        self.fillers: list[tuple[int, int]] = []

    def parse(self, route: str, body: dict[str, Any], headers: Any = None) -> ParsedRequest:
        raw = json.dumps({"model": "m", "max_tokens": 16, **body}).encode()
        return parse_body(route, raw, headers or {}, self.gateway, 32768)

    async def send(self, parsed: ParsedRequest) -> int:
        """The engine the request is admitted to (its slot given back at once)."""
        engine = await self.adm.acquire(parsed.cost, session=parsed.session, prefix=parsed.prefix)
        self.adm.release(engine, parsed.cost)
        return engine

    async def load(self, engine: int, n: int = 2, tokens: int = 20_000) -> None:
        """``n`` requests of ``tokens`` held on ``engine``: least-loaded avoids it."""
        for _ in range(n):
            other = frozenset(s.id for s in self.snaps) - {engine}
            got = await self.adm.acquire(tokens, exclude=other)
            assert got == engine
            self.fillers.append((got, tokens))

    def unload(self) -> None:
        for engine, tokens in self.fillers:
            self.adm.release(engine, tokens)
        self.fillers.clear()

    def restart(self, engine: int) -> None:
        self.snaps[engine] = dataclasses.replace(self.snaps[engine], pid=500 + engine)


def chat(turn: int, **extra: Any) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": DOC + " What is this about?"},
    ]
    for t in range(1, turn):
        msgs += [
            {"role": "assistant", "content": f"Answer {t}: " + "it is about words. " * 30},
            {"role": "user", "content": f"Follow-up question {t}?"},
        ]
    return {"messages": msgs, **extra}


ROUTES: dict[str, Any] = {
    "chat": chat,
    "completions": lambda turn, **x: {
        "prompt": DOC + "".join(f" Q{t} A{t}" for t in range(turn)),
        **x,
    },
    "responses": lambda turn, **x: {
        "instructions": SYSTEM,
        "input": chat(turn)["messages"][1:],
        **x,
    },
    "messages": lambda turn, **x: {
        "system": SYSTEM,
        "messages": chat(turn)["messages"][1:],
        **x,
    },
}


async def first_turn_then_load_its_engine(box: Box, route: str) -> int:
    engine = await box.send(box.parse(route, ROUTES[route](1)))
    await box.load(engine)  # least-loaded would now pick the other one
    return engine


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_later_turns_stay_on_their_engine_under_load(route: str) -> None:
    box = Box()
    engine = await first_turn_then_load_its_engine(box, route)
    for turn in (2, 3, 4):
        assert await box.send(box.parse(route, ROUTES[route](turn))) == engine


async def test_prefix_routing_off_is_least_loaded() -> None:
    box = Box(prefix_routing=False)
    engine = await first_turn_then_load_its_engine(box, "chat")
    assert box.parse("chat", chat(2)).prefix == ()
    assert await box.send(box.parse("chat", chat(2))) != engine


async def test_other_conversations_are_placed_by_load() -> None:
    box = Box()
    engine = await first_turn_then_load_its_engine(box, "chat")
    other = {"messages": [{"role": "user", "content": "another long question " * 200}]}
    assert await box.send(box.parse("chat", other)) != engine


@pytest.mark.parametrize(
    ("extra", "headers", "session"),
    [
        ({"user": "alice"}, None, "alice"),
        ({"prompt_cache_key": "conv-1", "user": "alice"}, None, "conv-1"),
        ({"metadata": {"user_id": "user_x_session_1"}}, None, "user_x_session_1"),
        ({"prompt_cache_key": "conv-1"}, {"X-Session-Id": "s-9"}, "s-9"),
    ],
)
async def test_a_hint_wins_over_the_prefix(
    extra: dict[str, Any], headers: dict[str, str] | None, session: str
) -> None:
    box = Box()
    engine = await first_turn_then_load_its_engine(box, "chat")
    parsed = box.parse("chat", chat(2, **extra), headers)
    assert parsed.session == session and parsed.prefix == ()  # nothing hashed
    # A new session goes where the session rule puts it: the least-loaded engine.
    assert await box.send(parsed) != engine


async def test_a_hotter_engine_loses_locality() -> None:
    box = Box()
    engine = await box.send(box.parse("chat", chat(1)))
    box.adm.set_throttle(engine, 1)
    assert await box.send(box.parse("chat", chat(2))) != engine
    box.adm.set_throttle(engine, 0)  # cooled; turn 2 went to the other one, which
    await box.load(1 - engine, n=1)  # now holds the longer prefix: turn 3 follows it
    assert await box.send(box.parse("chat", chat(3))) == 1 - engine


async def test_a_draining_engine_loses_locality() -> None:
    box = Box()
    engine = await box.send(box.parse("chat", chat(1)))
    box.snaps[engine] = dataclasses.replace(box.snaps[engine], state=EngineState.DRAINING)
    assert await box.send(box.parse("chat", chat(2))) != engine


async def test_a_drained_engine_keeps_its_entries() -> None:
    box = Box()
    engine = await first_turn_then_load_its_engine(box, "chat")
    box.snaps[engine] = dataclasses.replace(box.snaps[engine], state=EngineState.DRAINING)
    other = {"messages": [{"role": "user", "content": "another long question " * 200}]}
    assert await box.send(box.parse("chat", other)) != engine  # routed while it drains
    box.snaps[engine] = dataclasses.replace(box.snaps[engine], state=EngineState.READY)
    assert await box.send(box.parse("chat", chat(2))) == engine  # resumed: still holds it


async def test_a_restarted_engine_is_forgotten() -> None:
    box = Box()
    engine = await first_turn_then_load_its_engine(box, "chat")
    box.restart(engine)
    assert await box.send(box.parse("chat", chat(2))) != engine


async def test_a_holder_far_busier_than_the_other_gives_way() -> None:
    box = Box()
    engine = await box.send(box.parse("chat", chat(1)))
    await box.load(engine, n=8, tokens=10)
    assert await box.send(box.parse("chat", chat(2))) == engine  # 8 more: kept
    await box.load(engine, n=1, tokens=10)
    assert await box.send(box.parse("chat", chat(3))) != engine  # 9 more: moved


async def test_a_waiter_gets_its_prefix_routing_too() -> None:
    box = Box()
    engine = await box.send(box.parse("chat", chat(1)))
    one = dataclasses.replace(box.config.engine, max_inflight=1)
    box.config = dataclasses.replace(box.config, engine=one)
    # Both engines full, the holder with far more outstanding tokens.
    await box.load(engine, n=1, tokens=50_000)
    await box.load(1 - engine, n=1, tokens=10)
    parsed = box.parse("chat", chat(2))
    waiting = asyncio.ensure_future(box.adm.acquire(parsed.cost, prefix=parsed.prefix))
    await asyncio.sleep(0)
    assert box.adm.queue_depth == 1
    box.config = dataclasses.replace(box.config, engine=dataclasses.replace(one, max_inflight=8))
    box.adm.kick()  # room on both now: the waiter goes where its prefix is
    assert await waiting == engine
    box.adm.release(engine, parsed.cost)
    box.unload()
