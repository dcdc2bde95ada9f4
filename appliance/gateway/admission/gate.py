"""Admission: who gets an engine now, who waits, who is refused.

Per engine the gateway keeps an in-flight budget in requests (``engine.max_inflight``)
and in tokens (``engine.max_inflight_tokens``; a request costs what
``appliance/gateway/protocols/cost.py`` counts: sequences x (prompt estimate + max_tokens), per
prompt). The thermal governor scales both down on a hot GPU, and the KV-pressure
breaker closes an engine whose ``vllm:kv_cache_usage_perc`` passed 0.92 until it falls
below 0.85, so we stop feeding an engine that is about to preempt.

A request that no engine could ever take (it costs more than both
``max_inflight_tokens`` and ``max_model_len``; an idle engine takes any one sequence, see
``policy/routing.py``) is refused with 400 at once rather than queued to time out.

Requests that find no room wait in a bounded queue, interactive before batch; under
pressure batch is shed first. A waiter too large for the room any engine has *now* lets
smaller ones pass until it has waited ``gateway.queue_aging_s``; then nobody of its model
passes it, so engines drain until it fits.
All but waiting is synchronous: a release hands the slot on without a scheduling gap.

Per key (docs/security.md): a key with ``max_inflight`` N has at most N requests in
flight; beyond, they wait (never refused). While another key's request waits for a
model, a key already holding ``gateway.key_token_share`` of that model's in-flight
token budget takes no more (its requests wait; a key with nothing in flight always may),
so one key cannot keep the others out. With nobody else waiting a key may use it all.

Several models ([[models]]): a request names its model, and everything above happens
among that model's engines only (:func:`appliance.gateway.admission.models.candidates`), with that
model's budgets (``config.engine_of(model)``). One model's full engines, or its aged
waiter, never hold up another model's requests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from appliance.config import Config
from appliance.engine import EngineState
from appliance.gateway.admission.fallback import model_room
from appliance.gateway.admission.models import candidates
from appliance.gateway.admission.prefix_index import Blocks, PrefixIndex
from appliance.gateway.admission.wait_queue import Waiter, WaitQueue
from appliance.gateway.errors import GatewayError
from appliance.policy.fallback import ModelRoom
from appliance.policy.prefix import route_by_prefix
from appliance.policy.routing import EngineLoad, route
from appliance.policy.thermal import HARD_LEVEL, scale_budget

KV_BREAKER_OPEN = 0.92
KV_BREAKER_CLOSE = 0.85
AFFINITY_SESSIONS = 4096
# An engine that gave no answer at all (refused, no socket: it may have died a moment
# ago) is out of routing this long, or until its status shows another process or state.
UNANSWERED_S = 2.0


# States from which an engine may serve soon: a request may wait for one of them.
MAY_SERVE_SOON = frozenset(
    {
        EngineState.READY,
        EngineState.SUSPECT,  # may pass its next check
        EngineState.STARTING,
        EngineState.DRAINING,
        EngineState.EXITED,
        EngineState.SLEEPING,  # on demand: woken when its model is wanted
        # Going down to be started again (a crash, a restart); one that ends FAILED has
        # its waiters refused then (refuse_failed), and shutdown refuses everyone.
        EngineState.STOPPING,
    }
)


class EngineView(Protocol):
    """What admission reads of an engine (an ``appliance.control.EngineStatus``)."""

    @property
    def id(self) -> int: ...
    @property
    def state(self) -> EngineState: ...
    @property
    def model(self) -> str: ...
    @property
    def pid(self) -> int | None: ...


class Admission:
    def __init__(
        self,
        config: Callable[[], Config],
        engines: Callable[[], Sequence[EngineView]],
        accepting: Callable[[], bool],
        *,
        starting: Callable[[], bool] = lambda: False,
        on_reject: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        heat_of: Callable[[Sequence[int]], str] = lambda ids: "",
    ) -> None:
        self._config = config
        # The readings behind the engines' heat, in words ("GPU 0 at 91 °C"), for the
        # 503 of a model held back by heat (the gateway reads the telemetry).
        self._heat_of = heat_of
        self._clock = clock
        self._engines = engines
        self._accepting = accepting
        self._starting = starting
        self._on_reject = on_reject or (lambda reason: None)
        self._inflight: collections.Counter[int] = collections.Counter()
        self._tokens: collections.Counter[int] = collections.Counter()
        # Per key id: requests in flight, and tokens in flight per (key, model).
        self._key_inflight: collections.Counter[str] = collections.Counter()
        self._key_tokens: collections.Counter[tuple[str, str | None]] = collections.Counter()
        self._throttle_level: dict[int, int] = {}  # engine id -> governor level
        self._kv_tripped: dict[int, bool] = {}  # engine id -> breaker open
        # TCP engines a relay connection found someone else on, until the supervisor's
        # check (admission/engine_owners.py).
        self._unverified: set[int] = set()
        # Engines an admin drained (the admin API), until resumed or restarted: a model
        # whose every engine is so is refused at once, not queued (admin.py keeps it).
        self._drained: set[int] = set()
        # Engines that gave a request no answer at all: (their pid then, until when).
        self._unanswered: dict[int, tuple[int | None, float]] = {}
        self._queue = WaitQueue()
        self._affinity: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._prefixes = PrefixIndex()  # which engine was sent which prompt beginnings

    # ---- views ----------------------------------------------------------------------
    def inflight(self, engine_id: int) -> int:
        return self._inflight[engine_id]

    def inflight_tokens(self, engine_id: int) -> int:
        return self._tokens[engine_id]

    def key_inflight(self, key: str) -> int:
        """The requests of the key ``key`` (its id) holding a slot now."""
        return self._key_inflight[key]

    def top_keys(self, n: int) -> list[tuple[str, int]]:
        """The ``n`` key ids with the most requests in flight now, most first."""
        return self._key_inflight.most_common(n)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def queued_since(self, model: str) -> float | None:
        """When the longest-waiting request for ``model`` began to wait (this clock,
        monotonic); None: nobody waits for it."""
        return self._queue.oldest(model)

    @property
    def queued(self) -> tuple[int, int]:
        """Requests waiting now: (interactive, batch)."""
        return len(self._queue.interactive), len(self._queue.batch)

    def loads(self, model: str | None = None) -> list[EngineLoad]:
        """Each engine of ``model`` (None: every engine) as routing sees it, with its own
        model's budgets."""
        config = self._config()
        out = []
        for snap in candidates(model, self._engines()):
            e = config.engine_of(snap.model)
            level = self._throttle_level.get(snap.id, 0)
            self._prefixes.seen(snap.id, snap.state, snap.pid)  # a restart loses its cache
            out.append(
                EngineLoad(
                    id=snap.id,
                    accepting=(
                        snap.state is EngineState.READY
                        and level < HARD_LEVEL
                        and not self._kv_tripped.get(snap.id, False)
                        and snap.id not in self._unverified
                        and (not self._unanswered or self._answers(snap))
                    ),
                    inflight=self._inflight[snap.id],
                    outstanding_tokens=self._tokens[snap.id],
                    max_inflight=scale_budget(e.max_inflight, level),
                    token_budget=scale_budget(e.max_inflight_tokens, level),
                    throttle_level=level,
                )
            )
        return out

    def _answers(self, snap: EngineView) -> bool:
        """Not marked by :meth:`unanswered`, or no longer: its mark ran out, or its status
        shows another process or state (the supervisor noticed)."""
        mark = self._unanswered.get(snap.id)
        if mark is None:
            return True
        pid, until = mark
        if pid != snap.pid or snap.state is not EngineState.READY or time.monotonic() >= until:
            del self._unanswered[snap.id]
            return True
        return False

    def unanswered(self, engine_id: int, pid: int | None) -> None:
        """The engine (process ``pid``) gave a request no answer at all: it may have died a
        moment before the supervisor noticed. Out of routing until its status changes,
        for at most UNANSWERED_S, so a request that waits for it is not sent to the
        dead socket again (and gets its 502) before the supervisor sees the exit."""
        self._unanswered[engine_id] = (pid, time.monotonic() + UNANSWERED_S)
        asyncio.get_running_loop().call_later(UNANSWERED_S, self.kick)

    # ---- inputs from the supervisor -------------------------------------------------
    def set_throttle(self, engine_id: int, level: int) -> None:
        """The thermal governor's level for the engine's GPUs (0 = none); a change may
        let a waiter go, or hold new work back."""
        if self._throttle_level.get(engine_id, 0) != level:
            self._throttle_level[engine_id] = level
            self.kick()

    def set_drained(self, engine_id: int, drained: bool) -> None:
        """An admin drained the engine (True: a model whose every engine is so is refused
        at once, and its waiters now), or resumed or restarted it (False: waiters may go)."""
        if drained:
            self._drained.add(engine_id)
            self.refuse_failed()
        else:
            self._drained.discard(engine_id)
            self.kick()

    def throttle(self, engine_id: int) -> int:
        """The engine's throttle level now (0 = none, HARD_LEVEL = admits nothing)."""
        return self._throttle_level.get(engine_id, 0)

    def kv_open(self, engine_id: int) -> bool:
        """Whether the engine's KV-cache breaker is open (it admits nothing new)."""
        return self._kv_tripped.get(engine_id, False)

    def unverified(self, engine_id: int) -> bool:
        """Whether a connection to the engine reached someone else's process, and the
        supervisor's check of it is still under way (out of routing meanwhile)."""
        return engine_id in self._unverified

    def set_unverified(self, engine_id: int, unverified: bool) -> None:
        """Out of routing until the supervisor's check (True), or back in (False)."""
        if unverified:
            self._unverified.add(engine_id)
        else:
            self._unverified.discard(engine_id)
            self.kick()

    def observe_kv(self, engine_id: int, usage: float | None) -> None:
        """The KV-pressure breaker, with hysteresis so it does not flap."""
        if usage is None:
            return
        tripped = self._kv_tripped.get(engine_id, False)
        if not tripped and usage > KV_BREAKER_OPEN:
            self._kv_tripped[engine_id] = True
        elif tripped and usage < KV_BREAKER_CLOSE:
            self._kv_tripped[engine_id] = False
            self.kick()

    # ---- acquire / release ----------------------------------------------------------
    def _reject(self, status: int, message: str, reason: str, retry_after: float) -> GatewayError:
        self._on_reject(reason)
        return GatewayError(status, message, code=reason, retry_after=retry_after, reason=reason)

    def _closed(self) -> GatewayError:
        """The 503 while not accepting: starting (an earlier run's engines still being
        swept) or shutting down, said as it is."""
        if self._starting():
            return self._reject(503, "the server is starting; retry shortly", "starting", 5)
        return self._reject(503, "the server is shutting down", "shutting_down", 5)

    def check_cost(self, cost: int, model: str | None = None) -> None:
        """400 for a request no engine (of ``model``) could ever take, rather than a queue
        timeout."""
        ceiling = self._ceiling(model or "")  # no model is named "": [engine] itself
        if cost > ceiling:
            self._on_reject("too_many_tokens")
            raise GatewayError(
                400,
                f"this request may take up to {cost} tokens on an engine (answers per "
                f"prompt x (prompt + max_tokens), for each prompt), more than an engine "
                f"takes at once ({ceiling}); ask for fewer tokens, fewer answers (n, "
                "best_of) or fewer prompts",
                code="too_many_tokens",
                reason="too_many_tokens",
            )

    async def acquire(
        self,
        cost: int,
        *,
        batch: bool = False,
        session: str | None = None,
        exclude: frozenset[int] = frozenset(),
        model: str | None = None,
        load_wait_s: float | None = None,
        key: str | None = None,
        key_cap: int = 0,
        prefix: Blocks = (),
    ) -> int:
        """An engine id (one of ``model``'s) with a slot reserved for this request;
        release() it when done. ``load_wait_s``: the model is on demand (its
        load_timeout_s); while none of its engines serves (it is being loaded, or put
        away for another model of its slot: a swap) the request may wait that long in
        all, instead of gateway.queue_timeout_s. ``key``: the key's id, counted per key;
        ``key_cap``: its max_inflight (0: none), beyond which it waits. ``prefix``: its
        prompt's block hashes, when no ``session`` places it (prefix_index.py)."""
        self.check_cost(cost, model)
        if self._drained_all(model, exclude):
            raise self._drained_error(model)
        if load_wait_s is None or self._serving(model) or self._failed(model):
            self._refuse_unless_open(exclude, model)  # every engine FAILED: no load to wait
        elif not self._accepting():
            raise self._closed()
        g = self._config().gateway
        if not self._queued_for(model) and not self._capped(key, key_cap):
            chosen = self._route(cost, session, exclude, model=model, key=key, prefix=prefix)
            if chosen is not None:
                return chosen
        self._make_room_in_queue(batch, g.max_queue, key)
        waiter = Waiter(cost, session, exclude, batch, self._clock(), model, key, key_cap, prefix)
        self._queue.add(waiter)
        self.kick()  # room may exist for it: waiters ahead may be waiting for more room
        return await self._wait_in_queue(waiter, g.queue_timeout_s, load_wait_s)

    def try_acquire(
        self,
        cost: int,
        session: str | None,
        model: str,
        key: str | None = None,
        key_cap: int = 0,
        prefix: Blocks = (),
    ) -> int | None:
        """An engine of ``model`` reserved for this request if one has room at once (and
        nobody of that model waits, and the key is under its cap), else None: no
        queueing, no refusal. The fallback's first look (relay/handlers.py); release() it like
        acquire()'s."""
        if not self._accepting() or self._queued_for(model) or self._capped(key, key_cap):
            return None
        return self._route(cost, session, frozenset(), model=model, key=key, prefix=prefix)

    def _capped(self, key: str | None, cap: int) -> bool:
        """The key has ``cap`` (its max_inflight) requests in flight already."""
        return key is not None and cap > 0 and self._key_inflight[key] >= cap

    def _key_blocked(self, w: Waiter, loads: list[EngineLoad], others_wait: bool) -> bool:
        """The waiter's key may not take a slot now: it is at its max_inflight, or another
        key's request waits for the model and this key already holds its share
        (``gateway.key_token_share``) of the model's in-flight token budget. A key with
        nothing in flight on the model is never held back by its share: it may run one
        request whatever its size, as an idle engine takes any one (routing's rule 1)."""
        if self._capped(w.key, w.key_cap):
            return True
        share = self._config().gateway.key_token_share
        if w.key is None or share >= 1.0 or not others_wait:
            return False
        held = self._key_tokens[(w.key, w.model)]
        budget = sum(x.token_budget for x in loads if x.accepting)
        return held > 0 and held + w.cost > share * budget

    def fits(self, cost: int, model: str) -> bool:
        """Whether ``model``'s engines could ever take a request of ``cost`` (check_cost
        without the refusal): a fallback model with a shorter context may not."""
        return cost <= self._ceiling(model)

    def _ceiling(self, model: str) -> int:
        """The most one request may cost on ``model``'s engines: an idle engine takes any
        one sequence (routing's rule 1), and a sequence never costs more than
        max_model_len, so that much always fits eventually."""
        e = self._config().engine_of(model)
        return max(e.max_inflight_tokens, e.max_model_len)

    def room(self, model: str, cost: int) -> ModelRoom:
        """``model``'s room for a request of ``cost`` now, as the fallback decision reads
        it (built from the same snapshot routing uses)."""
        return model_room(
            candidates(model, self._engines()),
            self.loads(model),
            self._throttle_level,
            self._kv_tripped,
            cost,
            self._queued_for(model),
        )

    def _queued_for(self, model: str | None) -> bool:
        """Someone of ``model`` is waiting whom a newcomer must not pass (a waiter of a
        key at its max_inflight cannot take a free slot: it does not count)."""
        return self._queue.holds(model, self._waiter_capped)

    def _waiter_capped(self, w: Waiter) -> bool:
        return self._capped(w.key, w.key_cap)

    def _refuse_unless_open(self, exclude: frozenset[int], model: str | None = None) -> None:
        """503 while shutting down, or when no engine of ``model`` (but the excluded) may
        serve soon."""
        if not self._accepting():
            raise self._closed()
        if not any(
            s.state in MAY_SERVE_SOON and s.id not in exclude
            for s in candidates(model, self._engines())
        ):
            raise self._no_engine(model)

    def _no_engine(self, model: str | None) -> GatewayError:
        return self._reject(
            503, f"no engine{_of(model)} is ready to take requests", "no_engine", 10
        )

    def _failed(self, model: str | None) -> bool:
        """Every engine of ``model`` is FAILED: none serves it until an admin restarts one."""
        engines = candidates(model, self._engines())
        return bool(engines) and all(s.state is EngineState.FAILED for s in engines)

    def _drained_all(self, model: str | None, exclude: frozenset[int] = frozenset()) -> bool:
        """Every engine of ``model`` that could serve (but the excluded) is drained by an
        admin: none takes a request until an admin resumes one."""
        if not self._drained:
            return False
        open_ = [
            s
            for s in candidates(model, self._engines())
            if s.state is not EngineState.FAILED and s.id not in exclude
        ]
        return bool(open_) and all(
            s.state is EngineState.DRAINING and s.id in self._drained for s in open_
        )

    def _drained_error(self, model: str | None) -> GatewayError:
        ids = sorted(s.id for s in candidates(model, self._engines()) if s.id in self._drained)
        first = ids[0] if ids else 0
        return self._reject(
            503,
            f"every engine{_of(model)} is drained by an admin (engine "
            f"{', '.join(map(str, ids))}): it takes no requests until one is resumed "
            f"(POST /admin/engines/{first}/resume, or `llm-appliance engines resume "
            f"{first}`)",
            "no_engine",
            10,
        )

    def refuse_failed(self) -> None:
        """Refuse the waiters of a model whose every engine is FAILED now, or drained by
        an admin, not at their timeout (an on-demand model's would wait for a load that
        cannot come)."""
        if self._drained:  # forget engines no longer drained (resumed, restarted, exited)
            states = {s.id: s.state for s in self._engines()}
            self._drained = {i for i in self._drained if states.get(i) is EngineState.DRAINING}
        self._queue.fail_models(
            lambda m: self._failed(m) or self._drained_all(m),
            lambda m: self._drained_error(m) if self._drained_all(m) else self._no_engine(m),
        )

    def _make_room_in_queue(self, batch: bool, max_queue: int, key: str | None = None) -> None:
        """Refuse a waiter the queue has no room for, or make room for it: shed the
        newest waiter of a key that waits with more requests than ``key`` (one key's
        backlog must not fill the queue for everyone), else the newest batch waiter for
        an interactive one."""
        depth = self.queue_depth

        def shed() -> GatewayError:
            return self._reject(
                503, "the server is busy; batch requests are shed first", "shed_batch", 5
            )

        if batch and depth >= max(1, max_queue // 2):
            raise shed()
        full = depth >= max_queue
        if not full:
            return

        def busiest() -> GatewayError:
            return self._reject(
                503,
                "the server is busy and this key has the most requests waiting; its newest "
                "was shed to make room for another key's",
                "queue_full",
                5,
            )

        if self._queue.shed_newest_of_busiest_key(key, busiest):
            return
        if batch or not self._queue.shed_newest_batch(shed):
            raise self._reject(503, "the request queue is full", "queue_full", 5)

    def _serving(self, model: str | None) -> bool:
        """Some engine of ``model`` serves now (READY, or SUSPECT: may pass its next check)."""
        serving = (EngineState.READY, EngineState.SUSPECT)
        return any(s.state in serving for s in candidates(model, self._engines()))

    async def _wait_in_queue(
        self, waiter: Waiter, timeout_s: float, load_wait_s: float | None = None
    ) -> int:
        """The engine a release() or kick() hands the queued ``waiter``; 503 after
        ``timeout_s``. For an on-demand model (``load_wait_s``) the bound is
        ``load_wait_s`` from when its model is seen not serving, at the start or at a
        deadline: a model put away while its requests wait (a swap) is loaded again for
        them, and they wait for that load as long as a request that found it unloaded."""
        began = time.monotonic()  # not self._clock: tests move that one by hand
        limit = 0.0  # only grows: a request that waited for a load keeps that bound
        try:
            while True:
                loading = load_wait_s is not None and not self._serving(waiter.model)
                limit = max(limit, load_wait_s if loading and load_wait_s else timeout_s)
                left = limit - (time.monotonic() - began)
                if left <= 0:
                    if _handed_over(waiter.future):
                        # A release handed it a slot in the same turn as its deadline:
                        # wait_for's timeout dropped the result, which is taken here, or
                        # the slot would be held for ever.
                        return waiter.future.result()
                    raise self._timed_out(waiter, limit, loading)
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(asyncio.shield(waiter.future), left)
        except asyncio.CancelledError:
            # The client went away while queued. If a slot was handed over at the same
            # moment, give it back.
            if _handed_over(waiter.future):
                self.release(waiter.future.result(), waiter.cost, waiter.key, waiter.model)
            raise
        finally:
            self._queue.forget(waiter)

    def _timed_out(self, waiter: Waiter, limit_s: float, loading: bool) -> GatewayError:
        hot = self._all_too_hot(waiter.model)
        if hot:
            where = self._heat_of(hot)
            limit = self._config().thermal.hard_limit_c
            return self._reject(
                503,
                f"no engine{_of(waiter.model)} could take the request within {limit_s:g} s: "
                f"{'its GPU is' if len(hot) == 1 else 'every one of its GPUs is'} at the "
                f"hard thermal limit ({where + ', ' if where else ''}thermal.hard_limit_c = "
                f"{limit:g} °C) and takes nothing new until it cools; retry later",
                # The code stays the queue's: clients and alerts key on it; the words and
                # /readyz say it is heat.
                "queue_timeout",
                10,
            )
        if loading:
            return self._reject(
                503,
                f"the model '{waiter.model}' is not loaded: it did not load within "
                f"{limit_s:g} s (load_timeout_s); retry later",
                "model_loading",
                10,
            )
        return self._reject(
            503,
            f"no engine{_of(waiter.model)} could take the request within {limit_s:g} s",
            "queue_timeout",
            5,
        )

    def _all_too_hot(self, model: str | None) -> list[int]:
        """The engines of ``model`` that serve, when every one of them is held at the hard
        thermal limit (else []): heat is then why nothing took the request."""
        serving = (EngineState.READY, EngineState.SUSPECT)
        engines = [s.id for s in candidates(model, self._engines()) if s.state in serving]
        if engines and all(self._throttle_level.get(i, 0) >= HARD_LEVEL for i in engines):
            return engines
        return []

    def _route(
        self,
        cost: int,
        session: str | None,
        exclude: frozenset[int],
        loads: list[EngineLoad] | None = None,
        model: str | None = None,
        key: str | None = None,
        prefix: Blocks = (),
    ) -> int | None:
        """Reserve a slot on the engine of ``model`` routing picks; ``loads`` (that
        model's) if the caller has them; counted for ``key`` (its id) too. A request
        with a ``prefix`` (no session) goes where its prompt's beginning is cached
        (policy/prefix.py), and its blocks are then that engine's."""
        if loads is None:
            loads = self.loads(model)
        if exclude:
            loads = [x for x in loads if x.id not in exclude]
        if prefix:
            # The index is read only when some engine has room: a waiter tried at every
            # release while the engines are full costs no lookup.
            chosen = route(loads, cost)
            if chosen is not None:
                matched = self._prefixes.matched(prefix)
                chosen = route_by_prefix(loads, cost, matched, len(prefix))
        else:
            chosen = route(loads, cost, session, self._affinity)
        if chosen is None:
            return None
        if prefix:
            self._prefixes.record(chosen, prefix)
        self._inflight[chosen] += 1
        self._tokens[chosen] += cost
        if key is not None:
            self._key_inflight[key] += 1
            self._key_tokens[(key, model)] += cost
        if session is not None:
            self._affinity[session] = chosen
            self._affinity.move_to_end(session)
            if len(self._affinity) > AFFINITY_SESSIONS:
                self._affinity.popitem(last=False)
        return chosen

    def release(
        self, engine_id: int, cost: int, key: str | None = None, model: str | None = None
    ) -> None:
        """Give back a slot acquired for ``key`` on ``model`` (as acquire was told)."""
        self._inflight[engine_id] -= 1
        self._tokens[engine_id] -= cost
        if key is not None:
            self._key_inflight[key] -= 1
            self._key_tokens[(key, model)] -= cost
            if not self._key_inflight[key]:  # no entry left per key that ever came
                del self._key_inflight[key]
            if not self._key_tokens[(key, model)]:
                del self._key_tokens[(key, model)]
        self.kick()

    def kick(self) -> None:
        """Hand free slots to waiters (:mod:`.wait_queue` says in which order)."""
        if not len(self._queue):
            return
        self._queue.serve(
            self._clock(),
            self._config().gateway.queue_aging_s,
            self.loads,
            lambda w, loads: self._route(
                w.cost, w.session, w.exclude, loads, w.model, w.key, w.prefix
            ),
            self._key_blocked,
            self._key_inflight.__getitem__,
            self._waiter_capped,
            lambda key, model: self._key_tokens[(key, model)],
        )

    def fail_waiters(self, reason: str, message: str) -> None:
        """Refuse everyone waiting (shutdown)."""
        self._queue.fail_all(lambda: self._reject(503, message, reason, 5))


def _of(model: str | None) -> str:
    """ " of model 'X'" for a message about one model's engines."""
    return "" if model is None else f" of model '{model}'"


def _handed_over(future: asyncio.Future[int]) -> bool:
    """A waiter's future holds the engine a release() or kick() handed it."""
    return future.done() and not future.cancelled() and future.exception() is None
