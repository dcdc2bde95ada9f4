"""The usage file: hourly buckets, atomic saves, a corrupt file set aside, the tpm debit."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from prometheus_client import CollectorRegistry

from appliance.gateway.accounting.book import HOUR_S, KEEP_HOURS, UsageBook, read_usage, usage_path
from appliance.gateway.accounting.plan import UsagePlan, plan_usage
from appliance.gateway.accounting.stream_tap import Metering, StreamTap
from appliance.gateway.admission.ratelimit import RateLimiter
from appliance.gateway.protocols.counts import Usage
from appliance.gateway.relay.answers import EngineCall

T0 = 1_700_000_000.0  # a fixed clock


def book(tmp_path: Path) -> UsageBook:
    return UsageBook(usage_path(tmp_path / "keys.json"), CollectorRegistry(), RateLimiter())


def test_counts_survive_a_save_and_load(tmp_path: Path) -> None:
    b = book(tmp_path)
    b.add("k1", 10, 5, now=T0)
    b.add("k1", 1, 2, now=T0 + 2 * HOUR_S)
    b.add("k2", 7, 0, now=T0)
    b.save(now=T0 + 2 * HOUR_S)
    assert b.path == tmp_path / "usage.json"
    assert os.stat(b.path).st_mode & 0o777 == 0o600
    again = book(tmp_path)
    again.load()
    assert again.counts.since(None) == {"k1": (11, 7), "k2": (7, 0)}
    # --since: the hours from the one holding the start on.
    assert again.counts.since(T0 + HOUR_S + 1) == {"k1": (1, 2)}
    assert again.counts.since(T0 - HOUR_S) == {"k1": (11, 7), "k2": (7, 0)}


def test_a_save_replaces_the_file_whole(tmp_path: Path) -> None:
    b = book(tmp_path)
    b.add("k1", 1, 1, now=T0)
    b.save(now=T0)
    b.add("k1", 1, 1, now=T0)
    b.save(now=T0)
    assert [p.name for p in tmp_path.iterdir()] == ["usage.json"]  # no temp file left
    assert json.loads(b.path.read_bytes())["keys"]["k1"]["prompt_tokens"] == 2


def test_old_hours_are_dropped_totals_kept(tmp_path: Path) -> None:
    b = book(tmp_path)
    b.add("k1", 3, 4, now=T0)
    b.save(now=T0 + (KEEP_HOURS + 2) * HOUR_S)
    counts = read_usage(b.path)
    assert counts is not None
    assert counts.hours["k1"] == {}
    assert counts.since(None) == {"k1": (3, 4)}


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"format": 99, "keys": {}}',
        b'{"format":1,"keys":{"k":{"prompt_tokens":-1}}}',
    ],
)
def test_a_corrupt_file_is_set_aside_and_counting_starts_fresh(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "usage.json"
    path.write_bytes(content)
    b = book(tmp_path)
    with caplog.at_level(logging.ERROR, logger="appliance.gateway"):
        b.load()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("usage.json.corrupt-")]
    assert len(aside) == 1 and aside[0].read_bytes() == content
    assert not path.exists()
    assert b.counts.since(None) == {}
    assert any(
        "not a usage file" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records
    )
    b.add("k1", 1, 0, now=T0)
    b.save(now=T0)
    assert read_usage(path) is not None


def test_the_metric_counts_per_key_id_and_kind(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    b = UsageBook(tmp_path / "usage.json", registry, RateLimiter())
    b.add("k1", 10, 5)
    b.add("k1", 1, 0)
    value = registry.get_sample_value
    assert value("appliance_key_tokens_total", {"key": "k1", "kind": "prompt"}) == 11
    assert value("appliance_key_tokens_total", {"key": "k1", "kind": "completion"}) == 5


def test_tpm_debits_the_real_count_not_the_estimate() -> None:
    rl = RateLimiter()
    assert rl.check("k", None, 1000, 900, now=0.0) is None  # estimate 900 of 1000
    assert rl.check("k", None, 1000, 500, now=0.0) is not None
    rl.settle("k", 1000, 900, 100, now=0.0)  # it used 100
    assert rl.check("k", None, 1000, 500, now=0.0) is None
    rl.settle("k", 1000, 500, 1300, now=0.0)  # it used more than estimated: owed
    assert rl.check("k", None, 1000, 1, now=0.0) is not None


def try_of(client: dict[str, object], plan: UsagePlan | None, meter: Metering) -> EngineCall:
    parsed = SimpleNamespace(tpm_charge=600, usage=plan)
    return cast(EngineCall, SimpleNamespace(client=client, parsed=parsed, meter=meter))


def stream_meter(usage: Usage | None, events: int = 0) -> Metering:
    tap = StreamTap(strip=True)
    tap.usage, tap.events = usage, events
    return Metering(status=200, tap=tap)


def test_a_request_tried_on_two_engines_gets_its_charge_back_once(tmp_path: Path) -> None:
    """The first engine died after producing a little (the client saw nothing, the
    request went to another engine): both engines' tokens are debited, the admission
    charge is returned once."""
    rl = RateLimiter()
    b = UsageBook(usage_path(tmp_path / "keys.json"), CollectorRegistry(), rl)
    client: dict[str, object] = {"key": SimpleNamespace(id="k", tpm=1000)}
    assert rl.check("k", None, 1000, 600) is None  # charged 600: 400 left
    b.finish(
        try_of(client, None, stream_meter(Usage(10, 1))), b.begin(0)
    )  # the first engine: 11 used
    b.finish(try_of(client, None, stream_meter(Usage(10, 30))), b.begin(0))  # the retry: 40 used
    assert b.counts.since(None) == {"k": (20, 31)}
    # 1000 - 600 + 600 - 11 - 40 = 949 left (and a few ms of refill); twice back: 1000
    assert rl.check("k", None, 1000, 990) is not None
    assert rl.check("k", None, 1000, 940) is None


DENSE = "a " * 3000  # a token a word for many tokenizers: 1 per 2 characters, not per 4


def chat_plan(stream: bool, n_bound: int = 0, **fields: object) -> UsagePlan:
    body = {"model": "m", "messages": [{"role": "user", "content": DENSE}], **fields}
    return plan_usage("chat", stream, body, 4096, n_bound)


def test_a_whole_answer_cut_off_is_charged_its_bounds(tmp_path: Path) -> None:
    """A client that left before a non-streamed answer (issue 20, item 3a): the key is
    counted, and the tpm debited, the prompt's upper bound and everything it allowed."""
    rl = RateLimiter()
    b = UsageBook(usage_path(tmp_path / "keys.json"), CollectorRegistry(), rl)
    client: dict[str, object] = {"key": SimpleNamespace(id="k", tpm=100_000)}
    plan = chat_plan(False, n_bound=2 * 50)  # max_tokens 50, n 2
    b.finish(try_of(client, plan, Metering()), b.begin(0))  # no head came: cancelled while waiting
    prompt, completion = b.counts.since(None)["k"]
    assert prompt >= 3000 + 2  # at least a token a word, the role's tokens
    assert prompt <= 4096  # never above the context
    assert completion == 100


