"""``tool_call_parser``, ``reasoning_parser`` and ``responses_store``: what check-config
says, what the engine is started with, and which requests the gateway refuses without a
parser (the refusal a client reads). The names checked against the installed vLLM's
registries: tests/e2e/test_real_parser_names.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from appliance.config import Config, parse_config
from appliance.endpoint import EngineAddress
from appliance.engine import build_argv, build_env
from appliance.errors import ConfigError
from appliance.gateway.protocols import ROUTES
from appliance.gateway.protocols.tools import tools_refusal

EMBED = "packaged:all-minilm-l6-v2"


def problems_of(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    return info.value.problems


# ---- check-config ------------------------------------------------------------------------
def test_parsers_default_off_and_store_on() -> None:
    e = Config().engine
    assert (e.tool_call_parser, e.reasoning_parser, e.responses_store) == ("", "", True)


@pytest.mark.parametrize(
    ("raw", "expect"),
    [
        (
            {"engine": {"tool_call_parser": "hermez"}},
            ['engine.tool_call_parser = "hermez"', "(did you mean 'hermes'?)", "llama3_json"],
        ),
        (
            {"models": [{"name": "chat", "reasoning_parser": "qwen"}]},
            ['models[0] ("chat").reasoning_parser = "qwen"', "(did you mean 'qwen3'?)"],
        ),
        (
            {"models": [{"name": "e", "model": EMBED, "tool_call_parser": "hermes"}]},
            ['models[0] ("e").tool_call_parser = "hermes"', "not embeddings"],
        ),
        (
            {"engine": {"env": {"VLLM_ENABLE_RESPONSES_API_STORE": "0"}}},
            ["engine.env.VLLM_ENABLE_RESPONSES_API_STORE", "engine.responses_store"],
        ),
        (
            {"models": [{"name": "chat", "responses_store": "no"}]},
            ['models[0] ("chat").responses_store = "no"', "true or false"],
        ),
    ],
    ids=["typo", "model typo", "embed model", "store by env", "store not a bool"],
)
def test_check_config_names_the_key_and_what_is_allowed(
    raw: dict[str, Any], expect: list[str]
) -> None:
    (problem,) = problems_of(raw)
    for part in expect:
        assert part in problem, problem


def test_engine_defaults_apply_to_generate_models_and_a_table_overrides_them() -> None:
    cfg = parse_config(
        {
            "engine": {"device": "cpu", "tool_call_parser": "hermes"},
            "models": [
                {"name": "chat"},
                {"name": "think", "reasoning_parser": "deepseek_r1", "tool_call_parser": ""},
                {"name": "e", "model": EMBED},  # [engine]'s parser is ignored here
            ],
        }
    )
    got = [(m.engine.tool_call_parser, m.engine.reasoning_parser) for m in cfg.served]
    assert got == [("hermes", ""), ("", "deepseek_r1"), ("hermes", "")]


# ---- the engine's command line and environment -------------------------------------------
def argv(cfg: Config, i: int = 0) -> tuple[str, ...]:
    return build_argv(
        cfg.served[i],
        python="/py",
        model="/m",
        address=EngineAddress(uds="/run/e.sock"),
        gpus=(),
        on_gpu=False,
    )


def test_a_parser_starts_the_engine_with_vllms_flags() -> None:
    cfg = parse_config(
        {
            "engine": {"device": "cpu"},
            "models": [
                {"name": "chat", "tool_call_parser": "hermes", "reasoning_parser": "qwen3"},
                {"name": "plain"},
                {"name": "e", "model": EMBED},
            ],
        }
    )
    args = argv(cfg)
    i = args.index("--tool-call-parser")
    assert args[i + 1] == "hermes" and "--enable-auto-tool-choice" in args
    assert args[args.index("--reasoning-parser") + 1] == "qwen3"
    for other in (argv(cfg, 1), argv(cfg, 2)):
        assert not {"--tool-call-parser", "--enable-auto-tool-choice", "--reasoning-parser"} & set(
            other
        )


def test_an_embed_model_never_gets_engine_wide_parser_flags() -> None:
    cfg = parse_config(
        {
            "engine": {"device": "cpu", "tool_call_parser": "hermes"},
            "models": [{"name": "e", "model": EMBED}],
        }
    )
    assert "--tool-call-parser" not in argv(cfg)


@pytest.mark.parametrize(("store", "value"), [(True, "1"), (False, "0")])
def test_responses_store_sets_vllms_variable(store: bool, value: str) -> None:
    cfg = parse_config({"engine": {"responses_store": store}})
    env = build_env(cfg.engine, {}, gpus=(), cpu_bind=None, engine_tag="t")
    assert env["VLLM_ENABLE_RESPONSES_API_STORE"] == value


# ---- the gateway's refusal ---------------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
A_TOOL = {"name": "f", "input_schema": {"type": "object"}}
MSGS = [{"role": "user", "content": "hi"}]

REFUSED_WITHOUT_PARSER: list[tuple[str, dict[str, Any], bool]] = [
    ("chat", {"messages": MSGS, "tools": [TOOL]}, True),  # absent: vLLM makes it "auto"
    ("chat", {"messages": MSGS, "tools": [TOOL], "tool_choice": "auto"}, True),
    ("chat", {"messages": MSGS, "tools": [TOOL], "tool_choice": "required"}, True),
    (
        "chat",
        {"messages": MSGS, "tools": [TOOL], "tool_choice": {"type": "function", "function": {}}},
        True,  # vLLM 0.32: a named tool needs --tool-call-parser too
    ),
    ("chat", {"messages": MSGS, "tools": [TOOL], "tool_choice": "none"}, False),
    ("chat", {"messages": MSGS, "tools": [TOOL], "tool_choice": None}, False),
    ("chat", {"messages": MSGS, "tools": []}, False),
    ("chat", {"messages": MSGS, "response_format": {"type": "json_schema"}}, False),
    ("chat", {"messages": MSGS, "structured_outputs": {"json": {}}}, False),
    ("responses", {"input": "x", "tools": [TOOL["function"]]}, True),
    ("responses", {"input": "x", "tools": [TOOL["function"]], "tool_choice": "none"}, False),
    ("responses", {"input": "x"}, False),
    ("messages", {"messages": MSGS, "max_tokens": 1, "tools": [A_TOOL]}, True),
    (
        "messages",
        {"messages": MSGS, "max_tokens": 1, "tools": [A_TOOL], "tool_choice": {"type": "any"}},
        True,
    ),
    (
        "messages",
        {"messages": MSGS, "max_tokens": 1, "tools": [A_TOOL], "tool_choice": {"type": "none"}},
        False,
    ),
    ("count_tokens", {"messages": MSGS, "tools": [A_TOOL]}, False),  # runs no model
    ("completions", {"prompt": "x", "tools": [TOOL]}, False),
]


@pytest.mark.parametrize(("route", "body", "refused"), REFUSED_WITHOUT_PARSER)
def test_which_requests_need_a_tool_parser(route: str, body: dict[str, Any], refused: bool) -> None:
    tables = parse_config({"models": [{"name": "chat"}]})
    model = tables.served[0]
    got = tools_refusal(ROUTES[route].calls_tools, body, model, tables=True)
    assert (got is not None) == refused
    if got is not None:
        assert got.status == 400 and got.param == "tool_choice"
        assert "models.chat.tool_call_parser" in got.message
    with_parser = dataclasses.replace(
        model, engine=dataclasses.replace(model.engine, tool_call_parser="hermes")
    )
    assert tools_refusal(ROUTES[route].calls_tools, body, with_parser, tables=True) is None


def test_without_tables_the_refusal_names_the_engine_key() -> None:
    model = parse_config({}).served[0]
    got = tools_refusal(ROUTES["chat"].calls_tools, {"tools": [TOOL]}, model, tables=False)
    assert got is not None and "engine.tool_call_parser" in got.message
