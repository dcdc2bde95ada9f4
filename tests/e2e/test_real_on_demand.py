"""Two models on demand on real vLLM (CPU), ``swap = "stop"``: they take turns on one
share of the cores, answering in turn through the official ``openai`` client.

"one" and "two" are both SmolLM2 under two names, on demand, one CPU engine each. At
start neither runs; a request for "one" starts it, a request for "two" drains and stops
"one" and starts "two", and "one" comes back the same way. Each cold start of SmolLM2 on
CPU takes tens of seconds: the figures are printed, never asserted.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.conftest import (
    READY_TIMEOUT_S,
    RUN_MARKER,
    RealAppliance,
    kill_run,
    missing_setup,
    real_home,
)
from tests.fakes.appliance_proc import get_json, real_engine_config, run_appliance

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
CHAT = "packaged:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealAppliance]:
    reason = missing_setup()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("e2e-on-demand")
    cfg = real_engine_config(tmp, 1)
    on_demand = {"model": CHAT, "load": "on_demand", "min_residency_s": 0}
    timeout = {"load_timeout_s": READY_TIMEOUT_S}
    cfg["models"] = [
        {"name": "one", **on_demand, **timeout},
        {"name": "two", **on_demand, **timeout},
    ]
    marker = secrets.token_hex(8)
    groups: set[int] = set()
    env = {"LLM_APPLIANCE_HOME": str(real_home()), RUN_MARKER: marker}
    try:
        with run_appliance(tmp, cfg, env=env) as app:
            real = RealAppliance(app, marker, tmp)
            real.groups = groups
            app.wait_for((tmp / "admin.key").exists, 30, "admin.key written")
            real.admin_key = (tmp / "admin.key").read_text().strip()
            app.wait_for(lambda: get_json(app.url + "/healthz")[0] == 200, 30, "the gateway")
            try:
                yield real
            finally:
                print(f"\n[e2e] daemon log: {app.log_path}")
    finally:
        kill_run(marker, groups)


def models(box: RealAppliance) -> dict[str, str]:
    return {m["name"]: m["state"] for m in box.status()["models"]}


def ask(box: RealAppliance, model: str) -> float:
    """One chat answer from ``model`` through the official client; its time, printed."""
    client = openai.OpenAI(
        base_url=box.url + "/v1", api_key=box.admin_key, timeout=READY_TIMEOUT_S + 60, max_retries=0
    )
    started = time.monotonic()
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
    )
    took = time.monotonic() - started
    assert chat.model == model and chat.choices[0].message.content
    print(f"\n[e2e] {model}: answered in {took:.1f} s, its cold start included")
    return took


def test_neither_model_runs_until_asked(box: RealAppliance) -> None:
    assert models(box) == {"one": "unloaded", "two": "unloaded"}
    assert [e["state"] for e in box.status()["engines"]] == ["EXITED", "EXITED"]
    code, body = get_json(box.url + "/readyz")  # a request would load one: ready
    assert code == 200 and body["models"] == {"one": "unloaded", "two": "unloaded"}, body


def test_two_models_answer_in_turn_on_one_share_of_the_cores(box: RealAppliance) -> None:
    ask(box, "one")
    assert models(box) == {"one": "loaded", "two": "unloaded"}
    ask(box, "two")  # "one" drained and stopped first: one model at a time
    assert models(box) == {"one": "unloaded", "two": "loaded"}
    ask(box, "one")
    assert models(box) == {"one": "loaded", "two": "unloaded"}
    log = box.app.log()
    assert "model one: draining, then stopped: to make room for two" in log
    assert "model two: draining, then stopped: to make room for one" in log