def test_a_stream_cut_before_its_usage_is_charged_the_bound_and_the_events(
    tmp_path: Path,
) -> None:
    """Issue 20, item 3b: not the 1-per-4-characters estimate (~1,508 here)."""
    b = book(tmp_path)
    client: dict[str, object] = {"key": SimpleNamespace(id="k", tpm=None)}
    b.finish(try_of(client, chat_plan(True, n_bound=50), stream_meter(None, events=8)), b.begin(0))
    assert b.counts.since(None) == {"k": (chat_plan(True).prompt_bound, 8)}
    # "a " is 2 bytes, each of which may be a token: 6,000 and more, capped by the context
    assert chat_plan(True).prompt_bound == 4096


@pytest.mark.parametrize(
    "meter",
    [Metering(failed=True), Metering(status=400), Metering(status=200, answer=Usage(0, 0))],
    ids=["failed before a byte", "engine error", "engine said zero"],
)
def test_a_try_that_did_nothing_counts_nothing_and_gives_the_charge_back(
    tmp_path: Path, meter: Metering
) -> None:
    rl = RateLimiter()
    b = UsageBook(usage_path(tmp_path / "keys.json"), CollectorRegistry(), rl)
    client: dict[str, object] = {"key": SimpleNamespace(id="k", tpm=1000)}
    assert rl.check("k", None, 1000, 600) is None
    b.finish(try_of(client, chat_plan(False, 50), meter), b.begin(0))
    assert b.counts.since(None) == {}
    assert rl.check("k", None, 1000, 990) is None  # the 600 went back


