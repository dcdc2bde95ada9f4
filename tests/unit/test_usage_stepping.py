"""A stream cut before its usage event, where one event carries several tokens.

vLLM 0.32 sends one stream event per ``stream_interval`` new tokens (the larger of the
engine's ``--stream-interval`` and the request's own field) and a speculative step adds
up to ``num_speculative_tokens`` + 1 at once. Counting one token per event read then
counted a key a fraction of what the engine made when its stream was cut (a client gone:
on real vLLM, 1 token charged for 385 generated with ``stream_interval`` 100000). The
count must stay an upper bound: events times the most one carries, plus one event's worth
the engine made but had not sent, never above what the request allowed.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from appliance.config import parse_config
from appliance.gateway.accounting.book import UsageBook, usage_path
from appliance.gateway.accounting.plan import Stepping, UsagePlan, plan_usage, stepping_of
from appliance.gateway.accounting.stream_tap import Metering, StreamTap
from appliance.gateway.admission.ratelimit import RateLimiter
from appliance.gateway.protocols.counts import Usage
from appliance.gateway.relay.answers import EngineCall

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}


@pytest.mark.parametrize(
    ("stepping", "fields", "per_event"),
    [
        (Stepping(), {}, 1),
        (Stepping(), {"stream_interval": 8}, 8),
        (Stepping(interval=4), {"stream_interval": 2}, 4),  # vLLM takes the larger
        (Stepping(interval=4), {"stream_interval": 9}, 9),
        (Stepping(speculative=4), {}, 5),
        (Stepping(interval=3, speculative=2), {"stream_interval": 6}, 8),
        (Stepping(), {"stream_interval": "8"}, 1),  # vLLM refuses it: nothing runs
        (Stepping(), {"stream_interval": True}, 1),
        (Stepping(interval=None), {}, None),
        (Stepping(speculative=None), {"stream_interval": 2}, None),
    ],
)
def test_the_most_tokens_one_event_carries(
    stepping: Stepping, fields: dict[str, Any], per_event: int | None
) -> None:
    assert stepping.per_event(fields) == per_event


def served(**model: Any) -> Any:
    config = parse_config({"models": [{"name": "m", **model}]})
    found = config.model("m")
    assert found is not None
    return found


@pytest.mark.parametrize(
    ("model", "stepping"),
    [
        ({}, Stepping(1, 0)),
        ({"extra_args": ["--stream-interval", "5"]}, Stepping(5, 0)),
        ({"extra_args": ["--stream-interval=7", "--seed", "1"]}, Stepping(7, 0)),
        ({"extra_args": ["--stream-interval", "2", "--stream-interval", "3"]}, Stepping(3, 0)),
        ({"extra_args": ["--stream-interval"]}, Stepping(None, 0)),
        (
            {
                "speculative": {
                    "method": "ngram",
                    "num_speculative_tokens": 4,
                    "prompt_lookup_max": 4,
                }
            },
            Stepping(1, 4),
        ),
    ],
)
def test_what_a_models_engines_do_is_read_from_its_config(
    model: dict[str, Any], stepping: Stepping
) -> None:
    assert stepping_of(served(**model)) == stepping


def charged_to_key(tmp_path: Path, plan: UsagePlan, tap: StreamTap) -> tuple[int, int]:
    """What the key is counted for one try of ``plan`` whose stream ``tap`` read."""
    book = UsageBook(usage_path(tmp_path / "keys.json"), CollectorRegistry(), RateLimiter())
    client: dict[str, object] = {"key": SimpleNamespace(id="k", tpm=None)}
    parsed = SimpleNamespace(tpm_charge=0, usage=plan)
    call = SimpleNamespace(client=client, parsed=parsed, meter=Metering(status=200, tap=tap))
    book.finish(cast(EngineCall, call), book.begin(0))
    return book.counts.since(None)["k"]


def cut_stream_charge(tmp_path: Path, fields: dict[str, Any], stepping: Stepping) -> int:
    """Completion tokens a key is charged for a chat stream cut after its role event and
    10 token events, no usage event."""
    plan = plan_usage("chat", True, {**BODY, **fields}, 4096, 1000, stepping=stepping)
    tap = StreamTap.for_plan(plan)
    tap.events = 1 + 10
    return charged_to_key(tmp_path, plan, tap)[1]


@pytest.mark.parametrize(
    ("fields", "stepping", "completion"),
    [
        ({}, Stepping(), 10),  # one token an event, as before
        ({"stream_interval": 8}, Stepping(), (10 + 1) * 8),
        ({"stream_interval": 100_000}, Stepping(), 1000),  # never above max_tokens
        ({}, Stepping(speculative=4), (10 + 1) * 5),
        ({}, Stepping(interval=None), 1000),  # unknown: everything it allowed
    ],
)
def test_a_cut_stream_is_charged_what_its_events_may_hold(
    tmp_path: Path, fields: dict[str, Any], stepping: Stepping, completion: int
) -> None:
    assert cut_stream_charge(tmp_path, fields, stepping) == completion


def test_a_whole_stream_is_charged_the_engines_own_count(tmp_path: Path) -> None:
    """The usage event, when it came, is the count, whatever the stepping."""
    plan = plan_usage("chat", True, {**BODY, "stream_interval": 8}, 4096, 1000)
    tap = StreamTap.for_plan(plan)
    tap.events, tap.usage = 3, Usage(12, 17)
    assert charged_to_key(tmp_path, plan, tap) == (12, 17)
