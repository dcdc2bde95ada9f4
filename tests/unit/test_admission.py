"""Admission and rate limits without HTTP: budgets, queue order, shedding, breaker,
head-of-line passing and aging, and refusing what can never fit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from appliance.config import Config, EngineConfig, GatewayConfig
from appliance.control import EngineStatus
from appliance.endpoint import EngineAddress
from appliance.engine import EngineState
from appliance.gateway.admission.gate import Admission
from appliance.gateway.admission.ratelimit import RateLimiter
from appliance.gateway.admission.wait_queue import Waiter, WaitQueue, fair_order
from appliance.gateway.errors import GatewayError


def make(
    n: int = 2,
    *,
    max_inflight: int = 2,
    tokens: int = 1000,
    max_queue: int = 4,
    queue_timeout_s: float = 1.0,
    states: list[EngineState] | None = None,
    aging_s: float = 10.0,
    max_model_len: int = 16,
    clock: Callable[[], float] = time.monotonic,
    key_token_share: float = 1.0,
) -> tuple[Admission, list[EngineStatus], list[str]]:
    cfg = Config(
        engine=EngineConfig(
            max_inflight=max_inflight, max_inflight_tokens=tokens, max_model_len=max_model_len
        ),
        gateway=GatewayConfig(
            max_queue=max_queue,
            queue_timeout_s=queue_timeout_s,
            queue_aging_s=aging_s,
            key_token_share=key_token_share,
        ),
    )
    snaps = [
        EngineStatus(
            i, None, EngineAddress(port=9000 + i), (states or [EngineState.READY] * n)[i], "k"
        )
        for i in range(n)
    ]
    rejected: list[str] = []
    adm = Admission(
        lambda: cfg, lambda: snaps, lambda: True, on_reject=rejected.append, clock=clock
    )
    return adm, snaps, rejected


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def queued(adm: Admission, cost: int, *, batch: bool = False) -> asyncio.Future[int]:
    """acquire() started and (the engines having no room for it) waiting in the queue."""
    depth = adm.queue_depth
    fut = asyncio.ensure_future(adm.acquire(cost, batch=batch))
    await asyncio.sleep(0)
    assert not fut.done() and adm.queue_depth == depth + 1
    return fut


async def test_spreads_by_outstanding_tokens_and_respects_the_sequence_budget() -> None:
    adm, _, _ = make(max_inflight=1)
    a = await adm.acquire(100)
    b = await adm.acquire(10)
    assert {a, b} == {0, 1}
    waiter = asyncio.ensure_future(adm.acquire(10))
    await asyncio.sleep(0.01)
    assert not waiter.done() and adm.queue_depth == 1
    adm.release(a, 100)
    assert await waiter == a  # the freed slot goes straight to the waiter
    assert adm.queue_depth == 0


async def test_hard_throttled_engine_gets_nothing_new() -> None:
    adm, _, _ = make(max_inflight=4)
    adm.set_throttle(0, 4)
    assert [await adm.acquire(1) for _ in range(4)] == [1, 1, 1, 1]
    assert adm.inflight(0) == 0


async def test_soft_level_halves_the_sequence_budget() -> None:
    adm, _, _ = make(n=1, max_inflight=4, queue_timeout_s=0.05)
    adm.set_throttle(0, 2)  # 50 %
    await adm.acquire(1)
    await adm.acquire(1)
    with pytest.raises(GatewayError) as ei:
        await adm.acquire(1)
    assert ei.value.status == 503 and ei.value.code == "queue_timeout"


async def test_kv_breaker_opens_above_092_and_closes_below_085() -> None:
    adm, _, _ = make(n=1, queue_timeout_s=1.0)
    adm.observe_kv(0, 0.95)
    waiter = asyncio.ensure_future(adm.acquire(1))
    await asyncio.sleep(0.01)
    adm.observe_kv(0, 0.90)  # between the two thresholds: still open
    await asyncio.sleep(0.01)
    assert not waiter.done()
    adm.observe_kv(0, 0.80)
    assert await asyncio.wait_for(waiter, 0.5) == 0


async def test_queue_full_is_503_and_batch_is_shed_before_interactive() -> None:
    adm, _, rejected = make(n=1, max_inflight=1, max_queue=2, queue_timeout_s=2)
    await adm.acquire(1)
    batch = asyncio.ensure_future(adm.acquire(1, batch=True))
    inter1 = asyncio.ensure_future(adm.acquire(1))
    await asyncio.sleep(0.01)
    # Queue at half: a new batch request is shed at once.
    with pytest.raises(GatewayError) as ei:
        await adm.acquire(1, batch=True)
    assert ei.value.code == "shed_batch" and ei.value.retry_after
    # Queue full: an interactive request takes the waiting batch request's place.
    inter2 = asyncio.ensure_future(adm.acquire(1))
    await asyncio.sleep(0.01)
    with pytest.raises(GatewayError) as ei2:
        await batch
    assert ei2.value.code == "shed_batch"
    # Full of interactive requests: the next one is refused.
    with pytest.raises(GatewayError) as ei3:
        await adm.acquire(1)
    assert ei3.value.status == 503 and ei3.value.code == "queue_full"
    adm.release(0, 1)
    assert await inter1 == 0  # arrival order
    adm.release(0, 1)
    assert await inter2 == 0
    assert rejected == ["shed_batch", "shed_batch", "queue_full"]


async def test_interactive_waiters_go_before_batch_waiters() -> None:
    adm, _, _ = make(n=1, max_inflight=1, max_queue=10)
    await adm.acquire(1)
    order: list[str] = []

    async def want(name: str, batch: bool) -> None:
        await adm.acquire(1, batch=batch)
        order.append(name)
        adm.release(0, 1)

    tasks = [
        asyncio.ensure_future(want("b1", True)),
        asyncio.ensure_future(want("i1", False)),
        asyncio.ensure_future(want("i2", False)),
    ]
    await asyncio.sleep(0.01)
    adm.release(0, 1)
    await asyncio.gather(*tasks)
    assert order == ["i1", "i2", "b1"]


async def test_a_cancelled_waiter_gives_nothing_away() -> None:
    adm, _, _ = make(n=1, max_inflight=1)
    await adm.acquire(1)
    waiter = asyncio.ensure_future(adm.acquire(1))
    await asyncio.sleep(0.01)
    waiter.cancel()
    await asyncio.sleep(0.01)
    assert adm.queue_depth == 0
    adm.release(0, 1)
    assert adm.inflight(0) == 0  # the slot was not handed to the departed waiter


async def test_no_engine_at_all_is_503_at_once_and_shutdown_refuses() -> None:
    adm, _, _ = make(states=[EngineState.FAILED, EngineState.FAILED])
    with pytest.raises(GatewayError) as ei:
        await adm.acquire(1)
    assert ei.value.code == "no_engine" and ei.value.status == 503
    cfg = Config()
    closed = Admission(lambda: cfg, lambda: [], lambda: False)
    with pytest.raises(GatewayError) as ei2:
        await closed.acquire(1)
    assert ei2.value.code == "shutting_down"


async def test_exclude_sends_a_retry_elsewhere() -> None:
    adm, _, _ = make()
    assert await adm.acquire(1, exclude=frozenset({0})) == 1


@pytest.mark.parametrize(
    ("rpm", "tpm", "asks", "refused_at", "limit"),
    [
        (2, None, [1, 1, 1], 2, "rpm"),
        (None, 100, [60, 60], 1, "tpm"),
        (None, 100, [500], None, None),  # bigger than a minute's allowance: let through once
        (None, None, [10**9] * 5, None, None),
    ],
)
def test_rate_limiter_buckets(
    rpm: int | None, tpm: int | None, asks: list[int], refused_at: int | None, limit: str | None
) -> None:
    rl = RateLimiter()
    results = [rl.check("k", rpm, tpm, n, now=100.0) for n in asks]
    for i, r in enumerate(results):
        if i == refused_at:
            assert r is not None and r[0] == limit and r[1] > 0
        else:
            assert r is None


def test_rate_limiter_refills_over_time_and_says_when() -> None:
    rl = RateLimiter()
    assert rl.check("k", 60, None, 1, now=0.0) is None
    for _ in range(59):
        rl.check("k", 60, None, 1, now=0.0)
    refused = rl.check("k", 60, None, 1, now=0.0)
    assert refused is not None and refused[1] == pytest.approx(1.0)
    assert rl.check("k", 60, None, 1, now=1.01) is None


# ---- head of line: a big waiter does not hold up small ones, until it has aged ----------


async def test_a_waiter_too_large_for_now_lets_smaller_ones_pass() -> None:
    adm, _, _ = make(n=1, max_inflight=8, tokens=1000)
    assert await adm.acquire(600) == 0  # running
    big = await queued(adm, 500)  # 600 + 500 > 1000: waits for room
    # A small request behind it is not held up although the queue is not empty.
    assert await asyncio.wait_for(adm.acquire(100), 0.5) == 0
    assert await asyncio.wait_for(adm.acquire(300), 0.5) == 0  # exactly fills the budget
    assert not big.done()
    adm.release(0, 600)
    adm.release(0, 300)
    assert await asyncio.wait_for(big, 0.5) == 0  # 100 + 500 fits now
    assert adm.inflight_tokens(0) == 600 and adm.queue_depth == 0


async def test_an_aged_waiter_is_passed_by_nobody_until_it_fits() -> None:
    clock = Clock()
    adm, _, _ = make(n=1, max_inflight=8, tokens=1000, aging_s=5.0, clock=clock)
    await adm.acquire(600)
    big = await queued(adm, 500)
    clock.now += 4.9
    assert await asyncio.wait_for(adm.acquire(100), 0.5) == 0  # not aged yet: passed
    clock.now += 0.1
    small = await queued(adm, 100)  # aged: it would fit, but must not pass
    adm.release(0, 100)  # 600 + 500 still does not fit: everyone keeps waiting
    assert not big.done() and not small.done()
    adm.release(0, 600)
    assert await asyncio.wait_for(big, 0.5) == 0
    assert await asyncio.wait_for(small, 0.5) == 0  # right behind it
    assert adm.inflight_tokens(0) == 600


async def test_zero_aging_keeps_strict_arrival_order() -> None:
    adm, _, _ = make(n=1, max_inflight=8, tokens=1000, aging_s=0)
    await adm.acquire(600)
    big = await queued(adm, 500)
    small = await queued(adm, 100)
    adm.release(0, 600)
    assert [await big, await small] == [0, 0]


async def test_an_aged_interactive_waiter_holds_batch_back_too() -> None:
    clock = Clock()
    adm, _, _ = make(n=1, max_inflight=8, tokens=1000, aging_s=5.0, clock=clock)
    await adm.acquire(600)
    big = await queued(adm, 500)
    # Not aged: a small batch request may use the room the big one cannot.
    assert await asyncio.wait_for(adm.acquire(50, batch=True), 0.5) == 0
    clock.now += 5
    batch = await queued(adm, 50, batch=True)
    adm.release(0, 50)
    assert not batch.done()
    adm.release(0, 600)
    assert await big == 0 and await batch == 0


async def test_interactive_that_fits_is_served_before_batch_behind_a_big_one() -> None:
    adm, _, _ = make(n=1, max_inflight=2, tokens=1000)
    first = await adm.acquire(600)
    await adm.acquire(10)  # both sequence slots taken
    big = await queued(adm, 500)
    batch = await queued(adm, 10, batch=True)
    inter = await queued(adm, 10)
    adm.release(0, 10)  # one slot: the small interactive one gets it, not the batch one
    assert await asyncio.wait_for(inter, 0.5) == 0
    assert not batch.done() and not big.done()
    adm.release(first, 600)
    assert await asyncio.wait_for(big, 0.5) == 0
    adm.release(0, 10)
    assert await asyncio.wait_for(batch, 0.5) == 0


async def test_a_retry_waiting_for_another_engine_does_not_hold_up_the_queue() -> None:
    adm, _, _ = make(n=2, max_inflight=1)
    assert await adm.acquire(10, exclude=frozenset({0})) == 1  # engine 1 now full
    retry = asyncio.ensure_future(adm.acquire(10, exclude=frozenset({0})))
    await asyncio.sleep(0)
    assert not retry.done() and adm.queue_depth == 1
    assert await asyncio.wait_for(adm.acquire(10), 0.5) == 0  # engine 0 is free
    adm.release(1, 10)
    assert await asyncio.wait_for(retry, 0.5) == 1


# ---- what can never fit is refused at once ----------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "max_model_len", "cost", "fits"),
    [
        (1000, 16, 1000, True),  # the whole budget: runs (on an idle engine if need be)
        (1000, 16, 1001, False),
        (1000, 4096, 4096, True),  # one sequence never costs more than max_model_len
        (1000, 4096, 4097, False),
    ],
)
async def test_a_request_no_engine_can_ever_take_is_400_at_once(
    tokens: int, max_model_len: int, cost: int, fits: bool
) -> None:
    adm, _, rejected = make(n=2, tokens=tokens, max_model_len=max_model_len, max_inflight=1)
    await adm.acquire(1)
    await adm.acquire(1)  # every engine busy: a request that fits must wait
    if fits:
        waiter = await queued(adm, cost)
        adm.release(0, 1)
        assert await asyncio.wait_for(waiter, 0.5) == 0  # idle engine: takes it whole
        return
    with pytest.raises(GatewayError) as ei:
        await adm.acquire(cost)
    err = ei.value
    assert err.status == 400 and err.code == "too_many_tokens"
    assert str(cost) in err.message and "fewer tokens" in err.message
    assert rejected == ["too_many_tokens"] and adm.queue_depth == 0


async def test_an_on_demand_request_waits_for_its_model_put_away_while_it_waited() -> None:
    # It came while its model served, but full; the model was then put away for another
    # of its slot (a swap). Past queue_timeout_s it still waits (load_timeout_s, the
    # load_wait_s here), and is served once the model is loaded again.
    adm, snaps, rejected = make(n=1, max_inflight=1, queue_timeout_s=0.1)
    first = await adm.acquire(10, load_wait_s=5.0)
    waiter = asyncio.ensure_future(adm.acquire(10, load_wait_s=5.0))
    await asyncio.sleep(0)
    snaps[0] = replace(snaps[0], state=EngineState.DRAINING)
    await asyncio.sleep(0.3)  # three queue timeouts
    assert not waiter.done() and rejected == []
    adm.release(first, 10)
    snaps[0] = replace(snaps[0], state=EngineState.READY)  # loaded again
    adm.kick()
    assert await asyncio.wait_for(waiter, 1) == 0


async def test_an_on_demand_request_waits_at_most_its_load_wait_then_model_loading() -> None:
    adm, snaps, rejected = make(n=1, max_inflight=1, queue_timeout_s=0.05)
    await adm.acquire(10, load_wait_s=0.2)
    waiter = asyncio.ensure_future(adm.acquire(10, load_wait_s=0.2))
    await asyncio.sleep(0)
    snaps[0] = replace(snaps[0], state=EngineState.EXITED)  # put away, never back
    with pytest.raises(GatewayError) as err:
        await asyncio.wait_for(waiter, 2)
    assert (err.value.status, err.value.code) == (503, "model_loading")
    assert "within 0.2 s (load_timeout_s)" in err.value.message
    assert rejected == ["model_loading"]


async def test_an_on_demand_request_to_a_serving_full_model_times_out_as_any() -> None:
    adm, _, rejected = make(n=1, max_inflight=1, queue_timeout_s=0.1)
    await adm.acquire(10, load_wait_s=5.0)
    with pytest.raises(GatewayError) as err:
        await adm.acquire(10, load_wait_s=5.0)  # the model serves all along: 0.1 s
    assert (err.value.status, err.value.code) == (503, "queue_timeout")
    assert rejected == ["queue_timeout"]


async def test_an_on_demand_model_whose_every_engine_failed_is_refused_at_once() -> None:
    # Its waiters (and new requests) would wait out load_timeout_s for a load that cannot
    # come: every engine FAILED. They get no_engine at once, naming the model; a waiter
    # for a model still being loaded is left waiting.
    adm, snaps, rejected = make(n=1, states=[EngineState.EXITED])
    snaps[0] = replace(snaps[0], model="m")
    waiter = asyncio.ensure_future(adm.acquire(10, model="m", load_wait_s=60.0))
    await asyncio.sleep(0)
    adm.refuse_failed()  # being loaded: it waits on
    await asyncio.sleep(0)
    assert not waiter.done() and adm.queue_depth == 1
    snaps[0] = replace(snaps[0], state=EngineState.FAILED)
    adm.refuse_failed()  # the supervisor's call when an engine changes state
    with pytest.raises(GatewayError) as err:
        await asyncio.wait_for(waiter, 1)
    assert (err.value.status, err.value.code) == (503, "no_engine")
    assert "model 'm'" in err.value.message
    with pytest.raises(GatewayError) as err:
        await asyncio.wait_for(adm.acquire(10, model="m", load_wait_s=60.0), 1)
    assert (err.value.status, err.value.code) == (503, "no_engine")
    assert rejected == ["no_engine", "no_engine"] and adm.queue_depth == 0


# ---- per key: max_inflight and key_token_share (issue 33 item 2, issue 35) -----------------
async def test_a_key_at_its_max_inflight_waits_and_others_pass_it() -> None:
    adm, _, _ = make(n=1, max_inflight=4, max_queue=8)
    first = await adm.acquire(10, key="aaaaaaaa", key_cap=1)
    # Room on the engine, but the key is at its cap: it waits, it is not refused.
    second = asyncio.ensure_future(adm.acquire(10, key="aaaaaaaa", key_cap=1))
    await asyncio.sleep(0)
    assert not second.done() and adm.queue_depth == 1
    # Another key goes past it, to the free slots.
    assert await adm.acquire(10, key="bbbbbbbb") == 0
    assert adm.key_inflight("aaaaaaaa") == 1 and adm.key_inflight("bbbbbbbb") == 1
    adm.release(first, 10, "aaaaaaaa")
    assert await second == 0  # its own release serves it
    assert adm.key_inflight("aaaaaaaa") == 1


async def test_a_capped_waiter_that_aged_does_not_hold_the_line() -> None:
    clock = Clock()
    adm, _, _ = make(n=1, max_inflight=4, max_queue=8, aging_s=0.0, clock=clock)
    await adm.acquire(10, key="aaaaaaaa", key_cap=1)
    capped = asyncio.ensure_future(adm.acquire(10, key="aaaaaaaa", key_cap=1))
    await asyncio.sleep(0)
    clock.now += 60
    assert await adm.acquire(10, key="bbbbbbbb") == 0  # passes the aged capped waiter
    assert not capped.done()
    capped.cancel()


async def test_a_key_over_its_token_share_lets_another_keys_waiter_go_first() -> None:
    adm, _, _ = make(n=1, max_inflight=8, tokens=1000, max_queue=8, key_token_share=0.5)
    a1 = await adm.acquire(600, key="aaaaaaaa")  # nobody waits: it may hold more than half
    b = asyncio.ensure_future(adm.acquire(500, key="bbbbbbbb"))  # does not fit now
    await asyncio.sleep(0)
    # A holds 600 > half of 1000 while B waits: its next request waits too, although it
    # would fit (600 + 200 <= 1000) and is smaller than B's.
    a2 = asyncio.ensure_future(adm.acquire(200, key="aaaaaaaa"))
    await asyncio.sleep(0)
    assert not b.done() and not a2.done() and adm.queue_depth == 2
    adm.release(a1, 600, "aaaaaaaa")
    assert await b == 0
    assert await a2 == 0  # then A's, within its share again


async def test_without_a_share_bound_a_key_passes_the_waiter_it_keeps_out() -> None:
    """The same with key_token_share = 1: the old behaviour, which let one key keep
    another's request waiting as long as it kept sending small ones."""
    adm, _, _ = make(n=1, max_inflight=8, tokens=1000, max_queue=8, key_token_share=1.0)
    await adm.acquire(600, key="aaaaaaaa")
    b = asyncio.ensure_future(adm.acquire(500, key="bbbbbbbb"))
    await asyncio.sleep(0)
    assert await adm.acquire(200, key="aaaaaaaa") == 0
    assert not b.done()
    b.cancel()