def test_a_request_without_a_key_is_not_counted(tmp_path: Path) -> None:
    b = book(tmp_path)
    b.finish(try_of({}, chat_plan(False, 50), Metering()), b.begin(0))
    assert b.counts.since(None) == {}


def test_a_retry_after_a_failure_before_any_byte_is_charged_once(tmp_path: Path) -> None:
    """The first engine failed before the client saw a byte (counted nothing), the second
    answered: the key pays the second's count once, and the admission charge goes back
    once."""
    rl = RateLimiter()
    b = UsageBook(usage_path(tmp_path / "keys.json"), CollectorRegistry(), rl)
    client: dict[str, object] = {"key": SimpleNamespace(id="k", tpm=1000)}
    assert rl.check("k", None, 1000, 600) is None  # charged 600: 400 left
    b.finish(try_of(client, chat_plan(False, 50), Metering(failed=True)), b.begin(0))
    b.finish(
        try_of(client, chat_plan(False, 50), Metering(status=200, answer=Usage(30, 20))), b.begin(0)
    )
    assert b.counts.since(None) == {"k": (30, 20)}
    assert rl.check("k", None, 1000, 960) is not None  # 950 left, not 1000 nor 350
    assert rl.check("k", None, 1000, 940) is None


# ---- energy per key (issue 37, item 4) ------------------------------------------------------


