"""Energy per key (issue 37, item 4): the split rule as tables, and the meter over ticks."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import pytest

from appliance.gateway.accounting.energy import (
    EnergyMeter,
    EnergySplit,
    counter_delta,
    split_energy,
)


@pytest.mark.parametrize(
    ("before", "after", "delta"),
    [
        (1000.0, 1600.0, 600.0),
        (1000.0, 1000.0, 0.0),
        (1000.0, 250.0, 250.0),  # a reset (driver reload): used 250 J since, never -750
        (1000.0, 0.0, 0.0),
        (None, 1600.0, None),  # the first reading only starts the count
        (1000.0, None, None),  # unknown now: no figure
        (None, None, None),
    ],
)
def test_counter_delta(before: float | None, after: float | None, delta: float | None) -> None:
    assert counter_delta(before, after) == delta


ONE_ENGINE: Mapping[int, Collection[int]] = {0: (0,)}
TWO_ENGINES_TWO_GPUS: Mapping[int, Collection[int]] = {0: (0,), 1: (1,)}
TENSOR_PARALLEL: Mapping[int, Collection[int]] = {0: (0, 1)}
SHARED_GPU: Mapping[int, Collection[int]] = {0: (0,), 1: (0,)}  # on-demand models taking turns
MIXED: Mapping[int, Collection[int]] = {0: (0, 1), 1: (1,)}  # a TP engine and one beside it


@pytest.mark.parametrize(
    ("case", "deltas", "tokens", "gpus_of", "busy", "held", "expected"),
    [
        (
            "one GPU, two keys 3:1",
            {0: 400.0},
            {0: {"a": 300, "b": 100}},
            ONE_ENGINE,
            (),
            {},
            EnergySplit({"a": 300.0, "b": 100.0}),
        ),
        (
            "each GPU's energy stays with its own engine's keys",
            {0: 100.0, 1: 50.0},
            {0: {"a": 10}, 1: {"b": 99}},
            TWO_ENGINES_TWO_GPUS,
            (),
            {},
            EnergySplit({"a": 100.0, "b": 50.0}),
        ),
        (
            "tensor parallel: the engine's GPUs' energy summed",
            {0: 100.0, 1: 60.0},
            {0: {"a": 1, "b": 3}},
            TENSOR_PARALLEL,
            (),
            {},
            EnergySplit({"a": 40.0, "b": 120.0}),
        ),
        (
            "a GPU shared by two engines: by their tokens together",
            {0: 90.0},
            {0: {"a": 10}, 1: {"a": 20, "b": 60}},
            SHARED_GPU,
            (),
            {},
            EnergySplit({"a": 30.0, "b": 60.0}),
        ),
        (
            "a TP engine beside another: GPU 1 by both engines' tokens, GPU 0 by one",
            {0: 100.0, 1: 100.0},
            {0: {"a": 1}, 1: {"b": 1}},
            MIXED,
            (),
            {},
            EnergySplit({"a": 150.0, "b": 50.0}),
        ),
        (
            "no tokens, nothing in flight: idle, charged to nobody",
            {0: 500.0},
            {},
            ONE_ENGINE,
            (),
            {},
            EnergySplit({}, {}, 500.0),
        ),
        (
            "no tokens yet, a request in flight: held for the tokens to come",
            {0: 500.0},
            {},
            ONE_ENGINE,
            (0,),
            {},
            EnergySplit({}, {0: 500.0}),
        ),
        (
            "the held energy goes with the next tokens",
            {0: 100.0},
            {0: {"a": 5}},
            ONE_ENGINE,
            (0,),
            {0: 500.0},
            EnergySplit({"a": 600.0}),
        ),
        (
            "held, and the requests ended without tokens: idle",
            {},
            {},
            ONE_ENGINE,
            (),
            {0: 500.0},
            EnergySplit({}, {}, 500.0),
        ),
        (
            "a busy engine on another GPU holds nothing here",
            {0: 100.0, 1: 100.0},
            {},
            TWO_ENGINES_TWO_GPUS,
            (1,),
            {},
            EnergySplit({}, {1: 100.0}, 100.0),
        ),
        (
            "tokens on an engine whose GPU's energy is unknown: nothing to share",
            {1: 100.0},
            {0: {"a": 10}},
            TWO_ENGINES_TWO_GPUS,
            (),
            {},
            EnergySplit({}, {}, 100.0),
        ),
        (
            "a GPU no engine uses: idle",
            {3: 70.0},
            {0: {"a": 10}},
            ONE_ENGINE,
            (),
            {},
            EnergySplit({}, {}, 70.0),
        ),
        (
            "zero tokens do not count as a share",
            {0: 10.0},
            {0: {"a": 0, "b": 2}},
            ONE_ENGINE,
            (),
            {},
            EnergySplit({"b": 10.0}),
        ),
    ],
)
def test_split_energy(
    case: str,
    deltas: Mapping[int, float],
    tokens: Mapping[int, Mapping[str, int]],
    gpus_of: Mapping[int, Collection[int]],
    busy: Collection[int],
    held: Mapping[int, float],
    expected: EnergySplit,
) -> None:
    got = split_energy(deltas, tokens, gpus_of, busy, held)
    assert got.per_key == pytest.approx(expected.per_key), case
    assert got.held == pytest.approx(expected.held), case
    assert got.idle_j == pytest.approx(expected.idle_j), case


def test_the_split_never_charges_more_than_the_gpus_used() -> None:
    deltas = {0: 123.0, 1: 77.0}
    split = split_energy(deltas, {0: {"a": 7, "b": 3}, 1: {"b": 5}}, MIXED)
    assert sum(split.per_key.values()) + split.idle_j == pytest.approx(200.0)


def test_the_meter_over_ticks_first_reading_reset_gap() -> None:
    meter = EnergyMeter()
    gpus = {0: (0,)}
    meter.count(0, "a", 30)
    # The first reading only starts the count: energy since the driver loaded is not ours.
    assert meter.tick({0: 10_000.0}, gpus, ()) == {}
    meter.count(0, "a", 30)
    meter.count(0, "b", 10)
    assert meter.tick({0: 10_400.0}, gpus, ()) == pytest.approx({"a": 300.0, "b": 100.0})
    # A reset: the counter restarted from 0 and reads 80 J, all used since.
    meter.count(0, "b", 1)
    assert meter.tick({0: 80.0}, gpus, ()) == pytest.approx({"b": 80.0})
    # Unknown for a tick: tokens then are not charged, and the next reading starts afresh.
    meter.count(0, "a", 5)
    assert meter.tick({0: None}, gpus, ()) == {}
    meter.count(0, "a", 5)
    assert meter.tick({0: 5_000.0}, gpus, ()) == {}
    meter.count(0, "a", 5)
    assert meter.tick({0: 5_050.0}, gpus, ()) == pytest.approx({"a": 50.0})
    # No tokens, nothing in flight: idle.
    assert meter.tick({0: 5_150.0}, gpus, ()) == {}
    assert meter.idle_j == pytest.approx(100.0)


def test_the_meter_holds_a_long_requests_energy_until_its_tokens_are_counted() -> None:
    meter = EnergyMeter()
    gpus = {0: (0,)}
    meter.tick({0: 0.0}, gpus, ())
    for t in range(1, 30):  # a 30 s stream: tokens counted only when it ends
        assert meter.tick({0: 300.0 * t}, gpus, busy=(0,)) == {}
    meter.count(0, "a", 1000)
    assert meter.tick({0: 9000.0}, gpus, busy=()) == pytest.approx({"a": 9000.0})
    assert meter.idle_j == 0.0


def test_tokens_are_counted_once_per_tick() -> None:
    meter = EnergyMeter()
    meter.tick({0: 0.0}, ONE_ENGINE, ())
    meter.count(0, "a", 10)
    assert meter.tick({0: 100.0}, ONE_ENGINE, ()) == pytest.approx({"a": 100.0})
    meter.count(0, "b", 10)  # only b's tokens in this interval
    assert meter.tick({0: 200.0}, ONE_ENGINE, ()) == pytest.approx({"b": 100.0})
    meter.count(0, "a", 0)  # a try that used nothing is no share
    assert meter.tokens == {}
