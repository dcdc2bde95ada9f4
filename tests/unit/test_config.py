"""Config validation: every key good and bad, cross-checks, loading, and `check-config`.

What is asserted is what an admin reads: each problem names the key path (`section.key`),
the value it saw and what is allowed, and every problem is reported in one go.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

from appliance.cli import main
from appliance.config import (
    CONFIG_ENV,
    SECTIONS,
    Config,
    load_config,
    parse_config,
    resolve_config_path,
)
from appliance.config import load as config_load
from appliance.errors import EXIT_CONFIG, ConfigError

ALL_KEYS = sorted(
    f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)
)


def problems_of(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    return info.value.problems


def one_key(path: str, value: Any, context: dict[str, Any] | None = None) -> dict[str, Any]:
    section, key = path.split(".", 1)
    return {section: {**(context or {}), key: value}}


# ---------------------------------------------------------------------------------------
# Every key: a good value (and what it becomes), and bad values with what must be said.
# ---------------------------------------------------------------------------------------

# (key path, TOML value, parsed value, other keys of the same section it needs)
GOOD: list[tuple[str, Any, Any, dict[str, Any]]] = [
    ("gateway.host", "::1", "::1", {}),
    ("gateway.host", "localhost", "localhost", {}),
    ("gateway.host", "192.168.1.20", "192.168.1.20", {"allow_lan": True}),
    ("gateway.port", 9000, 9000, {}),
    ("gateway.allow_lan", True, True, {}),
    ("gateway.tls_cert", "/etc/llm/cert.pem", "/etc/llm/cert.pem", {"tls_key": "/k.pem"}),
    ("gateway.tls_key", "/etc/llm/key.pem", "/etc/llm/key.pem", {"tls_cert": "/c.pem"}),
    ("gateway.keys_file", "/srv/keys.json", "/srv/keys.json", {}),
    ("gateway.max_body_bytes", 1024, 1024, {}),
    ("gateway.max_tokens_cap", 1, 1, {}),
    ("gateway.max_n", 128, 128, {}),
    ("gateway.max_best_of", 1, 1, {}),
    ("gateway.max_prompts", 1, 1, {}),
    ("gateway.max_answer_bytes", 65536, 65536, {}),
    ("gateway.queue_aging_s", 0, 0.0, {}),
    ("gateway.key_token_share", 1, 1.0, {}),
    ("gateway.stall_timeout_s", 5, 5.0, {}),
    ("gateway.stored_responses_per_key", 1, 1, {}),
    ("gateway.max_queue", 0, 0, {}),
    ("gateway.queue_timeout_s", 5, 5.0, {}),  # an int is fine where a number is wanted
    ("gateway.queue_timeout_s", 0.5, 0.5, {}),
    ("gateway.metrics_public", True, True, {}),
    ("gateway.prefix_routing", False, False, {}),
    ("gateway.max_connections", 100_000, 100_000, {}),
    ("gateway.header_timeout_s", 0.5, 0.5, {}),
    ("gateway.body_timeout_s", 3600, 3600.0, {}),
    ("engine.python", "/opt/venv/bin/python", "/opt/venv/bin/python", {}),
    ("engine.model", "/models/qwen", "/models/qwen", {}),
    ("engine.served_model_name", "chat", "chat", {}),
    ("engine.device", "auto", "auto", {}),
    ("engine.device", "cuda", "cuda", {}),
    ("engine.device", "cpu", "cpu", {}),
    ("engine.gpus", "auto", "auto", {}),
    ("engine.gpus", [0, 1], [0, 1], {}),
    ("engine.gpus", [7, 6, 5, 4, 3, 2, 1, 0], [7, 6, 5, 4, 3, 2, 1, 0], {}),
    ("engine.cpu_engines", 8, 8, {}),
    ("engine.port_base", 9100, 9100, {}),
    ("engine.listen", "tcp", "tcp", {}),
    ("engine.listen", "unix", "unix", {}),
    ("engine.max_model_len", 16, 16, {}),
    ("engine.max_num_batched_tokens", 16384, 16384, {}),
    ("engine.gpu_memory_utilization", 1, 1.0, {}),
    ("engine.gpu_memory_utilization", 0.5, 0.5, {}),
    ("engine.max_inflight", 1, 1, {}),
    ("engine.max_inflight_tokens", 1, 1, {}),
    ("engine.extra_args", ["--seed", "1"], ["--seed", "1"], {}),
    ("engine.env", {"OMP_NUM_THREADS": "4"}, {"OMP_NUM_THREADS": "4"}, {}),
    (
        "engine.command",
        ["{python}", "-m", "srv", "--uds", "{uds}", "--key={api_key}"],
        ["{python}", "-m", "srv", "--uds", "{uds}", "--key={api_key}"],
        {},
    ),
    ("engine.startup_timeout_s", 60, 60.0, {}),
    ("engine.stop_timeout_s", 0.1, 0.1, {}),
    ("engine.cpu_kvcache_space_gib", 4, 4.0, {}),
    ("engine.tool_call_parser", "hermes", "hermes", {}),
    ("engine.tool_call_parser", "", "", {}),
    ("engine.reasoning_parser", "deepseek_r1", "deepseek_r1", {}),
    ("engine.responses_store", False, False, {}),
    ("engine.structured_outputs_backend", "xgrammar", "xgrammar", {}),
    ("engine.scheduling", "fcfs", "fcfs", {}),
    ("engine.allow_prompt_logprobs", True, True, {}),
    (
        "engine.allowed_media_domains",
        ["images.example.com", "10.0.0.5"],
        ["images.example.com", "10.0.0.5"],
        {},
    ),
    ("telemetry.source", "nvml", "nvml", {}),
    ("telemetry.source", "none", "none", {}),
    ("telemetry.source", "file:/run/sensors.json", "file:/run/sensors.json", {}),
    ("telemetry.interval_s", 0.05, 0.05, {}),
    ("thermal.soft_limit_c", 70, 70.0, {}),
    ("thermal.hard_limit_c", 95.5, 95.5, {}),
    ("thermal.hysteresis_c", 0, 0.0, {}),
    ("thermal.governor", "stepped", "stepped", {}),
    ("thermal.governor", "predictive", "predictive", {}),
    ("health.interval_s", 3600, 3600.0, {}),
    ("health.probe_timeout_s", 30, 30.0, {}),
    ("health.failures_to_restart", 1, 1, {}),
    ("restart.backoff_initial_s", 0, 0.0, {}),
    ("restart.backoff_max_s", 600, 600.0, {}),
    ("restart.max_restarts_per_hour", 0, 0, {}),
    ("restart.max_planned_restarts_per_hour", 12, 12, {}),
    ("restart.drain_timeout_s", 0, 0.0, {}),
    ("restart.degradation_restart", False, False, {}),
    ("thermal.power_limit_w", 300, 300, {}),
    ("thermal.heat_restart_after_s", 300, 300.0, {}),
    ("thermal.heat_restore_after_s", 60, 60.0, {}),
    ("degradation.window_s", 120, 120.0, {}),
    ("degradation.max_preemptions_per_min", 5, 5.0, {}),
    ("degradation.hang_s", 10, 10.0, {}),
    ("degradation.leak_kv_usage", 0.95, 0.95, {}),
    ("degradation.leak_hold_s", 20, 20.0, {}),
    ("degradation.slowdown_ratio", 0.5, 0.5, {}),
    ("degradation.rss_growth_ratio", 2, 2.0, {}),
    ("degradation.baseline_warmup_s", 0, 0.0, {}),
]

# (key path, bad TOML value, the value as the message shows it, what the message allows)
BAD: list[Any] = [
    ("gateway.host", 5, "5", "must be a string"),
    ("gateway.port", "8080", '"8080"', "must be an integer"),
    ("gateway.port", True, "true", "must be an integer"),  # bool is not an int
    ("gateway.port", 8080.0, "8080.0", "must be an integer"),
    ("gateway.port", 0, "0", "must be >= 1 and <= 65535"),
    ("gateway.port", 65536, "65536", "must be >= 1 and <= 65535"),
    ("gateway.allow_lan", "yes", '"yes"', "must be true or false"),
    ("gateway.allow_lan", 1, "1", "must be true or false"),
    ("gateway.tls_cert", 1, "1", "must be a string"),
    ("gateway.tls_key", ["k"], "['k']", "must be a string"),
    ("gateway.keys_file", 0, "0", "must be a string"),
    ("gateway.keys_file", "", '""', "must be a file path"),
    ("gateway.max_body_bytes", 1023, "1023", "must be >= 1024"),
    ("gateway.max_body_bytes", "1M", '"1M"', "must be an integer"),
    ("gateway.max_tokens_cap", 0, "0", "must be >= 1"),
    ("gateway.max_connections", 0, "0", "must be >= 1 and <= 100000"),
    ("gateway.header_timeout_s", 0, "0", "must be > 0 and <= 3600"),
    ("gateway.body_timeout_s", 3601, "3601", "must be > 0 and <= 3600"),
    ("gateway.max_tokens_cap", 1.5, "1.5", "must be an integer"),
    ("gateway.max_n", 0, "0", "must be >= 1 and <= 16384"),
    ("gateway.max_n", 16385, "16385", "must be >= 1 and <= 16384"),
    ("gateway.max_best_of", 0, "0", "must be >= 1 and <= 16384"),
    ("gateway.max_prompts", 0, "0", "must be >= 1"),
    ("gateway.max_answer_bytes", 65535, "65535", "must be >= 65536"),
    ("gateway.queue_aging_s", -1, "-1", "must be >= 0"),
    ("gateway.key_token_share", 0, "0", "must be > 0 and <= 1"),
    ("gateway.key_token_share", 1.5, "1.5", "must be > 0 and <= 1"),
    ("gateway.stall_timeout_s", 0, "0", "must be > 0"),
    ("gateway.stored_responses_per_key", 0, "0", "must be >= 1 and <= 100000"),
    ("gateway.max_queue", -1, "-1", "must be >= 0"),
    ("gateway.queue_timeout_s", 0, "0", "must be > 0"),
    ("gateway.queue_timeout_s", "30s", '"30s"', "must be a number"),
    ("gateway.queue_timeout_s", True, "true", "must be a number"),
    ("gateway.queue_timeout_s", math.nan, "nan", "must be a number"),
    ("gateway.queue_timeout_s", math.inf, "inf", "must be a number"),
    ("gateway.metrics_public", "false", '"false"', "must be true or false"),
    ("gateway.prefix_routing", "off", '"off"', "must be true or false"),
    ("engine.python", ["python3"], "['python3']", "must be a string"),
    ("engine.model", 1, "1", "must be a string"),
    ("engine.served_model_name", False, "false", "must be a string"),
    ("engine.device", "gpu", '"gpu"', 'must be one of "auto", "cuda", "cpu"'),
    ("engine.device", "CUDA", '"CUDA"', 'must be one of "auto", "cuda", "cpu"'),
    ("engine.device", 0, "0", 'must be one of "auto", "cuda", "cpu"'),
    ("engine.gpus", "all", '"all"', '"auto" or a list of integers'),
    ("engine.gpus", 0, "0", '"auto" or a list of integers'),
    ("engine.gpus", [0, "1"], "[0, '1']", '"auto" or a list of integers'),
    ("engine.gpus", [True], "[True]", '"auto" or a list of integers'),
    ("engine.gpus", [], "[]", 'must be "auto" or a non-empty list'),
    ("engine.gpus", [0, 0], "[0, 0]", "distinct and 0..63"),
    ("engine.gpus", [-1], "[-1]", "distinct and 0..63"),
    ("engine.gpus", [64], "[64]", "distinct and 0..63"),
    ("engine.gpus", list(range(9)), repr(list(range(9))), "at most 8 GPUs"),
    ("engine.cpu_engines", 0, "0", "must be >= 1 and <= 8"),
    ("engine.cpu_engines", 9, "9", "must be >= 1 and <= 8"),
    ("engine.cpu_engines", True, "true", "must be an integer"),
    ("engine.port_base", 1023, "1023", "must be >= 1024 and <= 65535"),
    ("engine.port_base", 65536, "65536", "must be >= 1024 and <= 65535"),
    ("engine.max_model_len", 15, "15", "must be >= 16"),
    ("engine.max_num_batched_tokens", 0, "0", "must be >= 16"),
    ("engine.gpu_memory_utilization", 0, "0", "must be > 0 and <= 1"),
    pytest.param(
        "engine.gpu_memory_utilization",
        1.1,
        "1.1",
        "must be > 0 and <= 1",
    ),
    ("engine.gpu_memory_utilization", "0.9", '"0.9"', "must be a number"),
    ("engine.max_inflight", 0, "0", "must be >= 1"),
    ("engine.max_inflight_tokens", 0, "0", "must be >= 1"),
    ("engine.max_inflight_tokens", True, "true", "must be an integer"),
    ("engine.extra_args", "--seed 1", '"--seed 1"', "must be a list of strings"),
    ("engine.extra_args", [1], "[1]", "must be a list of strings"),
    ("engine.env", {"A": 1}, "{'A': 1}", "must be a table of string values"),
    ("engine.env", ["A=1"], "['A=1']", "must be a table of string values"),
    ("engine.env", {"1BAD": "x"}, "1BAD", "not a valid environment variable name"),
    ("engine.command", "python -m x", '"python -m x"', "must be a list of strings"),
    (
        "engine.command",
        ["{pyhton}", "{uds}"],
        '"{pyhton}"',
        "unknown placeholder {pyhton}; allowed: ",
    ),
    ("engine.listen", "udp", '"udp"', 'must be one of "unix", "tcp"'),
    ("engine.startup_timeout_s", 0, "0", "must be >= 1"),
    ("engine.stop_timeout_s", 0, "0", "must be >= 0.1"),
    ("engine.cpu_kvcache_space_gib", 0, "0", "must be > 0"),
    ("engine.tool_call_parser", "Hermes", '"Hermes"', "did you mean 'hermes'?"),
    ("engine.reasoning_parser", "r1", '"r1"', "allowed: cohere_command3,"),
    ("engine.responses_store", "yes", '"yes"', "must be true or false"),
    ("engine.structured_outputs_backend", "xgr", '"xgr"', 'one of "guidance", "xgrammar"'),
    ("engine.scheduling", "lifo", '"lifo"', 'one of "priority", "fcfs"'),
    ("engine.allow_prompt_logprobs", 1, "1", "must be true or false"),
    (
        "engine.allowed_media_domains",
        ["https://images.example.com/"],
        '"https://images.example.com/"',
        "give host names only",
    ),
    (
        "engine.allowed_media_domains",
        "images.example.com",
        '"images.example.com"',
        "must be a list of strings",
    ),
    ("telemetry.source", "nvidia", '"nvidia"', '"nvml", "none", "file:/path/sensors.json"'),
    ("telemetry.source", "file:", '"file:"', '"nvml", "none", "file:/path/sensors.json"'),
    ("telemetry.source", "NVML", '"NVML"', '"nvml", "none", "file:/path/sensors.json"'),
    ("telemetry.source", "", '""', '"nvml", "none", "file:/path/sensors.json"'),
    ("telemetry.source", 1, "1", "must be a string"),
    ("telemetry.interval_s", 0.01, "0.01", "must be >= 0.05 and <= 3600"),
    ("telemetry.interval_s", 3601, "3601", "must be >= 0.05 and <= 3600"),
    ("thermal.soft_limit_c", 19, "19", "must be >= 20 and <= 120"),
    ("thermal.soft_limit_c", 121, "121", "must be >= 20 and <= 120"),
    ("thermal.hard_limit_c", 131, "131", "must be >= 20 and <= 130"),
    ("thermal.hard_limit_c", "hot", '"hot"', "must be a number"),
    ("thermal.hysteresis_c", -1, "-1", "must be >= 0 and <= 30"),
    ("thermal.hysteresis_c", 31, "31", "must be >= 0 and <= 30"),
    ("thermal.governor", "pid", '"pid"', 'must be one of "predictive", "stepped"'),
    ("health.interval_s", 0, "0", "must be >= 0.05 and <= 3600"),
    ("health.probe_timeout_s", 0.01, "0.01", "must be >= 0.05 and <= 3600"),
    ("health.failures_to_restart", 0, "0", "must be >= 1 and <= 100"),
    ("health.failures_to_restart", 101, "101", "must be >= 1 and <= 100"),
    ("health.failures_to_restart", 2.0, "2.0", "must be an integer"),
    ("restart.backoff_initial_s", -1, "-1", "must be >= 0"),
    ("restart.backoff_max_s", -0.5, "-0.5", "must be >= 0"),
    ("restart.max_restarts_per_hour", -1, "-1", "must be >= 0"),
    ("restart.max_planned_restarts_per_hour", -1, "-1", "must be >= 0"),
    ("restart.max_restarts_per_hour", 1.5, "1.5", "must be an integer"),
    ("restart.drain_timeout_s", -1, "-1", "must be >= 0"),
    ("restart.degradation_restart", "true", '"true"', "must be true or false"),
    ("thermal.power_limit_w", -1, "-1", "must be >= 0"),
    ("thermal.power_limit_w", 2001, "2001", "<= 2000"),
    ("thermal.power_limit_w", 300.5, "300.5", "an integer"),
    ("thermal.heat_restart_after_s", -1, "-1", "must be >= 0"),
    ("thermal.heat_restore_after_s", 0, "0", "must be >= 1"),
    ("degradation.window_s", 0, "0", "must be >= 1"),
    ("degradation.max_preemptions_per_min", 0, "0", "must be > 0"),
    ("degradation.hang_s", 0.5, "0.5", "must be >= 1"),
    ("degradation.leak_kv_usage", 1.5, "1.5", "must be > 0 and <= 1"),
    ("degradation.leak_hold_s", "30", '"30"', "must be a number"),
    ("degradation.slowdown_ratio", 0, "0", "must be > 0 and <= 1"),
    ("degradation.rss_growth_ratio", 1, "1", "must be > 1"),
    ("degradation.baseline_warmup_s", -1, "-1", "must be >= 0"),
]


def _values(row: Any) -> tuple[Any, ...]:
    return tuple(row.values) if hasattr(row, "values") else tuple(row)


def test_every_key_has_a_good_and_a_bad_row() -> None:
    assert sorted({row[0] for row in GOOD}) == ALL_KEYS
    assert sorted({_values(row)[0] for row in BAD}) == ALL_KEYS


@pytest.mark.parametrize(
    ("path", "value", "parsed", "context"),
    GOOD,
    ids=[f"{r[0]}={r[1]!r}" for r in GOOD],
)
def test_good_value_is_accepted(
    path: str, value: Any, parsed: Any, context: dict[str, Any]
) -> None:
    cfg = parse_config(one_key(path, value, context))
    section, key = path.split(".", 1)
    got = getattr(getattr(cfg, section), key)
    assert got == parsed
    assert type(got) is type(parsed)


@pytest.mark.parametrize(
    ("path", "value", "shown", "allowed"),
    BAD,
    ids=[f"{_values(r)[0]}={_values(r)[1]!r}" for r in BAD],
)
def test_bad_value_names_key_value_and_what_is_allowed(
    path: str, value: Any, shown: str, allowed: str
) -> None:
    problems = problems_of(one_key(path, value))
    assert len(problems) == 1, problems
    (msg,) = problems
    assert msg.startswith(path), msg
    assert shown in msg, msg
    assert allowed in msg, msg


def test_int_is_accepted_where_a_number_is_wanted_but_float_is_not_an_int() -> None:
    cfg = parse_config({"thermal": {"soft_limit_c": 70}, "gateway": {"queue_timeout_s": 10}})
    assert cfg.thermal.soft_limit_c == 70.0 and isinstance(cfg.thermal.soft_limit_c, float)
    assert isinstance(cfg.gateway.queue_timeout_s, float)
    assert problems_of({"gateway": {"port": 8080.5}}) == [
        "gateway.port = 8080.5: must be an integer"
    ]


def test_bool_is_not_accepted_for_any_int_key() -> None:
    int_keys = [
        f"{name}.{f.name}"
        for name, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if f.type in ("int", int)
    ]
    assert len(int_keys) >= 8
    raw: dict[str, Any] = {}
    for path in int_keys:
        section, key = path.split(".")
        raw.setdefault(section, {})[key] = True
    problems = problems_of(raw)
    assert sorted(problems) == sorted(f"{p} = true: must be an integer" for p in int_keys)


def test_huge_toml_integer_for_a_number_key_is_a_config_error() -> None:
    raw = tomllib.loads("[thermal]\nsoft_limit_c = 1" + "0" * 400 + "\n")
    problems = problems_of(raw)
    assert problems and problems[0].startswith("thermal.soft_limit_c")


# ---------------------------------------------------------------------------------------
# Unknown keys and sections: errors, with a did-you-mean.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expect"),
    [
        ({"engine": {"max_infligth": 8}}, ["engine.max_infligth", "did you mean 'max_inflight'"]),
        ({"gateway": {"prot": 8}}, ["gateway.prot", "did you mean 'port'"]),
        ({"restart": {"backof_max_s": 8}}, ["restart.backof_max_s", "'backoff_max_s'"]),
        ({"gatway": {"port": 9000}}, ["[gatway]", "unknown", "did you mean '[gateway]'"]),
        ({"thermals": {}}, ["[thermals]", "did you mean '[thermal]'"]),
        ({"zzz": {}}, ["[zzz]", "unknown", "allowed keys: [gateway], [engine]"]),
    ],
)
def test_unknown_key_or_section_is_an_error_with_a_suggestion(
    raw: dict[str, Any], expect: list[str]
) -> None:
    (msg,) = problems_of(raw)
    for fragment in expect:
        assert fragment in msg


def test_unknown_key_lists_the_allowed_keys() -> None:
    (msg,) = problems_of({"telemetry": {"sauce": "nvml"}})
    assert msg == (
        "telemetry.sauce: unknown key (did you mean 'source'?); allowed keys: source, interval_s"
    )


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (
            {"engine": {"max_tokens_cap": 2048}},
            "engine.max_tokens_cap: unknown key here; it belongs in [gateway] "
            "(gateway.max_tokens_cap)",
        ),
        (
            {"gateway": {"hard_limit_c": 90}},
            "gateway.hard_limit_c: unknown key here; it belongs in [thermal] "
            "(thermal.hard_limit_c)",
        ),
        (
            {"models": [{"name": "chat", "max_tokens_cap": 2048}]},
            'models[0] ("chat").max_tokens_cap: unknown key here; it belongs in [gateway]',
        ),
    ],
)
def test_a_key_of_another_section_says_where_it_belongs(raw: dict[str, Any], said: str) -> None:
    """Not a near-miss of this section's keys (max_tokens_cap is no misspelt
    max_inflight_tokens): the section that has it (issue 33, item 16)."""
    (msg,) = problems_of(raw)
    assert msg.startswith(said), msg
    assert "did you mean" not in msg


def test_section_that_is_not_a_table() -> None:
    assert problems_of({"gateway": 5}) == ["[gateway]: must be a table, got 5"]


def test_every_problem_is_reported_at_once() -> None:
    raw = {
        "gateway": {"port": "x", "allow_lan": 1, "prot": 1},
        "engine": {"device": "gpu", "max_inflight": 0},
        "telemetry": {"source": "file:"},
        "thermal": {"soft_limit_c": 90, "hard_limit_c": 85},
        "restart": {"backoff_initial_s": 10, "backoff_max_s": 5},
        "bogus": {},
    }
    problems = problems_of(raw)
    for fragment in [
        "gateway.port",
        "gateway.allow_lan",
        "gateway.prot",
        "engine.device",
        "engine.max_inflight",
        "telemetry.source",
        "thermal.hard_limit_c",
        "restart.backoff_max_s",
        "[bogus]",
    ]:
        assert sum(fragment in p for p in problems) == 1, (fragment, problems)
    assert len(problems) == 9
    with pytest.raises(ConfigError) as info:
        parse_config(raw, "/etc/x.toml")
    text = str(info.value)
    assert text.startswith("9 config problem(s) in /etc/x.toml:")
    assert all(p in text for p in problems)


# ---------------------------------------------------------------------------------------
# Cross-checks between keys.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "10.0.0.5", "llm.lan"])
def test_non_loopback_host_needs_allow_lan(host: str) -> None:
    (msg,) = problems_of({"gateway": {"host": host}})
    assert msg.startswith(f'gateway.host = "{host}"')
    assert "gateway.allow_lan = true" in msg
    cfg = parse_config({"gateway": {"host": host, "allow_lan": True}})
    assert cfg.gateway.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_host_needs_no_allow_lan(host: str) -> None:
    assert parse_config({"gateway": {"host": host}}).gateway.host == host


@pytest.mark.parametrize(
    ("tls", "ok"),
    [
        ({}, True),
        ({"tls_cert": "/c.pem", "tls_key": "/k.pem"}, True),
        ({"tls_cert": "/c.pem"}, False),
        ({"tls_key": "/k.pem"}, False),
    ],
)
def test_tls_needs_both_files_or_neither(tls: dict[str, str], ok: bool) -> None:
    if ok:
        cfg = parse_config({"gateway": tls})
        assert ("https://" in cfg.summary()) == bool(tls)
    else:
        assert problems_of({"gateway": tls}) == [
            "gateway.tls_cert / gateway.tls_key: set both for HTTPS, or neither"
        ]


@pytest.mark.parametrize(
    ("soft", "hard", "ok"), [(80, 87, True), (80, 80.5, True), (80, 80, False), (86, 85, False)]
)
def test_hard_limit_must_be_above_soft_limit(soft: float, hard: float, ok: bool) -> None:
    raw = {"thermal": {"soft_limit_c": soft, "hard_limit_c": hard}}
    if ok:
        parse_config(raw)
    else:
        (msg,) = problems_of(raw)
        assert msg == (
            f"thermal.hard_limit_c = {hard:g}: must be above thermal.soft_limit_c ({soft:g})"
        )


@pytest.mark.parametrize(
    ("initial", "maximum", "ok"), [(2, 300, True), (5, 5, True), (0, 0, True), (10, 5, False)]
)
def test_backoff_max_not_below_initial(initial: float, maximum: float, ok: bool) -> None:
    raw = {"restart": {"backoff_initial_s": initial, "backoff_max_s": maximum}}
    if ok:
        parse_config(raw)
    else:
        (msg,) = problems_of(raw)
        assert msg.startswith(f"restart.backoff_max_s = {maximum:g}: must be >= ")
        assert f"restart.backoff_initial_s ({initial:g})" in msg


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_gpu_list_is_fine_with_gpu_devices(device: str) -> None:
    assert parse_config({"engine": {"device": device, "gpus": [1]}}).engine.gpus == [1]


def test_gpu_list_with_device_cpu_is_an_error() -> None:
    (msg,) = problems_of({"engine": {"device": "cpu", "gpus": [0]}})
    assert msg.startswith("engine.gpus")
    assert "engine.device" in msg and "engine.cpu_engines" in msg


def test_unknown_placeholder_names_the_argument_and_the_allowed_ones() -> None:
    (msg,) = problems_of({"engine": {"command": ["{python}", "--x", "{modle}", "{uds}"]}})
    assert msg == (
        'engine.command[2] = "{modle}": unknown placeholder {modle}; allowed: '
        "{api_key} {gpu} {model} {port} {python} {served_model_name} {uds}"
    )


def test_every_documented_placeholder_is_accepted() -> None:
    cmd = ["{python}", "{model}", "{uds}", "{port}", "{gpu}", "{api_key}", "{served_model_name}"]
    assert parse_config({"engine": {"command": cmd}}).engine.command == cmd


@pytest.mark.parametrize(
    ("listen", "command", "missing"),
    [
        ("unix", ["srv", "--port", "{port}"], "{uds}"),
        ("tcp", ["srv", "--uds", "{uds}"], "{port}"),
    ],
)
def test_a_command_must_say_where_to_listen(listen: str, command: list[str], missing: str) -> None:
    (msg,) = problems_of({"engine": {"listen": listen, "command": command}})
    assert msg.startswith(f"engine.command: has no {missing} placeholder"), msg
    assert f'engine.listen = "{listen}"' in msg


def test_escaped_braces_in_command_are_not_placeholders() -> None:
    parse_config(
        {"engine": {"command": ["{python}", "--uds={uds}", "--compilation-config", '{{"l": 0}}']}}
    )


@pytest.mark.parametrize(
    ("engine", "ok"),
    [
        ({"device": "cpu", "cpu_engines": 1, "port_base": 65535}, True),
        ({"device": "cpu", "cpu_engines": 2, "port_base": 65535}, False),
        ({"device": "cpu", "cpu_engines": 8, "port_base": 65528}, True),
        ({"device": "cpu", "cpu_engines": 8, "port_base": 65529}, False),
        ({"gpus": [0, 1], "port_base": 65534}, True),
        ({"gpus": [0, 1], "port_base": 65535}, False),
        ({"gpus": "auto", "port_base": 65528}, True),  # room for up to 8 GPUs
        ({"gpus": "auto", "port_base": 65530}, False),
    ],
)
def test_engine_ports_must_stay_below_65536(engine: dict[str, Any], ok: bool) -> None:
    if ok:
        parse_config({"engine": engine})
    else:
        (msg,) = problems_of({"engine": engine})
        assert msg == (f"engine.port_base = {engine['port_base']}: engine ports would pass 65535")


@pytest.mark.parametrize(
    ("gateway_port", "engine", "clash"),
    [
        (8100, {}, True),
        (8107, {}, True),  # gpus = "auto" reserves 8 ports
        (8108, {}, False),
        (8099, {}, False),
        (8101, {"gpus": [0, 1]}, True),
        (8102, {"gpus": [0, 1]}, False),
        (8100, {"device": "cpu"}, True),
        (8101, {"device": "cpu"}, False),
        (9001, {"device": "cpu", "cpu_engines": 3, "port_base": 8999}, True),
    ],
)
def test_gateway_port_must_not_collide_with_engine_ports(
    gateway_port: int, engine: dict[str, Any], clash: bool
) -> None:
    # Engine ports exist only with listen = "tcp"; on Unix sockets nothing can clash.
    parse_config({"gateway": {"port": gateway_port}, "engine": engine})
    raw = {"gateway": {"port": gateway_port}, "engine": {**engine, "listen": "tcp"}}
    if clash:
        (msg,) = problems_of(raw)
        assert msg.startswith(f"gateway.port = {gateway_port}: collides with engine ports")
        assert "engine.port_base" in msg
    else:
        parse_config(raw)


# ---------------------------------------------------------------------------------------
# Defaults: the contract's TOML block parses to exactly the built-in defaults.
# ---------------------------------------------------------------------------------------

CONTRACT_DEFAULTS = """
[gateway]
host = "127.0.0.1"            # non-loopback needs allow_lan = true (and should use tls)
port = 8080
allow_lan = false
tls_cert = ""                 # both set: HTTPS
tls_key = ""
keys_file = "/var/lib/llm-appliance/keys.json"
max_body_bytes = 1048576
max_tokens_cap = 4096         # larger max_tokens is clamped or refused (your choice, documented)
max_queue = 256               # waiting requests beyond this: 503 + Retry-After
queue_timeout_s = 30
metrics_public = false        # false: /metrics needs a key with scope metrics or admin

