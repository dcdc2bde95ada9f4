"""The prefix index (gateway/admission/prefix_index.py) and the prompt text it hashes
(protocols/prompt_text.py): chained block hashes, longest match per engine, a bounded
LRU, engines forgotten when their cache is gone, and a conversation's next turn
beginning with its previous turn's text on every protocol."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.engine import EngineState
from appliance.gateway.admission.prefix_index import BLOCK_CHARS, MAX_BLOCKS, PrefixIndex
from appliance.gateway.admission.prefix_index import prompt_blocks as blocks
from appliance.gateway.protocols import prompt_text

B = BLOCK_CHARS


def text(n_blocks: int, seed: str = "a") -> str:
    return "".join(f"{seed}{i:05d}".ljust(B, ".") for i in range(n_blocks))


def test_whole_blocks_are_hashed_and_each_stands_for_everything_before_it() -> None:
    t = text(4)
    assert len(blocks(t)) == 4
    assert len(blocks(t + "x" * (B - 1))) == 4  # a partial last block is left out
    assert blocks(t + "x" * B)[:4] == blocks(t)  # a longer prompt starts the same
    other = "Z" + t[1:]  # the first block differs: so does every hash after it
    assert not set(blocks(other)) & set(blocks(t))
    assert blocks("") == () and blocks("x" * (B - 1)) == ()


def test_a_huge_prompt_is_hashed_up_to_a_bound() -> None:
    assert len(blocks("y" * B * (MAX_BLOCKS + 10))) == MAX_BLOCKS


def test_longest_match_per_engine() -> None:
    idx = PrefixIndex()
    conv = blocks(text(10))
    idx.record(0, conv[:4])
    idx.record(1, conv[:7])
    idx.record(2, blocks(text(10, "b")))
    assert idx.matched(conv) == {0: 4, 1: 7}
    idx.record(0, conv)
    assert idx.matched(conv) == {0: 10, 1: 7}
    assert idx.matched(conv[:3]) == {0: 3, 1: 3}
    assert idx.matched(blocks(text(10, "c"))) == {}
    assert idx.matched(()) == {}


def test_the_index_is_a_bounded_lru() -> None:
    idx = PrefixIndex(capacity=8)
    old, new = blocks(text(5, "o")), blocks(text(5, "n"))
    idx.record(0, old)
    idx.record(1, new)  # 10 hashes: two of ``old`` go, its last two (its end first)
    assert len(idx) == 8
    assert idx.matched(old) == {0: 3}  # what is left of it still matches from the start
    assert idx.matched(new) == {1: 5}
    idx.record(1, new)  # used again: now the most recent
    idx.record(0, old[:3])
    assert idx.matched(new) == {1: 5} and idx.matched(old) == {0: 3}


def test_a_full_index_trims_a_prompt_from_its_end() -> None:
    # A conversation squeezed by others keeps its beginning, so it still matches as far
    # as it is kept (it lost its first block, and with it everything, before).
    idx = PrefixIndex(capacity=10)
    conv = blocks(text(8, "c"))
    idx.record(0, conv)
    idx.record(1, blocks(text(3, "x")))  # one over: one of conv's hashes goes
    assert idx.matched(conv) == {0: 7}


def test_engines_forgotten_together_cost_one_pass() -> None:
    idx = PrefixIndex()
    conv = blocks(text(4))
    for engine in range(4):
        idx.record(engine, conv)
    idx.forget(1)
    idx.forget(2)
    assert idx.matched(conv) == {0: 4, 3: 4}


def test_the_chain_is_seeded_by_the_model_sent() -> None:
    # An adapter's prefix cache is its own in vLLM: the same text for another is no match.
    idx = PrefixIndex()
    t = text(3)
    idx.record(0, blocks(t, hash("base")))
    assert idx.matched(blocks(t, hash("base"))) == {0: 3}
    assert idx.matched(blocks(t, hash("adapter-a"))) == {}
    assert len(blocks(t, hash("base"), limit=2)) == 2


def test_forget_drops_one_engine_only() -> None:
    idx = PrefixIndex()
    conv = blocks(text(6))
    idx.record(0, conv)
    idx.record(1, conv[:2])
    idx.forget(0)
    assert idx.matched(conv) == {1: 2}
    assert len(idx) == 2


@pytest.mark.parametrize(
    ("later", "forgotten"),
    [
        ((EngineState.READY, 101), False),  # the same process
        ((EngineState.DRAINING, 101), False),  # draining keeps its cache
        ((EngineState.SUSPECT, 101), False),  # may pass its next check
        ((EngineState.READY, 202), True),  # restarted: another process
        ((EngineState.STOPPING, 101), True),
        ((EngineState.STARTING, None), True),
        ((EngineState.SLEEPING, 101), True),  # asleep: its KV cache is freed
        ((EngineState.FAILED, None), True),
    ],
)
def test_an_engine_that_lost_its_cache_is_forgotten(
    later: tuple[EngineState, int | None], forgotten: bool
) -> None:
    idx = PrefixIndex()
    conv = blocks(text(3))
    idx.seen(0, EngineState.READY, 101)
    idx.seen(1, EngineState.READY, 102)
    idx.record(0, conv)
    idx.record(1, conv)
    idx.seen(0, *later)
    idx.seen(1, EngineState.READY, 102)
    assert idx.matched(conv) == ({1: 3} if forgotten else {0: 3, 1: 3})


def test_an_engine_without_a_pid_is_forgotten_when_it_stops_serving() -> None:
    idx = PrefixIndex()
    conv = blocks(text(3))
    idx.seen(0, EngineState.READY, None)
    idx.record(0, conv)
    idx.seen(0, EngineState.STOPPING, None)
    idx.seen(0, EngineState.READY, None)
    assert idx.matched(conv) == {}


# ---- the prompt text of each protocol: turn k's is a prefix of turn k+1's ---------------
DOC = "a long document. " * 200
SYSTEM = "You are a careful assistant."


def chat_turns() -> list[dict[str, Any]]:
    m1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DOC + "Q1"}]
    m2 = [
        *m1,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "user", "content": [{"type": "text", "text": "Q2"}]},
    ]
    return [{"messages": m1}, {"messages": m2}]


def messages_turns() -> list[dict[str, Any]]:
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    m1 = [{"role": "user", "content": [{"type": "text", "text": DOC + "Q1"}]}]
    m2 = [
        {"role": "user", "content": [{"type": "text", "text": DOC + "Q1"}]},  # marker moved
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"},
                {"type": "text", "text": "Q2", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    return [{"system": system, "messages": m1}, {"system": system, "messages": m2}]


def responses_turns() -> list[dict[str, Any]]:
    i1 = [{"role": "user", "content": DOC + "Q1"}]
    i2 = [
        *i1,
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "user", "content": [{"type": "input_text", "text": "Q2"}]},
    ]
    return [{"instructions": SYSTEM, "input": i1}, {"instructions": SYSTEM, "input": i2}]


@pytest.mark.parametrize(
    ("read", "turns"),
    [
        (prompt_text.chat, chat_turns()),
        (prompt_text.messages, messages_turns()),
        (prompt_text.responses, responses_turns()),
        (
            prompt_text.completions,
            [{"prompt": DOC + "Q1"}, {"prompt": [DOC + "Q1 A1 Q2"]}],
        ),
    ],
    ids=["chat", "messages", "responses", "completions"],
)
def test_the_next_turns_text_begins_with_the_previous_turns(read: Any, turns: Any) -> None:
    first, second = read(turns[0]), read(turns[1])
    assert first and second and len(second) > len(first)
    assert second.startswith(first)
    assert DOC in first
    assert len(blocks(first)) >= 6 and blocks(second)[: len(blocks(first))] == blocks(first)


@pytest.mark.parametrize(
    ("read", "body"),
    [
        (prompt_text.completions, {"prompt": [1, 2, 3]}),  # token ids
        (prompt_text.completions, {"prompt": ["a", "b"]}),  # several prompts
        (prompt_text.chat, {"messages": []}),
        (prompt_text.responses, {}),
    ],
)
def test_no_text_no_prefix(read: Any, body: dict[str, Any]) -> None:
    assert read(body) is None


def test_two_conversations_on_one_system_prompt_differ_after_it() -> None:
    a = prompt_text.chat(
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]}
    )
    b = prompt_text.chat(
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "y"}]}
    )
    assert a != b and a is not None and b is not None


def test_a_body_of_many_empty_parts_is_walked_within_its_budget() -> None:
    # 60,000 empty parts after the text: the walk stops at its node budget, and the text
    # read so far is what every turn of the conversation begins with.
    many = [{"role": "user", "content": [{"type": "text", "text": "hi"}, *([{}] * 60000)]}]
    got = prompt_text.chat({"messages": many})
    assert got is not None and got.startswith("user\x1ftext\x1fhi\x1f")
    numbers = prompt_text.chat({"messages": [{"role": "user", "content": [0] * 60000}]})
    assert numbers == "user\x1f"
    pieces = prompt_text.chat({"messages": [{"role": "user", "content": ["a"] * 60000}]})
    assert pieces is not None and pieces.count("a") <= prompt_text.NODE_BUDGET


def test_text_the_cost_does_not_count_cannot_fill_the_index() -> None:
    # A 300 KB "id" on a message: the cost counts the message's text and max_tokens (a
    # few dozen tokens), so the request hashes a block or two, not 512. Flushing the
    # index takes requests whose cost adds up to about 4 tokens per character held.
    from appliance.config import GatewayConfig
    from appliance.gateway.relay.request_body import parse_body

    body = {
        "model": "m",
        "max_tokens": 16,
        "messages": [{"role": "user", "id": "x" * 300_000, "content": "hi"}],
    }
    raw = __import__("json").dumps(body).encode()
    parsed = parse_body("chat", raw, {}, GatewayConfig(), 4096)
    assert 0 < len(parsed.prefix) <= 2


def test_a_model_with_one_engine_hashes_nothing() -> None:
    # Where a one-engine model's request goes is no choice: its prompt is not read.
    from appliance.config import GatewayConfig
    from appliance.gateway.relay.request_body import finish_body, open_body

    raw = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * 4000 + b'"}]}'
    several = finish_body("chat", open_body("chat", raw), {}, GatewayConfig(), 4096)
    one = finish_body("chat", open_body("chat", raw), {}, GatewayConfig(), 4096, choice=False)
    assert len(several.prefix) == 7 and one.prefix == ()
