"""Which engine holds each stored response, and whose it is.

vLLM keeps a stored response (Responses API, ``store``) in the memory of the engine that
made it, and nowhere else: a retrieve, a cancel or a ``previous_response_id`` sent to
another engine of the same model gets that engine's 404, and one sent after the engine
restarted gets a 404 about an id it never saw. So the gateway remembers, for each
response id it chose (protocols/responses.py writes the id into the request), the engine
and the spawn of it that made the response, and the key that asked:

- a request naming the id goes to that engine only (no other engine, no fallback, no
  retry elsewhere: each would answer "not found");
- an id this gateway never gave out, or gave out to another key, is 404 "no stored
  response": the same answer for both, so a key cannot learn that another key's id
  exists (ids are 128 random bits, and the key is checked too);
- an engine that restarted since (its spawn differs: its process and restart count)
  lost its stored responses: a 404 that says so, rather than the engine's puzzling one.

The map is bounded (:data:`MAX_KEPT`, least recently made or used goes first), and so
is each key's share of it (``gateway.stored_responses_per_key``): a key that stores past
its share forgets its own least recently made or used first, so one key cannot push
every other key's responses out of the map (issue 33 item 8). It lives in the daemon's
memory: a daemon restart restarts the engines too, so nothing it forgets
could still be read. vLLM's own store is unbounded (``VLLM_ENABLE_RESPONSES_API_STORE``
warns of it) and vLLM 0.32 has no route to delete from it (create, retrieve, cancel
only; a cancel removes nothing): a response this map forgot stays in the engine's memory
until it restarts (docs/security.md says what bounds it: ``responses_store = false``,
the key's tpm, an engine restart).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from appliance.control import EngineStatus
from appliance.gateway.accounting.plan import UsagePlan
from appliance.gateway.errors import GatewayError
from appliance.gateway.protocols.counts import EventUsage, Usage

MAX_KEPT = 100_000  # ids remembered: ~200 bytes each
# A retrieve or cancel runs no model, and the response's tokens were counted when it was
# made: its answer and its replayed events count nothing (every count read is zero).
REPLAY = UsagePlan(
    added=False,
    fields={},
    route="responses",
    stream=False,
    max_model_len=0,
    bound=lambda fields, context: 0,
    reader=lambda payload: EventUsage(0, 0),
    answer=lambda body: Usage(0, 0),
)


def replays_stream(value: str | None) -> bool:
    """Whether a retrieve's ``stream`` query asks for the events (as vLLM's FastAPI reads
    a boolean query parameter)."""
    return value is not None and value.lower() in ("true", "1", "yes", "on")


@dataclass(frozen=True, slots=True)
class Holder:
    """The engine (and which spawn of it) that made a stored response, for whom."""

    engine_id: int
    spawn: tuple[int, int | None]  # (restarts, pid): changes whenever the engine restarts
    key_id: str
    model: str


def spawn_of(engine: EngineStatus) -> tuple[int, int | None]:
    return (engine.restarts, engine.pid)


def not_found(response_id: str, param: str, why: str) -> GatewayError:
    shown = response_id if len(response_id) <= 64 else response_id[:61] + "..."
    return GatewayError(
        404,
        f"no stored response '{shown}': {why}",
        param=param,
        code="response_not_found",
        reason="response_not_found",
    )


def made_by_other_model(response_id: str, held: Holder) -> GatewayError:
    """The 400 for a request that continues a response another model made."""
    return GatewayError(
        400,
        f"the response '{response_id}' was made by the model '{held.model}': send the "
        "request that follows it to that model",
        param="previous_response_id",
        code="model_mismatch",
        reason="bad_request",
    )


def store_off(response_id: str, model: str, tables: bool) -> GatewayError:
    """The 400 for a request that reads a stored response on a model that keeps none."""
    key = f"models.{model}.responses_store" if tables else "engine.responses_store"
    return GatewayError(
        400,
        f"the model '{model}' keeps no stored responses ({key} = false), so "
        f"'{response_id[:64]}' cannot be read: send the whole conversation in 'input' instead",
        param="previous_response_id",
        code="response_store_off",
        reason="bad_request",
    )


class StoredResponses:
    """The bounded map from response id to the :class:`Holder` that made it."""

    def __init__(
        self, limit: int = MAX_KEPT, per_key: Callable[[], int] = lambda: MAX_KEPT
    ) -> None:
        self.limit = limit
        self._per_key = per_key  # read at each record: a reload's value applies at once
        self._held: collections.OrderedDict[str, Holder] = collections.OrderedDict()
        # Each key's ids, least recently made or used first (the same order as _held's).
        self._of_key: dict[str, collections.OrderedDict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def count(self, key_id: str) -> int:
        """The ids the key ``key_id`` has in the map."""
        return len(self._of_key.get(key_id, ()))

    def record(self, response_id: str, holder: Holder) -> None:
        """``holder`` made (or is making) ``response_id``; a retry on another engine
        overwrites the first try's. Past its key's share, that key's least recently made
        or used id goes; past the whole map's bound, anyone's least recent."""
        before = self._held.get(response_id)
        if before is not None and before.key_id != holder.key_id:
            self._drop_from_key(response_id, before.key_id)
        self._held[response_id] = holder
        self._held.move_to_end(response_id)
        mine = self._of_key.setdefault(holder.key_id, collections.OrderedDict())
        mine[response_id] = None
        mine.move_to_end(response_id)
        share = max(1, self._per_key())
        while len(mine) > share:
            oldest, _ = mine.popitem(last=False)
            del self._held[oldest]
        while len(self._held) > self.limit:
            gone, old = self._held.popitem(last=False)
            self._drop_from_key(gone, old.key_id)

    def _drop_from_key(self, response_id: str, key_id: str) -> None:
        ids = self._of_key.get(key_id)
        if ids is None:
            return
        ids.pop(response_id, None)
        if not ids:
            del self._of_key[key_id]

    def engine_for(
        self,
        needs: str | None,
        model: str,
        key_id: str,
        engine: Callable[[int], EngineStatus | None],
        store: tuple[bool, bool],
    ) -> int | None:
        """The engine a request that reads the stored response ``needs`` must go to (None:
        it reads none); a 400 when ``model`` keeps none or another model made it, a 404
        when it is gone. ``store``: (the model keeps responses, the config has tables)."""
        if needs is None:
            return None
        if not store[0]:
            raise store_off(needs, model, store[1])
        held = self.holder(needs, key_id, engine, "previous_response_id")
        if held.model != model:
            raise made_by_other_model(needs, held)
        return held.engine_id

    def holder(
        self,
        response_id: str,
        key_id: str,
        engine: Callable[[int], EngineStatus | None],
        param: str = "response_id",
    ) -> Holder:
        """The holder of ``response_id`` for the key ``key_id`` whose engine still runs
        the spawn that made it; else a 404 saying why (the module's docstring)."""
        held = self._held.get(response_id)
        if held is None or held.key_id != key_id:
            raise not_found(
                response_id,
                param,
                "this server made none with that id for this key (stored responses live "
                "in the engine that made them; store: false keeps none)",
            )
        now = engine(held.engine_id)
        if now is None or spawn_of(now) != held.spawn:
            raise not_found(
                response_id,
                param,
                f"the engine that made it (engine {held.engine_id}) has restarted since, "
                "and stored responses are lost when an engine restarts",
            )
        self._held.move_to_end(response_id)
        mine = self._of_key.get(key_id)
        if mine is not None and response_id in mine:
            mine.move_to_end(response_id)
        return held
