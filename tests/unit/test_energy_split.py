"""Energy per key (issue 37, item 4): the split rule as tables, and the meter over ticks."""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence

import pytest

from appliance.gateway.accounting.energy import (
    MAX_GPU_W,
    Ended,
    EnergyMeter,
    EnergySplit,
    OpenTry,
    Tick,
    counter_delta,
    split_energy,
)

ONE_S = MAX_GPU_W * 1.0  # the most a GPU can use in a 1 s interval


@pytest.mark.parametrize(
    ("before", "after", "max_j", "delta"),
    [
        (1000.0, 1600.0, math.inf, 600.0),
        (1000.0, 1000.0, math.inf, 0.0),
        (1000.0, 250.0, math.inf, 250.0),  # a reset (driver reload): 250 J since, never -750
        (1000.0, 0.0, math.inf, 0.0),
        (None, 1600.0, math.inf, None),  # the first reading only starts the count
        (1000.0, None, math.inf, None),  # unknown now: no figure
        (None, None, math.inf, None),
        (1000.0, 250.0, ONE_S, 250.0),  # a reset to what 1 s could use: plausible
        # A writer's 0.1 J jitter (or GPUs in another order) is no reset of a 5 MJ counter.
        (5_000_000.0, 4_999_999.9, ONE_S, None),
        (5_000_000.0, 5_001_000.0, ONE_S, 1000.0),
        (0.0, 1e308, ONE_S, None),  # a rise no GPU makes in a second
        (1e308, 0.0, ONE_S, 0.0),  # then back: a reset to 0
        (0.0, math.inf, math.inf, None),
        (math.nan, 10.0, math.inf, None),
        (1e308, 1e308, math.inf, 0.0),  # finite both: no overflow to a non-figure
    ],
)
def test_counter_delta(
    before: float | None, after: float | None, max_j: float, delta: float | None
) -> None:
    assert counter_delta(before, after, max_j) == delta


def e(start: float, end: float, key: str, tokens: int) -> Ended:
    return (start, end, key, tokens)


@pytest.mark.parametrize(
    ("case", "ticks", "ended", "expected"),
    [
        (
            "one tick, two keys 3:1",
            [Tick(400.0, 0, 10)],
            [e(1, 2, "a", 300), e(3, 4, "b", 100)],
            EnergySplit({"a": 300.0, "b": 100.0}),
        ),
        (
            "a try over two ticks: its tokens spread over its time",
            [Tick(100.0, 0, 10), Tick(100.0, 10, 20)],
            [e(5, 15, "a", 10), e(12, 13, "b", 5)],
            # tick 1: a alone; tick 2: a 5 tokens, b 5 tokens
            EnergySplit({"a": 150.0, "b": 50.0}),
        ),
        (
            "a long request and short ones: shares by tokens over time",
            [Tick(1500.0, t, t + 1) for t in range(16)],
            [e(0, 16, "attacker", 8000)] + [e(t, t + 0.5, "victim", 20) for t in range(15)],
            # each of the first 15 ticks: attacker 500 tokens, victim 20; the last: attacker
            EnergySplit({"attacker": 15 * 1500 * 500 / 520 + 1500, "victim": 15 * 1500 * 20 / 520}),
        ),
        (
            "a try of no duration: all its tokens in the tick it fell in, (t0, t1]",
            [Tick(100.0, 0, 10), Tick(60.0, 10, 20)],
            [e(10, 10, "a", 5), e(15, 15, "b", 5)],
            EnergySplit({"a": 100.0, "b": 60.0}),
        ),
        (
            "a try at the start of the first tick is before it",
            [Tick(100.0, 0, 10)],
            [e(0, 0, "a", 5)],
            EnergySplit({}, 100.0),
        ),
        (
            "a tick no try overlapped: idle, charged to nobody",
            [Tick(100.0, 0, 10), Tick(70.0, 10, 20)],
            [e(1, 9, "a", 5)],
            EnergySplit({"a": 100.0}, 70.0),
        ),
        (
            "tries outside the ticks (before the count, in a gap) weigh nothing there",
            [Tick(100.0, 10, 20)],
            [e(0, 5, "a", 99), e(21, 30, "b", 99), e(15, 25, "c", 10)],
            EnergySplit({"c": 100.0}),
        ),
        (
            "zero tokens are no share",
            [Tick(10.0, 0, 1)],
            [e(0, 1, "a", 0), e(0, 1, "b", 2)],
            EnergySplit({"b": 10.0}),
        ),
        ("no ticks", [], [e(0, 1, "a", 2)], EnergySplit()),
    ],
)
def test_split_energy(
    case: str, ticks: Sequence[Tick], ended: Sequence[Ended], expected: EnergySplit
) -> None:
    got = split_energy(ticks, ended)
    assert got.per_key == pytest.approx(expected.per_key), case
    assert got.idle_j == pytest.approx(expected.idle_j), case


