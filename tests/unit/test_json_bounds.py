"""How much JSON structure one request body may carry (appliance/gateway/relay/json_bounds.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.gateway.errors import GatewayError
from appliance.gateway.relay.json_bounds import (
    MAX_CONTAINERS,
    MAX_DEPTH,
    MAX_VALUES,
    TooMuchStructure,
    check_structure,
    may_exceed,
)
from appliance.gateway.relay.request_body import open_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def nested(depth: int) -> Any:
    """``depth`` arrays, one inside the other."""
    body: Any = 1
    for _ in range(depth):
        body = [body]
    return body


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({**CHAT, "tools": [{}] * MAX_CONTAINERS}, "objects and arrays"),
        ({**CHAT, "stop": ["ab"] * MAX_VALUES}, "JSON values"),
        ({**CHAT, "x": nested(MAX_DEPTH + 1)}, "levels deep"),
    ],
)
def test_a_body_over_a_limit_is_a_400_naming_it(body: dict[str, Any], limit: str) -> None:
    raw = json.dumps(body, separators=(",", ":")).encode()
    assert may_exceed(raw)
    with pytest.raises(GatewayError) as err:
        open_body("chat", raw)
    assert err.value.status == 400
    assert limit in err.value.message
    assert (
        str(MAX_CONTAINERS if "arrays" in limit else MAX_VALUES if "values" in limit else MAX_DEPTH)
        in err.value.message
    )


@pytest.mark.parametrize(
    "body",
    [
        {**CHAT, "tools": [{}] * (MAX_CONTAINERS - 10)},  # just under, with messages
        {**CHAT, "x": nested(MAX_DEPTH - 1)},
        # Text full of commas and braces is not structure: only the exact count says so.
        {**CHAT, "messages": [{"role": "user", "content": "{[,]}" * 200_000}]},
        {"model": "m", "input": list(range(100_000))},  # token ids for embeddings
    ],
)
def test_a_body_within_the_limits_passes(body: dict[str, Any]) -> None:
    route = "embeddings" if "input" in body else "chat"
    opened = open_body(route, json.dumps(body).encode())
    assert opened.model == "m"


def test_the_byte_bound_never_misses_a_body_over_a_limit() -> None:
    """may_exceed is an upper bound: whatever is over a limit is caught by it first."""
    for body in (
        [{}] * (MAX_CONTAINERS + 1),
        [0] * MAX_VALUES,
        nested(MAX_DEPTH + 1),
        {"a": [[[]]] * (MAX_CONTAINERS // 2)},  # 2 + 2 x 8192 containers
    ):
        with pytest.raises(TooMuchStructure):
            check_structure(body)
        for sep in ((",", ":"), (", ", ": ")):
            assert may_exceed(json.dumps(body, separators=sep).encode())


def test_an_ordinary_request_takes_the_byte_count_only() -> None:
    body = {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    assert not may_exceed(json.dumps(body).encode())
