"""Engine health in layers, and the pure rule that turns observations into a verdict.

A vLLM engine can be alive, answer ``/health`` with 200 and still never produce another
token (vllm#39863). So one check looks at four layers:

1. the process exists (the supervisor knows this without I/O);
2. ``GET /health`` answers 200 in time;
3. a real 1-token completion answers within ``probe_timeout_s``;
4. ``vllm:generation_tokens_total`` keeps rising while requests run.

Under heavy load the probe can be slow without anything being wrong, so a failed probe
only counts against an engine when tokens are *not* flowing, and it takes
``failures_to_restart`` such checks in a row to call an engine hung. :func:`assess` is
pure; :func:`observe` does the I/O.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import re
import time
from collections.abc import Collection
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

PROBE_PROMPT = "Hi"
# /health and /metrics answer at once from a live API server (no inference): a few
# seconds without an answer means frozen, whatever health.probe_timeout_s allows the probe.
STATUS_TIMEOUT_S = 5.0
# Speculative decoding's counters (only an engine with --speculative-config has them).
SPEC_METRICS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
ENGINE_METRICS = frozenset(
    {
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        *SPEC_METRICS,
    }
)


class Verdict(enum.Enum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"  # a failed check counted; not yet acted on
    HUNG = "hung"  # replace it


@dataclass(frozen=True)
class Observation:
    health_ok: bool
    probe_ok: bool
    generation_tokens: float | None = None  # vllm:generation_tokens_total (all labels)
    running: float | None = None  # vllm:num_requests_running
    detail: str = ""  # why a layer failed, for the log
    waiting: float | None = None  # vllm:num_requests_waiting
    kv_cache_usage: float | None = None  # vllm:kv_cache_usage_perc (0..1)
    preemptions_total: float | None = None  # vllm:num_preemptions_total
    # vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total (None: no speculation)
    spec_drafts: float | None = None
    spec_draft_tokens: float | None = None
    spec_accepted_tokens: float | None = None


@dataclass(frozen=True)
class HealthHistory:
    consecutive_failures: int = 0
    last_generation_tokens: float | None = None


def assess(
    obs: Observation, history: HealthHistory, failures_to_restart: int
) -> tuple[Verdict, HealthHistory]:
    tokens_rose = (
        obs.generation_tokens is not None
        and history.last_generation_tokens is not None
        and obs.generation_tokens > history.last_generation_tokens
    )
    tokens = (
        obs.generation_tokens
        if obs.generation_tokens is not None
        else history.last_generation_tokens
    )
    if (obs.health_ok and obs.probe_ok) or tokens_rose:
        # Tokens flowing is proof of life even when a loaded engine is slow to probe.
        return Verdict.HEALTHY, HealthHistory(0, tokens)
    failures = history.consecutive_failures + 1
    verdict = Verdict.HUNG if failures >= failures_to_restart else Verdict.SUSPECT
    return verdict, HealthHistory(failures, tokens)


def metric_sums(text: str, names: Collection[str]) -> dict[str, float]:
    """Sum the samples of each named metric over all label sets (vLLM labels per model).

    Every health check reads ``/metrics``, and vLLM's is hundreds of lines (histograms,
    Python's own figures) of which a handful are used: only the lines of ``names`` are
    found (one regex pass in C) and parsed. A text where none of them is found gets the
    full parser, so one that is not Prometheus text still raises ValueError.
    """
    out: dict[str, float] = {}
    if not names:
        return out
    wanted = names if isinstance(names, frozenset) else frozenset(names)
    for match in _samples_of(wanted).finditer(text):
        name = match[1]
        out[name] = out.get(name, 0.0) + float(match[2])
    if not out and text.strip():
        for family in text_string_to_metric_families(text):  # raises on garbage
            for sample in family.samples:
                if sample.name in names:  # a layout the regex does not know
                    out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


@functools.lru_cache(maxsize=8)
def _samples_of(names: frozenset[str]) -> re.Pattern[str]:
    """A sample line of one of ``names``: ``name{labels} value [timestamp]``.

    The labels run to the line's last ``}`` (a label value may hold braces and spaces;
    the value and timestamp never do); the name must end there, so ``x_total`` is not
    read as ``x``.
    """
    alternatives = "|".join(re.escape(n) for n in sorted(names))
    return re.compile(
        rf"^({alternatives})(?:\{{[^\n]*\}})?[ \t]+([^ \t\n]+)(?:[ \t]+[^ \t\n]+)?[ \t]*$",
        re.MULTILINE,
    )


async def read_metrics(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float, names: Collection[str]
) -> dict[str, float]:
    """:func:`metric_sums` of the engine's ``/metrics`` ({} when it answers non-200).

    Bounded by :data:`STATUS_TIMEOUT_S` at most. Raises TimeoutError, aiohttp.ClientError
    or ValueError (not Prometheus text)."""
    timeout = aiohttp.ClientTimeout(total=min(timeout_s, STATUS_TIMEOUT_S))
    async with session.get(f"{base_url}/metrics", timeout=timeout) as resp:
        if resp.status != 200:
            return {}
        return metric_sums(await resp.text(), names)


async def read_kv_usage(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float
) -> float | None:
    """The engine's ``vllm:kv_cache_usage_perc`` (0..1), or None when it cannot be read."""
    try:
        sums = await read_metrics(session, base_url, timeout_s, ("vllm:kv_cache_usage_perc",))
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None
    return sums.get("vllm:kv_cache_usage_perc")


