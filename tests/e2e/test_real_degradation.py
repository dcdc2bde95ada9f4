"""Real preemptions on real vLLM: the detector drains and restarts the engine, and a
steady client loop sees zero failures.

Two CPU engines with one core each and a tiny KV cache (``--num-gpu-blocks-override``):
long concurrent generations on one engine cause real preemptions
(``vllm:num_preemptions_total``). Engine 1 is drained while the long requests are
admitted, so they all land on engine 0; it is resumed at once, so short requests keep
being served there while engine 0 thrashes and is restarted.
"""

from __future__ import annotations

import secrets
import threading
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from appliance import paths
from tests.e2e.conftest import (
    READY_TIMEOUT_S,
    RUN_MARKER,
    RealAppliance,
    kill_run,
    missing_setup,
    real_home,
)
from tests.fakes.appliance_proc import real_engine_config, run_appliance

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
MODEL = paths.PACKAGED_MODEL_NAME


@pytest.fixture(scope="module")
def tiny_kv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealAppliance]:
    reason = missing_setup()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("e2e-degradation")
    cfg = real_engine_config(
        tmp,
        2,
        engine={
            "max_model_len": 768,
            # 8 blocks of 128 tokens: eight 400-token generations cannot all fit.
            "extra_args": ["--num-gpu-blocks-override", "8"],
        },
        health={"interval_s": 2, "probe_timeout_s": 30, "failures_to_restart": 5},
        degradation={
            "window_s": 20,
            "max_preemptions_per_min": 6,
            "hang_s": 20,
            "leak_hold_s": 20,
            "baseline_warmup_s": 0,
        },
        # Room for the long streams to finish on a slow shared machine (37-56 s on a quiet
        # one): a drain that runs out cuts streams that already sent bytes.
        restart={"drain_timeout_s": 300},
    )
    marker = secrets.token_hex(8)
    groups: set[int] = set()
    env = {"LLM_APPLIANCE_HOME": str(real_home()), RUN_MARKER: marker}
    try:
        with run_appliance(tmp, cfg, env=env) as app:
            real = RealAppliance(app, marker, tmp)
            real.groups = groups
            app.wait_ready(READY_TIMEOUT_S)
            real.admin_key = (tmp / "admin.key").read_text().strip()
            app.wait_for(
                lambda: real.states() == ["READY", "READY"], READY_TIMEOUT_S, "both engines READY"
            )
            yield real
    finally:
        kill_run(marker, groups)


def admin_post(real: RealAppliance, path: str) -> int:
    req = urllib.request.Request(
        real.url + path, data=b"", method="POST", headers=real.admin_headers()
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(resp.status)


def test_real_preemptions_drain_and_restart_with_zero_client_failures(
    tiny_kv: RealAppliance,
) -> None:
    real = tiny_kv
    client = openai.OpenAI(
        base_url=real.url + "/v1", api_key=real.admin_key, max_retries=0, timeout=300
    )
    assert admin_post(real, "/admin/engines/1/drain") == 200

    heavy_errors: list[str] = []

    def heavy() -> None:
        try:
            stream = client.completions.create(
                model=MODEL,
                prompt="Write a long story about a lighthouse keeper.",
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                pass
        except Exception as exc:  # every failure is a finding
            heavy_errors.append(repr(exc))

    heavy_threads = [threading.Thread(target=heavy) for _ in range(8)]
    for t in heavy_threads:
        t.start()
    real.app.wait_for(lambda: real.engine(0)["inflight"] == 8, 30, "8 long requests on 0")
    assert admin_post(real, "/admin/engines/1/resume") == 200

    failures: list[str] = []
    answered = 0
    stop = threading.Event()

    def loop() -> None:
        nonlocal answered
        while not stop.is_set():
            try:
                r = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
                )
                assert r.choices[0].message.content is not None
                answered += 1
            except Exception as exc:  # every failure is a finding
                failures.append(repr(exc))

    looper = threading.Thread(target=loop)
    looper.start()
    started = time.monotonic()
    try:
        real.app.wait_for(
            lambda: real.engine(0)["restarts"] >= 1,
            300,
            "engine 0 restarted by the degradation detector",
        )
        detected_s = time.monotonic() - started
        real.app.wait_for(lambda: real.engine(0)["state"] == "READY", 300, "engine 0 READY again")
        real.app.wait_for(lambda: answered >= 100, 300, "100 requests answered")
    finally:
        stop.set()
        looper.join(120)
        for t in heavy_threads:
            t.join(300)
    log = real.app.log()
    engine0 = real.engine(0)
    print(
        f"\n[e2e] degradation restart {detected_s:.0f} s after load; {answered} loop "
        f"requests, {len(failures)} failed; engine0 {engine0['restarts_by_reason']}"
    )
    assert failures == [], failures[:5]
    assert "of draining; restarting anyway" not in log  # the drain ran out: too slow a box
    assert heavy_errors == [], heavy_errors[:3]  # drained: the long ones finished too
    assert engine0["last_restart_reason"] == "degraded"
    assert "degraded (preemption_storm" in log
    assert "engine0: READY -> DRAINING" in log
    assert real.engine(1)["restarts"] == 0