[engine]
python = ""                   # engine venv's python; "" = the one set-up made
model = ""                    # "" = packaged SmolLM2; else a local path or model id
served_model_name = ""        # "" = derived from the model
device = "auto"               # auto | cuda | cpu
gpus = "auto"                 # "auto" or a list like [0, 1]; one engine per GPU
cpu_engines = 1               # device = cpu: engines, cores split between them
listen = "unix"               # unix | tcp (tcp: 127.0.0.1:port_base+i, checked)
port_base = 8100
max_model_len = 4096
max_num_batched_tokens = 8192
gpu_memory_utilization = 0.90
max_inflight = 64             # requests admitted to one engine at once; more wait in
                              # the gateway's queue (the thermal governor lowers it)
extra_args = []               # appended to the vLLM command line
env = {}                      # added to each engine's environment
command = []                  # replaces the whole engine command; placeholders
                              # {python} {model} {port} {gpu} {api_key} {served_model_name}
startup_timeout_s = 900

[telemetry]
source = "nvml"               # nvml | none | "file:/path/sensors.json"
interval_s = 1.0

[thermal]
soft_limit_c = 80             # above: admit less to that GPU, step by step
hard_limit_c = 87             # above: admit nothing new to that GPU
hysteresis_c = 5

[health]
interval_s = 2.0
probe_timeout_s = 10          # a real 1-token completion must answer within this

