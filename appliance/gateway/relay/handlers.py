"""The OpenAI routes: validate, limit, admit, relay to an engine, account.

The relay is the hot path. A streamed answer is passed on chunk by chunk as the engine's
bytes arrive (no parsing, no re-chunking, one write per chunk); a non-streamed body is
passed on untouched. The client's key never reaches the engine: the gateway sends the
engine's per-boot key instead.

Failure handling, by when it happens:

- before the engine sent a byte (connection refused, engine 5xx, reset): the request is
  retried once on another engine, so a crashing engine costs clients nothing; when no
  other engine is left, the client gets 504 if the engine timed out and 502 otherwise,
  decided by :class:`EngineFailure`'s ``timed_out``, set where the failure is caught;
- after the first byte of a stream: the client gets one SSE error event and the stream
  ends (the ``openai`` client raises ``APIError``), never a silently truncated answer;
- the supervisor declares the engine unresponsive (hung): :meth:`Relay.abandon` applies
  the two rules above at once to every request on it, rather than when the process is
  finally killed, so a request stuck on a frozen engine moves on at the verdict;
- the client goes away: the handler is cancelled, which closes the upstream connection,
  which makes vLLM abort the generation.

Several models: a request goes to the engines of the model its body names (by name or
alias, :mod:`appliance.gateway.admission.models`); an alias is rewritten to the canonical name in
what the engine is sent. Admission, the retry and every limit stay within that model's
engines: a request is never sent to another model's engine.

Several protocols: what is particular to a route (its input, cost and counts, its
error shape) is its module's in :mod:`appliance.gateway.protocols`; the relay is the same
for all. State that lives in one engine (a stored response) pins a request to that
engine (:mod:`appliance.gateway.relay.pinned`).

Where the parts live: the request body is read and checked in request_body.py; the
failure types in failures.py; what the client is sent in answers.py; the two ways to an
engine in via_client.py (aiohttp's client: whole answers, HTTP/1.0 streams) and
via_splice.py (HTTP/1.1 streams, spliced below aiohttp).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Coroutine
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion11

from appliance.control import ApplianceView, ModelDoor
from appliance.engine import EngineState
from appliance.gateway.accounting.book import UsageBook
from appliance.gateway.accounting.plan import stepping_of
from appliance.gateway.admission.adapter_work import AdapterWork
from appliance.gateway.admission.fallback import (
    REFUSE_HEADER,
    SERVED_BY,
    FallbackRecorder,
    fallback_allowed,
)
from appliance.gateway.admission.gate import Admission
from appliance.gateway.admission.models import (
    candidates,
    check_key_allows,
    key_allows,
    model_cards,
    resolve_named,
    visible_models,
)
from appliance.gateway.admission.open_requests import KEY_REVOKED, OpenRequests, revoked
from appliance.gateway.admission.ratelimit import RateLimiter
from appliance.gateway.errors import GatewayError
from appliance.gateway.keys import KeyRecord
from appliance.gateway.observe.metrics import GatewayMetrics
from appliance.gateway.protocols import ROUTES, Route
from appliance.gateway.protocols.refusals import model_refusal
from appliance.gateway.relay.answers import EngineCall
from appliance.gateway.relay.engine_ways import EngineWays
from appliance.gateway.relay.failures import Attempt, EngineFailure, engine_error
from appliance.gateway.relay.pinned import PinnedRelay
from appliance.gateway.relay.request_body import (
    LOWERED,
    PRIORITY_HEADER,
    ParsedRequest,
    engine_priority,
    finish_body,
    open_body,
    read_body,
)
from appliance.gateway.relay.via_client import relay_via_client
from appliance.gateway.relay.via_splice import relay_via_splice
from appliance.policy.fallback import choose_fallback

log = logging.getLogger("appliance.gateway")
LOAD_WAIT = "appliance_load_wait_s"  # request key: its on-demand model's load_timeout_s


class Relay:
    """The /v1 handlers, over the parts they use."""

    def __init__(
        self,
        appliance: ApplianceView,
        model_door: ModelDoor,
        admission: Admission,
        ratelimiter: RateLimiter,
        adapter_work: AdapterWork,
        fallbacks: FallbackRecorder,
        usage: UsageBook,
        metrics: GatewayMetrics,
        ways: EngineWays,
    ) -> None:
        self._appliance = appliance
        self._model_door = model_door
        self._admission = admission
        self._ratelimiter = ratelimiter
        self._adapter_work = adapter_work
        self._fallbacks = fallbacks
        self._usage = usage
        self._metrics = metrics
        self._ways = ways  # the two ways to an engine: via_client, via_splice
        self._attempts: collections.defaultdict[int, set[Attempt]] = collections.defaultdict(set)
        self.pinned = PinnedRelay(appliance, admission, metrics, self._relay, self._check_rate)
        self.open = OpenRequests()  # per key: ended when the key is revoked

    def abandon(self, engine_id: int, why: str) -> int:
        """Give up on every request on an engine that stopped answering; how many.

        One still waiting for the engine's answer (no byte sent to its client yet) is
        retried on another engine by the usual rule; a stream already under way ends with
        an error event. Both happen now rather than when the engine's process dies, which
        for a frozen engine is its stop grace later.
        """
        attempts = list(self._attempts.get(engine_id, ()))
        for attempt in attempts:
            # A verdict on the engine, not a timeout of this request: 502 if not retried.
            attempt.given_up = EngineFailure(why, timed_out=False)
            if attempt.close is not None:
                # Pending reads fail: handled like a broken engine.
                attempt.close()
            elif attempt.task is not None:
                attempt.task.cancel()  # still connecting: see failure_if_abandoned
        return len(attempts)

    async def models(self, request: web.Request) -> web.Response:
        created = int(self._appliance.started_at)
        config, adapters = self._appliance.config, self._model_door.adapter_names()
        # A key limited to models sees only those (and their aliases and adapters).
        served, adapters = visible_models(config, adapters, request["key"].models)
        return web.json_response({"object": "list", "data": model_cards(served, adapters, created)})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat", "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions", "/v1/completions")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "embeddings", "/v1/embeddings")

    def handler_for(self, route: Route) -> Any:
        """The POST handler of ``route``: the engine is sent the path the client called
        (vLLM serves each of a route's paths; only the registry's are ever relayed)."""

        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._handle(request, route.name, route.engine_path or request.path)

        return handle

    async def _handle(self, request: web.Request, route: str, path: str) -> web.StreamResponse:
        return await self._while_open(request, self._handle_open(request, route, path))

    async def stored_response(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/responses/{id}`` (and ``?stream=true``) and its cancel
        (:meth:`PinnedRelay.stored_response`): open requests like the others, so a
        revoked key's retrieve waiting for its engine gets 401 and its replay is cut."""
        return await self._while_open(request, self.pinned.stored_response(request))

    async def _while_open(
        self, request: web.Request, work: Coroutine[Any, Any, web.StreamResponse]
    ) -> web.StreamResponse:
        """``work`` (the handler's), open until it ends: its key's revocation ends it
        (open_requests.py)."""
        entry = self.open.add(request)
        try:
            return await work
        except asyncio.CancelledError:
            refused = self.open.refusal(entry)
            if refused is not None:
                raise refused from None
            raise
        finally:
            self.open.remove(entry)

    def keys_changed(self, records: tuple[KeyRecord, ...]) -> None:
        """The keys in force changed (now ``records``): end the open requests of keys no
        longer valid."""
        ended = self.open.end_invalid(records)
        if ended:
            log.warning("ended %d open request(s) of revoked or expired keys", ended)

    async def _handle_open(self, request: web.Request, route: str, path: str) -> web.StreamResponse:
        started = time.monotonic()
        record = request["key"]
        parsed, fallback = await self._parse(request, route)
        # before tpm: never charge what cannot run
        self._admission.check_cost(parsed.cost, parsed.model)
        pinned = self.pinned.engine_for(parsed, record.id)
        self._check_rate(record, parsed.cost)
        # Only a request that passed every check may make an on-demand model load: a
        # refused one (400, 429) never does (issue 33 item 3).
        self._want_model(request, parsed.model)
        batch = record.priority == "batch"
        if pinned is not None:
            return await self.pinned.relay(request, path, parsed, started, batch, pinned)
        if fallback and fallback_allowed(request.headers.get(REFUSE_HEADER), record.fallback):
            return await self._relay_with_failover(request, path, parsed, started, batch, fallback)
        return await self._relay_with_failover(request, path, parsed, started, batch)

    def _want_model(self, request: web.Request, model: str) -> None:
        """An on-demand model not loaded is wanted for as long as this request waits in
        the queue for it, and no longer (models_on_demand.py reads the queue). A request
        for an on-demand model waits up to its load_timeout_s while the model is not
        serving, loaded or not when the request came: it may be put away for another
        model of its slot while the request waits (Admission.acquire). A load this
        request starts is counted to its key. The model is marked used only once the
        request is admitted (:meth:`_relay`): a refused one did not use it."""
        served = self._appliance.config.model(model)
        if served is None or not served.on_demand:
            return
        door = self._model_door
        loaded = door.want_model(model)
        request[LOAD_WAIT] = {model: served.load_timeout_s}  # loaded now or not (above)
        if loaded or self._admission.queued_since(model) is not None:
            return  # somebody already waits for it: theirs is the load
        state = next((m.state for m in door.models() if m.name == model), "")
        if state in ("unloaded", "sleeping"):
            how = "wake" if state == "sleeping" else "cold"
            key_id = request["key"].id
            self._metrics.key_model_loads.labels(key_id, model, how).inc()
            log.info("model %s: a %s load asked for by key %s", model, how, key_id)

    async def _parse(self, request: web.Request, route: str) -> tuple[ParsedRequest, str]:
        """The checked request, costed on the engines of the model it names (404 for no
        such model, 400 for a route the model does not serve), and that model's fallback
        ("": none)."""
        opened, config = open_body(route, await read_body(request)), self._appliance.config
        served, sent = resolve_named(config, opened.model, route, self._model_door.adapter_names())
        name = served.name  # whose engines serve it (an adapter's: its base model's)
        # A key limited to models: refused here, before anything else is done for the
        # request, so a refused one never makes an on-demand model load (_want_model).
        allowed = request["key"].models
        check_key_allows(config, allowed, served, sent, opened.model)
        if sent != name:  # an adapter: its removal waits for this request (adapter_work)
            self._adapter_work.begin(request, sent)
        request["model"] = sent  # the metrics' label: a configured name, never the client's
        refused = model_refusal(ROUTES[route], opened.fields, served, bool(config.models))
        if refused is not None:
            raise refused
        max_model_len = served.engine.max_model_len
        steps = stepping_of(served)
        priority = engine_priority(served.engine.scheduling, request["key"].priority)
        parsed = finish_body(
            route,
            opened,
            request.headers,
            config.gateway,
            max_model_len,
            name,
            sent,
            steps,
            priority,
            self._several_engines(name),
        )
        # An adapter has no fallback: another model's engines do not serve it; nor does a
        # model the key may not use.
        fallback = served.fallback if sent == name else ""
        target = config.model(fallback) if fallback else None
        if target is None or not key_allows(config, allowed, target, target.name):
            fallback = ""
        return parsed, fallback

    async def _parse_for(
        self, request: web.Request, route: str, model: str
    ) -> ParsedRequest | None:
        """The request as ``model`` (the fallback) would be sent it: its name in the body,
        costed on its context; None when its engines could never take it. Parsed afresh
        from the client's bytes (aiohttp keeps them), so nothing of the first model's
        parse (its max_tokens cap, its usage plan) carries over."""
        config = self._appliance.config
        opened = open_body(route, await read_body(request))
        target = config.model(model)
        if target is None or model_refusal(
            ROUTES[route], opened.fields, target, bool(config.models)
        ):
            return None  # a fallback that refuses what the request asks (tools, ...)
        parsed = finish_body(
            route,
            opened,
            request.headers,
            config.gateway,
            target.engine.max_model_len,
            model,
            stepping=stepping_of(target),
            priority=engine_priority(target.engine.scheduling, request["key"].priority),
            choice=self._several_engines(model),
        )
        return parsed if self._admission.fits(parsed.cost, model) else None

    def _several_engines(self, model: str) -> bool:
        """Whether ``model`` has engines to choose among (prefix routing has a use)."""
        return len(candidates(model, self._appliance.engines())) > 1

    async def _admit_or_fall_back(
        self, request: web.Request, parsed: ParsedRequest, fallback: str
    ) -> tuple[int, ParsedRequest] | None:
        """An engine of the model named when one has room at once; else one of its
        fallback model's, with the request as that model is sent it, when policy says so
        (:func:`appliance.policy.fallback.choose_fallback`); None: queue for the model
        named as usual. One hop: the fallback's own fallback is never looked at."""
        adm = self._admission
        record = request["key"]
        own = adm.try_acquire(
            parsed.cost, parsed.session, parsed.model, record.id, record.max_inflight, parsed.prefix
        )
        if own is not None:
            self._fallbacks.served_own(parsed.model)
            return own, parsed
        target = self._appliance.config.model(fallback)  # config checked: it exists
        if target is None:
            return None
        other = await self._parse_for(request, parsed.route, target.name)
        if other is None:
            return None
        reason = choose_fallback(
            adm.room(parsed.model, parsed.cost), adm.room(target.name, other.cost), allowed=True
        )
        if reason is None:
            return None
        engine_id = adm.try_acquire(
            other.cost, other.session, target.name, record.id, record.max_inflight, other.prefix
        )
        if engine_id is None:
            return None
        self._fallbacks.fell_back(parsed.model, target.name, reason)
        request["model"] = target.name  # the model that served it, in the metrics
        request[SERVED_BY] = target.name  # X-Appliance-Model on the answer (app.py)
        # Settled against what the key was charged (_handle), not the fallback's cost.
        return engine_id, dataclasses.replace(other, charged=parsed.tpm_charge)

    def _has_other_engine(self, exclude: frozenset[int], model: str) -> bool:
        """A READY engine of ``model`` beyond ``exclude``, to retry on."""
        return any(
            e.state is EngineState.READY and e.id not in exclude
            for e in candidates(model, self._appliance.engines())
        )

    def _check_rate(self, record: Any, cost: int) -> None:
        """429 when the caller's key is past its rpm or tpm."""
        limited = self._ratelimiter.check(record.id, record.rpm, record.tpm, cost)
        if limited is None:
            return
        which, wait = limited
        self._metrics.rate_limited.labels(record.id, which).inc()
        self._metrics.rejections.labels(f"rate_limit_{which}").inc()
        raise GatewayError(
            429,
            f"rate limit reached for this key ({which}); retry in {wait:.1f} s",
            code=f"rate_limit_{which}",
            retry_after=wait,
            reason=f"rate_limit_{which}",
        )

    async def _relay_with_failover(
        self,
        request: web.Request,
        path: str,
        parsed: ParsedRequest,
        started: float,
        batch: bool,
        fallback: str = "",
    ) -> web.StreamResponse:
        """Relay on the engine admission picks among the model's; one that fails before
        its first byte is retried once on another of the model's, if there is another.
        With a ``fallback`` (allowed for this request) the first engine may be the
        fallback model's, and the retry stays among that model's engines."""
        tried: frozenset[int] = frozenset()
        waited_back = False  # waited once for an engine that gave no answer at all
        attempt = 0
        while True:
            attempt += 1
            engine_id, parsed = await self._admit(
                request, parsed, batch, tried, fallback if attempt == 1 else ""
            )
            try:
                result = await self._relay(request, engine_id, path, parsed, started)
            finally:
                self._admission.release(engine_id, parsed.cost, request["key"].id, parsed.model)
            if isinstance(result, web.StreamResponse):
                return result
            # Failed before the first byte: try once more elsewhere.
            if attempt == 1 and self._has_other_engine(tried | {engine_id}, parsed.model):
                tried = tried | {engine_id}
                self._metrics.failovers.inc()
                log.warning(
                    "engine%d failed before answering (%s); retrying on another engine",
                    engine_id,
                    result.reason,
                )
                continue
            if result.unanswered and not waited_back:
                # No other engine, and this one gave no answer at all: it may have died a
                # moment before the supervisor noticed. Wait in the queue for it to be
                # back (its restart), as a request that came a moment later would.
                waited_back = True
                self._admission.unanswered(engine_id, self._appliance.engine(engine_id).pid)
                log.warning(
                    "engine%d gave no answer (%s); the request waits for it to be back",
                    engine_id,
                    result.reason,
                )
                continue
            raise engine_error(result)

    async def _admit(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        batch: bool,
        tried: frozenset[int],
        fallback: str,
    ) -> tuple[int, ParsedRequest]:
        """A slot on an engine not ``tried`` (or the ``fallback`` model's), and the request
        as it goes there; the wait is recorded in appliance_queue_wait_seconds."""
        queued = time.monotonic()
        first = await self._admit_or_fall_back(request, parsed, fallback) if fallback else None
        if first is not None:
            engine_id, parsed = first
        else:
            engine_id = await self._admission.acquire(
                parsed.cost,
                batch=batch,
                session=parsed.session,
                prefix=parsed.prefix,
                exclude=tried,
                model=parsed.model,
                load_wait_s=request.get(LOAD_WAIT, {}).get(parsed.model),
                key=request["key"].id,
                key_cap=request["key"].max_inflight,
            )
        self._metrics.queue_wait.observe(time.monotonic() - queued)
        return engine_id, parsed

    async def _relay(
        self,
        request: web.Request,
        engine_id: int,
        path: str,
        parsed: ParsedRequest,
        started: float,
        method: str = "POST",
    ) -> web.StreamResponse | EngineFailure:
        """The response sent, or why the engine failed before its first byte."""
        if KEY_REVOKED in request:
            raise revoked()  # its slot came as its key was revoked (open_requests.py)
        # Admitted: the model (a fallback's, when it serves) is used; a request refused
        # before this (503, 401) never marks it (ModelDoor.model_used).
        self._model_door.model_used(parsed.model)
        snap = self._appliance.engine(engine_id)
        headers = {"Authorization": f"Bearer {snap.api_key}", "Content-Type": "application/json"}
        if parsed.priority_header is not None:  # Messages: vLLM reads it from a header
            headers[PRIORITY_HEADER] = str(parsed.priority_header)
        attempt = Attempt(asyncio.current_task())
        attempts = self._attempts[engine_id]
        attempts.add(attempt)
        self.pinned.record(request, parsed, engine_id)
        request[LOWERED] = parsed.lowered  # X-Appliance-Max-Tokens (request_body.py)
        call = EngineCall(request, parsed, attempt, snap.address, path, headers, started, method)
        opened = self._usage.begin(engine_id)  # the energy split waits for its end
        try:
            if parsed.stream and request.version >= HttpVersion11 and method == "POST":
                result = await relay_via_splice(self._ways, call)
            else:
                result = await relay_via_client(self._ways, call)
            call.meter.failed = isinstance(result, EngineFailure)
            return result
        finally:
            attempts.discard(attempt)
            # The one place a try's tokens are counted, however it ended: an answer, a
            # break, a client gone (cancelled), an abandoned engine (stream_tap.charged).
            self._usage.finish(call, opened)
