"""Overflow fallback and speculative decoding on real vLLM (CPU).

Two SmolLM2 engines: ``chat`` runs n-gram speculative decoding and falls back to
``small``. A repetitive prompt makes the n-gram proposer right often, so the engine's
accepted-token counter rises and ``/admin/status`` shows an acceptance rate. Draining
``chat`` through the admin API sends its requests to ``small``, which says so
(``X-Appliance-Model: small``, the body's ``model`` is ``small``); resuming brings them
back to ``chat``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import RealAppliance, missing_setup, serving
from tests.fakes.appliance_proc import real_engine_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
REPETITIVE = (
    "Copy this list exactly, then copy it again: apple, banana, cherry, date, elder, "
    "fig, grape, apple, banana, cherry, date, elder, fig, grape, apple, banana, cherry, "
    "date, elder, fig, grape."
)


@pytest.fixture(scope="module")
def chat_and_small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealAppliance]:
    reason = missing_setup()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("e2e-fallback")
    cfg = real_engine_config(tmp, 1)
    cfg["models"] = [
        {"name": "chat", "fallback": "small", "speculative": SPECULATIVE},
        {"name": "small"},
    ]
    with serving(tmp, cfg, engines=2) as real:
        yield real


def chat(app: RealAppliance, content: str, max_tokens: int = 16) -> tuple[dict[str, Any], Any]:
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    req = urllib.request.Request(
        app.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={**app.admin_headers(), "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read()), resp.headers


def post_admin(app: RealAppliance, path: str) -> int:
    req = urllib.request.Request(app.url + path, data=b"", headers=app.admin_headers())
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(resp.status)


def accepted_tokens(app: RealAppliance) -> float:
    """The chat engine's (engine 0) accepted speculative tokens, as /metrics shows them."""
    req = urllib.request.Request(app.url + "/metrics", headers=app.admin_headers())
    with urllib.request.urlopen(req, timeout=10) as resp:
        metrics = resp.read().decode()
    for line in metrics.splitlines():
        if line.startswith("appliance_engine_spec_accepted_tokens_total{") and 'engine="0"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_speculation_answers_and_its_accepted_tokens_rise(chat_and_small: RealAppliance) -> None:
    answer, _ = chat(chat_and_small, REPETITIVE, max_tokens=64)
    text = answer["choices"][0]["message"]["content"]
    assert "banana" in text.lower()  # a real answer, speculation or not
    # The gateway re-exports what the engine's last health check read: wait for one.
    chat_and_small.app.wait_for(
        lambda: accepted_tokens(chat_and_small) > 0, 30, "accepted speculative tokens"
    )
    print(f"\n[e2e] chat engine accepted speculative tokens: {accepted_tokens(chat_and_small)}")
    chat_and_small.app.wait_for(
        lambda: chat_and_small.engine(0)["spec_acceptance_rate"] is not None,
        30,
        "an acceptance rate over the last minute",
    )
    rate = chat_and_small.engine(0)["spec_acceptance_rate"]
    print(f"[e2e] acceptance rate over the last minute: {rate:.2f}")
    assert 0 < rate <= 1
    chat_engine = chat_and_small.engine(0)
    assert chat_engine["model"] == "chat"


def test_draining_chat_sends_its_requests_to_small_and_back(chat_and_small: RealAppliance) -> None:
    assert post_admin(chat_and_small, "/admin/engines/0/drain") == 200
    chat_and_small.app.wait_for(
        lambda: chat_and_small.engine(0)["state"] == "DRAINING", 30, "chat engine draining"
    )
    answer, headers = chat(chat_and_small, "Say hi.")
    assert headers["X-Appliance-Model"] == "small"
    assert answer["model"] == "small"
    assert post_admin(chat_and_small, "/admin/engines/0/resume") == 200
    chat_and_small.app.wait_for(
        lambda: chat_and_small.engine(0)["state"] == "READY", 30, "chat engine READY again"
    )
    started = time.monotonic()
    answer, headers = chat(chat_and_small, "Say hi.")
    assert answer["model"] == "chat", time.monotonic() - started
    assert headers.get("X-Appliance-Model", "chat") == "chat"
