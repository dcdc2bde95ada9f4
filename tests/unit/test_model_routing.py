"""Several models in the gateway without HTTP: which engines may take a model's request
(a table), how a request's model name is resolved and refused, the forwarded body, and
admission keeping each model's queue, budgets and engines to itself."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest

from appliance.config import Config, GatewayConfig, parse_config
from appliance.control import EngineStatus
from appliance.endpoint import EngineAddress
from appliance.engine import EngineState
from appliance.gateway.admission.gate import Admission
from appliance.gateway.admission.models import (
    candidates,
    check_key_allows,
    key_allows,
    model_list,
    resolve,
    resolve_named,
    visible_models,
)
from appliance.gateway.errors import GatewayError
from appliance.gateway.relay.request_body import finish_body, open_body


@dataclass(frozen=True)
class E:
    id: int
    model: str


ENGINES = [E(0, "chat"), E(1, "chat"), E(2, "embed")]


@pytest.mark.parametrize(
    ("model", "engines", "expected"),
    [
        ("chat", ENGINES, [0, 1]),
        ("embed", ENGINES, [2]),
        ("other", ENGINES, []),  # a model with no engine has none, never another's
        ("chat", [], []),
        (None, ENGINES, [0, 1, 2]),  # no model named (bare admission): every engine
    ],
)
def test_candidates_are_the_models_own_engines(
    model: str | None, engines: list[E], expected: list[int]
) -> None:
    assert [e.id for e in candidates(model, engines)] == expected


def two_models(**chat: Any) -> Config:
    return parse_config(
        {
            "engine": {"device": "cpu", "max_inflight": 2, "max_model_len": 100},
            "gateway": {"queue_timeout_s": 0.2, "queue_aging_s": 0},
            "models": [
                {"name": "chat", "aliases": ["gpt-4o-mini"], "cpu_engines": 1, **chat},
                {
                    "name": "embed",
                    "aliases": ["ada"],
                    "task": "embed",
                    "model": "/tmp",
                    "cpu_engines": 1,
                    "max_inflight": 5,
                    "max_inflight_tokens": 40,
                    "max_model_len": 50,
                },
            ],
        }
    )


def test_model_list_is_every_name_and_alias() -> None:
    assert model_list(two_models().served) == ["chat", "gpt-4o-mini", "embed", "ada"]


@pytest.mark.parametrize(
    ("name", "route", "expected"),
    [
        ("chat", "chat", "chat"),
        ("gpt-4o-mini", "completions", "chat"),
        ("ada", "embeddings", "embed"),
        ("gpt-9", "chat", "404 model_not_found"),
        ("embed", "chat", "400 model_wrong_route"),
        ("ada", "completions", "400 model_wrong_route"),
        ("chat", "embeddings", "400 model_wrong_route"),
    ],
)
def test_resolve(name: str, route: str, expected: str) -> None:
    try:
        got = resolve(two_models(), name, route).name
    except GatewayError as exc:
        assert exc.param == "model"
        got = f"{exc.status} {exc.code}"
    assert got == expected


def test_refusals_name_what_exists() -> None:
    with pytest.raises(GatewayError) as unknown:
        resolve(two_models(), "gpt-9", "chat")
    assert all(n in unknown.value.message for n in ("chat", "gpt-4o-mini", "embed", "ada"))
    with pytest.raises(GatewayError) as wrong:
        resolve(two_models(), "chat", "embeddings")
    assert "/v1/chat/completions and /v1/completions" in wrong.value.message


def test_the_canonical_name_goes_on_byte_for_byte_an_alias_is_rewritten() -> None:
    limits = GatewayConfig()
    raw = b'{"model": "embed",  "input": "hi"}'
    same = finish_body("embeddings", open_body("embeddings", raw), {}, limits, 50, "embed")
    assert same.body is raw and same.model == "embed"
    raw = b'{"model": "ada", "input": "hi"}'
    alias = finish_body("embeddings", open_body("embeddings", raw), {}, limits, 50, "embed")
    assert json.loads(alias.body) == {"model": "embed", "input": "hi"}
    assert alias.model == "embed"


def admission(cfg: Config) -> tuple[Admission, list[EngineStatus]]:
    snaps = [
        EngineStatus(0, None, EngineAddress(port=9000), EngineState.READY, "k", model="chat"),
        EngineStatus(1, None, EngineAddress(port=9001), EngineState.READY, "k", model="embed"),
    ]
    return Admission(lambda: cfg, lambda: snaps, lambda: True), snaps


def test_each_model_has_its_own_budgets_and_context() -> None:
    adm, _ = admission(two_models())
    assert [(x.id, x.max_inflight) for x in adm.loads("chat")] == [(0, 2)]
    assert [(x.id, x.max_inflight) for x in adm.loads("embed")] == [(1, 5)]
    adm.check_cost(60, "chat")
    with pytest.raises(GatewayError) as big:
        adm.check_cost(60, "embed")  # past both its max_inflight_tokens and max_model_len
    assert big.value.code == "too_many_tokens"


async def test_a_full_model_queues_its_own_requests_only() -> None:
    adm, _ = admission(two_models())
    assert {await adm.acquire(1, model="chat") for _ in range(2)} == {0}
    waiting = asyncio.ensure_future(adm.acquire(1, model="chat"))  # chat is full: it waits
    await asyncio.sleep(0)
    assert not waiting.done() and adm.queue_depth == 1
    # Another model's request is not held behind it, and never goes to chat's engine...
    assert await adm.acquire(1, model="embed") == 1
    # ...nor does the chat waiter go to the idle embedding engine: it times out.
    with pytest.raises(GatewayError) as late:
        await waiting
    assert late.value.code == "queue_timeout" and "'chat'" in late.value.message


async def test_a_model_with_no_engine_that_may_serve_is_refused_at_once() -> None:
    adm, snaps = admission(two_models())
    snaps[1] = EngineStatus(
        1, None, EngineAddress(port=9001), EngineState.FAILED, "k", model="embed"
    )
    with pytest.raises(GatewayError) as refused:
        await adm.acquire(1, model="embed")
    assert refused.value.code == "no_engine" and "'embed'" in refused.value.message
    assert await adm.acquire(1, model="chat") == 0


ADAPTERS = {"chat-sql": "chat"}  # an adapter of chat


@pytest.mark.parametrize(
    ("allowed", "asked", "expected"),
    [
        (None, "chat", True),  # no limit (a key made before the field existed)
        (None, "ada", True),
        (("chat",), "chat", True),
        (("chat",), "gpt-4o-mini", True),  # its alias follows it
        (("chat",), "chat-sql", True),  # and its adapter
        (("chat",), "embed", False),
        (("chat",), "ada", False),
        (("gpt-4o-mini",), "chat", True),  # named by an alias: the model
        (("ada",), "embed", True),
        (("chat-sql",), "chat-sql", True),  # an adapter named by itself
        (("chat-sql",), "chat", False),  # does not open its base model
        (("gone",), "chat", False),  # a name no longer served opens nothing
    ],
)
def test_a_key_limited_to_models(
    allowed: tuple[str, ...] | None, asked: str, expected: bool
) -> None:
    config = two_models()
    route = "embeddings" if asked in ("embed", "ada") else "chat"
    served, sent = resolve_named(config, asked, route, ADAPTERS)
    assert key_allows(config, allowed, served, sent) is expected
    if expected:
        check_key_allows(config, allowed, served, sent, asked)
        return
    with pytest.raises(GatewayError) as info:
        check_key_allows(config, allowed, served, sent, asked)
    err = info.value
    assert (err.status, err.code, err.param) == (403, "model_not_allowed", "model")
    assert asked in err.message


@pytest.mark.parametrize(
    ("allowed", "names", "adapters"),
    [
        (None, ["chat", "embed"], ["chat-sql"]),
        (("ada",), ["embed"], []),
        (("gpt-4o-mini",), ["chat"], ["chat-sql"]),
        (("chat-sql",), [], ["chat-sql"]),
    ],
)
def test_a_key_sees_only_its_models(
    allowed: tuple[str, ...] | None, names: list[str], adapters: list[str]
) -> None:
    served, shown = visible_models(two_models(), ADAPTERS, allowed)
    assert [m.name for m in served] == names and list(shown) == adapters