def test_the_split_never_charges_more_than_the_gpu_used() -> None:
    ticks = [Tick(123.0, 0, 1), Tick(77.0, 1, 2), Tick(10.0, 2, 3)]
    split = split_energy(ticks, [e(0.5, 1.7, "a", 7), e(0.2, 0.3, "b", 3)])
    assert sum(split.per_key.values()) + split.idle_j == pytest.approx(210.0)


ONE_ENGINE: Mapping[int, Collection[int]] = {0: (0,)}


def run(
    meter: EnergyMeter,
    tries: Sequence[tuple[int, str, int, float, float]],
    readings: Sequence[tuple[float, Mapping[int, float | None]]],
    gpus_of: Mapping[int, Collection[int]],
) -> dict[str, float]:
    """Tries (engine, key, tokens, start, end) and readings (at, per GPU) in time order,
    as the daemon sees them; the joules charged per key in all."""
    events: list[tuple[float, int, str, int]] = []  # at, order at the same time, what, which
    for i, (at, _) in enumerate(readings):
        events.append((at, 1, "read", i))
    for i, (_, _, _, start, end) in enumerate(tries):
        events.append((start, 0, "begin", i))
        events.append((end, 2, "end", i))
    opened: dict[int, OpenTry] = {}
    total: dict[str, float] = {}
    for at, _, what, i in sorted(events):
        if what == "begin":
            opened[i] = meter.begin(tries[i][0], at)
        elif what == "end":
            _, key, tokens, _, _ = tries[i]
            meter.end(opened.pop(i), key, tokens, at)
        else:
            for k, j in meter.tick(readings[i][1], gpus_of, at).items():
                total[k] = total.get(k, 0.0) + j
    return total


def test_a_long_request_pays_for_its_time_and_short_ones_beside_it_for_theirs() -> None:
    """The reviewer's probe: a key's 8000-token request runs through 16 ticks of 1500 J
    while another key ends a 20-token request in each of 15 of them. Counted when they
    end, the short ones paid 22500 J and the long one 1500 J; by tokens over time each
    tick is shared 500:20 (the long one's 8000 tokens over 16 s) and the last is its own."""
    meter = EnergyMeter()
    tries = [(0, "attacker", 8000, 0.5, 16.5)]
    tries += [(0, "victim", 20, t + 0.6, t + 0.9) for t in range(1, 16)]
    readings = [(t + 0.5, {0: min(t, 16) * 1500.0}) for t in range(18)]  # then idle
    total = run(meter, tries, readings, ONE_ENGINE)
    assert total == pytest.approx(
        {"attacker": 15 * 1500 * 500 / 520 + 1500, "victim": 15 * 1500 * 20 / 520}
    )
    assert total["victim"] < 1000 < 20_000 < total["attacker"]
    assert meter.pending == {} and meter.ended == {} and meter.open == {}


def test_ticks_wait_for_the_tries_that_overlapped_them_and_no_longer() -> None:
    meter = EnergyMeter()
    meter.tick({0: 0.0}, ONE_ENGINE, 0.0)
    long = meter.begin(0, 0.5)
    assert meter.tick({0: 100.0}, ONE_ENGINE, 1.0) == {}  # waits for the long try
    short = meter.begin(0, 1.2)
    meter.end(short, "b", 10, 1.4)
    assert meter.tick({0: 200.0}, ONE_ENGINE, 2.0) == {}
    assert len(meter.pending[0]) == 2
    meter.end(long, "a", 30, 2.5)  # 15 tokens a second: 15 of them beside b's 10 in (1, 2]
    assert meter.tick({0: 300.0}, ONE_ENGINE, 3.0) == pytest.approx(
        {"a": 100.0 + 100.0 * 15 / 25 + 100.0, "b": 100.0 * 10 / 25}
    )
    assert meter.pending == {} and meter.ended == {}
    # A try that begins after a tick's end does not hold it back.
    later = meter.begin(0, 3.5)
    meter.end(meter.begin(0, 3.6), "b", 5, 3.7)
    assert meter.tick({0: 350.0}, ONE_ENGINE, 4.0) == {}  # later overlaps this one
    meter.end(later, "a", 0, 4.5)  # ended without tokens
    assert meter.tick({0: 400.0}, ONE_ENGINE, 5.0) == pytest.approx({"b": 50.0})
    assert meter.idle_j == pytest.approx(50.0)  # the last tick: nobody's tokens