[restart]
backoff_initial_s = 2
backoff_max_s = 300
max_restarts_per_hour = 6
drain_timeout_s = 120
degradation_restart = true
"""

CONTRACT_RAW = tomllib.loads(CONTRACT_DEFAULTS)
CONTRACT_KEYS = [(s, k) for s, table in CONTRACT_RAW.items() for k in table]


@pytest.mark.parametrize(
    ("section", "key"), CONTRACT_KEYS, ids=[f"{s}.{k}" for s, k in CONTRACT_KEYS]
)
def test_contract_default_equals_builtin_default(section: str, key: str) -> None:
    parsed = parse_config(CONTRACT_RAW)
    builtin = Config()
    assert getattr(getattr(parsed, section), key) == getattr(getattr(builtin, section), key)
    assert getattr(getattr(builtin, section), key) == CONTRACT_RAW[section][key]


def test_contract_defaults_block_parses_to_config() -> None:
    assert parse_config(CONTRACT_RAW) == Config()
    assert parse_config({}) == Config()


# ---------------------------------------------------------------------------------------
# Loading: --config, $LLM_APPLIANCE_CONFIG, the default path.
# ---------------------------------------------------------------------------------------


@pytest.fixture
def no_system_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the built-in default path somewhere empty; clear the env var."""
    missing = tmp_path / "etc" / "config.toml"
    monkeypatch.setattr(config_load, "DEFAULT_CONFIG_PATH", missing)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    return missing