# The probe: the smallest real piece of work on the route the model serves.
_PROBE_ANSWER = {"/v1/completions": "choices", "/v1/embeddings": "data"}


def _probe_request(task: str, model: str) -> tuple[str, dict[str, object]]:
    if task == "embed":
        return "/v1/embeddings", {"model": model, "input": PROBE_PROMPT}
    return "/v1/completions", {
        "model": model,
        "prompt": PROBE_PROMPT,
        "max_tokens": 1,
        "temperature": 0,
    }


async def observe(
    session: aiohttp.ClientSession,
    base_url: str,
    api_key: str,
    model: str,
    timeout_s: float,
    task: str = "generate",
) -> Observation:
    """Run layers 2-4 against one engine.

    ``/health`` and ``/metrics`` are read at the same time, each bounded by
    :data:`STATUS_TIMEOUT_S` (at most ``timeout_s``): they do no inference, and a
    frozen engine must not cost a whole probe timeout per route per check, while
    requests routed to it wait. Only the 1-token probe gets all of ``timeout_s``.
    """
    detail: list[str] = []
    quick = aiohttp.ClientTimeout(total=min(timeout_s, STATUS_TIMEOUT_S))
    health_ok, sums = await asyncio.gather(
        _health_ok(session, base_url, quick, detail),
        _engine_metrics(session, base_url, timeout_s, detail),
    )
    probe_ok = health_ok and await _probe(
        session, base_url, api_key, model, task, timeout_s, detail
    )
    return _observation(health_ok, probe_ok, sums, task, detail)


async def _health_ok(
    session: aiohttp.ClientSession,
    base_url: str,
    bound: aiohttp.ClientTimeout,
    detail: list[str],
) -> bool:
    try:
        async with session.get(f"{base_url}/health", timeout=bound) as resp:
            if resp.status != 200:
                detail.append(f"/health answered {resp.status}")
            return resp.status == 200
    except (TimeoutError, aiohttp.ClientError) as exc:
        detail.append(f"/health: {type(exc).__name__}")
        return False


async def _engine_metrics(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float, detail: list[str]
) -> dict[str, float]:
    try:
        return await read_metrics(session, base_url, timeout_s, ENGINE_METRICS)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        detail.append(f"/metrics: {type(exc).__name__}")
        return {}


async def _probe(
    session: aiohttp.ClientSession,
    base_url: str,
    api_key: str,
    model: str,
    task: str,
    timeout_s: float,
    detail: list[str],
) -> bool:
    """The smallest real piece of work on the model's route; True when it came back."""
    started = time.monotonic()
    route, body = _probe_request(task, model)
    try:
        async with session.post(
            f"{base_url}{route}",
            json=body,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            headers={"Authorization": f"Bearer {api_key}"},
        ) as resp:
            data = await resp.json(content_type=None)
            ok = resp.status == 200 and bool(data.get(_PROBE_ANSWER[route]))
            if not ok:
                detail.append(f"probe answered {resp.status}")
            return ok
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        waited = time.monotonic() - started
        detail.append(f"probe: {type(exc).__name__} after {waited:.1f} s")
        return False


def _observation(
    health_ok: bool, probe_ok: bool, sums: dict[str, float], task: str, detail: list[str]
) -> Observation:
    # The progress counter the hang and slowdown rules watch: tokens generated, or for a
    # pooling (embed) model, which generates none, the prompt tokens it has embedded.
    progress = "vllm:prompt_tokens_total" if task == "embed" else "vllm:generation_tokens_total"
    return Observation(
        health_ok,
        probe_ok,
        sums.get(progress),
        sums.get("vllm:num_requests_running"),
        "; ".join(detail),
        waiting=sums.get("vllm:num_requests_waiting"),
        kv_cache_usage=sums.get("vllm:kv_cache_usage_perc"),
        preemptions_total=sums.get("vllm:num_preemptions_total"),
        spec_drafts=sums.get(SPEC_METRICS[0]),
        spec_draft_tokens=sums.get(SPEC_METRICS[1]),
        spec_accepted_tokens=sums.get(SPEC_METRICS[2]),
    )