@pytest.mark.parametrize(
    ("case", "gpus_of", "tries", "readings", "expected"),
    [
        (
            "each GPU's energy stays with its own engine's keys",
            {0: (0,), 1: (1,)},
            [(0, "a", 10, 1, 2), (1, "b", 99, 1, 2)],
            [(0, {0: 0.0, 1: 0.0}), (3, {0: 100.0, 1: 50.0})],
            {"a": 100.0, "b": 50.0},
        ),
        (
            "tensor parallel: the engine's GPUs' energy summed",
            {0: (0, 1)},
            [(0, "a", 1, 1, 2), (0, "b", 3, 1, 2)],
            [(0, {0: 0.0, 1: 0.0}), (3, {0: 100.0, 1: 60.0})],
            {"a": 40.0, "b": 120.0},
        ),
        (
            "a GPU shared by two engines: by their tokens together",
            {0: (0,), 1: (0,)},
            [(0, "a", 10, 1, 2), (1, "a", 20, 1, 2), (1, "b", 60, 1, 2)],
            [(0, {0: 0.0}), (3, {0: 90.0})],
            {"a": 30.0, "b": 60.0},
        ),
        (
            "a TP engine beside another: GPU 1 by both engines' tokens, GPU 0 by one",
            {0: (0, 1), 1: (1,)},
            [(0, "a", 1, 1, 2), (1, "b", 1, 1, 2)],
            [(0, {0: 0.0, 1: 0.0}), (3, {0: 100.0, 1: 100.0})],
            {"a": 150.0, "b": 50.0},
        ),
        (
            "a try on another GPU's engine holds nothing back here",
            {0: (0,), 1: (1,)},
            [(0, "a", 10, 1, 2), (1, "b", 10, 1, 9)],
            [(0, {0: 0.0, 1: 0.0}), (3, {0: 100.0, 1: 100.0})],
            {"a": 100.0},  # b's tick waits for b: no end before the last reading
        ),
        (
            "tokens on an engine whose GPU's energy is unknown: nothing to share",
            {0: (0,), 1: (1,)},
            [(0, "a", 10, 1, 2)],
            [(0, {0: None, 1: 0.0}), (3, {0: None, 1: 100.0})],
            {},
        ),
    ],
)
def test_the_meter_per_gpu(
    case: str,
    gpus_of: Mapping[int, Collection[int]],
    tries: Sequence[tuple[int, str, int, float, float]],
    readings: Sequence[tuple[float, Mapping[int, float | None]]],
    expected: dict[str, float],
) -> None:
    assert run(EnergyMeter(), tries, readings, gpus_of) == pytest.approx(expected), case


def test_the_meter_over_ticks_first_reading_reset_gap() -> None:
    meter = EnergyMeter()

    def one(key: str, tokens: int, at: float) -> None:
        meter.end(meter.begin(0, at), key, tokens, at + 0.1)

    one("a", 30, 0.5)
    # The first reading only starts the count: energy since the driver loaded is not ours.
    assert meter.tick({0: 10_000.0}, ONE_ENGINE, 1.0) == {}
    one("a", 30, 1.5)
    one("b", 10, 1.6)
    assert meter.tick({0: 10_400.0}, ONE_ENGINE, 2.0) == pytest.approx({"a": 300.0, "b": 100.0})
    # A reset: the counter restarted from 0 and reads 80 J, all used since.
    one("b", 1, 2.5)
    assert meter.tick({0: 80.0}, ONE_ENGINE, 3.0) == pytest.approx({"b": 80.0})
    # Unknown for a tick: tokens then are not charged, and the next reading starts afresh.
    one("a", 5, 3.5)
    assert meter.tick({0: None}, ONE_ENGINE, 4.0) == {}
    one("a", 5, 4.5)
    assert meter.tick({0: 5_000.0}, ONE_ENGINE, 5.0) == {}
    one("a", 5, 5.5)
    assert meter.tick({0: 5_050.0}, ONE_ENGINE, 6.0) == pytest.approx({"a": 50.0})
    # No tokens: idle.
    assert meter.tick({0: 5_150.0}, ONE_ENGINE, 7.0) == {}
    assert meter.idle_j == pytest.approx(100.0)