@pytest.mark.parametrize(
    ("explicit", "env", "expect"),
    [
        ("/a.toml", {CONFIG_ENV: "/b.toml"}, ("/a.toml", True)),
        (None, {CONFIG_ENV: "/b.toml"}, ("/b.toml", False)),
        (None, {}, ("DEFAULT", False)),
        (None, {CONFIG_ENV: ""}, ("DEFAULT", False)),
    ],
)
def test_resolve_config_path_order(
    explicit: str | None, env: dict[str, str], expect: tuple[str, bool], no_system_config: Path
) -> None:
    path, must_exist = resolve_config_path(explicit, env)
    want = no_system_config if expect[0] == "DEFAULT" else Path(expect[0])
    assert (path, must_exist) == (want, expect[1])


def test_explicit_config_that_is_missing_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(str(missing), env={})
    assert info.value.problems == [f"--config {missing}: no such file"]
    assert info.value.exit_code == EXIT_CONFIG


def test_env_config_that_is_missing_means_defaults(tmp_path: Path) -> None:
    cfg = load_config(None, env={CONFIG_ENV: str(tmp_path / "nope.toml")})
    assert cfg == Config()


def test_no_config_anywhere_means_defaults(no_system_config: Path) -> None:
    assert load_config(None, env={}) == Config()
    assert Config().summary().startswith("config ok (built-in defaults)")


