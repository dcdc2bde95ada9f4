"""SIGHUP reload: live keys change in place, restart-only keys are reported, not applied."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest

from appliance import config
from appliance.config import SECTIONS, Config, parse_config
from appliance.reload import LIVE_KEYS, changed_keys, merge_live

ALL_KEYS = [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]

# Baked into an engine's command line, environment or the listening socket, or read
# once when the gateway starts (its keys file, its body limit, its connection limits and
# timers): a reload cannot change these without restarting something.
MUST_NEED_RESTART = {
    "gateway.host",
    "gateway.port",
    "gateway.allow_lan",
    "gateway.tls_cert",
    "gateway.tls_key",
    "gateway.keys_file",
    "gateway.max_body_bytes",
    "gateway.max_connections",
    "gateway.header_timeout_s",
    "gateway.body_timeout_s",
    "engine.python",
    "engine.model",
    "engine.served_model_name",
    "engine.device",
    "engine.gpus",
    "engine.cpu_engines",
    "engine.listen",
    "engine.port_base",
    "engine.max_model_len",
    "engine.max_num_batched_tokens",
    "engine.gpu_memory_utilization",
    "engine.extra_args",
    "engine.env",
    "engine.command",
    "engine.cpu_kvcache_space_gib",
    "engine.structured_outputs_backend",  # on the engine's command line
    "engine.allowed_media_domains",  # likewise, and the gateway reads the same list
    "telemetry.source",
}


def other_value(cls: type[Any], name: str, current: Any) -> Any:
    """A value different from ``current`` of the field's type (no validation needed)."""
    tp = typing.get_type_hints(cls)[name]
    if tp is bool:
        return not current
    if tp is int:
        return current + 1
    if tp is float:
        return current + 0.5
    if tp is str:
        return current + "x"
    if get_origin(tp) is list:
        return [*current, "x"]
    if get_origin(tp) is dict:
        return {**current, "X": "1"}
    if name == "gpus":
        return [0]
    if name == "device":
        return "cpu" if current != "cpu" else "cuda"
    if name == "listen":
        return "tcp" if current != "tcp" else "unix"
    if get_origin(tp) is Literal:
        return next(a for a in get_args(tp) if a != current)
    raise AssertionError(f"no other value for {name}: {tp} {get_args(tp)}")


def with_change(cfg: Config, key: str) -> tuple[Config, Any]:
    section, name = key.split(".")
    sec = getattr(cfg, section)
    new_value = other_value(type(sec), name, getattr(sec, name))
    return dataclasses.replace(cfg, **{section: dataclasses.replace(sec, **{name: new_value})}), (
        new_value
    )


def value_of(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def test_live_keys_are_the_fields_marked_live() -> None:
    """Said once, on the field (``live=True``); reload.py derives nothing of its own and
    config.py needs nothing from reload.py."""
    marked = {
        f"{name}.{f.name}"
        for name, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if f.metadata["live"]
    }
    assert marked == LIVE_KEYS
    assert "appliance.reload" not in Path(config.__file__).read_text(encoding="utf-8")


def test_live_keys_name_real_keys() -> None:
    assert set(LIVE_KEYS) <= set(ALL_KEYS), sorted(set(LIVE_KEYS) - set(ALL_KEYS))


def test_keys_baked_into_engines_or_socket_are_not_live() -> None:
    assert not (MUST_NEED_RESTART & LIVE_KEYS)
    assert set(ALL_KEYS) >= MUST_NEED_RESTART


@pytest.mark.parametrize("key", ALL_KEYS)
def test_one_changed_key_is_applied_or_reported(key: str) -> None:
    old = Config(source="/etc/a.toml")
    new, new_value = with_change(old, key)
    new = dataclasses.replace(new, source="/etc/b.toml")
    assert changed_keys(old, new) == [key]
    merged, live, restart = merge_live(old, new)
    assert merged.source == "/etc/b.toml"
    if key in LIVE_KEYS:
        assert (live, restart) == ([key], [])
        assert value_of(merged, key) == new_value
        assert merged == dataclasses.replace(new, source="/etc/b.toml")
    else:
        assert (live, restart) == ([], [key])
        assert value_of(merged, key) == value_of(old, key)
        assert merged == dataclasses.replace(old, source="/etc/b.toml")


def test_mixed_reload_applies_live_keys_and_lists_the_rest() -> None:
    old = parse_config({})
    new = parse_config(
        {
            "gateway": {"max_queue": 10, "port": 9000},
            "engine": {"max_inflight": 4, "max_model_len": 2048},
            "thermal": {"soft_limit_c": 70, "hard_limit_c": 75},
            "restart": {"max_restarts_per_hour": 2},
        },
        "/etc/llm-appliance/config.toml",
    )
    merged, live, restart = merge_live(old, new)
    assert sorted(live) == [
        "engine.max_inflight",
        "gateway.max_queue",
        "restart.max_restarts_per_hour",
        "thermal.hard_limit_c",
        "thermal.soft_limit_c",
    ]
    assert sorted(restart) == ["engine.max_model_len", "gateway.port"]
    assert merged.gateway.max_queue == 10
    assert merged.engine.max_inflight == 4
    assert (merged.thermal.soft_limit_c, merged.thermal.hard_limit_c) == (70.0, 75.0)
    assert merged.restart.max_restarts_per_hour == 2
    assert merged.gateway.port == 8080  # the listening socket is unchanged
    assert merged.engine.max_model_len == 4096  # the engines run with the old value


def test_unchanged_config_changes_nothing() -> None:
    old = parse_config({"engine": {"device": "cpu"}})
    merged, live, restart = merge_live(old, old)
    assert (merged, live, restart) == (old, [], [])
