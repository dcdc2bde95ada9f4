"""The per-request figures: counted exactly, with each series' child looked up once.

``labels()`` is a validation, a lock and a dict look-up; the gateway took three per
request (#24 item 2). These check that what /metrics says is unchanged and that the
look-up happens once per series, not once per request.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client import generate_latest

from appliance.gateway.observe.metrics import GatewayMetrics


def counting_labels(monkeypatch: pytest.MonkeyPatch, metric: Any) -> list[tuple[str, ...]]:
    calls: list[tuple[str, ...]] = []
    real = metric.labels

    def spy(*values: str) -> Any:
        calls.append(values)
        return real(*values)

    monkeypatch.setattr(metric, "labels", spy)
    return calls


def test_answers_are_counted_per_series_with_one_lookup_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = GatewayMetrics()
    looked_up = counting_labels(monkeypatch, m.requests)
    started = time.monotonic()
    for _ in range(3):
        m.answered("/v1/chat/completions", 200, "m1", started)
    m.answered("/v1/chat/completions", 429, "m1", started)
    text = generate_latest(m.registry).decode()
    assert (
        'appliance_requests_total{model="m1",route="/v1/chat/completions",status="200"} 3.0' in text
    )
    assert (
        'appliance_requests_total{model="m1",route="/v1/chat/completions",status="429"} 1.0' in text
    )
    assert (
        'appliance_request_duration_seconds_count{model="m1",route="/v1/chat/completions"} 4.0'
        in text
    )
    assert looked_up == [
        ("/v1/chat/completions", "200", "m1"),
        ("/v1/chat/completions", "429", "m1"),
    ]


def test_time_to_first_byte_is_observed_per_stream_with_one_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = GatewayMetrics()
    looked_up = counting_labels(monkeypatch, m.ttft)
    for _ in range(5):
        m.first_byte("/v1/completions", "m1", time.monotonic())
    text = generate_latest(m.registry).decode()
    assert (
        'appliance_time_to_first_token_seconds_count{model="m1",route="/v1/completions"} 5.0'
        in text
    )
    assert looked_up == [("/v1/completions", "m1")]