def test_a_small_step_down_is_no_reset_that_charges_the_whole_counter() -> None:
    """A writer's 0.1 J jitter on a 5 MJ counter charged the key 5 MJ as a 'reset'."""
    meter = EnergyMeter()
    meter.tick({0: 5_000_000.0}, ONE_ENGINE, 0.0)
    meter.end(meter.begin(0, 0.2), "victim", 5, 0.4)
    assert meter.tick({0: 4_999_999.9}, ONE_ENGINE, 1.0) == {}  # no figure: no charge
    meter.end(meter.begin(0, 1.2), "victim", 5, 1.4)
    # The count started again from the lower reading.
    assert meter.tick({0: 5_000_099.9}, ONE_ENGINE, 2.0) == pytest.approx({"victim": 100.0})


def test_an_absurd_reading_charges_nothing_and_never_an_infinity() -> None:
    meter = EnergyMeter()
    total: dict[str, float] = {}
    for t, reading in enumerate((0.0, 1e308, 0.0, 1e308, math.inf, 1e308, 10.0)):
        meter.end(meter.begin(0, t + 0.2), "k1", 10, t + 0.4)
        for k, j in meter.tick({0: reading}, ONE_ENGINE, float(t + 1)).items():
            total[k] = total.get(k, 0.0) + j
    # Only a reset to 0 (0 J) and the last step, a reset to 10 J, are figures.
    assert total == pytest.approx({"k1": 10.0})
    assert math.isfinite(meter.idle_j)


def test_pending_ticks_are_capped_the_oldest_going_to_idle_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    meter = EnergyMeter(max_pending=3)
    meter.tick({0: 0.0}, ONE_ENGINE, 0.0)
    stuck = meter.begin(0, 0.5)
    with caplog.at_level(logging.WARNING, "appliance.gateway"):
        for t in range(1, 7):
            meter.tick({0: 10.0 * t}, ONE_ENGINE, float(t))
    assert len(meter.pending[0]) == 3
    assert meter.idle_j == pytest.approx(30.0)
    assert len([r for r in caplog.records if "charged to nobody" in r.message]) == 1
    meter.end(stuck, "a", 60, 6.5)
    # The new tick comes in (the cap drops one more) before the three left are split.
    assert meter.tick({0: 70.0}, ONE_ENGINE, 7.0) == pytest.approx({"a": 30.0})
    assert meter.idle_j == pytest.approx(40.0)
    assert meter.pending == {} and meter.ended == {}


def test_ended_tries_are_forgotten_once_no_tick_can_use_them() -> None:
    meter = EnergyMeter()
    meter.tick({0: 0.0}, ONE_ENGINE, 0.0)
    for i in range(100):
        meter.end(meter.begin(0, 0.1 + i * 0.001), "a", 1, 0.2 + i * 0.001)
    meter.tick({0: 100.0}, ONE_ENGINE, 1.0)
    assert meter.ended == {}
    # No energy telemetry at all (a CPU box): nothing piles up either.
    cpu = EnergyMeter()
    for t in range(5):
        cpu.end(cpu.begin(0, t + 0.1), "a", 1, t + 0.2)
        assert cpu.tick({0: None}, ONE_ENGINE, t + 1.0) == {}
    assert cpu.ended == {} and cpu.pending == {}
    # An engine gone from the list: its tries are dropped.
    gone = EnergyMeter()
    gone.tick({0: 0.0}, ONE_ENGINE, 0.0)
    gone.end(gone.begin(7, 0.1), "a", 1, 0.2)
    gone.tick({0: 1.0}, ONE_ENGINE, 1.0)
    assert gone.ended == {}


def test_a_try_without_a_key_or_tokens_only_stops_holding_ticks_back() -> None:
    meter = EnergyMeter()
    meter.tick({0: 0.0}, ONE_ENGINE, 0.0)
    opened = meter.begin(0, 0.1)
    assert meter.tick({0: 50.0}, ONE_ENGINE, 1.0) == {}
    meter.end(opened, None, 0, 1.5)
    assert meter.tick({0: 100.0}, ONE_ENGINE, 2.0) == {}
    assert meter.idle_j == pytest.approx(100.0)
    assert meter.open == {} and meter.ended == {} and meter.pending == {}
