"""Settings that are allowed but unwise: `check-config` names them (still exit 0) and
`serve` logs them at start; plus the gateway's connection-limit keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from appliance.cli import main
from appliance.config import CONFIG_ENV, Config, EngineConfig, config_warnings, parse_config
from appliance.config import load as config_load
from appliance.errors import ConfigError

LAN = {"host": "0.0.0.0", "allow_lan": True}
TLS = {"tls_cert": "/etc/llm-appliance/cert.pem", "tls_key": "/etc/llm-appliance/key.pem"}
COMMAND = ["{python}", "-m", "vllm.entrypoints.openai.api_server", "--uds", "{uds}"]


def warnings_for(raw: dict[str, Any]) -> list[str]:
    return config_warnings(parse_config(raw))


def command_warnings(command: list[str]) -> list[str]:
    # Built directly: which other placeholders a command needs is parse_config's business.
    return config_warnings(Config(engine=EngineConfig(command=command)))


def test_the_defaults_warn_about_nothing() -> None:
    assert warnings_for({}) == []


def test_lan_without_tls_warns_and_says_why_and_what_to_do() -> None:
    (warning,) = warnings_for({"gateway": LAN})
    assert warning.startswith('gateway.host = "0.0.0.0" (allow_lan = true) without tls_cert')
    assert "clear text" in warning
    assert "set gateway.tls_cert and gateway.tls_key" in warning


@pytest.mark.parametrize(
    "gateway",
    [
        {**LAN, **TLS},  # LAN with TLS
        {"host": "127.0.0.1", "allow_lan": True},  # allowed, but nothing leaves the box
        {"host": "::1", "allow_lan": True},
    ],
)
def test_no_warning_when_nothing_crosses_the_network_in_clear(gateway: dict[str, Any]) -> None:
    assert warnings_for({"gateway": gateway}) == []


@pytest.mark.parametrize("arg", ["{api_key}", "--api-key={api_key}", "KEY:{api_key}:x"])
def test_the_api_key_placeholder_in_a_command_warns(arg: str) -> None:
    (warning,) = command_warnings([*COMMAND, "--api-key", arg])
    assert warning.startswith(f'engine.command[6] = "{arg}": {{api_key}} puts the engine key')
    assert "every local user can read" in warning
    assert "VLLM_API_KEY" in warning


def test_a_command_without_the_placeholder_does_not_warn() -> None:
    # A literal brace pair is not the placeholder.
    assert command_warnings([*COMMAND, "--note", "{{api_key}}"]) == []


def test_check_config_prints_warnings_after_the_summary_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_load, "DEFAULT_CONFIG_PATH", tmp_path / "missing.toml")
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    path = tmp_path / "c.toml"
    path.write_text('[gateway]\nhost = "0.0.0.0"\nallow_lan = true\n')
    assert main(["check-config", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    # stdout stays the one-line summary scripts read; the warnings go to stderr.
    assert out.count("\n") == 1 and out.startswith(f"config ok ({path})")
    (line,) = err.splitlines()
    assert line.startswith('llm-appliance: warning: gateway.host = "0.0.0.0" (allow_lan')


def test_connection_limits_have_team_box_defaults() -> None:
    g = parse_config({}).gateway
    assert (g.max_connections, g.header_timeout_s, g.body_timeout_s) == (1024, 10.0, 30.0)
    g = parse_config(
        {"gateway": {"max_connections": 50, "header_timeout_s": 2.5, "body_timeout_s": 60}}
    ).gateway
    assert (g.max_connections, g.header_timeout_s, g.body_timeout_s) == (50, 2.5, 60.0)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_connections", 0, "gateway.max_connections = 0: must be >= 1 and <= 100000"),
        ("max_connections", "many", 'gateway.max_connections = "many": must be an integer'),
        ("header_timeout_s", 0, "gateway.header_timeout_s = 0: must be > 0 and <= 3600"),
        ("body_timeout_s", -1, "gateway.body_timeout_s = -1: must be > 0 and <= 3600"),
        ("body_timeout_s", 1e9, "gateway.body_timeout_s = 1000000000.0: must be > 0 and <= 3600"),
    ],
)
def test_connection_limits_are_bounded(key: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"gateway": {key: value}})
    assert info.value.problems == [message]


# --- heat restarts with a command of one's own (issue 33, item 14) ---------------------------

HEAT = {"heat_restart_after_s": 120}


def test_heat_restarts_with_a_command_that_has_nothing_to_halve_warn() -> None:
    config = parse_config({"engine": {"command": COMMAND}, "thermal": HEAT})
    (warning,) = config_warnings(config)
    assert warning.startswith(
        "engine.command: has no --max-num-batched-tokens argument, so "
        "thermal.heat_restart_after_s = 120 does nothing for its engines"
    )
    assert "or set thermal.heat_restart_after_s = 0" in warning


def test_a_models_own_command_is_named_too() -> None:
    table = {"name": "chat", "command": COMMAND}
    config = parse_config({"engine": {"device": "cpu"}, "models": [table], "thermal": HEAT})
    (warning,) = config_warnings(config)
    assert warning.startswith('models[0] ("chat").command: has no --max-num-batched-tokens')


@pytest.mark.parametrize(
    ("command", "thermal"),
    [
        ([*COMMAND, "--max-num-batched-tokens", "2048"], HEAT),  # a heat restart halves it
        (COMMAND, {"heat_restart_after_s": 0}),  # heat restarts off: nothing to say
        ([], HEAT),  # the appliance's own command line has the flag
    ],
)
def test_no_heat_warning_when_a_heat_restart_can_act_or_is_off(
    command: list[str], thermal: dict[str, Any]
) -> None:
    assert config_warnings(parse_config({"engine": {"command": command}, "thermal": thermal})) == []
