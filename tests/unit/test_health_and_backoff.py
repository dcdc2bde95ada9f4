"""The pure health verdict, vLLM metric parsing, the restart backoff and the hourly budget."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from appliance import health
from appliance.health import HealthHistory, Observation, Verdict, assess, metric_sums
from appliance.supervisor import backoff_delay, restart_allowed

H, SUS, HUNG = Verdict.HEALTHY, Verdict.SUSPECT, Verdict.HUNG


def obs(health: bool, probe: bool, tokens: float | None = None) -> Observation:
    return Observation(health_ok=health, probe_ok=probe, generation_tokens=tokens)


# Each case: (history before, observation, failures_to_restart, verdict, history after)
ASSESS_CASES = [
    pytest.param(HealthHistory(), obs(True, True, 0), 3, H, HealthHistory(0, 0), id="healthy"),
    pytest.param(
        HealthHistory(2, 50), obs(True, True, 50), 3, H, HealthHistory(0, 50), id="healthy-resets"
    ),
    pytest.param(
        HealthHistory(2, 50),
        obs(True, True, None),
        3,
        H,
        HealthHistory(0, 50),
        id="healthy-no-metrics-keeps-last-tokens",
    ),
    pytest.param(
        HealthHistory(2, 50),
        obs(True, False, 80),
        3,
        H,
        HealthHistory(0, 80),
        id="probe-fails-but-tokens-rise",
    ),
    pytest.param(
        HealthHistory(2, 50),
        obs(False, False, 51),
        3,
        H,
        HealthHistory(0, 51),
        id="health-fails-but-tokens-rise",
    ),
    pytest.param(
        HealthHistory(0, 50),
        obs(True, False, 50),
        3,
        SUS,
        HealthHistory(1, 50),
        id="probe-fails-tokens-flat",
    ),
    pytest.param(
        HealthHistory(1, 50),
        obs(True, False, 50),
        3,
        SUS,
        HealthHistory(2, 50),
        id="second-failure",
    ),
    pytest.param(
        HealthHistory(2, 50),
        obs(True, False, 50),
        3,
        HUNG,
        HealthHistory(3, 50),
        id="third-failure-hung",
    ),
    pytest.param(
        HealthHistory(5, 50),
        obs(True, False, 50),
        3,
        HUNG,
        HealthHistory(6, 50),
        id="still-hung",
    ),
    pytest.param(
        HealthHistory(0, 50),
        obs(True, False, 50),
        1,
        HUNG,
        HealthHistory(1, 50),
        id="failures-to-restart-1",
    ),
    pytest.param(
        HealthHistory(0, 50),
        obs(True, False, 40),
        3,
        SUS,
        HealthHistory(1, 40),
        id="tokens-fall-is-not-progress",
    ),
    pytest.param(
        HealthHistory(0, 50),
        obs(False, False, None),
        3,
        SUS,
        HealthHistory(1, 50),
        id="metrics-missing-keeps-last-tokens",
    ),
    pytest.param(
        HealthHistory(0, None),
        obs(True, False, 10),
        3,
        SUS,
        HealthHistory(1, 10),
        id="first-tokens-seen-are-no-progress-yet",
    ),
    pytest.param(
        HealthHistory(0, None),
        obs(False, False, None),
        2,
        SUS,
        HealthHistory(1, None),
        id="never-any-metrics",
    ),
    pytest.param(
        HealthHistory(1, None),
        obs(False, False, None),
        2,
        HUNG,
        HealthHistory(2, None),
        id="never-any-metrics-hung",
    ),
    pytest.param(
        HealthHistory(0, 10),
        obs(False, True, 10),
        3,
        SUS,
        HealthHistory(1, 10),
        id="probe-ok-but-health-fails",
    ),
]


@pytest.mark.parametrize(("before", "observation", "limit", "verdict", "after"), ASSESS_CASES)
def test_assess(
    before: HealthHistory,
    observation: Observation,
    limit: int,
    verdict: Verdict,
    after: HealthHistory,
) -> None:
    assert assess(observation, before, limit) == (verdict, after)


@pytest.mark.parametrize("limit", [1, 2, 3, 5])
def test_assess_sequence_suspect_then_hung_at_limit(limit: int) -> None:
    history = HealthHistory(0, 100)
    verdicts = []
    for _ in range(limit + 1):
        verdict, history = assess(obs(True, False, 100), history, limit)
        verdicts.append(verdict)
    assert verdicts == [SUS] * (limit - 1) + [HUNG, HUNG]
    # One good check clears the count entirely.
    verdict, history = assess(obs(True, True, 100), history, limit)
    assert (verdict, history.consecutive_failures) == (H, 0)


def test_assess_busy_engine_with_slow_probe_is_never_hung() -> None:
    history = HealthHistory()
    for tokens in range(0, 1000, 10):
        verdict, history = assess(obs(True, False, tokens), history, 2)
        assert verdict in (H, SUS)
        if tokens > 0:
            assert verdict is H


VLLM_METRICS = """\
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="smollm2-135m-instruct"} 1234.0
vllm:generation_tokens_total{engine="1",model_name="smollm2-135m-instruct"} 66.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="smollm2-135m-instruct"} 1.7e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2-135m-instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="smollm2-135m-instruct"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="smollm2-135m-instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="smollm2-135m-instruct"} 9.0
vllm:time_to_first_token_seconds_count{model_name="smollm2-135m-instruct"} 9.0
vllm:time_to_first_token_seconds_sum{model_name="smollm2-135m-instruct"} 0.5
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 100.0
"""


@pytest.mark.parametrize(
    ("names", "expect"),
    [
        (
            {"vllm:generation_tokens_total", "vllm:num_requests_running"},
            {"vllm:generation_tokens_total": 1300.0, "vllm:num_requests_running": 4.0},
        ),
        ({"vllm:generation_tokens_total"}, {"vllm:generation_tokens_total": 1300.0}),
        (
            {"vllm:time_to_first_token_seconds_count"},
            {"vllm:time_to_first_token_seconds_count": 9.0},
        ),
        ({"vllm:num_preemptions_total"}, {}),  # absent: absent, not 0
        (set(), {}),
    ],
)
def test_metric_sums_over_labelled_vllm_text(names: set[str], expect: dict[str, float]) -> None:
    assert metric_sums(VLLM_METRICS, names) == expect


def test_metric_sums_of_empty_text() -> None:
    assert metric_sums("", {"vllm:generation_tokens_total"}) == {}


def test_metric_sums_rejects_garbage_with_value_error() -> None:
    # observe() turns ValueError into "metrics unreadable" rather than crashing the check.
    with pytest.raises(ValueError):
        metric_sums("<html>{ not prometheus }</html>\n", {"vllm:generation_tokens_total"})


@pytest.mark.parametrize(
    ("failures", "initial", "maximum", "expect"),
    [
        (0, 2, 300, 0.0),
        (-1, 2, 300, 0.0),
        (1, 2, 300, 2.0),
        (2, 2, 300, 4.0),
        (3, 2, 300, 8.0),
        (4, 2, 300, 16.0),
        (8, 2, 300, 256.0),
        (9, 2, 300, 300.0),  # 512 capped
        (10, 2, 300, 300.0),
        (10_000, 2, 300, 300.0),  # no overflow however long it fails
        (1, 0, 300, 0.0),
        (5, 0, 300, 0.0),
        (1, 5, 5, 5.0),
        (3, 5, 5, 5.0),
        (1, 0.5, 10, 0.5),
        (2, 0.5, 10, 1.0),
    ],
)
def test_backoff_delay(failures: int, initial: float, maximum: float, expect: float) -> None:
    delay = backoff_delay(failures, initial, maximum)
    assert delay == expect
    assert isinstance(delay, float)


def test_backoff_delay_never_decreases_and_never_passes_max() -> None:
    delays = [backoff_delay(n, 2, 300) for n in range(1, 40)]
    assert delays == sorted(delays)
    assert max(delays) == 300


HOUR = 3600.0
NOW = 10_000.0


@pytest.mark.parametrize(
    ("times", "max_per_hour", "allowed"),
    [
        ([], 6, True),
        ([NOW - 10] * 5, 6, True),
        ([NOW - 10] * 6, 6, False),
        ([NOW - HOUR - 1] * 6, 6, True),  # all older than an hour
        ([NOW - HOUR] * 6, 6, True),  # exactly an hour ago has left the window
        ([NOW - HOUR + 0.001] * 6, 6, False),  # just inside the window
        ([NOW - HOUR - 5] * 3 + [NOW - 5] * 3, 6, True),  # only 3 in the window
        ([NOW - 3000, NOW - 2000, NOW - 1000], 3, False),
        ([NOW - 3700, NOW - 2000, NOW - 1000], 3, True),
        ([], 0, False),  # a budget of 0 never restarts
        ([NOW - 5 * HOUR], 0, False),
        ([NOW - 1], 1, False),
        ([NOW - 1], 2, True),
    ],
)
def test_restart_allowed_sliding_hour(times: list[float], max_per_hour: int, allowed: bool) -> None:
    assert restart_allowed(times, NOW, max_per_hour) is allowed


def test_restart_budget_frees_up_as_the_window_slides() -> None:
    times = [0.0, 600.0, 1200.0]
    assert not restart_allowed(times, 1800.0, 3)
    assert not restart_allowed(times, 3599.0, 3)
    assert restart_allowed(times, 3600.0, 3)  # the restart at 0 has left the window
    assert not restart_allowed([*times, 3600.0], 3600.0, 3)


# ---------------------------------------------------------------------------- observe()


async def _engine(routes: dict[str, Any]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    for path, handler in routes.items():
        method, _, route = path.partition(" ")
        app.router.add_route(method, route, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_frozen_engine_costs_the_status_timeout_not_the_probe_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/health and /metrics of a frozen engine are given up on after STATUS_TIMEOUT_S,
    together, and no probe is sent: not probe_timeout_s per route."""
    monkeypatch.setattr(health, "STATUS_TIMEOUT_S", 0.3)
    seen: list[str] = []
    thaw = asyncio.Event()

    async def frozen(request: web.Request) -> web.Response:
        seen.append(request.path)
        await asyncio.wait_for(thaw.wait(), 60)
        return web.Response()

    runner, url = await _engine(
        {"GET /health": frozen, "GET /metrics": frozen, "POST /v1/completions": frozen}
    )
    try:
        async with aiohttp.ClientSession() as s:
            started = time.monotonic()
            obs = await health.observe(s, url, "k", "m", timeout_s=30.0)
            took = time.monotonic() - started
    finally:
        thaw.set()
        await runner.cleanup()
    assert not obs.health_ok and not obs.probe_ok
    assert "/health: TimeoutError" in obs.detail and "/metrics: TimeoutError" in obs.detail
    assert sorted(seen) == ["/health", "/metrics"]  # no probe to an engine that is not there
    assert took < 10.0  # far below the 30 s probe timeout, let alone 60 s for both routes


