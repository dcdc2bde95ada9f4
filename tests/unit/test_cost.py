"""What a request costs (admission and tpm) and what the engine is sent, from the body.

Cost = sum over prompts of sequences x min(prompt estimate + max_tokens, max_model_len);
prompt estimates come from the text fields (ASCII: 4 characters a token), a chat message
adds 8 tokens of template. These tables pin the cases a client could use to make the
engines generate far more than it is charged for.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from appliance.config import GatewayConfig
from appliance.gateway.errors import GatewayError
from appliance.gateway.protocols.cost import MEDIA_PART_TOKENS, TOKENS_PER_MESSAGE, text_tokens
from appliance.gateway.relay.request_body import (
    ParsedRequest,
    _dump,
    engine_priority,
    finish_body,
    open_body,
    parse_body,
)

CAP = 1000
MML = 4096  # engine.max_model_len
LIMITS = GatewayConfig(max_tokens_cap=CAP, max_n=4, max_best_of=6, max_prompts=3)
MSG = [{"role": "user", "content": "abcdefgh"}]  # 2 tokens + 8 of template
CHAT_PROMPT = 2 + TOKENS_PER_MESSAGE


def parse(
    route: str, body: dict[str, Any] | bytes, limits: GatewayConfig = LIMITS
) -> ParsedRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_body(route, raw, {}, limits, MML)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSG, **fields}


def completion(prompt: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, **fields}


@pytest.mark.parametrize(
    ("route", "body", "cost"),
    [
        pytest.param("chat", chat(max_tokens=100), CHAT_PROMPT + 100, id="chat"),
        pytest.param("chat", chat(max_tokens=100, n=4), 4 * (CHAT_PROMPT + 100), id="chat-n"),
        pytest.param(
            "chat", chat(max_tokens=100, n=2, best_of=5), 5 * (CHAT_PROMPT + 100), id="best_of"
        ),
        pytest.param(
            "chat",
            chat(max_tokens=10, max_completion_tokens=100),
            CHAT_PROMPT + 100,
            id="max_completion_tokens-wins",
        ),
        pytest.param("completions", completion("abcd" * 10, max_tokens=5), 10 + 5, id="string"),
        pytest.param(
            "completions",
            completion(["abcd", "abcd" * 5, "x"], max_tokens=5, n=2),
            2 * ((1 + 5) + (5 + 5) + (1 + 5)),
            id="prompt-list",
        ),
        pytest.param(
            "completions", completion([7] * 50, max_tokens=5), 50 + 5, id="token-ids-one-prompt"
        ),
        pytest.param(
            "completions",
            completion([[7] * 50, [7] * 20], max_tokens=5, n=3),
            3 * ((50 + 5) + (20 + 5)),
            id="token-id-lists",
        ),
        pytest.param("completions", completion("abcd"), 1 + 16, id="completions-default-16"),
        pytest.param(
            "completions", completion("abcd", max_tokens=None), 1 + 16, id="completions-null-16"
        ),
        pytest.param(
            "embeddings", {"model": "m", "input": ["abcd" * 3, [1, 2, 3]]}, 3 + 3, id="embeddings"
        ),
        pytest.param(
            "chat",
            chat(max_tokens=100, messages=[{"role": "user", "content": "\u4f60\u597d" * 30}]),
            TOKENS_PER_MESSAGE + 60 + 100,  # CJK: about a token a character
            id="cjk",
        ),
        pytest.param(
            "chat",
            chat(
                max_tokens=100,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "abcd" * 25},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                        ],
                    }
                ],
            ),
            TOKENS_PER_MESSAGE + 25 + MEDIA_PART_TOKENS + 100,
            id="list-of-parts",
        ),
        pytest.param(
            "chat",
            chat(max_tokens=100, messages=[{"role": "user", "content": " " * 600_000}]),
            MML,  # one sequence never holds more than the context
            id="text-padding-capped-at-context",
        ),
    ],
)
def test_cost_counts_what_the_engine_will_do(route: str, body: dict[str, Any], cost: int) -> None:
    assert parse(route, body).cost == cost


def test_json_padding_costs_nothing() -> None:
    plain = json.dumps(chat(max_tokens=10)).encode()
    padded = plain[:-1] + b" " * 600_000 + b"}"
    assert parse("chat", padded).cost == parse("chat", plain).cost == CHAT_PROMPT + 10


@pytest.mark.parametrize("missing", [{}, {"max_tokens": None}, {"max_completion_tokens": None}])
def test_chat_without_max_tokens_is_sent_with_the_cap(missing: dict[str, Any]) -> None:
    # vLLM would generate to the end of the context: the cap is written into the body.
    parsed = parse("chat", chat(**missing))
    sent = json.loads(parsed.body)
    assert sent["max_completion_tokens"] == CAP
    assert sent["messages"] == MSG and sent["model"] == "m"
    assert parsed.cost == CHAT_PROMPT + CAP


def test_the_written_max_tokens_never_passes_the_context() -> None:
    long = [{"role": "user", "content": "abcd" * 3500}]  # 3500 + 8 tokens of 4096
    parsed = parse("chat", chat(messages=long))
    assert json.loads(parsed.body)["max_completion_tokens"] == MML - 3508
    assert parsed.cost == MML
    # A prompt already past the context (the engine refuses it): never above max_model_len.
    small_context = GatewayConfig(max_tokens_cap=8192)
    huge = [{"role": "user", "content": "abcd" * 5000}]
    assert json.loads(parse("chat", chat(messages=huge), small_context).body)[
        "max_completion_tokens"
    ] == min(8192, MML)


def test_the_body_is_forwarded_untouched_unless_a_field_must_be_set() -> None:
    for route, body in (
        ("chat", chat(max_tokens=5)),
        ("chat", chat(max_completion_tokens=5)),
        ("completions", completion("x")),  # 16 by default: nothing to write
        ("embeddings", {"model": "m", "input": "x"}),
    ):
        raw = json.dumps(body).encode() + b"  "
        assert parse_body(route, raw, {}, LIMITS, MML).body is raw


def test_completions_default_is_written_only_under_a_lower_cap() -> None:
    parsed = parse("completions", completion("abcd"), GatewayConfig(max_tokens_cap=8))
    assert json.loads(parsed.body)["max_tokens"] == 8
    assert parsed.cost == 1 + 8


def test_non_ascii_and_lone_surrogates_survive_a_rewrite() -> None:
    raw = (
        b'{"model": "m", "messages": [{"role": "user", "content": "caf\\u00e9 \\ud800 \xc3\xa9"}]}'
    )
    sent = json.loads(parse("chat", raw).body)
    assert sent["messages"][0]["content"] == "caf\u00e9 \ud800 \u00e9"


@pytest.mark.parametrize(
    ("route", "body", "param", "words"),
    [
        ("chat", chat(n=5), "n", "limit of 4"),
        ("chat", chat(n=0), "n", "positive integer"),
        ("chat", chat(n="2"), "n", "positive integer"),
        ("chat", chat(n=True), "n", "positive integer"),
        ("completions", completion("x", n=16384), "n", "limit of 4"),
        ("completions", completion("x", best_of=7), "best_of", "limit of 6"),
        ("completions", completion(["a", "b", "c", "d"]), "prompt", "limit of 3"),
        ("completions", completion([[1], [2], [3], [4]]), "prompt", "limit of 3"),
        ("embeddings", {"model": "m", "input": ["a", "b", "c", "d"]}, "input", "limit of 3"),
        ("chat", chat(max_tokens=CAP + 1), "max_tokens", f"limit of {CAP}"),
        ("chat", chat(max_completion_tokens=0), "max_completion_tokens", "positive integer"),
    ],
)
def test_each_maximum_is_a_400_naming_the_field(
    route: str, body: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(GatewayError) as ei:
        parse(route, body)
    err = ei.value
    assert (err.status, err.param) == (400, param)
    assert words in err.message and param in err.message


def test_a_long_token_id_list_is_one_prompt_not_many() -> None:
    # max_prompts = 3 bounds lists of prompts, not the tokens of one prompt.
    assert parse("completions", completion([1] * 100, max_tokens=1)).cost == 101


def test_text_estimate() -> None:
    assert [text_tokens(t) for t in ("", "a", "abcd", "abcde")] == [0, 1, 1, 2]
    assert text_tokens("\u00e9" * 3) == 2  # 6 UTF-8 bytes


# --- what the engine is sent is what the gateway read --------------------------------------
def engine_reads(parsed: ParsedRequest) -> Any:
    """The body as the engine parses it (the last of two equal keys wins, as here)."""
    return json.loads(parsed.body)


def test_stream_options_null_is_replaced_not_shadowed() -> None:
    parsed = parse("chat", chat(stream=True, max_tokens=5, stream_options=None))
    assert parsed.usage is not None and parsed.usage.added
    assert engine_reads(parsed)["stream_options"] == {"include_usage": True}


def test_a_body_in_utf_16_without_a_bom_is_written_anew_for_the_usage_field() -> None:
    raw = json.dumps(chat(stream=True, max_tokens=5)).encode("utf-16-le")
    parsed = parse("chat", raw)
    assert engine_reads(parsed)["stream_options"] == {"include_usage": True}
    assert parsed.body.startswith(b'{"model"')  # UTF-8 now, not ASCII spliced into UTF-16


def test_a_body_too_deep_to_write_again_is_a_400_not_a_500() -> None:
    """json.loads can read a body one level shallower than json.dumps can write: such a
    body, when it must be written anew (an alias, a field set), is refused, not a crash."""
    deep: list[Any] = []
    for _ in range(sys.getrecursionlimit() + 10):
        deep = [deep]
    with pytest.raises(GatewayError) as exc:
        _dump({"model": "m", "tools": deep})
    assert exc.value.status == 400 and "nested too deeply" in str(exc.value)


def test_stream_null_is_no_stream_and_embeddings_never_stream() -> None:
    assert parse("chat", chat(stream=None, max_tokens=5)).stream is False
    embed = parse("embeddings", {"model": "m", "input": "x", "stream": True})
    assert embed.stream is False  # vLLM answers with one JSON body: relayed and counted so


@pytest.mark.parametrize("value", ["true", 1, [], {}])
def test_include_usage_must_be_a_boolean(value: Any) -> None:
    with pytest.raises(GatewayError) as exc:
        parse("chat", chat(stream=True, max_tokens=5, stream_options={"include_usage": value}))
    assert exc.value.status == 400 and exc.value.param == "stream_options"


# ---- the upper bound charged when the engine's count never comes (issue 20, item 3) ----
def bound(route: str, body: dict[str, Any]) -> tuple[int, int]:
    """(prompt bound, completion bound) of a request as the relay would plan it."""
    plan = parse(route, body).usage
    assert plan is not None
    return plan.prompt_bound, plan.completion_bound


@pytest.mark.parametrize(
    "text",
    ["a " * 300, "1 2 3 4 5 6 7 8 9 0 " * 30, "日本語のテキスト" * 20, "e\u0301" * 100, "x"],
    ids=["dense words", "digits", "CJK", "combining", "one char"],
)
def test_the_prompt_bound_is_at_least_one_token_per_utf8_byte(text: str) -> None:
    """Byte-level BPE never makes more tokens than bytes: that, plus the template's
    markers and the role, is what a cut-off request is charged; the estimate that
    admission uses (4 characters a token) is not (it was: ~1 token per 4 chars)."""
    chat_bound, _ = bound("chat", {"model": "m", "messages": [{"role": "user", "content": text}]})
    assert chat_bound >= len(text.encode()) + TOKENS_PER_MESSAGE + len("user")
    assert chat_bound > text_tokens(text) + TOKENS_PER_MESSAGE  # above the admission estimate
    completion_bound, _ = bound("completions", completion([text, text]))
    assert completion_bound >= 2 * len(text.encode())


def test_the_prompt_bound_never_passes_the_context() -> None:
    long = {"model": "m", "messages": [{"role": "user", "content": "a " * 3000}]}
    assert bound("chat", long)[0] == MML
    assert bound("completions", completion(["a " * 3000] * 2))[0] == 2 * MML  # per prompt


def test_what_the_gateway_cannot_bound_counts_the_context() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    media = [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]
    assert bound("chat", {"model": "m", "messages": media})[0] == MML
    assert bound("chat", chat(chat_template="{{ messages }}"))[0] == MML


def test_token_ids_are_their_own_count_and_tools_count_as_rendered() -> None:
    assert bound("completions", completion([1, 2, 3]))[0] == 3
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plain, with_tools = bound("chat", chat())[0], bound("chat", chat(tools=tools))[0]
    assert with_tools - plain >= len(json.dumps(tools, indent=4).encode())


def test_the_completion_bound_is_what_admission_charged_for() -> None:
    assert bound("chat", chat(max_tokens=50, n=3))[1] == 150
    assert bound("completions", completion(["a", "b"], max_tokens=7, best_of=2))[1] == 28
    assert bound("embeddings", {"model": "m", "input": "x"})[1] == 0


@pytest.mark.parametrize(
    ("route", "body", "priority", "sent", "header"),
    [
        # a batch key's priority goes in front of the client's bytes, nothing re-serialised
        ("chat", chat(max_tokens=5), 10, 10, None),
        ("completions", completion("x"), 10, 10, None),
        ("embeddings", {"model": "m", "input": "x"}, 10, 10, None),
        # an interactive key's 0 is vLLM's default: nothing written
        ("chat", chat(max_tokens=5), 0, None, None),
        # a client's own priority never reaches the engine: replaced, or taken out
        ("chat", chat(max_tokens=5, priority=-5), 10, 10, None),
        ("chat", chat(max_tokens=5, priority=-5), 0, None, None),
        ("chat", chat(max_tokens=5, priority=None), None, None, None),
        ("chat", chat(max_tokens=5, priority=-5), None, None, None),  # fcfs
        ("chat", chat(max_tokens=5), None, None, None),  # fcfs: nothing sent
        # Messages: vLLM reads it from the X-Vllm-Priority header; its body has none
        ("messages", {"model": "m", "messages": MSG, "max_tokens": 5}, 10, None, 10),
        (
            "messages",
            {"model": "m", "messages": MSG, "max_tokens": 5, "priority": 3},
            0,
            None,
            None,
        ),
    ],
)
def test_the_engine_is_sent_the_keys_priority_never_the_clients(
    route: str, body: dict[str, Any], priority: int | None, sent: int | None, header: int | None
) -> None:
    raw = json.dumps(body).encode()
    opened = open_body(route, raw)
    parsed = finish_body(route, opened, {}, LIMITS, MML, priority=priority)
    forwarded = json.loads(parsed.body)
    assert forwarded.get("priority") == sent and ("priority" in forwarded) == (sent is not None)
    assert parsed.priority_header == header
    if "priority" not in body and sent is not None:
        assert parsed.body == b'{"priority":%d,' % sent + raw[1:]  # inserted, not rewritten


def test_a_stream_gets_its_usage_and_its_priority_in_one_insertion() -> None:
    raw = json.dumps(chat(max_tokens=5, stream=True)).encode()
    parsed = finish_body("chat", open_body("chat", raw), {}, LIMITS, MML, priority=10)
    assert parsed.body == (b'{"stream_options":{"include_usage":true},"priority":10,' + raw[1:])


@pytest.mark.parametrize(
    ("scheduling", "key_class", "expected"),
    [("priority", "interactive", 0), ("priority", "batch", 10), ("fcfs", "batch", None)],
)
def test_engine_priority(scheduling: str, key_class: str, expected: int | None) -> None:
    assert engine_priority(scheduling, key_class) == expected