async def test_a_key_with_nothing_in_flight_is_never_held_back_by_its_share() -> None:
    adm, _, _ = make(n=1, max_inflight=8, tokens=1000, max_queue=8, key_token_share=0.1)
    a1 = await adm.acquire(800, key="aaaaaaaa")
    b = asyncio.ensure_future(adm.acquire(500, key="bbbbbbbb"))
    c = asyncio.ensure_future(adm.acquire(150, key="cccccccc"))  # more than its share
    await asyncio.sleep(0)
    assert await c == 0  # holds nothing: one request whatever the share
    adm.release(a1, 800, "aaaaaaaa")
    assert await b == 0


# ---- fair share between keys (issue 35 item 2) -------------------------------------------
async def test_a_freed_slot_goes_to_the_waiting_key_with_the_fewest_in_flight() -> None:
    adm, _, _ = make(n=1, max_inflight=4, max_queue=64)
    running = [await adm.acquire(1, key="aaaaaaaa") for _ in range(4)]
    flood = [asyncio.ensure_future(adm.acquire(1, key="aaaaaaaa")) for _ in range(10)]
    await asyncio.sleep(0)
    other = asyncio.ensure_future(adm.acquire(1, key="bbbbbbbb"))  # came last
    await asyncio.sleep(0)
    assert adm.queue_depth == 11
    adm.release(running[0], 1, "aaaaaaaa")
    assert await other == 0  # the next free slot, not behind A's ten
    assert not any(f.done() for f in flood)
    adm.release(running[1], 1, "aaaaaaaa")
    assert await asyncio.wait_for(flood[0], 5) == 0  # then A's, in A's order
    assert not any(f.done() for f in flood[1:])
    for f in flood:
        f.cancel()


