"""The map from a stored response's id to the engine, spawn and key that made it.

What a client reads: a request for another key's id or an unknown one is the same 404;
an id whose engine restarted since is a 404 that says so; the map forgets the least
recently used id past its bound; a model that keeps no responses, or another model's
response, is a 400 naming why.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from appliance.gateway.errors import GatewayError
from appliance.gateway.protocols.counts import EventUsage, Usage
from appliance.gateway.relay.stored_responses import (
    REPLAY,
    Holder,
    StoredResponses,
    replays_stream,
)


@dataclass
class Engine:  # what the map reads of an engine's status
    restarts: int = 0
    pid: int | None = 100


ENGINES = {0: Engine(), 1: Engine(pid=200)}


def lookup(engine_id: int) -> Engine | None:
    return ENGINES.get(engine_id)


def held(engine_id: int = 0, key: str = "k1", model: str = "chat") -> Holder:
    e = ENGINES[engine_id]
    return Holder(engine_id, (e.restarts, e.pid), key, model)


def refusal(store: StoredResponses, rid: str, key: str = "k1") -> GatewayError:
    with pytest.raises(GatewayError) as info:
        store.holder(rid, key, lookup)  # type: ignore[arg-type]
    return info.value


def test_the_key_that_made_it_finds_its_engine() -> None:
    store = StoredResponses()
    store.record("resp_a", held(1))
    assert store.holder("resp_a", "k1", lookup).engine_id == 1  # type: ignore[arg-type]


def test_another_keys_id_reads_exactly_as_an_unknown_one() -> None:
    store = StoredResponses()
    store.record("resp_a", held(key="k1"))
    other = refusal(store, "resp_a", key="k2")
    unknown = refusal(store, "resp_a_never", key="k2")
    assert other.status == unknown.status == 404
    assert other.message.replace("resp_a", "X") == unknown.message.replace("resp_a_never", "X")


@pytest.mark.parametrize(
    "change", [{"restarts": 1}, {"pid": 999}, None], ids=["restarted", "new pid", "gone"]
)
def test_an_engine_restarted_since_is_a_404_that_says_so(change: dict[str, int] | None) -> None:
    store = StoredResponses()
    store.record("resp_a", held(0))
    saved = ENGINES[0]
    try:
        if change is None:
            del ENGINES[0]
        else:
            ENGINES[0] = Engine(**{**vars(saved), **change})
        err = refusal(store, "resp_a")
    finally:
        ENGINES[0] = saved
    assert err.status == 404 and "restarted since" in err.message


def test_the_map_is_bounded_and_forgets_the_least_recently_used() -> None:
    store = StoredResponses(limit=2)
    store.record("resp_a", held())
    store.record("resp_b", held())
    store.holder("resp_a", "k1", lookup)  # type: ignore[arg-type]  # a read: recently used
    store.record("resp_c", held())
    assert len(store) == 2
    assert refusal(store, "resp_b").status == 404
    assert store.holder("resp_a", "k1", lookup).engine_id == 0  # type: ignore[arg-type]


def test_a_retry_on_another_engine_overwrites_the_first_try() -> None:
    store = StoredResponses()
    store.record("resp_a", held(0))
    store.record("resp_a", held(1))
    assert store.holder("resp_a", "k1", lookup).engine_id == 1  # type: ignore[arg-type]


def test_continuing_reads_the_model_and_the_store_switch() -> None:
    store = StoredResponses()
    store.record("resp_a", held(1, model="chat"))
    assert store.engine_for(None, "chat", "k1", lookup, (True, True)) is None  # type: ignore[arg-type]
    assert store.engine_for("resp_a", "chat", "k1", lookup, (True, True)) == 1  # type: ignore[arg-type]
    with pytest.raises(GatewayError) as other:
        store.engine_for("resp_a", "big", "k1", lookup, (True, True))  # type: ignore[arg-type]
    assert other.value.status == 400 and other.value.code == "model_mismatch"
    with pytest.raises(GatewayError) as off:
        store.engine_for("resp_a", "chat", "k1", lookup, (False, False))  # type: ignore[arg-type]
    assert off.value.code == "response_store_off"
    assert "engine.responses_store = false" in off.value.message


@pytest.mark.parametrize(
    ("query", "streams"),
    [(None, False), ("false", False), ("true", True), ("True", True), ("1", True), ("", False)],
)
def test_stream_query_read_as_vllm_reads_it(query: str | None, streams: bool) -> None:
    assert replays_stream(query) is streams


def test_a_replay_counts_nothing() -> None:
    got = REPLAY.answer_usage(b'{"usage": {"input_tokens": 5, "output_tokens": 5}}')
    assert got == Usage(0, 0)
    assert REPLAY.reader is not None and REPLAY.reader(b'data: {"usage": null}') == EventUsage(0, 0)
    assert REPLAY.prompt_bound == 0


def test_a_key_past_its_share_forgets_its_own_oldest_first() -> None:
    """Issue 33 item 8: one key storing without end cannot push out another key's."""
    store = StoredResponses(limit=5, per_key=lambda: 2)
    store.record("resp_other", held(key="k2"))
    for i in range(10):
        store.record(f"resp_{i}", held(key="k1"))
    assert store.holder("resp_other", "k2", lookup).engine_id == 0  # type: ignore[arg-type]
    assert store.count("k1") == 2 and store.count("k2") == 1 and len(store) == 3
    assert store.holder("resp_9", "k1", lookup).engine_id == 0  # type: ignore[arg-type]
    assert refusal(store, "resp_7").status == 404  # its own oldest went first


def test_a_read_keeps_an_id_within_its_keys_share() -> None:
    store = StoredResponses(per_key=lambda: 2)
    store.record("resp_a", held())
    store.record("resp_b", held())
    store.holder("resp_a", "k1", lookup)  # type: ignore[arg-type]  # used: kept
    store.record("resp_c", held())
    assert refusal(store, "resp_b").status == 404
    assert store.holder("resp_a", "k1", lookup).engine_id == 0  # type: ignore[arg-type]


def test_the_whole_maps_bound_keeps_each_keys_count_right() -> None:
    store = StoredResponses(limit=2, per_key=lambda: 5)
    store.record("resp_a", held(key="k1"))
    store.record("resp_b", held(key="k2"))
    store.record("resp_c", held(key="k2"))  # the map is full: k1's resp_a goes
    assert store.count("k1") == 0 and store.count("k2") == 2
    store.record("resp_c", held(1, key="k1"))  # a retry for another key moves the id
    assert store.count("k1") == 1 and store.count("k2") == 1
