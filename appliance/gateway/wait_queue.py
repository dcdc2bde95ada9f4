"""The requests waiting for an engine: two queues, interactive before batch, and the
order in which freed slots are handed out.

Owned by :class:`appliance.gateway.admission.Admission`, which decides *whether* a
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

    def holds(self, model: str | None) -> bool:
        """Someone of ``model`` (None: anyone) waits: a newcomer must not pass them."""
        if model is None:
            return len(self) > 0
        return any(w.model == model for q in (self.interactive, self.batch) for w in q)

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
    ) -> None:
        """Hand free slots to the waiters that fit, interactive first; a waiter whose
        key is ``blocked`` is passed by (its key's own release serves it later) and never
        holds the line for its model, however long it waited."""
        held: set[str | None] = set()  # models whose aged waiter holds the line
        keys = _KeysWaiting(self.interactive, self.batch)
        for queue in (self.interactive, self.batch):
            # an aged one holds batch too
            _serve(queue, now, aging_s, held, loads_of, reserve, blocked, keys, in_flight)


class _KeysWaiting:
    """How many waiters of each (model, key) are left in this pass: whether another
    key's request waits for a model, in O(1) as waiters are served."""

    def __init__(self, *queues: collections.deque[Waiter]) -> None:
        self.per_key: collections.Counter[tuple[str | None, str | None]] = collections.Counter()
        self.per_model: collections.Counter[str | None] = collections.Counter()
        for queue in queues:
            for w in queue:
                if not w.future.done():
                    self.per_key[(w.model, w.key)] += 1
                    self.per_model[w.model] += 1

    def others(self, w: Waiter) -> bool:
        return self.per_model[w.model] > self.per_key[(w.model, w.key)]

    def served(self, w: Waiter) -> None:
        self.per_key[(w.model, w.key)] -= 1
        self.per_model[w.model] -= 1


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
        ordered = fair_order(queue, in_flight)
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


def fair_order(queue: Iterable[Waiter], in_flight: Callable[[str], int]) -> list[Waiter]:
    """The order in which free slots go to ``queue``'s waiters (issue 35): the key with
    the fewest requests in flight first, counting its requests served before in this
    order, ties by who waited longest; each key's own requests in their arrival order.
    A key's n-th waiter (from 0) ranks as its in-flight count + n: one key's 40 queued
    requests do not keep another key's one waiting behind all of them. Waiters with no
    key are one key with nothing in flight (bare admission: arrival order)."""
    seen: collections.Counter[str | None] = collections.Counter()
    ranked = []
    for w in queue:
        base = in_flight(w.key) if w.key is not None else 0
        ranked.append((base + seen[w.key], w.seq, w))
        seen[w.key] += 1
    ranked.sort(key=lambda r: (r[0], r[1]))
    return [w for _, _, w in ranked]