async def test_healthy_engine_observed_with_probe_and_metrics() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            text=VLLM_METRICS
            + "# TYPE vllm:kv_cache_usage_perc gauge\n"
            + 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42\n'
        )

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["max_tokens"] == 1
        assert request.headers["Authorization"] == "Bearer k"
        return web.json_response({"choices": [{"text": "!"}]})

    runner, url = await _engine(
        {"GET /health": ok, "GET /metrics": metrics, "POST /v1/completions": completions}
    )
    try:
        async with aiohttp.ClientSession() as s:
            obs = await health.observe(s, url, "k", "m", timeout_s=5.0)
            kv = await health.read_kv_usage(s, url, 5.0)
    finally:
        await runner.cleanup()
    assert obs.health_ok and obs.probe_ok and obs.detail == ""
    assert obs.generation_tokens is not None
    assert kv == obs.kv_cache_usage == 0.42


# ---------------------------------------------------------------------------------------
# why an engine exited, from its last output
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "code", "expect"),
    [
        pytest.param(
            [
                "INFO loading model",
                "ValueError: speculative method 'ngramm' is not supported",
                "INFO shutting down",
            ],
            1,
            "exited with status 1: ValueError: speculative method 'ngramm' is not supported",
            id="the line that names the error, not the last line",
        ),
        pytest.param(["INFO a", "INFO b"], 1, "exited with status 1: INFO b", id="else the last"),
        pytest.param([], -9, "exited with signal SIGKILL", id="no output: the status alone"),
    ],
)
def test_exit_reason_names_what_the_engine_said(output: list[str], code: int, expect: str) -> None:
    from appliance.endpoint import EngineAddress
    from appliance.engine import EngineSpec
    from appliance.supervisor.process import EngineProcess

    proc = EngineProcess(
        EngineSpec(id=0, gpu=None, address=EngineAddress(port=1), argv=(), tag="t")
    )
    proc.output_tail.extend(output)

    class Exited:
        returncode = code

    proc._proc = Exited()  # type: ignore[assignment]
    assert proc.exit_reason() == expect


