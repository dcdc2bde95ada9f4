"""Reading a stream's usage event, and taking it out when the client did not ask for it.

The events are vLLM 0.32's (compact JSON; ``system_fingerprint`` on the finishing event
without include_usage, on the usage event with it): what the client receives through the
tap must be byte for byte the stream vLLM sends without include_usage, however the
engine's bytes are split into reads.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.gateway.accounting import stream_tap as usage_events
from appliance.gateway.accounting.plan import insert_stream_usage, plan_usage
from appliance.gateway.accounting.stream_tap import StreamTap
from appliance.gateway.protocols.counts import Usage, usage_of_answer
from appliance.gateway.wire.http1 import count_whole_chunks, is_whole_chunks, scan_chunks

FP = "vllm-0.32.0-1a2b3c4d"
HEAD = '"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m"'


def event(obj: str) -> bytes:
    return f"data: {{{obj}}}\n\n".encode()


def token(text: str, finish: str | None = None, fp: bool = False) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    choice = f'{{"index":0,"delta":{{"content":{json.dumps(text)}}},"finish_reason":{reason}}}'
    stamp = f',"system_fingerprint":"{FP}"' if fp else ""
    return event(f'{HEAD},"choices":[{choice}]{stamp}')


ROLE = event(HEAD + ',"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]')
USAGE = event(
    HEAD + ',"choices":[],"usage":{"prompt_tokens":11,"total_tokens":14,"completion_tokens":3}'
    f',"system_fingerprint":"{FP}"'
)
DONE = b"data: [DONE]\n\n"
# A token whose text looks like the marks: escaped inside JSON, so never taken for them.
TRICKY = 'say "usage": and "finish_reason":"stop"'

# What vLLM sends for one answer, without and with include_usage.
PLAIN = [ROLE, token("a"), token(TRICKY), token("c", "stop", fp=True), DONE]
WITH_USAGE = [ROLE, token("a"), token(TRICKY), token("c", "stop"), USAGE, DONE]


def wire(events: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n" % len(e) + e + b"\r\n" for e in events)


def body_of(wire_bytes: bytes) -> bytes:
    return b"".join(scan_chunks(wire_bytes)[1])


def through_splice(tap: StreamTap, events: list[bytes], per_read: int) -> bytes:
    """Feed the tap ``per_read`` whole chunks at a time, as splice.py does."""
    out = []
    for i in range(0, len(events), per_read):
        piece = wire(events[i : i + per_read])
        out.append(tap.wire(piece, count_whole_chunks(piece)))
    out.append(tap.last(b""))
    return b"".join(out)


@pytest.mark.parametrize("per_read", [1, 2, 3, 6])
def test_the_added_usage_event_is_taken_out_byte_for_byte(per_read: int) -> None:
    tap = StreamTap(strip=True)
    sent = through_splice(tap, WITH_USAGE, per_read)
    assert body_of(sent) == b"".join(PLAIN)
    assert is_whole_chunks(sent)
    assert tap.usage == Usage(11, 3)


def test_a_client_that_asked_gets_the_usage_event_untouched() -> None:
    tap = StreamTap(strip=False)
    sent = through_splice(tap, WITH_USAGE, 1)
    assert sent == wire(WITH_USAGE)
    assert tap.usage == Usage(11, 3)


def test_token_events_pass_without_a_copy() -> None:
    tap = StreamTap(strip=True)
    piece = wire([token("a")])
    assert tap.wire(piece, 1) is piece
    assert tap.events == 1


def test_an_engine_without_fingerprint_finishes_unchanged() -> None:
    usage = USAGE.replace(f',"system_fingerprint":"{FP}"'.encode(), b"")
    plain = [ROLE, token("a"), token("c", "stop"), DONE]
    tap = StreamTap(strip=True)
    sent = through_splice(tap, [ROLE, token("a"), token("c", "stop"), usage, DONE], 1)
    assert body_of(sent) == b"".join(plain)


def test_a_stream_cut_before_its_usage_event_gives_back_what_was_held() -> None:
    """The engine died after the finishing event: the client still gets it (unstamped),
    and the tokens relayed are counted."""
    tap = StreamTap(strip=True, preamble=1)
    sent = through_splice(tap, [ROLE, token("a"), token("b"), token("c", "stop")], 1)
    assert body_of(sent) == b"".join([ROLE, token("a"), token("b"), token("c", "stop")])
    assert tap.usage is None
    assert tap.produced() == 3  # the role event is not a token


@pytest.mark.parametrize("cut", [1, 7, 50, 200])
def test_http10_path_any_split_byte_for_byte(cut: int) -> None:
    raw = b"".join(WITH_USAGE)
    tap = StreamTap(strip=True)
    pending = bytearray()
    out = [tap.sse(raw[i : i + cut], pending) for i in range(0, len(raw), cut)]
    out.append(tap.flush_sse(pending))
    assert b"".join(out) == b"".join(PLAIN)
    assert tap.usage == Usage(11, 3)


def test_continuous_usage_asked_by_the_client_passes() -> None:
    per_token = event(HEAD + ',"choices":[{"index":0,"delta":{"content":"a"}}],"usage":{}')
    tap = StreamTap(strip=False)
    assert tap.wire(wire([per_token]), 1) == wire([per_token])
    assert tap.usage is None


# Usage events of other shapes than vLLM's own (which is read off its bytes): each is read
# as json.loads reads it, and the fingerprint goes back as json.dumps writes it.
COUNTS = '"prompt_tokens":11,"total_tokens":14,"completion_tokens":3'
SHAPES = {
    "vllm": (HEAD, COUNTS, '"vllm-0.32.0-1a2b3c4d"'),
    "details": (HEAD, COUNTS + ',"prompt_tokens_details":{"cached_tokens":0}', '"fp"'),
    "openai order": (HEAD, '"prompt_tokens":11,"completion_tokens":3,"total_tokens":14', '"f"'),
    "other order": (HEAD, '"completion_tokens":3,"prompt_tokens":11,"total_tokens":14', '"fp"'),
    "escaped model": (HEAD.replace('"m"', '"a\\"b"'), COUNTS, '"fp"'),
    "escaped fingerprint": (HEAD, COUNTS, '"fp\\u00e9\\"x"'),
    "no fingerprint": (HEAD, COUNTS, ""),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_usage_events_of_any_shape_are_read_and_taken_out(shape: str) -> None:
    head, counts, fp = SHAPES[shape]
    stamp = f',"system_fingerprint":{fp}' if fp else ""
    usage = event(f'{head},"choices":[],"usage":{{{counts}}}{stamp}')
    tap = StreamTap(strip=True)
    sent = through_splice(tap, [token("a"), token("c", "stop"), usage, DONE], 1)
    fingerprint = json.loads(fp) if fp else None
    finish = token("c", "stop")
    if fingerprint is not None:  # as vLLM stamps it without include_usage
        finish = finish[:-3] + f',"system_fingerprint":{json.dumps(fingerprint)}}}\n\n'.encode()
    assert body_of(sent) == b"".join([token("a"), finish, DONE])
    assert tap.usage == Usage(11, 3)


@pytest.mark.parametrize("shape", ["vllm", "openai order", "details", "no fingerprint"])
def test_vllms_own_usage_event_is_read_without_parsing_it(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hot path's cost: vLLM's usage event (and OpenAI's field order, which the fake
    engine writes) is read off its bytes, never json.loads'd."""

    def no_json(payload: bytes) -> None:
        raise AssertionError(f"parsed {payload!r}")

    monkeypatch.setattr(usage_events, "_event_json", no_json)
    test_usage_events_of_any_shape_are_read_and_taken_out(shape)


