"""``tool_call_parser`` and ``reasoning_parser``: the names vLLM 0.32 offers, checked here.

The supervisor never imports vLLM (it lives in the engine venv, and importing it costs
seconds and gigabytes), so the names are kept in this module, copied from vLLM 0.32's two
registries (``vllm/tool_parsers/__init__.py``: ``_TOOL_PARSERS_TO_REGISTER``;
``vllm/reasoning/__init__.py``: ``_REASONING_PARSERS_TO_REGISTER``).
tests/unit/test_parser_names.py compares them with the installed vLLM's registries, so a
vLLM upgrade that adds or drops a name fails a test instead of a start-up. A name not in
the list would make vLLM refuse to start (FAILED, its reason in ``status``); check-config
says so before, with the nearest name.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from appliance.config.words import show

TOOL_CALL_PARSERS: tuple[str, ...] = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31",
    "deepseek_v32", "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma",
    "gemma4", "gigachat3", "glm45", "glm47", "granite", "granite-20b-fc", "granite4",
    "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba",
    "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json",
    "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax_m2", "minimax_m3",
    "mistral", "muse_glimmer", "olmo3", "openai", "phi4_mini_json", "plamo3",
    "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss",
    "step3", "step3p5", "xlam",
)  # fmt: skip
REASONING_PARSERS: tuple[str, ...] = (
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4",
    "deepseek_v41", "ernie45", "gemma4", "glm45", "glm47", "granite",
    "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling",
    "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2",
    "minimax_m2_append_think", "minimax_m3", "mistral", "muse_glimmer", "nemotron_v3",
    "olmo3", "openai_gptoss", "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3",
    "step3p5",
)  # fmt: skip
ALLOWED: dict[str, tuple[str, ...]] = {
    "tool_call_parser": TOOL_CALL_PARSERS,
    "reasoning_parser": REASONING_PARSERS,
}


def parser_problem(path: str, key: str, value: str) -> str | None:
    """What is wrong with ``value`` for ``key`` ("" is off and always fine), naming the
    nearest allowed name and every allowed one; None when vLLM 0.32 offers it."""
    allowed = ALLOWED[key]
    if not value or value in allowed:
        return None
    near = difflib.get_close_matches(value, allowed, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return (
        f"{path}.{key} = {show(value)}: not a {key.replace('_', ' ')} vLLM 0.32 offers"
        f"{hint}; allowed: {', '.join(allowed)}"
    )


STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
# A host name as urllib3 reports a URL's host (lower case), which is what vLLM compares
# --allowed-media-domains with: labels of letters, digits and hyphens, or an IPv4 address.
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
HOST_RE = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")


def check_parsers(
    keys: Mapping[str, Any], path: str, problems: list[str], embed: bool = False
) -> None:
    """The parser names and engine variables among ``keys`` ([engine]'s fields, or what a
    model's table sets, under ``path``): names vLLM offers, never on an embedding model
    (whose engine gets no parser flags), media hosts that are host names, and the
    response store set by its key alone (the gateway reads the key to know whether a
    stored response can exist)."""
    for key in ALLOWED:
        value = keys.get(key) or ""
        problem = parser_problem(path, key, value)
        if problem is not None:
            problems.append(problem)
        elif value and embed:
            problems.append(
                f"{path}.{key} = {show(value)}: parsers are for generate models, not "
                "embeddings; remove it"
            )
    for host in keys.get("allowed_media_domains") or ():
        if not HOST_RE.fullmatch(host):
            problems.append(
                f"{path}.allowed_media_domains: {show(host)} is not a host name; give "
                "host names only, as vLLM compares them with a URL's host (e.g. "
                '"images.example.com", no scheme, port or path)'
            )
    if STORE_ENV in (keys.get("env") or {}):
        problems.append(
            f"{path}.env.{STORE_ENV}: set {path}.responses_store = true|false instead "
            "(the gateway reads it to route and refuse requests for stored responses)"
        )