async def test_a_tensor_parallel_engine_waits_for_the_memory_of_all_its_gpus() -> None:
    from appliance.endpoint import EngineAddress
    from appliance.engine import EngineSpec
    from appliance.supervisor.process import EngineProcess
    from appliance.telemetry import GpuReading

    gib = 1 << 30
    spec = EngineSpec(
        id=0, gpu=0, address=EngineAddress(uds="/x.sock"), argv=(), tag="t", gpus=(0, 1)
    )
    proc = EngineProcess(spec)
    reads = 0

    def readings() -> list[GpuReading | None]:
        nonlocal reads
        reads += 1
        # GPU 0 is free at once; GPU 1 (the second GPU) still holds memory twice.
        busy = 23 * gib if reads <= 2 else 0
        return [
            GpuReading(0, memory_used_bytes=0, memory_total_bytes=24 * gib),
            GpuReading(1, memory_used_bytes=busy, memory_total_bytes=24 * gib),
        ]

    await asyncio.wait_for(proc.wait_resources_free(readings, lambda: False, 0.01), 5)
    assert reads == 3


# Lines the sample finder must read as the full Prometheus parser does: label values with
# braces, spaces and escaped quotes, a timestamp, special values, a longer name that
# starts with a wanted one, a histogram's many lines, and CRLF line ends.
TRICKY_METRICS = (
    "# HELP vllm:num_requests_running Requests running.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{model_name="a} b",engine="0"} 2.0\n'
    'vllm:num_requests_running{model_name="say \\"hi\\" {x}",engine="1"} 3.0 1700000000000\n'
    "vllm:num_requests_running_extra 100.0\n"
    "vllm:kv_cache_usage_perc NaN\n"
    'vllm:num_preemptions_total{engine="0"} +Inf\r\n'
    + "".join(
        f'vllm:e2e_request_latency_seconds_bucket{{le="{le}",model_name="m"}} {i}.0\n'
        for i, le in enumerate(["0.3", "0.5", "1.0", "+Inf"])
    )
    + 'vllm:generation_tokens_total{engine="0",model_name="m"} 1.5e3\n'
)


