"""Models on demand in /metrics, read at scrape time from the supervisor's counts
(:class:`appliance.control.ModelStatus`), so a request pays nothing for them:

- ``appliance_model_loaded{model}``: 1 while the model is loaded, else 0;
- ``appliance_model_loads_total{model,how}``: loads by how (``cold``: engines started;
  ``wake``: woken from sleep);
- ``appliance_model_load_seconds{model}``: from asking for a load to the first engine
  READY (a histogram).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from appliance.control import LOAD_BUCKETS, ModelDoor

HOWS = ("cold", "wake")


class ModelCollector(Collector):
    def __init__(self, door: ModelDoor) -> None:
        self._door = door

    def describe(self) -> list[Metric]:
        return []  # collected live; no fixed description

    def collect(self) -> Iterator[Metric]:
        models = self._door.models()
        if not models:
            return
        loaded = GaugeMetricFamily(
            "appliance_model_loaded", "1 while the model is loaded, else 0", labels=["model"]
        )
        loads = CounterMetricFamily(
            "appliance_model_loads_total",
            "Model loads, by how: cold (engines started) or wake (from sleep)",
            labels=["model", "how"],
        )
        seconds = HistogramMetricFamily(
            "appliance_model_load_seconds",
            "From asking for a model's load to its first engine READY",
            labels=["model"],
        )
        for m in models:
            loaded.add_metric([m.name], 1.0 if m.state == "loaded" and not m.detail else 0.0)
            for how in HOWS:
                loads.add_metric([m.name, how], m.loads.get(how, 0))
            counts = list(accumulate(m.load_buckets or [0] * (len(LOAD_BUCKETS) + 1)))
            edges = [*(f"{b:g}" for b in LOAD_BUCKETS), "+Inf"]
            seconds.add_metric(
                [m.name], list(zip(edges, map(float, counts), strict=True)), m.load_seconds_sum
            )
        yield loaded
        yield loads
        yield seconds
