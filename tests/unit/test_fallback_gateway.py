"""The fallback's gateway side without HTTP: the room each model has (a table built from
admission's snapshot), who may refuse a fallback (header, key), the journal's one line
per change, admission's no-queue first look, and the key field end to end in the store.
The decision itself is tested in test_fallback_policy.py."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from appliance import cli
from appliance.config import Config, parse_config
from appliance.control import EngineStatus
from appliance.endpoint import EngineAddress
from appliance.engine import EngineState
from appliance.gateway.admission.fallback import FallbackRecorder, fallback_allowed, model_room
from appliance.gateway.admission.gate import Admission
from appliance.gateway.keys import KeyRecord, KeyStore
from appliance.gateway.keys.errors import KeySpecError
from appliance.gateway.keys.fields import validate_fallback
from appliance.policy.fallback import ModelRoom, choose_fallback
from appliance.policy.routing import EngineLoad
from appliance.policy.thermal import HARD_LEVEL
from appliance.status import render_table

READY, STARTING = EngineState.READY, EngineState.STARTING


@dataclass(frozen=True)
class Snap:
    id: int
    state: EngineState


def load(i: int, *, accepting: bool = True, inflight: int = 0, max_inflight: int = 2) -> EngineLoad:
    return EngineLoad(i, accepting, inflight, 0, max_inflight, 1000)


@pytest.mark.parametrize(
    ("states", "loads", "levels", "kv", "queued", "expected"),
    [
        # one READY engine with room: it can admit
        ([READY], [load(0)], {}, {}, False, ModelRoom(1, 0, 0, True)),
        # someone of the model waits: a newcomer may not pass them
        ([READY], [load(0)], {}, {}, True, ModelRoom(1, 0, 0, False)),
        # none READY (starting): down
        ([STARTING], [load(0, accepting=False)], {}, {}, False, ModelRoom(0, 0, 0, False)),
        # READY at the hard thermal level: hot, no room
        (
            [READY],
            [load(0, accepting=False)],
            {0: HARD_LEVEL},
            {},
            False,
            ModelRoom(1, 1, 0, False),
        ),
        # a level below the hard one is not "hot"
        ([READY], [load(0)], {0: HARD_LEVEL - 1}, {}, False, ModelRoom(1, 0, 0, True)),
        # behind the KV breaker
        ([READY], [load(0, accepting=False)], {}, {0: True}, False, ModelRoom(1, 0, 1, False)),
        # at its in-flight budget
        ([READY], [load(0, inflight=2)], {}, {}, False, ModelRoom(1, 0, 0, False)),
        # a hot engine that is not READY is not counted as hot
        (
            [READY, STARTING],
            [load(0, inflight=2), load(1, accepting=False)],
            {1: HARD_LEVEL},
            {},
            False,
            ModelRoom(1, 0, 0, False),
        ),
        # two READY: one hot, one with room
        (
            [READY, READY],
            [load(0, accepting=False), load(1)],
            {0: HARD_LEVEL},
            {},
            False,
            ModelRoom(2, 1, 0, True),
        ),
    ],
)
def test_model_room_from_the_snapshot(
    states: list[EngineState],
    loads: list[EngineLoad],
    levels: dict[int, int],
    kv: dict[int, bool],
    queued: bool,
    expected: ModelRoom,
) -> None:
    snaps = [Snap(i, s) for i, s in enumerate(states)]
    assert model_room(snaps, loads, levels, kv, 10, queued) == expected


@pytest.mark.parametrize(
    ("header", "key_allows", "allowed"),
    [
        (None, True, True),
        ("never", True, False),
        (" Never ", True, False),  # case and spaces forgiven
        ("NEVER", True, False),
        ("always", True, True),  # any other value is ignored
        ("", True, True),
        ("no", True, True),
        (None, False, False),  # a --no-fallback key
        ("always", False, False),  # the header cannot override the key
    ],
)
def test_who_may_refuse_a_fallback(header: str | None, key_allows: bool, allowed: bool) -> None:
    assert fallback_allowed(header, key_allows) is allowed


def test_the_journal_says_each_change_of_reason_once(caplog: pytest.LogCaptureFixture) -> None:
    counter = Counter("x_fallbacks", "", ["from", "to", "reason"], registry=CollectorRegistry())
    rec = FallbackRecorder(counter)
    caplog.set_level(logging.INFO, "appliance.gateway")
    for _ in range(3):
        rec.fell_back("chat", "small", "heat")
    rec.served_own("small")  # another model: nothing to say
    rec.fell_back("chat", "small", "kv")
    rec.served_own("chat")
    rec.served_own("chat")
    assert [r.getMessage() for r in caplog.records] == [
        "chat -> small: fallback (heat)",
        "chat -> small: fallback (kv)",
        "chat: serving its own requests again",
    ]
    assert counter.labels("chat", "small", "heat")._value.get() == 3
    assert counter.labels("chat", "small", "kv")._value.get() == 1


def chat_and_small() -> Config:
    return parse_config(
        {
            "engine": {"device": "cpu", "max_inflight": 1, "max_model_len": 100},
            "models": [
                {"name": "chat", "cpu_engines": 1, "fallback": "small"},
                {"name": "small", "cpu_engines": 1, "max_model_len": 50, "max_inflight_tokens": 40},
            ],
        }
    )


def admission(states: tuple[EngineState, EngineState] = (READY, READY)) -> Admission:
    cfg = chat_and_small()
    snaps = [
        EngineStatus(0, None, EngineAddress(port=9000), states[0], "k", model="chat"),
        EngineStatus(1, None, EngineAddress(port=9001), states[1], "k", model="small"),
    ]
    return Admission(lambda: cfg, lambda: snaps, lambda: True)


def test_a_hot_model_falls_back_to_a_cool_one_and_a_full_fallback_does_not() -> None:
    adm = admission()
    adm.set_throttle(0, HARD_LEVEL)
    assert adm.try_acquire(10, None, "chat") is None  # nothing reserved, nothing queued
    assert adm.queue_depth == 0 and adm.inflight(0) == 0
    chat, small = adm.room("chat", 10), adm.room("small", 10)
    assert chat == ModelRoom(1, 1, 0, False) and small.can_admit
    assert choose_fallback(chat, small, allowed=True) == "heat"
    assert adm.try_acquire(10, None, "small") == 1
    # small is now at its budget (max_inflight 1): chat's request queues instead
    assert choose_fallback(chat, adm.room("small", 10), allowed=True) is None


def test_a_model_whose_engine_is_down_falls_back_for_reason_down() -> None:
    adm = admission((EngineState.FAILED, READY))
    assert choose_fallback(adm.room("chat", 10), adm.room("small", 10), allowed=True) == "down"


def test_a_request_the_fallback_could_never_take_is_not_sent_there() -> None:
    adm = admission()
    assert adm.fits(90, "chat")
    assert not adm.fits(90, "small")  # max_model_len 50, max_inflight_tokens below


def test_no_first_look_while_shutting_down() -> None:
    cfg = chat_and_small()
    snaps = [EngineStatus(0, None, EngineAddress(port=9000), READY, "k", model="chat")]
    adm = Admission(lambda: cfg, lambda: snaps, lambda: False)
    assert adm.try_acquire(1, None, "chat") is None


@pytest.mark.parametrize(("value", "expected"), [(None, True), (True, True), (False, False)])
def test_the_key_fallback_field(value: object, expected: bool) -> None:
    assert validate_fallback(value) is expected


@pytest.mark.parametrize("value", ["false", 0, 1, "no", [], {}])
def test_a_bad_fallback_field_is_named(value: object) -> None:
    with pytest.raises(KeySpecError) as err:
        validate_fallback(value)
    assert err.value.field == "fallback"


def loaded(path: Path) -> tuple[KeyRecord, ...]:
    store = KeyStore(path)
    store.load()
    return store.records


def test_a_no_fallback_key_is_kept_in_the_file_and_older_files_allow_it(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    store = KeyStore(path)
    off, _ = store.create(name="no-fb", fallback=False)
    on, _ = store.create(name="default")
    assert (off.fallback, on.fallback) == (False, True)
    doc = json.loads(path.read_text())
    assert [k["fallback"] for k in doc["keys"]] == [False, True]
    reread = {r.name: r.fallback for r in loaded(path)}
    assert reread == {"no-fb": False, "default": True}
    # A file written before the field existed: every key may fall back.
    for k in doc["keys"]:
        del k["fallback"]
    path.write_text(json.dumps(doc))
    assert {r.fallback for r in loaded(path)} == {True}


def test_status_shows_speculation_and_why_a_failed_engine_exited() -> None:
    base = {
        "gpu": None,
        "port": None,
        "inflight": 0,
        "throttle_level": 0,
        "temperature_c": None,
        "kv_cache_usage": None,
        "restarts": 0,
        "last_restart_reason": None,
        "model": "chat",
    }
    engines = [
        {
            **base,
            "id": 0,
            "state": "READY",
            "spec_acceptance_rate": 0.625,
            "spec_mean_accepted_length": 3.5,
            "last_exit": None,
        },
        {
            **base,
            "id": 1,
            "state": "READY",
            "spec_acceptance_rate": None,
            "spec_mean_accepted_length": None,
            "last_exit": "exit 1 (old)",
        },
        {
            **base,
            "id": 2,
            "state": "FAILED",
            "spec_acceptance_rate": None,
            "spec_mean_accepted_length": None,
            "last_exit": "ValueError: unknown speculative method 'nram'",
        },
    ]
    doc = {
        "version": "test",
        "device": "cpu",
        "uptime_s": 5.0,
        "accepting": True,
        "ready": True,
        "queue_depth": 0,
        "engines": engines,
        "gpus": [],
    }
    lines = render_table(doc).splitlines()
    assert "engine 0 speculation (last minute): acceptance 62%, mean accepted length 3.50" in lines
    assert "engine 2 FAILED: ValueError: unknown speculative method 'nram'" in lines
    assert not any(line.startswith("engine 1 ") for line in lines)  # READY: no exit line


def test_keys_create_no_fallback_makes_a_key_that_never_falls_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.json"
    config = tmp_path / "config.toml"
    config.write_text(f'[gateway]\nkeys_file = "{keys}"\n')
    argv = ["keys", "create", "--config", str(config), "--name"]
    assert cli.main([*argv, "strict", "--no-fallback"]) == 0
    assert "no fallback" in capsys.readouterr().err
    assert cli.main([*argv, "usual"]) == 0
    assert {r.name: r.fallback for r in loaded(keys)} == {"strict": False, "usual": True}