@pytest.mark.parametrize(
    "counts",
    [
        '"prompt_tokens":-1,"total_tokens":2,"completion_tokens":3',
        COUNTS[:-1] + "3.5",
        COUNTS.replace(":11", ":011"),  # not JSON
    ],
)
def test_a_malformed_usage_event_is_not_taken_for_one(counts: str) -> None:
    bad = event(f'{HEAD},"choices":[],"usage":{{{counts}}}')
    tap = StreamTap(strip=False)
    assert tap.wire(wire([bad]), 1) == wire([bad])
    assert tap.usage is None


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_plan_asks_for_usage_only_where_the_client_did_not() -> None:
    b = body(stream=True)
    assert plan_usage("chat", True, b, 8).added
    assert b["stream_options"] == {"include_usage": True}
    asked = body(stream=True, stream_options={"include_usage": True})
    assert not plan_usage("chat", True, asked, 8).added
    assert not plan_usage("chat", False, body(), 8).added
    assert not plan_usage("embeddings", True, {"model": "m", "input": "x"}, 8).added


def test_plan_never_turns_continuous_usage_on() -> None:
    b = body(stream=True, stream_options={"continuous_usage_stats": True})
    plan = plan_usage("chat", True, b, 8)
    assert plan.added and plan.rewrite
    assert b["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


def test_inserted_field_keeps_the_clients_bytes() -> None:
    raw = b' {"model":"m","stream":true,"prompt":"\\u00e9"}'
    new = insert_stream_usage(raw)
    assert new is not None
    assert json.loads(new) == {**json.loads(raw), "stream_options": {"include_usage": True}}
    assert new.endswith(raw[2:])
    assert insert_stream_usage('{"a":1}'.encode("utf-16")) is None


def test_usage_of_a_whole_answer() -> None:
    answer = b'{"object":"list","data":[],"usage":{"prompt_tokens":5,"total_tokens":5}}'
    assert usage_of_answer(answer) == Usage(5, 0)
    assert usage_of_answer(b'{"usage":{"prompt_tokens":"x"}}') is None
    assert usage_of_answer(b"not json") is None


def choice_token(index: int, text: str, finish: str | None = None, fp: bool = False) -> bytes:
    return token(text, finish, fp).replace(b'"index":0', b'"index":%d' % index)


def test_with_n_2_only_finishing_events_wait_and_the_other_choice_streams_on() -> None:
    """A long second choice after the first finished: its tokens reach the client as they
    come (nothing piles up in the gateway), and every finishing event gets its stamp."""
    tokens_1 = [choice_token(1, f"t{i}") for i in range(50)]
    with_usage = [
        ROLE,
        choice_token(0, "a"),
        choice_token(0, "b", "stop"),
        *tokens_1,
        choice_token(1, "z", "length"),
        USAGE,
        DONE,
    ]
    tap = StreamTap(strip=True, preamble=1)
    sent: list[bytes] = []
    for e in with_usage[:-2]:
        sent.append(body_of(tap.wire(wire([e]), 1)))
        assert len(tap.held or ()) <= 2  # at most one finishing event per choice
    assert b"".join(sent[3 : 3 + len(tokens_1)]) == b"".join(tokens_1)  # not held back
    sent.append(body_of(tap.wire(wire(with_usage[-2:]), 2)))
    sent.append(body_of(tap.last(b"")))
    assert b"".join(sent) == b"".join(
        [
            ROLE,
            choice_token(0, "a"),
            *tokens_1,
            choice_token(0, "b", "stop", fp=True),
            choice_token(1, "z", "length", fp=True),
            DONE,
        ]
    )
    assert tap.usage == Usage(11, 3)


# An OpenAI-compatible engine that writes JSON with spaces (json.dumps' default), given
# as engine.command (issue 20, item 3c): exact counts, and its usage event taken out.
def spaced(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


SPACED_HEAD = {"id": "c-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def spaced_token(text: str, finish: str | None = None, fp: bool = False) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    stamp = {"system_fingerprint": FP} if fp else {}
    return spaced({**SPACED_HEAD, "choices": [choice], **stamp})


SPACED_USAGE = spaced(
    {
        **SPACED_HEAD,
        "choices": [],
        "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
        "system_fingerprint": FP,
    }
)
SPACED_PLAIN = [spaced_token("a"), spaced_token(TRICKY), spaced_token("c", "stop", fp=True), DONE]
SPACED_WITH_USAGE = [spaced_token("a"), spaced_token(TRICKY), spaced_token("c", "stop")]
SPACED_WITH_USAGE += [SPACED_USAGE, DONE]


@pytest.mark.parametrize("per_read", [1, 2, 5])
def test_an_engine_writing_spaces_gets_exact_counts_and_its_usage_taken_out(
    per_read: int,
) -> None:
    tap = StreamTap(strip=True)
    sent = through_splice(tap, SPACED_WITH_USAGE, per_read)
    assert body_of(sent) == b"".join(SPACED_PLAIN)  # fingerprint back, as json.dumps puts it
    assert tap.usage == Usage(11, 3)


@pytest.mark.parametrize("cut", [1, 13, 400])
def test_an_engine_writing_spaces_http10_path(cut: int) -> None:
    raw = b"".join(SPACED_WITH_USAGE)
    tap = StreamTap(strip=True)
    pending = bytearray()
    out = [tap.sse(raw[i : i + cut], pending) for i in range(0, len(raw), cut)]
    out.append(tap.flush_sse(pending))
    assert b"".join(out) == b"".join(SPACED_PLAIN)
    assert tap.usage == Usage(11, 3)


def test_an_engine_writing_spaces_to_a_client_that_asked() -> None:
    tap = StreamTap(strip=False)
    sent = through_splice(tap, SPACED_WITH_USAGE, 1)
    assert sent == wire(SPACED_WITH_USAGE)
    assert tap.usage == Usage(11, 3)


def test_vllms_token_events_stay_on_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compact shape keeps the byte marks: after the first read, a token read passes
    as it came (no copy), and no event is parsed as JSON."""

    def no_json(payload: bytes) -> None:
        raise AssertionError(f"parsed {payload!r}")

    monkeypatch.setattr(usage_events, "_event_json", no_json)
    tap = StreamTap(strip=True, preamble=1)
    first = wire([ROLE])
    assert tap.wire(first, 1) is first
    piece = wire([token("a")])
    assert tap.wire(piece, 1) is piece
    assert tap.mark == usage_events.FINISH_MARK and not tap.by_json