def reference_sums(text: str, names: set[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


@pytest.mark.parametrize(
    "names",
    [
        {"vllm:num_requests_running"},
        {"vllm:generation_tokens_total", "vllm:num_preemptions_total"},
        {"vllm:e2e_request_latency_seconds_bucket"},
        {"vllm:kv_cache_usage_perc"},
        {"vllm:num_requests_waiting"},
    ],
)
def test_metric_sums_reads_lines_as_the_prometheus_parser_does(names: set[str]) -> None:
    got = metric_sums(TRICKY_METRICS, frozenset(names))
    want = reference_sums(TRICKY_METRICS, names)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == value or (math.isnan(got[name]) and math.isnan(value))


async def test_gpu_memory_never_freed_is_said_with_its_holders_and_the_wait_ends(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An engine's memory that outlives it (vllm#55510) is waited for, bounded: the
    # journal says it waits, then names the pids NVML lists, and the wait ends.
    from appliance.endpoint import EngineAddress
    from appliance.engine import EngineSpec
    from appliance.supervisor import process
    from appliance.telemetry import GpuReading

    monkeypatch.setattr(process, "GPU_MEMORY_WAIT_S", 0.2)
    gib = 1 << 30
    spec = EngineSpec(
        id=0, gpu=0, address=EngineAddress(uds="/x.sock"), argv=(), tag="t", gpus=(0,)
    )
    held = GpuReading(0, memory_used_bytes=20 * gib, memory_total_bytes=24 * gib, pids=(77, 78))
    caplog.set_level(logging.INFO, "appliance.supervisor")
    proc = process.EngineProcess(spec)
    await asyncio.wait_for(proc.wait_resources_free(lambda: [held], lambda: False, 0.01), 5)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.endswith(": waiting for GPU 0 memory to be freed") for m in said), said
    assert any(
        "GPU 0 memory still in use after 0 s (held by pid 77, 78); going on anyway" in m
        for m in said
    ), said
