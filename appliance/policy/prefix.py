"""Prefix locality: which engine takes a request whose prompt some engines already hold.

A pure function of a snapshot, like :func:`appliance.policy.routing.route`, which it
extends: the gateway's prefix index (``gateway/admission/prefix_index.py``) says for
each engine how many leading blocks of this request's prompt it was sent before
(``matched``), and this decides whether that locality is worth more than the balance.

vLLM keeps the KV cache of the prompts it served (automatic prefix caching): a request
whose beginning an engine computed before has only its new end prefilled there. Coding
agents and chat clients resend the whole conversation every turn, so keeping a
conversation on one engine turns a 20k-token prefill into a few hundred tokens. The
rules, in order:

1. **Least-loaded first.** ``best`` = what :func:`route` picks without a session
   (eligible: accepting and with room; coolest, then fewest outstanding tokens). None
   when no engine has room: the request waits, as without prefix routing.
2. **Heat and draining win over locality.** Only engines with room (so never a draining,
   not-ready, breaker-tripped or full one) at ``best``'s throttle level may hold the
   request: a hotter engine is never chosen for its cache.
3. **A holder must hold enough.** ``holder`` = the engine among those with the most
   matched blocks, at least ``min_share`` of the request's blocks (``PREFIX_MIN_SHARE``;
   vllm-router's ``cache_threshold``); ties go to the lighter. A request that shares only
   a short beginning (a common system prompt) with what an engine holds is placed by
   load: every engine soon holds that beginning anyway.
4. **Unless it is loaded well beyond the best.** The holder is passed over when it has
   both more than ``balance_abs`` requests (``BALANCE_ABS``) and more than
   ``balance_rel`` times (``BALANCE_REL``) as many requests in flight as ``best``
   (vllm-router's ``balance_abs_threshold`` / ``balance_rel_threshold``: imbalanced
   only when both hold). Requests, not tokens: a request whose prefix is cached costs
   its holder far less than its token estimate says, and what a pile-up costs the
   others is decode steps, which go by sequences.

Why these values: a move costs the whole prompt's prefill on the other engine (seconds
on a CPU engine, tens to hundreds of ms on a GPU), staying costs one more sequence in the
holder's batch, so the holder is kept up to 8 requests of difference (an engine takes 64
by default). With 4, on two real CPU engines and 16 conversations at once, the
conversations still running when the other engine's had ended were moved and prefilled
again (hit rate 71 % instead of 74.5 %, docs/journal/2026-11-28-prefix-routing.md).
vllm-router's defaults are 0.3, 64 and 1.5; 64 would let a new prompt that begins with
a long shared system prompt pile up on the one engine that has seen it before any other
gets one (ties go to the lighter only once both hold it). They are constants, not
config keys: one rule for all boxes until a measurement shows a box that needs another.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from appliance.policy.routing import EngineLoad, has_room, route

PREFIX_MIN_SHARE = 0.5  # of the request's blocks an engine must hold to be its holder
BALANCE_ABS = 8  # requests in flight beyond the least-loaded engine's ...
BALANCE_REL = 1.5  # ... and this many times its count: the holder is passed over


def route_by_prefix(
    engines: Sequence[EngineLoad],
    cost_tokens: int,
    matched: Mapping[int, int],
    blocks: int,
    *,
    min_share: float = PREFIX_MIN_SHARE,
    balance_abs: int = BALANCE_ABS,
    balance_rel: float = BALANCE_REL,
) -> int | None:
    """The id of the engine that should take a request of ``cost_tokens`` whose prompt
    has ``blocks`` blocks, of which engine ``i`` holds the first ``matched[i]``; None
    when no engine has room (the module's docstring gives the rules)."""
    best_id = route(engines, cost_tokens)
    if best_id is None or not matched or blocks <= 0:
        return best_id
    best = next(e for e in engines if e.id == best_id)
    need = max(1.0, blocks * min_share)
    holder: EngineLoad | None = None
    held = 0
    for e in engines:
        m = matched.get(e.id, 0)
        if m < need or e.throttle_level != best.throttle_level or not has_room(e, cost_tokens):
            continue
        if holder is None or m > held or (m == held and _lighter(e, holder)):
            holder, held = e, m
    if holder is None or holder is best:
        return best_id
    if (
        holder.inflight - best.inflight > balance_abs
        and holder.inflight > best.inflight * balance_rel
    ):
        return best_id
    return holder.id


def _lighter(a: EngineLoad, b: EngineLoad) -> bool:
    """``a`` has less outstanding work than ``b`` (tokens, then requests)."""
    return (a.outstanding_tokens, a.inflight) < (b.outstanding_tokens, b.inflight)
