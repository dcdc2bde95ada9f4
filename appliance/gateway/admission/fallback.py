"""Overflow fallback, the gateway's side: the rooms the decision reads, who may refuse
it, and what an operator is told.

The decision itself is :func:`appliance.policy.fallback.choose_fallback` (pure, table
tested); this module builds its inputs from the same snapshot admission routes on
(:func:`model_room`), reads the refusals (:func:`fallback_allowed`: the request header
``X-Appliance-Fallback: never`` or a key created with ``--no-fallback``) and keeps the
metric and the journal quiet (:class:`FallbackRecorder`: one line per change of reason
for a pair of models, never one per request).

What a client sees of a fallback: the forwarded body names the fallback model (its engine
answers with ``"model": <fallback>``, never disguised as the model asked for) and the
answer carries ``X-Appliance-Model: <fallback>``. An answer from the model asked for
carries no such header.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from aiohttp import web
from prometheus_client import Counter

from appliance.engine import EngineState
from appliance.policy.fallback import FallbackReason, ModelRoom
from appliance.policy.routing import EngineLoad, has_room
from appliance.policy.thermal import HARD_LEVEL

log = logging.getLogger("appliance.gateway")

MODEL_HEADER = "X-Appliance-Model"  # on an answer served by the fallback model
REFUSE_HEADER = "X-Appliance-Fallback"  # "never": wait for the model named instead
REFUSE_VALUE = "never"
SERVED_BY = "fallback_model"  # request key: the fallback model that took the request


async def add_model_header(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``on_response_prepare``: an answer from the fallback model says so in its head,
    on either relay path and on a streamed answer too (the head goes with its first
    chunk). Answers from the model asked for carry no header."""
    served_by = request.get(SERVED_BY)
    if served_by is not None:
        response.headers[MODEL_HEADER] = served_by


class EngineSnap(Protocol):
    """What the room reads of one engine (an ``appliance.control.EngineStatus``)."""

    @property
    def id(self) -> int: ...
    @property
    def state(self) -> EngineState: ...


def model_room(
    engines: Sequence[EngineSnap],
    loads: Sequence[EngineLoad],
    throttle_level: Mapping[int, int],
    kv_tripped: Mapping[int, bool],
    cost: int,
    queued: bool,
) -> ModelRoom:
    """One model's room for a request of ``cost`` tokens, from admission's snapshot:
    ``engines`` and ``loads`` are that model's (the same candidates), ``queued`` whether
    someone of that model already waits (a newcomer may not pass them, so the model
    cannot admit it at once)."""
    ready = [e.id for e in engines if e.state is EngineState.READY]
    return ModelRoom(
        ready=len(ready),
        hot=sum(1 for i in ready if throttle_level.get(i, 0) >= HARD_LEVEL),
        kv_tripped=sum(1 for i in ready if kv_tripped.get(i, False)),
        can_admit=not queued and any(has_room(x, cost) for x in loads),
    )


def fallback_allowed(header: str | None, key_allows: bool) -> bool:
    """Whether this request may go to its model's fallback: not when its key was created
    with ``--no-fallback``, nor when it says ``X-Appliance-Fallback: never`` (any case,
    spaces around forgiven). Any other value is ignored (allowed), so a client sending
    a value this server does not know is served rather than refused."""
    if not key_allows:
        return False
    return header is None or header.strip().lower() != REFUSE_VALUE


class FallbackRecorder:
    """``appliance_fallbacks_total{from,to,reason}`` and the journal: a line when the
    reason a model's requests go to its fallback changes (``chat -> small: fallback
    (heat)``), and one when its own engines admit its requests again; none per request."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._reason: dict[str, tuple[str, FallbackReason]] = {}  # from -> (to, reason)

    def fell_back(self, src: str, dst: str, reason: FallbackReason) -> None:
        self._counter.labels(src, dst, reason).inc()
        if self._reason.get(src) != (dst, reason):
            self._reason[src] = (dst, reason)
            log.warning("%s -> %s: fallback (%s)", src, dst, reason)

    def served_own(self, src: str) -> None:
        """A request for ``src`` was admitted by its own engines at once."""
        if src in self._reason:
            del self._reason[src]
            log.info("%s: serving its own requests again", src)
