"""Prometheus figures under ``appliance_``: one registry per app, no globals.

Request-path figures (counts, latencies, queue) are updated as requests happen. Engine,
GPU and throttle figures are read at scrape time by a collector, from one status
snapshot of the appliance (:class:`appliance.control.ApplianceView`), so the hot path
pays nothing for them and they are never stale.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.control import ApplianceStatus, ApplianceView
from appliance.engine import EngineState
from appliance.state_writes import STATE_FILES, WriteHealth

if TYPE_CHECKING:
    from appliance.gateway.admission.gate import Admission

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30)


class GatewayMetrics:
    def __init__(self) -> None:
        # *_created series double the output and no dashboard reads them.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # Registered in this order, which is the order /metrics lists them in.
        self.requests, self.duration, self.ttft = _request_metrics(r)
        (
            self.queue_wait,
            self.rejections,
            self.rate_limited,
            self.failovers,
            self.fallbacks,
        ) = _admission_metrics(r)
        self.key_model_loads = Counter(
            "appliance_key_model_loads",
            "On-demand model loads (cold) and wakes asked for by a key's request: the "
            "first request that passed every check and found its model put away",
            ["key_id", "model", "how"],
            registry=r,
        )

        # Each series' child, kept: labels() per request is a validation, a lock and a
        # dict look-up (3 per request, #24). The label values are bounded (routes,
        # statuses, configured models), so are these dicts.
        self._answered: dict[tuple[str, int, str], tuple[Any, Any]] = {}
        self._ttft: dict[tuple[str, str], Any] = {}

    def answered(self, route: str, status: int, model: str, started: float) -> None:
        """A request was answered (``started``: monotonic): counted, and its duration."""
        key = (route, status, model)
        children = self._answered.get(key)
        if children is None:
            children = (
                self.requests.labels(route, str(status), model),
                self.duration.labels(route, model),
            )
            self._answered[key] = children
        children[0].inc()
        children[1].observe(time.monotonic() - started)

    def first_byte(self, route: str, model: str, started: float) -> None:
        """The first byte of an answer left for the client (``started``: monotonic)."""
        child = self._ttft.get((route, model))
        if child is None:
            child = self._ttft[(route, model)] = self.ttft.labels(route, model)
        child.observe(time.monotonic() - started)

    def attach(self, view: ApplianceView, admission: Admission) -> None:
        self.registry.register(_LiveCollector(view, admission))

    def attach_state_files(self, files: Callable[[], Iterable[WriteHealth]]) -> None:
        """``appliance_state_write_errors_total{file}``: read from each file's own count at
        scrape time, so a write pays nothing for it."""
        self.registry.register(_StateWriteCollector(files))


def _request_metrics(r: CollectorRegistry) -> tuple[Counter, Histogram, Histogram]:
    """Requests answered, their duration and their time to first byte."""
    requests = Counter(
        "appliance_requests",
        'Requests answered, by route, status and model (a configured name; "" before '
        "one was known)",
        ["route", "status", "model"],
        registry=r,
    )
    duration = Histogram(
        "appliance_request_duration_seconds",
        "Time from request to the last byte of the answer",
        ["route", "model"],
        buckets=LATENCY_BUCKETS,
        registry=r,
    )
    ttft = Histogram(
        "appliance_time_to_first_token_seconds",
        "Time from request to the first streamed byte, seen by the gateway",
        ["route", "model"],
        buckets=LATENCY_BUCKETS,
        registry=r,
    )
    return requests, duration, ttft


def _admission_metrics(
    r: CollectorRegistry,
) -> tuple[Histogram, Counter, Counter, Counter, Counter]:
    """What admission, the rate limits, failover and fallback did to requests."""
    queue_wait = Histogram(
        "appliance_queue_wait_seconds",
        "Time requests waited for an engine slot",
        buckets=QUEUE_BUCKETS,
        registry=r,
    )
    rejections = Counter(
        "appliance_admission_rejections",
        "Requests refused by admission, by reason",
        ["reason"],
        registry=r,
    )
    rate_limited = Counter(
        "appliance_rate_limited",
        "Requests refused by a key's rpm or tpm limit",
        ["key_id", "limit"],
        registry=r,
    )
    failovers = Counter(
        "appliance_failovers",
        "Requests retried on another engine before the first byte",
        registry=r,
    )
    fallbacks = Counter(
        "appliance_fallbacks",
        "Requests sent to their model's fallback model, by model asked for, model that "
        "served and why the first could not admit them (down, heat, kv, full)",
        ["from", "to", "reason"],
        registry=r,
    )
    return queue_wait, rejections, rate_limited, failovers, fallbacks


class _StateWriteCollector(Collector):
    def __init__(self, files: Callable[[], Iterable[WriteHealth]]) -> None:
        self._files = files

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        errors = CounterMetricFamily(
            "appliance_state_write_errors",
            "Failed writes of a state file (usage.json, audit.log, keys.json): a full disk, "
            "a read-only file system; /admin/status says which is failing now and why",
            labels=["file"],
        )
        counts = dict.fromkeys(STATE_FILES, 0)  # every file has a series, 0 until it fails
        for w in self._files():
            counts[w.file] = counts.get(w.file, 0) + w.errors_total
        for file, n in counts.items():
            errors.add_metric([file], n)
        yield errors


# The last health check's vLLM figures, per engine: (family, help, EngineStatus field).
_OBSERVED: tuple[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, str], ...] = (
    (
        GaugeMetricFamily,
        "appliance_engine_kv_cache_usage",
        "vLLM KV cache usage (0..1), last scrape",
        "kv_cache_usage",
    ),
    (
        GaugeMetricFamily,
        "appliance_engine_requests_running",
        "vLLM requests running, last scrape",
        "running",
    ),
    (
        GaugeMetricFamily,
        "appliance_engine_requests_waiting",
        "vLLM requests waiting, last scrape",
        "waiting",
    ),
    (
        CounterMetricFamily,
        "appliance_engine_preemptions",
        "vLLM preemptions (since the engine's start)",
        "preemptions_total",
    ),
    (
        CounterMetricFamily,
        "appliance_engine_generation_tokens",
        "vLLM generated tokens (since the engine's start)",
        "generation_tokens",
    ),
    # Speculative decoding (vLLM's own counters, so an engine restart resets them:
    # rate() and increase() handle the reset). Only engines that speculate report them.
    (
        CounterMetricFamily,
        "appliance_engine_spec_drafts",
        "vLLM speculative drafts proposed (since the engine's start)",
        "spec_drafts",
    ),
    (
        CounterMetricFamily,
        "appliance_engine_spec_draft_tokens",
        "vLLM speculative draft tokens proposed (since the engine's start)",
        "spec_draft_tokens",
    ),
    (
        CounterMetricFamily,
        "appliance_engine_spec_accepted_tokens",
        "vLLM speculative draft tokens accepted (since the engine's start)",
        "spec_accepted_tokens",
    ),
)
# Each GPU's sensors: (name, help, GpuReading field).
_SENSORS: tuple[tuple[str, str, str], ...] = (
    ("appliance_gpu_temperature_celsius", "GPU temperature", "temperature_c"),
    ("appliance_gpu_power_watts", "GPU power draw", "power_w"),
    ("appliance_gpu_power_limit_watts", "GPU enforced power limit", "power_limit_w"),
    ("appliance_gpu_memory_used_bytes", "GPU memory in use", "memory_used_bytes"),
    ("appliance_gpu_utilization_ratio", "GPU utilization (0..1)", "utilization"),
    ("appliance_gpu_sm_clock_mhz", "GPU SM clock", "sm_clock_mhz"),
)


class _LiveCollector(Collector):
    def __init__(self, view: ApplianceView, admission: Admission) -> None:
        self._view = view
        self._adm = admission

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: figures are read at scrape time

    def collect(self) -> Iterator[Metric]:
        status = self._view.status()
        queue = GaugeMetricFamily("appliance_queue_depth", "Requests waiting for an engine")
        queue.add_metric([], self._adm.queue_depth)
        yield queue
        yield from self._engines(status)
        yield from _gpus(status)

    def _engines(self, status: ApplianceStatus) -> Iterator[Metric]:
        adm = self._adm
        state = GaugeMetricFamily(
            "appliance_engine_state",
            "1 for the engine's current lifecycle state",
            labels=["engine", "state"],
        )
        inflight = GaugeMetricFamily(
            "appliance_engine_inflight", "Requests admitted to the engine now", labels=["engine"]
        )
        tokens = GaugeMetricFamily(
            "appliance_engine_inflight_tokens",
            "Tokens (prompt estimate + max_tokens) admitted now",
            labels=["engine"],
        )
        restarts = CounterMetricFamily(
            "appliance_engine_restarts", "Engine restarts, by reason", labels=["engine", "reason"]
        )
        breaker = GaugeMetricFamily(
            "appliance_engine_kv_breaker_open",
            "1 while the KV-pressure breaker keeps new work away",
            labels=["engine"],
        )
        info = GaugeMetricFamily(
            "appliance_engine_info",
            '1 per engine: the model it serves and its GPUs ("0,1"; "" on CPU)',
            labels=["engine", "model", "gpus"],
        )
        for e in status.engines:
            eid = str(e.id)
            info.add_metric([eid, e.model, ",".join(map(str, e.gpus))], 1.0)
            for s in EngineState:
                state.add_metric([eid, s.value], 1.0 if e.state is s else 0.0)
            inflight.add_metric([eid], adm.inflight(e.id))
            tokens.add_metric([eid], adm.inflight_tokens(e.id))
            for reason, n in sorted(e.restarts_by_reason.items()):
                restarts.add_metric([eid, reason], n)
            breaker.add_metric([eid], 1.0 if adm.kv_open(e.id) else 0.0)
        yield from (info, state, inflight, tokens, restarts, *_observed(status), breaker)


def _observed(status: ApplianceStatus) -> list[Metric]:
    """The last health check's vLLM figures, one family per figure (see _OBSERVED)."""
    observed: list[tuple[Any, str]] = [
        (family(name, text, labels=["engine"]), field) for family, name, text, field in _OBSERVED
    ]
    for e in status.engines:
        for fam, field in observed:
            value = getattr(e, field)
            if value is not None:
                fam.add_metric([str(e.id)], value)
    return [f for f, _ in observed]