def test_default_path_is_read_when_present(no_system_config: Path) -> None:
    no_system_config.parent.mkdir(parents=True)
    no_system_config.write_text("[gateway]\nport = 9999\n")
    cfg = load_config(None, env={})
    assert cfg.gateway.port == 9999
    assert cfg.source == str(no_system_config)


@pytest.mark.parametrize("how", ["explicit", "env"])
def test_config_file_is_loaded_and_named_as_source(tmp_path: Path, how: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[engine]\ndevice = "cpu"\ncpu_engines = 2\n')
    if how == "explicit":
        cfg = load_config(str(path), env={CONFIG_ENV: "/does/not/matter.toml"})
    else:
        cfg = load_config(None, env={CONFIG_ENV: str(path)})
    assert (cfg.engine.device, cfg.engine.cpu_engines, cfg.source) == ("cpu", 2, str(path))


def test_invalid_toml_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[gateway\nport = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), env={})
    (msg,) = info.value.problems
    assert msg.startswith(f"{path}: not valid TOML")
    assert str(path) in str(info.value)


def test_unreadable_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path), env={})  # a directory
    assert "cannot be read" in info.value.problems[0]


def test_bad_values_in_a_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[gateway]\nport = 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), env={})
    assert info.value.source == str(path)
    assert f"in {path}" in str(info.value)


