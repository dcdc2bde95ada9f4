"""The requests waiting for an engine: two queues, interactive before batch, and the
order in which freed slots are handed out.

Owned by :class:`appliance.gateway.admission.gate.Admission`, which decides *whether* a
request waits; this module decides *who is served next* when room appears: interactive
first, each queue fairly between keys (the key with the fewest requests in flight
first, each key's own in arrival order: :func:`fair_order`), a waiter that does not fit
now passed by smaller ones of its model until it has aged (``gateway.queue_aging_s``);
from then on nobody of its model passes it (batch included). Each model's waiters
compete for that model's engines only. Synchronous: a release hands the slot on without
a scheduling gap.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from appliance.policy.routing import EngineLoad

# (waiter, its model's loads) -> the engine reserved for it, or None.
Route = Callable[["Waiter", list[EngineLoad]], "int | None"]
# (waiter, its model's loads, whether another key's request waits for its model) -> its
# key may not take more now (its max_inflight, or its share of the model's tokens).
Blocked = Callable[["Waiter", list[EngineLoad], bool], bool]


@dataclass(slots=True)
class Waiter:
    cost: int
    session: str | None
    exclude: frozenset[int]
    batch: bool
    since: float
    model: str | None  # its model's canonical name (None: any engine)
    key: str | None = None  # the id of the key it came with (None: not counted per key)
    key_cap: int = 0  # that key's max_inflight (0: no cap)
    prefix: tuple[int, ...] = ()  # its prompt's block hashes (prefix_index.py)
    seq: int = 0  # its place in arrival order (WaitQueue.add)
    future: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class WaitQueue:
    """Interactive and batch waiters, in arrival order."""

    def __init__(self) -> None:
        self.interactive: collections.deque[Waiter] = collections.deque()
        self.batch: collections.deque[Waiter] = collections.deque()
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self.interactive) + len(self.batch)

    def holds(self, model: str | None, passable: Callable[[Waiter], bool] | None = None) -> bool:
        """Someone of ``model`` (None: anyone) waits whom a newcomer must not pass:
        anyone but the ``passable`` (waiters at their key's max_inflight: they cannot
        take a free slot, so one key's capped backlog never keeps others from it)."""
        if passable is None:
            if model is None:
                return len(self) > 0
            return any(w.model == model for q in (self.interactive, self.batch) for w in q)
        return any(
            (model is None or w.model == model) and not passable(w)
            for q in (self.interactive, self.batch)
            for w in q
        )

    def shed_newest_of_busiest_key(
        self, key: str | None, error: Callable[[], BaseException]
    ) -> bool:
        """The queue is full: refuse the newest waiter of the key with the most waiters
        (batch before interactive) when that key has more than ``key``'s, to make room
        for ``key``'s request. One key that fills the queue then costs others nothing
        but its own backlog; False when no key waits more than ``key``."""
        counts: collections.Counter[str | None] = collections.Counter(
            w.key for q in (self.interactive, self.batch) for w in q if w.key is not None
        )
        if not counts:
            return False
        busiest, most = counts.most_common(1)[0]
        if busiest == key or most <= counts[key] + 1:
            return False
        for queue in (self.batch, self.interactive):
            for w in reversed(queue):
                if w.key == busiest:
                    queue.remove(w)
                    if not w.future.done():
                        w.future.set_exception(error())
                    return True
        return False

    def oldest(self, model: str) -> float | None:
        """When the longest-waiting request of ``model`` began to wait; None: nobody."""
        return min(
            (w.since for q in (self.interactive, self.batch) for w in q if w.model == model),
            default=None,
        )

    def add(self, waiter: Waiter) -> None:
        waiter.seq = next(self._arrivals)
        (self.batch if waiter.batch else self.interactive).append(waiter)

    def forget(self, waiter: Waiter) -> None:
        queue = self.batch if waiter.batch else self.interactive
        with contextlib.suppress(ValueError):  # already handed a slot or shed
            queue.remove(waiter)
        if not waiter.future.done():
            waiter.future.cancel()

    def shed_newest_batch(self, error: Callable[[], BaseException]) -> bool:
        """Refuse the newest batch waiter with ``error()`` (room for an interactive
        one); False when no batch waiter is left to shed."""
        if not self.batch:
            return False
        shed = self.batch.pop()
        if not shed.future.done():
            shed.future.set_exception(error())
        return True

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """Refuse everyone waiting (shutdown)."""
        for queue in (self.interactive, self.batch):
            while queue:
                w = queue.popleft()
                if not w.future.done():
                    w.future.set_exception(error())

    def fail_models(
        self, which: Callable[[str | None], bool], error: Callable[[str | None], BaseException]
    ) -> None:
        """Refuse everyone waiting for a model ``which`` picks (asked once per model)."""
        models = {w.model for q in (self.interactive, self.batch) for w in q}
        for model in filter(which, models):
            for queue in (self.interactive, self.batch):
                for w in [w for w in queue if w.model == model]:
                    queue.remove(w)
                    if not w.future.done():
                        w.future.set_exception(error(model))

    def serve(
        self,
        now: float,
        aging_s: float,
        loads_of: Callable[[str | None], list[EngineLoad]],
        reserve: Route,
        blocked: Blocked = lambda w, loads, others: False,
        in_flight: Callable[[str], int] = lambda key: 0,
        capped: Callable[[Waiter], bool] = lambda w: False,
        holding: Callable[[str, str | None], int] = lambda key, model: 0,
    ) -> None:
        """Hand free slots to the waiters that fit, interactive first; a waiter whose
        key is ``blocked`` is passed by (its key's own release serves it later) and never
        holds the line for its model, however long it waited. ``capped``: the waiter's
        key is at its max_inflight; ``holding``: the tokens a key holds on a model
        (what decides whether another key waiting is one that holds less)."""
        held: set[str | None] = set()  # models whose aged waiter holds the line
        keys = _KeysWaiting((self.interactive, self.batch), capped, holding)
        for queue in (self.interactive, self.batch):
            # an aged one holds batch too
            _serve(queue, now, aging_s, held, loads_of, reserve, blocked, keys, in_flight)


class _KeysWaiting:
    """The keys waiting for each model in this pass, and the tokens each held on it when
    the pass began: whether a key waits that holds less of the model than a waiter's
    own key (so the waiter's key, past its share, must leave it the room). Waiters of a
    key at its max_inflight are not counted: they cannot take room anyway, and counting
    them would hold back keys that can (an engine left idle for nobody)."""

    def __init__(
        self,
        queues: Iterable[collections.deque[Waiter]],
        capped: Callable[[Waiter], bool],
        holding: Callable[[str, str | None], int],
    ) -> None:
        self.per_key: collections.Counter[tuple[str | None, str]] = collections.Counter()
        for queue in queues:
            for w in queue:
                if w.key is not None and not w.future.done() and not capped(w):
                    self.per_key[(w.model, w.key)] += 1
        self.holds = {mk: holding(mk[1], mk[0]) for mk in self.per_key}

    def others(self, w: Waiter) -> bool:
        """Another key waits for ``w``'s model that holds fewer of its tokens than ``w``'s
        key: of keys blocked by their share, the one holding least is never blocked,
        so two keys never hold each other back while the engine has room."""
        assert w.key is not None
        mine = self.holds.get((w.model, w.key))
        if mine is None:
            return False  # its key is capped, or counted nowhere: nothing to leave room for
        return any(
            left > 0 and key != w.key and model == w.model and self.holds[(model, key)] < mine
            for (model, key), left in self.per_key.items()
        )

    def served(self, w: Waiter) -> None:
        if w.key is not None and (w.model, w.key) in self.per_key:
            self.per_key[(w.model, w.key)] -= 1


def _serve(
    queue: collections.deque[Waiter],
    now: float,
    aging_s: float,
    held: set[str | None],
    loads_of: Callable[[str | None], list[EngineLoad]],
    reserve: Route,
    blocked: Blocked,
    keys: _KeysWaiting,
    in_flight: Callable[[str], int],
) -> None:
    """Serve the waiters of ``queue`` that fit, in fair order (:func:`fair_order`); a
    model whose aged waiter did not fit is added to ``held``, and nobody of that model
    is served after it. Those left keep their places in arrival order."""
    if len(queue) > 1:
        ordered = fair_order(queue, in_flight, now, aging_s)
        queue.clear()
        queue.extend(ordered)
    passed: list[Waiter] = []  # looked at, still waiting: they keep their places
    loads: dict[str | None, list[EngineLoad]] = {}  # per model, until one changes
    full: set[str | None] = set()  # models with no free slot on any engine
    refused_at: dict[str | None, int] = {}  # per model: smallest cost just refused
    while queue:
        waiter = queue.popleft()
        if waiter.future.done():
            continue
        model = waiter.model
        if model in held or model in full:
            passed.append(waiter)  # nobody of that model fits now, whatever the cost
            continue
        model_loads = loads.get(model)
        if model_loads is None:
            model_loads = loads[model] = loads_of(model)
            if not any(x.accepting and x.inflight < x.max_inflight for x in model_loads):
                full.add(model)
                passed.append(waiter)
                continue
        if waiter.key is not None and blocked(waiter, model_loads, keys.others(waiter)):
            passed.append(waiter)  # its key holds its share: not refused for room, no hold
            continue
        chosen = None
        refused = refused_at.get(model)
        # Without an exclusion, a waiter no smaller than one refused just now is
        # refused as well: skip the routing (a long queue stays cheap to scan).
        if waiter.exclude or refused is None or waiter.cost < refused:
            chosen = reserve(waiter, model_loads)
        if chosen is not None:
            waiter.future.set_result(chosen)
            keys.served(waiter)
            del loads[model]  # that engine's load changed
            continue
        passed.append(waiter)
        if not waiter.exclude:
            refused_at[model] = waiter.cost if refused is None else min(refused, waiter.cost)
        if now - waiter.since >= aging_s:
            held.add(model)  # waited long enough: nobody of its model may pass it now
    passed.sort(key=lambda w: w.seq)  # back in arrival order
    queue.extend(passed)


def fair_order(
    queue: Iterable[Waiter],
    in_flight: Callable[[str], int],
    now: float = 0.0,
    aging_s: float = float("inf"),
) -> list[Waiter]:
    """The order in which free slots go to ``queue``'s waiters (issue 35): the key with
    the fewest requests in flight first, counting its requests served before in this
    order, ties by who waited longest; each key's own requests in their arrival order.
    A key's n-th waiter (from 0) ranks as its in-flight count + n: one key's 40 queued
    requests do not keep another key's one waiting behind all of them. Waiters with no
    key are one key with nothing in flight (bare admission: arrival order). Waiters that
    have aged (``aging_s``) come first, in arrival order: a large request that waited
    that long is served before smaller ones of keys with less in flight, or it would
    wait for ever under steady light traffic."""
    seen: collections.Counter[str | None] = collections.Counter()
    ranked = []
    for w in queue:
        base = in_flight(w.key) if w.key is not None else 0
        aged = now - w.since >= aging_s
        ranked.append((not aged, 0 if aged else base + seen[w.key], w.seq, w))
        seen[w.key] += 1
    ranked.sort(key=lambda r: (r[0], r[1], r[2]))
    return [w for _, _, _, w in ranked]