def _gpus(status: ApplianceStatus) -> Iterator[Metric]:
    sensors = [
        (GaugeMetricFamily(name, text, labels=["gpu"]), field) for name, text, field in _SENSORS
    ]
    slow = GaugeMetricFamily(
        "appliance_gpu_clock_event_active",
        "1 for each clock event (throttle) reason now active",
        labels=["gpu", "reason"],
    )
    energy = CounterMetricFamily(
        "appliance_gpu_energy_joules",
        "GPU energy used since its driver loaded (NVML's total energy counter, or the "
        "sensors file's energy_j), as read; a driver reload resets it",
        labels=["gpu"],
    )
    level = GaugeMetricFamily(
        "appliance_throttle_level",
        "Thermal throttle level (0 = none, 4 = admit nothing new)",
        labels=["gpu"],
    )
    for g in status.gpus:
        idx = str(g.index)
        for fam, field in sensors:
            value = getattr(g.reading, field)
            if value is not None:
                fam.add_metric([idx], float(value))
        if g.reading.energy_j is not None:
            energy.add_metric([idx], g.reading.energy_j)
        for reason in g.reading.throttle_reasons:
            slow.add_metric([idx, reason], 1.0)
        level.add_metric([idx], g.throttle_level)
    yield from (*(f for f, _ in sensors), energy, slow, level)
