"""Which engine takes the next request: a pure function of a snapshot of engine loads.

The gateway builds one `EngineLoad` per engine (from the supervisor's state, the KV
breaker and the thermal governor's level) and calls `route` once per request. No I/O,
no clocks, no shared state: the same snapshot always gives the same answer, which is
what the table tests in ``tests/unit/test_routing.py`` rely on.

The rules, in order:

1. **Eligible** = ``accepting`` and *room*: ``inflight < max_inflight`` and
   ``outstanding_tokens + cost <= token_budget``. An *idle* engine (``inflight == 0``)
   has token room for any cost, so a request larger than a (thermally lowered) token
   budget still runs somewhere instead of waiting forever; the sequence budget is never
   waived (``max_inflight == 0`` means "nothing", full stop).
2. **Best** = lowest ``(throttle_level, outstanding_tokens, inflight)``: a cooler GPU
   wins outright, then the least outstanding work. Ties keep the snapshot's order, so
   the caller passes engines in id order and the result is deterministic.
3. **Session affinity**: when ``session`` maps (through ``affinity``) to an eligible
   engine at the best engine's throttle level whose outstanding tokens are within
   ``closeness`` (relative) plus ``slack_tokens`` (absolute) of the best one, that engine
   is kept, for prefix-cache hits. Affinity never overrides heat: a hotter engine is
   never chosen for stickiness.
4. ``None`` when no engine is eligible: the caller queues the request and retries when
   an engine frees up.

The caller owns the ``affinity`` map (session -> engine id); it should bound it (an
LRU of a few thousand sessions) since session keys come from clients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_CLOSENESS = 0.2
DEFAULT_SLACK_TOKENS = 256
MAX_SESSION_KEY_CHARS = 256


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the router sees of one engine at one moment."""

    id: int
    accepting: bool  # READY and not draining, KV breaker closed, not hard-throttled
    inflight: int  # requests on it now
    outstanding_tokens: int  # sum of (prompt estimate + max_tokens) of requests on it
    max_inflight: int  # its current budget in sequences (already lowered by the governor)
    token_budget: int  # its current budget in tokens (already lowered by the governor)
    throttle_level: int = 0  # 0 = cool; higher = hotter (prefer cooler)


def has_room(engine: EngineLoad, cost_tokens: int) -> bool:
    """Whether ``engine`` can take a request of ``cost_tokens`` now (rule 1 above)."""
    if not engine.accepting or engine.inflight >= engine.max_inflight:
        return False
    return engine.inflight == 0 or engine.outstanding_tokens + cost_tokens <= engine.token_budget


def route(
    engines: Sequence[EngineLoad],
    cost_tokens: int,
    session: str | None = None,
    affinity: Mapping[str, int] | None = None,
    closeness: float = DEFAULT_CLOSENESS,
    slack_tokens: int = DEFAULT_SLACK_TOKENS,
) -> int | None:
    """The id of the engine that should take a request costing ``cost_tokens``, or None.

    One pass over ``engines``, no allocation beyond the affinity lookup: this runs for
    every request.
    """
    sticky_id = affinity.get(session) if (session is not None and affinity) else None
    best: EngineLoad | None = None
    sticky: EngineLoad | None = None
    for e in engines:
        if not has_room(e, cost_tokens):
            continue
        if e.id == sticky_id:
            sticky = e
        if best is None or _cooler_or_lighter(e, best):
            best = e
    if best is None:
        return None
    if (
        sticky is not None
        and sticky is not best
        and sticky.throttle_level == best.throttle_level
        and sticky.outstanding_tokens <= best.outstanding_tokens * (1.0 + closeness) + slack_tokens
    ):
        return sticky.id
    return best.id


def _cooler_or_lighter(a: EngineLoad, b: EngineLoad) -> bool:
    """``(throttle, outstanding, inflight)`` of ``a`` < that of ``b``, without tuples."""
    if a.throttle_level != b.throttle_level:
        return a.throttle_level < b.throttle_level
    if a.outstanding_tokens != b.outstanding_tokens:
        return a.outstanding_tokens < b.outstanding_tokens
    return a.inflight < b.inflight


def session_key(
    user_field: str | None,
    header: str | None,
    cache_key: str | None = None,
    anthropic_user: str | None = None,
) -> str | None:
    """The session a request belongs to, for affinity: ``X-Session-Id``, else OpenAI's
    ``prompt_cache_key``, else Anthropic's ``metadata.user_id``, else ``user``.

    The header wins because a client sets it on purpose for this; ``prompt_cache_key``
    (Codex sends its conversation's id) is asked for precisely to share a cache;
    Claude Code's ``metadata.user_id`` names its session; the OpenAI ``user`` field names
    an end user, which is a good last guess (one user's conversation shares a prefix).
    Surrounding blanks are ignored, blank means none, and keys are cut to
    `MAX_SESSION_KEY_CHARS` so a client cannot make the affinity map hold megabytes.
    """
    for raw in (header, cache_key, anthropic_user, user_field):
        if raw:
            key = raw.strip()
            if key:
                return key[:MAX_SESSION_KEY_CHARS]
    return None