# ---------------------------------------------------------------------------------------
# `llm-appliance check-config`.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["after", "before"])
def test_check_config_ok_prints_one_line_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, no_system_config: Path
) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[engine]\ndevice = "cpu"\ncpu_engines = 2\n[gateway]\nport = 9000\n')
    args = (
        ["check-config", "--config", str(path)]
        if where == "after"
        else ["--config", str(path), "check-config"]
    )
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1
    assert out.startswith(f"config ok ({path}): device=cpu 2 cpu engine(s)")
    assert "gateway=http://127.0.0.1:9000" in out
    assert err == ""


def test_check_config_with_no_config_uses_defaults(
    capsys: pytest.CaptureFixture[str], no_system_config: Path
) -> None:
    assert main(["check-config"]) == 0
    out = capsys.readouterr().out
    assert out == Config().summary() + "\n"
    assert "gpus=auto" in out and "gateway=http://127.0.0.1:8080" in out


def test_check_config_bad_exits_2_naming_every_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_system_config: Path
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        '[gateway]\nport = "80"\nhost = "0.0.0.0"\n'
        '[engine]\ndevice = "gpu"\nmax_infligth = 3\n'
        "[thermal]\nhysteresis_c = 99\n"
    )
    assert main(["check-config", "--config", str(path)]) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == ""
    for fragment in [
        'gateway.port = "80": must be an integer',
        'gateway.host = "0.0.0.0": a non-loopback address needs gateway.allow_lan = true',
        'engine.device = "gpu": must be one of "auto", "cuda", "cpu"',
        "engine.max_infligth: unknown key (did you mean 'max_inflight'?)",
        "thermal.hysteresis_c = 99: must be >= 0 and <= 30",
    ]:
        assert fragment in err
    assert "5 config problem(s)" in err
    assert "Traceback" not in err


def test_check_config_missing_explicit_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.toml"
    assert main(["check-config", "--config", str(missing)]) == EXIT_CONFIG
    assert f"--config {missing}: no such file" in capsys.readouterr().err


def test_check_config_reads_env_var(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_system_config: Path,
) -> None:
    path = tmp_path / "env.toml"
    path.write_text("[telemetry]\nsource = 'sensors'\n")
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert main(["check-config"]) == EXIT_CONFIG
    assert 'telemetry.source = "sensors"' in capsys.readouterr().err


def test_check_config_invalid_toml_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("port = = 1\n")
    assert main(["check-config", "--config", str(path)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"{path}: not valid TOML" in err and "Traceback" not in err


def test_degradation_hold_times_must_fit_the_window() -> None:
    with pytest.raises(ConfigError) as ei:
        parse_config({"degradation": {"window_s": 10, "hang_s": 20}})
    assert "degradation.hang_s = 20: must be <= degradation.window_s (10)" in str(ei.value)