def test_energy_per_key_is_kept_with_the_tokens_across_a_save_and_load(tmp_path: Path) -> None:
    b = book(tmp_path)
    clock = Clock(b)
    b.add("k1", 10, 5, now=T0)
    b.energy_tick({0: 1000.0}, {0: (0,)}, now=T0)  # the first reading: a start only
    clock.t = 1.0
    b.finish(try_of({"key": SimpleNamespace(id="k1", tpm=None)}, None, answer(30, 10)), b.begin(0))
    b.finish(try_of({"key": SimpleNamespace(id="k2", tpm=None)}, None, answer(5, 5)), b.begin(0))
    clock.t = 2.0
    b.energy_tick({0: 1500.0}, {0: (0,)}, now=T0)  # 500 J by 40:10 tokens
    clock.t = 3.0
    b.finish(try_of({"key": SimpleNamespace(id="k2", tpm=None)}, None, answer(1, 1)), b.begin(0))
    clock.t = 4.0
    b.energy_tick({0: 1700.0}, {0: (0,)}, now=T0 + 2 * HOUR_S)  # 200 J, k2's alone
    b.save(now=T0 + 2 * HOUR_S)
    again = book(tmp_path)
    again.load()
    assert again.counts.energy_since(None) == pytest.approx({"k1": 400.0, "k2": 300.0})
    assert again.counts.energy_since(T0 + HOUR_S) == pytest.approx({"k2": 200.0})
    assert again.counts.since(None) == {"k1": (40, 15), "k2": (6, 6)}
    doc = json.loads(b.path.read_bytes())
    assert doc["keys"]["k1"]["energy_j"] == 400.0
    assert doc["keys"]["k1"]["energy_hours"] == {str(int(T0 // HOUR_S) * HOUR_S): 400.0}


class Clock:
    """The book's monotonic clock, set by the test (the energy split's times)."""

    def __init__(self, b: UsageBook) -> None:
        self.t = 0.0
        b.monotonic = lambda: self.t


def answer(prompt: int, completion: int) -> Metering:
    return Metering(status=200, answer=Usage(prompt, completion))


def test_a_usage_file_from_before_energy_loads_with_no_energy(tmp_path: Path) -> None:
    path = tmp_path / "usage.json"
    path.write_bytes(
        b'{"format":1,"saved_at":1.0,"keys":{"k1":{"prompt_tokens":3,"completion_tokens":4,'
        b'"hours":{"1699999200":[3,4]}}}}'
    )
    b = book(tmp_path)
    b.load()
    assert path.exists()  # read as ours, not set aside
    assert b.counts.since(None) == {"k1": (3, 4)}
    assert b.counts.energy_since(None) == {}
    b.add("k1", 1, 1, now=T0)
    b.save(now=T0)
    assert "energy_j" not in json.loads(path.read_bytes())["keys"]["k1"]  # none charged


@pytest.mark.parametrize(
    "entry",
    [
        b'"energy_j":-1',
        b'"energy_j":"12"',
        b'"energy_j":Infinity',  # what json.dumps wrote for an inf
        b'"energy_j":1,"energy_hours":[1]',
        b'"energy_j":1,"energy_hours":{"x":1}',
        b'"energy_j":1,"energy_hours":{"1699999200":-2}',
        b'"energy_j":1,"energy_hours":{"1699999200":NaN}',
    ],
)
def test_a_bad_energy_field_loses_that_keys_energy_only(
    tmp_path: Path, entry: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """An estimate that cannot be read is no reason to set everyone's token counts aside."""
    path = tmp_path / "usage.json"
    path.write_bytes(
        b'{"format":1,"keys":{"k":{"prompt_tokens":1,"completion_tokens":1,"hours":{},'
        + entry
        + b'},"other":{"prompt_tokens":5,"completion_tokens":6,"hours":{},"energy_j":7}}}'
    )
    b = book(tmp_path)
    with caplog.at_level(logging.WARNING, "appliance.gateway"):
        b.load()
    assert path.exists()  # not set aside
    assert b.counts.since(None) == {"k": (1, 1), "other": (5, 6)}
    assert b.counts.energy_since(None) == {"other": 7.0}
    assert any("key k" in r.getMessage() and "energy" in r.getMessage() for r in caplog.records)


def test_a_huge_energy_reading_never_becomes_an_infinity_in_the_file(tmp_path: Path) -> None:
    """A sensors file's energy_j of 1e308, a reset, 1e308 again: the book summed them to
    inf, wrote `Infinity`, and the next start set the whole usage file aside."""
    b = book(tmp_path)
    clock = Clock(b)
    key = {"key": SimpleNamespace(id="k1", tpm=None)}
    for reading in (0.0, 1e308, 0.0, 1e308, 0.0):
        clock.t += 0.5
        b.finish(try_of(dict(key), None, answer(5, 5)), b.begin(0))
        clock.t += 0.5
        b.energy_tick({0: reading}, {0: (0,)}, now=T0)
    b.counts.add_energy("k1", math.inf, T0)  # nor from anywhere else
    b.counts.add_energy("k1", math.nan, T0)
    b.save(now=T0)
    assert b"Infinity" not in b.path.read_bytes() and b"NaN" not in b.path.read_bytes()
    again = book(tmp_path)
    again.load()
    assert again.path.exists()
    assert again.counts.since(None) == {"k1": (25, 25)}
    assert all(math.isfinite(j) for j in again.counts.energy_since(None).values())


def test_a_try_is_charged_for_the_ticks_it_ran_in(tmp_path: Path) -> None:
    """UsageBook.begin (the relay, before the engine call) and finish (its finally): a try
    that began before a tick and ended after it holds the tick back, then pays for it."""
    b = book(tmp_path)
    clock = Clock(b)
    b.energy_tick({0: 0.0}, {0: (0,)}, now=T0)
    clock.t = 0.5
    opened = b.begin(0)
    clock.t = 1.0
    b.energy_tick({0: 300.0}, {0: (0,)}, now=T0)
    clock.t = 1.5
    b.finish(try_of({"key": SimpleNamespace(id="k2", tpm=None)}, None, answer(5, 5)), b.begin(0))
    assert b.counts.energy_since(None) == {}  # the tick waits for the open try
    clock.t = 2.0
    b.finish(try_of({"key": SimpleNamespace(id="k1", tpm=None)}, None, answer(50, 50)), opened)
    b.energy_tick({0: 300.0}, {0: (0,)}, now=T0)
    assert b.counts.energy_since(None) == pytest.approx({"k1": 300.0})
    assert b.energy.open == {}
