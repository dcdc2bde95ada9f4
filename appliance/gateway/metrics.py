"""Prometheus figures under ``appliance_``: one registry per app, no globals.

Request-path figures (counts, latencies, queue) are updated as requests happen. Engine,
GPU and throttle figures are read from the supervisor at scrape time by a collector, so
the hot path pays nothing for them and they are never stale.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.engine import EngineState

if TYPE_CHECKING:
    from appliance.gateway.admission import Admission
    from appliance.supervisor import Supervisor

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30)


class GatewayMetrics:
    def __init__(self) -> None:
        # *_created series double the output and no dashboard reads them.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "appliance_requests",
            "Requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.duration = Histogram(
            "appliance_request_duration_seconds",
            "Time from request to the last byte of the answer",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "appliance_time_to_first_token_seconds",
            "Time from request to the first streamed byte, seen by the gateway",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "appliance_queue_wait_seconds",
            "Time requests waited for an engine slot",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            "appliance_admission_rejections",
            "Requests refused by admission, by reason",
            ["reason"],
            registry=r,
        )
        self.rate_limited = Counter(
            "appliance_rate_limited",
            "Requests refused by a key's rpm or tpm limit",
            ["key_id", "limit"],
            registry=r,
        )
        self.failovers = Counter(
            "appliance_failovers",
            "Requests retried on another engine before the first byte",
            registry=r,
        )

    def attach(self, supervisor: Supervisor, admission: Admission) -> None:
        self.registry.register(_LiveCollector(supervisor, admission))


class _LiveCollector(Collector):
    def __init__(self, supervisor: Supervisor, admission: Admission) -> None:
        self._sup = supervisor
        self._adm = admission

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: figures are read at scrape time

    def collect(self) -> Iterator[Metric]:
        sup, adm = self._sup, self._adm
        queue = GaugeMetricFamily("appliance_queue_depth", "Requests waiting for an engine")
        queue.add_metric([], adm.queue_depth)
        yield queue
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
        kv = GaugeMetricFamily(
            "appliance_engine_kv_cache_usage",
            "vLLM KV cache usage (0..1), last scrape",
            labels=["engine"],
        )
        running = GaugeMetricFamily(
            "appliance_engine_requests_running",
            "vLLM requests running, last scrape",
            labels=["engine"],
        )
        waiting = GaugeMetricFamily(
            "appliance_engine_requests_waiting",
            "vLLM requests waiting, last scrape",
            labels=["engine"],
        )
        preempt = CounterMetricFamily(
            "appliance_engine_preemptions",
            "vLLM preemptions (since the engine's start)",
            labels=["engine"],
        )
        gen = CounterMetricFamily(
            "appliance_engine_generation_tokens",
            "vLLM generated tokens (since the engine's start)",
            labels=["engine"],
        )
        breaker = GaugeMetricFamily(
            "appliance_engine_kv_breaker_open",
            "1 while the KV-pressure breaker keeps new work away",
            labels=["engine"],
        )
        for rt in sup.engines:
            eid = str(rt.spec.id)
            for s in EngineState:
                state.add_metric([eid, s.value], 1.0 if rt.state is s else 0.0)
            inflight.add_metric([eid], adm.inflight(rt.spec.id))
            tokens.add_metric([eid], adm.inflight_tokens(rt.spec.id))
            for reason, n in sorted(rt.restarts_by_reason.items()):
                restarts.add_metric([eid, reason], n)
            breaker.add_metric([eid], 1.0 if adm.kv_tripped.get(rt.spec.id) else 0.0)
            m = rt.last_observation
            if m is not None:
                for fam, value in (
                    (kv, m.kv_cache_usage),
                    (running, m.running),
                    (waiting, m.waiting),
                    (preempt, m.preemptions_total),
                    (gen, m.generation_tokens),
                ):
                    if value is not None:
                        fam.add_metric([eid], value)
        yield from (state, inflight, tokens, restarts, kv, running, waiting, preempt, gen, breaker)
        temp = GaugeMetricFamily(
            "appliance_gpu_temperature_celsius", "GPU temperature", labels=["gpu"]
        )
        power = GaugeMetricFamily("appliance_gpu_power_watts", "GPU power draw", labels=["gpu"])
        limit = GaugeMetricFamily(
            "appliance_gpu_power_limit_watts", "GPU enforced power limit", labels=["gpu"]
        )
        mem = GaugeMetricFamily(
            "appliance_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"]
        )
        util = GaugeMetricFamily(
            "appliance_gpu_utilization_ratio", "GPU utilization (0..1)", labels=["gpu"]
        )
        clock = GaugeMetricFamily("appliance_gpu_sm_clock_mhz", "GPU SM clock", labels=["gpu"])
        slow = GaugeMetricFamily(
            "appliance_gpu_clock_event_active",
            "1 for each clock event (throttle) reason now active",
            labels=["gpu", "reason"],
        )
        for idx, r in sorted(sup.gpu_readings.items()):
            g = str(idx)
            for fam, value in (
                (temp, r.temperature_c),
                (power, r.power_w),
                (limit, r.power_limit_w),
                (mem, r.memory_used_bytes),
                (util, r.utilization),
                (clock, r.sm_clock_mhz),
            ):
                if value is not None:
                    fam.add_metric([g], float(value))
            for reason in r.throttle_reasons:
                slow.add_metric([g, reason], 1.0)
        yield from (temp, power, limit, mem, util, clock, slow)
        level = GaugeMetricFamily(
            "appliance_throttle_level",
            "Thermal throttle level (0 = none, 4 = admit nothing new)",
            labels=["gpu"],
        )
        for gpu, lvl in sorted(sup.throttle_levels().items()):
            level.add_metric([str(gpu)], lvl)
        yield level
