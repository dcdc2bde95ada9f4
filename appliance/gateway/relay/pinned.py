"""Requests pinned to one engine: those that read a response stored in its memory.

vLLM keeps a stored response in the engine that made it (stored_responses.py says why
the gateway remembers which). A request naming one (``previous_response_id``, a retrieve,
a cancel) goes to that engine alone: no fallback, no retry on another engine, since
neither would hold the state the request reads. Every try records the response it makes,
so a later request can be pinned to it. The relay (handlers.py) hands over its one try and
its rate check; what a try does is the same as for any request.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from appliance.control import ApplianceView
from appliance.gateway.admission.gate import Admission
from appliance.gateway.admission.models import candidates
from appliance.gateway.observe.metrics import GatewayMetrics
from appliance.gateway.relay.failures import EngineFailure, engine_error
from appliance.gateway.relay.request_body import ParsedRequest
from appliance.gateway.relay.stored_responses import REPLAY, Holder, StoredResponses, spawn_of
from appliance.gateway.relay.stored_responses import replays_stream as replays

# Relay._relay: one try on one engine (request, engine, path, parsed, started, method).
TryOn = Callable[
    [web.Request, int, str, ParsedRequest, float, str],
    Awaitable[web.StreamResponse | EngineFailure],
]
CheckRate = Callable[[Any, int], None]  # Relay._check_rate: 429 past the key's rpm or tpm


class PinnedRelay:
    """Which engine a request must go to, what each try made, and the relay on that engine
    alone; the handler of ``GET /v1/responses/{id}`` and its cancel."""

    def __init__(
        self,
        appliance: ApplianceView,
        admission: Admission,
        metrics: GatewayMetrics,
        try_on: TryOn,
        check_rate: CheckRate,
    ) -> None:
        self._appliance = appliance
        self._admission = admission
        self._metrics = metrics
        self.stored = StoredResponses(per_key=self._share)
        self._try_on = try_on
        self._check_rate = check_rate

    def engine_for(self, parsed: ParsedRequest, key_id: str) -> int | None:
        """The engine a request must go to (it reads a stored response), or None."""
        config = self._appliance.config
        store = (config.engine_of(parsed.model).responses_store, bool(config.models))
        needs = parsed.state.needs if parsed.state is not None else None
        return self.stored.engine_for(needs, parsed.model, key_id, self._engine, store)

    def _share(self) -> int:
        """Each key's share of the stored-response map, as the running config says."""
        return self._appliance.config.gateway.stored_responses_per_key

    def _engine(self, engine_id: int) -> Any:
        try:
            return self._appliance.engine(engine_id)
        except IndexError:  # the engine was configured away (a reload)
            return None

    def record(self, request: web.Request, parsed: ParsedRequest, engine_id: int) -> None:
        """Remember the engine (and its spawn) and key of the response this try makes."""
        made = parsed.state.made if parsed.state is not None else None
        if made is not None and self._appliance.config.engine_of(parsed.model).responses_store:
            snap = self._appliance.engine(engine_id)
            held = Holder(engine_id, spawn_of(snap), request["key"].id, parsed.model)
            self.stored.record(made, held)

    async def relay(
        self,
        request: web.Request,
        path: str,
        parsed: ParsedRequest,
        started: float,
        batch: bool,
        engine_id: int,
        method: str = "POST",
    ) -> web.StreamResponse:
        """Relay on ``engine_id`` alone: no fallback, no retry on another engine (which
        would not hold the state the request reads)."""
        others = frozenset(e.id for e in candidates(parsed.model, self._appliance.engines()))
        queued = time.monotonic()
        record = request["key"]
        got = await self._admission.acquire(
            parsed.cost,
            batch=batch,
            session=parsed.session,
            prefix=parsed.prefix,
            exclude=others - {engine_id},
            model=parsed.model,
            key=record.id,
            key_cap=record.max_inflight,
        )
        self._metrics.queue_wait.observe(time.monotonic() - queued)
        try:
            result = await self._try_on(request, got, path, parsed, started, method)
        finally:
            self._admission.release(got, parsed.cost, record.id, parsed.model)
        if isinstance(result, web.StreamResponse):
            return result
        raise engine_error(result)

    async def stored_response(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/responses/{id}`` (``?stream=true``: its events again, as vLLM
        streams them; spliced streams are POSTs only, so the client relay takes it) and
        ``POST /v1/responses/{id}/cancel``: to the engine that made the response, for the
        key that made it (else 404); nothing is counted again (REPLAY)."""
        started = time.monotonic()
        record = request["key"]
        response_id = request.match_info["response_id"]
        held = self.stored.holder(response_id, record.id, self._engine)
        request["model"] = held.model
        self._check_rate(record, 0)
        stream = request.method == "GET" and replays(request.query.get("stream"))
        parsed = ParsedRequest("responses", held.model, stream, 0, None, b"", REPLAY)
        path = request.path + (f"?{request.query_string}" if request.query_string else "")
        return await self.relay(
            request, path, parsed, started, False, held.engine_id, request.method
        )