@pytest.mark.parametrize(
    ("queued", "in_flight", "served"),
    [
        # (key of each waiter, in arrival order), in flight per key, the order served
        ("AAAB", {}, "ABAA"),  # B's first goes after A's first: both have none running
        ("AAAB", {"A": 4}, "BAAA"),  # A runs four: B first, then A's in A's order
        ("ABAB", {"A": 1, "B": 1}, "ABAB"),  # even: arrival order
        ("BBAA", {"B": 1}, "ABAB"),  # ties go to who waited longest
        ("AAA", {"A": 9}, "AAA"),  # one key: its order
    ],
)
async def test_fair_order(queued: str, in_flight: dict[str, int], served: str) -> None:
    queue = WaitQueue()
    for key in queued:
        queue.add(Waiter(1, None, frozenset(), False, 0.0, None, key))
    got = fair_order(queue.interactive, lambda k: in_flight.get(k, 0))
    assert "".join(str(w.key) for w in got) == served
    assert [w.seq for w in got if w.key == "A"] == sorted(w.seq for w in got if w.key == "A")


# ---- what an adversarial review found in the per-key rules (issue 33 item 2, issue 35) ----
async def test_one_capped_keys_backlog_never_keeps_another_key_from_a_free_slot() -> None:
    adm, _, rejected = make(n=1, max_inflight=8, max_queue=4)
    await adm.acquire(10, key="aaaaaaaa", key_cap=1)
    backlog = [asyncio.ensure_future(adm.acquire(10, key="aaaaaaaa", key_cap=1)) for _ in range(4)]
    await asyncio.sleep(0)
    assert adm.queue_depth == 4  # the queue is full of A's, which cannot run
    # B goes straight to one of the engine's 7 free slots: not queued, not queue_full.
    assert await asyncio.wait_for(adm.acquire(10, key="bbbbbbbb"), 1) == 0
    assert rejected == []
    for f in backlog:
        f.cancel()


async def test_a_full_queue_sheds_the_busiest_keys_newest_for_another_key() -> None:
    adm, _, rejected = make(n=1, max_inflight=1, max_queue=4)
    await adm.acquire(10, key="aaaaaaaa")
    flood = [asyncio.ensure_future(adm.acquire(10, key="aaaaaaaa")) for _ in range(4)]
    await asyncio.sleep(0)
    b = asyncio.ensure_future(adm.acquire(10, key="bbbbbbbb"))
    await asyncio.sleep(0)
    # B waits (the engine is busy) in the place of A's newest, which is refused.
    assert not b.done() and adm.queue_depth == 4
    with pytest.raises(GatewayError) as shed:
        await asyncio.wait_for(flood[-1], 1)
    assert shed.value.code == "queue_full" and "most requests waiting" in shed.value.message
    assert rejected == ["queue_full"]
    # A's next one finds A the busiest again: refused, B keeps its place.
    with pytest.raises(GatewayError):
        await adm.acquire(10, key="aaaaaaaa")
    assert not b.done()
    for f in [*flood[:-1], b]:
        f.cancel()


async def test_two_keys_past_their_share_never_hold_each_other_back() -> None:
    adm, _, _ = make(n=1, max_inflight=8, tokens=1000, max_queue=8, key_token_share=0.5)
    a = await adm.acquire(300, key="aaaaaaaa")
    b = await adm.acquire(300, key="bbbbbbbb")
    x = await adm.acquire(400, key="xxxxxxxx")  # the engine is full
    a2 = asyncio.ensure_future(adm.acquire(250, key="aaaaaaaa"))
    b2 = asyncio.ensure_future(adm.acquire(250, key="bbbbbbbb"))
    await asyncio.sleep(0)
    assert adm.queue_depth == 2
    adm.release(x, 400, "xxxxxxxx")  # 400 free: one of them fits, and is served
    done, _ = await asyncio.wait({a2, b2}, timeout=1, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1
    for f in (a2, b2):
        f.cancel()
    adm.release(a, 300, "aaaaaaaa")
    adm.release(b, 300, "bbbbbbbb")


async def test_a_capped_keys_waiter_does_not_count_against_anothers_share() -> None:
    adm, _, _ = make(n=1, max_inflight=8, tokens=1000, max_queue=8, key_token_share=0.5)
    await adm.acquire(100, key="cccccccc", key_cap=1)
    capped = asyncio.ensure_future(adm.acquire(100, key="cccccccc", key_cap=1))
    await adm.acquire(500, key="aaaaaaaa")
    await asyncio.sleep(0)
    # A holds half, but the only other waiter cannot run: A's next may use the room.
    assert await asyncio.wait_for(adm.acquire(100, key="aaaaaaaa"), 1) == 0
    capped.cancel()


async def test_an_aged_large_waiter_is_served_before_keys_with_less_in_flight() -> None:
    clock = Clock()
    adm, _, _ = make(n=1, max_inflight=16, tokens=100, max_queue=16, aging_s=5.0, clock=clock)
    a = await adm.acquire(10, key="aaaaaaaa")
    x = await adm.acquire(85, key="xxxxxxxx")
    big = asyncio.ensure_future(adm.acquire(60, key="aaaaaaaa"))
    await asyncio.sleep(0)
    clock.now += 10  # it has aged
    small = [asyncio.ensure_future(adm.acquire(5, key=f"k{i:07d}")) for i in range(10)]
    await asyncio.sleep(0)
    adm.release(x, 85, "xxxxxxxx")
    assert await asyncio.wait_for(big, 1) == 0  # first, although A has one in flight
    for f in small:
        f.cancel()
    adm.release(a, 10, "aaaaaaaa")


async def test_a_slot_handed_over_as_the_wait_times_out_is_kept_not_lost() -> None:
    """A release hands a waiter its slot in the same loop turn as its deadline: the
    wait's timeout must take the slot, not raise and leave it held for ever."""
    adm, _, _ = make(n=1, max_inflight=1)
    first = await adm.acquire(10, key="aaaaaaaa")
    waiter = Waiter(10, None, frozenset(), False, 0.0, None, "bbbbbbbb")
    adm._queue.add(waiter)
    adm.release(first, 10, "aaaaaaaa")  # hands it the engine
    assert waiter.future.done()
    assert await adm._wait_in_queue(waiter, 0.0) == 0  # its deadline already past
    adm.release(0, 10, "bbbbbbbb")
    assert adm.key_inflight("bbbbbbbb") == 0
    assert await asyncio.wait_for(adm.acquire(10, key="cccccccc"), 1) == 0
