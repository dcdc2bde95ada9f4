"""The engine's own token counts of a streamed answer, read off the stream as it passes.

vLLM sends a stream's usage only when asked (``stream_options.include_usage``): then, just
before ``data: [DONE]``, one event with ``"choices":[]`` and ``"usage":{...}``. So the
gateway asks for it on every streamed chat and completions request
(plan.plan_usage) and, when the client did not ask, takes that event out of what
the client receives (:class:`StreamTap`), so the client's stream is byte for byte what
vLLM would have sent without ``include_usage``.

One more difference has to be undone. vLLM 0.32 stamps ``system_fingerprint`` on an
answer's finishing events (``"finish_reason":"..."``) only without ``include_usage``; with
it, the fingerprint moves to the usage event. So the tap holds back a finishing event
until the usage event says the fingerprint, and puts it back where vLLM would have
(the last field of the event), then drops the usage event. Finishing events are at the
end of a stream, so holding them costs no latency worth the name. Only they are held:
with ``n`` > 1 the other choices' tokens pass on as they come, and each finished choice's
last event follows when the last choice finishes (so the gateway holds at most ``n``
events, however long the other choices run; events carry their choice's index, so a
client's reading of each choice is the same).

Cost on the per-token path: per read from the engine, ONE C-level search: for
``"finish_reason":"`` when stripping (vLLM sends the usage event only after every
choice's finishing event, and from the first finishing event on each event is looked
at one by one), else for ``"usage"``. Neither can occur inside a JSON string value (its
quotes are escaped), so a token's text never triggers the slow path. The usage event,
as vLLM writes it, is read off its bytes with one anchored regex (:data:`_VLLM_USAGE`);
only an event of another shape is parsed with ``json.loads``.

The marks are vLLM's compact bytes: another OpenAI-compatible server (``engine.command``)
may write ``"finish_reason": "stop"``, which the mark would miss, and its usage event would
reach a client that never asked for it. So when stripping, a stream's first read takes
the slow path once and its first event decides (:meth:`StreamTap._decide`): one that
starts as vLLM's do (``data: {"id":"``) keeps the marks; any other makes the tap read
every event of that stream as JSON (slower, only for such engines). Without stripping,
the mark ``"usage"`` is every shape's key anyway.

**Every try is counted once, however it ends**: :class:`Metering` records what a try got
(status, a whole answer's count, the stream's tap) as it goes; :func:`charged` makes it
the key's count in the relay's one ``finally`` per try (relay/handlers.py): the engine's own count
when it came; nothing when the engine failed before any byte reached the client (retried,
or a 502/504: the engine's failure, not the key's) or answered an error; else an upper
bound never below what the engine did (:attr:`plan.UsagePlan.prompt_bound`, and the token
events read for a stream, times the most tokens one event may carry where vLLM puts
several in one (``stream_interval``, speculative decoding: plan.Stepping),
everything the request allowed for a whole answer).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from appliance.gateway.accounting.plan import UsagePlan
from appliance.gateway.protocols.counts import USAGE_MARK, EventUsage, Usage, usage_of
from appliance.gateway.wire.http1 import scan_chunks

FINISH_MARK = b'"finish_reason":"'
DATA_PREFIX = b"data: "

# vLLM's usage event, as its pydantic models write it (model_dump_json, fields in their
# declared order, exclude_none): the top-level fields before "choices" are matched one by
# one, so "choices":[] and "usage" are the event's own, and the counts are the first
# fields of the usage object, in UsageInfo's order (prompt, total, completion) or
# OpenAI's (prompt, completion, total). Any other shape (an escaped character in the id
# or model name, other fields, another order) fails the match and goes through json.loads.
_N = rb"(0|[1-9]\d*)"  # a JSON count: no sign, no leading zero, no fraction (see [,}])
_VLLM_USAGE = re.compile(
    rb'data: \{"id":"[^"\\]*","object":"[a-z_.]*","created":\d+,"model":"[^"\\]*",'
    rb'"choices":\[\],"usage":\{"prompt_tokens":' + _N + rb","
    rb'(?:"total_tokens":\d+,"completion_tokens":' + _N + rb"|"
    rb'"completion_tokens":' + _N + rb',"total_tokens":\d+)[,}]'
)
# The fingerprint after it, when it is plain printable ASCII (as vLLM's is): then its
# bytes are what json.dumps would write, and go back on the finishing events verbatim.
_FINGERPRINT = re.compile(rb',"system_fingerprint":("[\x20\x21\x23-\x5b\x5d-\x7e]*")[,}]')
FINGERPRINT_KEY = b',"system_fingerprint":'
FINGERPRINT_NAME = b'"system_fingerprint"'
VLLM_FIRST = b'data: {"id":"'  # how every event vLLM streams starts (its id comes first)
COMPACT = (b",", b":")  # JSON separators: vLLM's
SPACED = (b", ", b": ")  # json.dumps' default


def _event_json(payload: bytes) -> Any:
    """The JSON of one SSE ``data:`` event, or None."""
    text = payload.strip()
    if not text.startswith(DATA_PREFIX.strip()):
        return None
    try:
        return json.loads(text[len(DATA_PREFIX.strip()) :])
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _read_usage_event(payload: bytes) -> tuple[Usage, bytes | None] | None:
    """The counts of the usage event ``payload`` and its fingerprint as JSON bytes, or
    None when ``payload`` is not a usage event (``"choices":[]`` and a well-formed
    ``usage``). vLLM's own shape is read off the bytes; any other is parsed."""
    m = _VLLM_USAGE.match(payload)
    if m is not None and payload.rstrip().endswith(b"}"):
        usage = Usage(int(m[1]), int(m[2] or m[3]))
        at = payload.find(FINGERPRINT_KEY, m.end())
        if at < 0:
            return usage, None
        fp = _FINGERPRINT.match(payload, at)
        if fp is not None:
            return usage, fp[1]
        # An escaped or non-ASCII fingerprint: json.dumps decides how it is written back.
    obj = _event_json(payload)
    if not isinstance(obj, dict) or obj.get("choices") != []:
        return None
    parsed = usage_of(obj)
    if parsed is None:
        return None
    fingerprint = obj.get("system_fingerprint")
    return parsed, json.dumps(fingerprint).encode() if isinstance(fingerprint, str) else None


def _frame(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk, framed as uvicorn (h11) frames it."""
    return b"%x\r\n" % len(payload) + payload + b"\r\n"


def _with_fingerprint(
    payload: bytes, fingerprint: bytes, separators: tuple[bytes, bytes] = (b",", b":")
) -> bytes:
    """A finishing event with ``system_fingerprint`` as its last field, as vLLM writes it
    (an engine that writes spaces: as json.dumps writes it by default)."""
    body = payload.rstrip()
    if not body.endswith(b"}"):
        return payload
    tail = payload[len(body) :]
    item, key = separators
    return body[:-1] + item + FINGERPRINT_NAME + key + fingerprint + b"}" + tail


class StreamTap:
    """One stream's view of its events: the engine's usage, and how many events passed.

    ``strip``: the gateway asked for the usage event, so the client must not see it.
    ``events`` counts the events read from the engine, which stands in for the
    completion tokens when the stream ends without a usage event (vLLM sends one event
    per token step).
    """

    __slots__ = (
        "by_json",
        "events",
        "held",
        "mark",
        "preamble",
        "prompt",
        "reader",
        "separators",
        "strip",
        "usage",
    )

    @classmethod
    def for_plan(cls, plan: UsagePlan | None) -> StreamTap:
        if plan is None:
            return cls(strip=False)
        return cls(plan.added, plan.preamble, plan.reader)

    def __init__(
        self,
        strip: bool,
        preamble: int = 0,
        reader: Callable[[bytes], EventUsage | None] | None = None,
    ) -> None:
        self.strip = strip
        # What sends a read off the fast path (the module's docstring says why one suffices).
        # Stripping, b"" (found in any read) until the first event says the shape (_decide).
        self.mark = b"" if strip else USAGE_MARK
        self.by_json = False  # not vLLM's shape: every event is read as JSON
        self.separators = COMPACT  # the engine's JSON separators, for the fingerprint
        self.preamble = preamble
        self.events = 0
        self.usage: Usage | None = None
        self.held: list[bytes] | None = None  # finishing events waiting for the fingerprint
        # Another protocol's events (protocols/): read by its own reader, never stripped
        # (their streams always carry their counts). The mark stays ``"usage"``.
        self.reader = reader
        self.prompt: int | None = None  # the engine's prompt count, before its final count

    # ---- the splice path: whole HTTP/1.1 chunks, one SSE event each ----------------------
    def wire(self, wire: bytes, chunks: int = 0) -> bytes:
        """What of ``wire`` (whole chunks, ``chunks`` of them when the caller counted
        them) goes to the client now."""
        # The per-token path, inlined (_passes): one call per read from the engine.
        if self.mark not in wire and (self.held is None or USAGE_MARK not in wire):
            self.events += chunks or len(scan_chunks(wire)[1])
            return wire
        _, payloads, _ = scan_chunks(wire)
        self.events += len(payloads)
        out = self._events(payloads)
        if out == payloads:
            return wire  # nothing taken out (the stream's first read, say): as it came
        return b"".join(_frame(p) for p in out)

    def last(self, wire: bytes) -> bytes:
        """The whole chunks before the body's end, then any events still held (the
        stream ended without its usage event): what the client gets last."""
        out = self.wire(wire) if wire else b""
        held, self.held = self.held, None
        return out + b"".join(_frame(p) for p in held or ())

    # ---- the aiohttp client path (HTTP/1.0 clients): SSE bytes in any pieces ------------
    def sse(self, data: bytes, pending: bytearray) -> bytes:
        """What of ``data`` goes to the client now; a partial event waits in ``pending``."""
        pending += data
        end = pending.rfind(b"\n\n")
        if end < 0:
            return b""
        whole = bytes(pending[: end + 2])
        del pending[: end + 2]
        events = [e + b"\n\n" for e in whole.split(b"\n\n")[:-1]]
        self.events += len(events)
        if self._passes(whole):
            return whole
        return b"".join(self._events(events))

    def flush_sse(self, pending: bytearray, broken: bool = False) -> bytes:
        """What is held at the end; a ``broken`` stream's partial event is dropped."""
        held, self.held = self.held, None
        out = b"".join(held or ()) + (b"" if broken else bytes(pending))
        pending.clear()
        return out

    # ---- both ------------------------------------------------------------------------
    def _passes(self, data: bytes) -> bool:
        """Whether ``data`` goes on untouched: no usage event in it (when stripping: no
        finishing event, which comes first, nor, once one is held, the usage event). One
        C-level search, two while a finishing event waits."""
        return self.mark not in data and (self.held is None or USAGE_MARK not in data)

    def _decide(self, first: bytes) -> None:
        """The shape of this stream's events, from its first: vLLM's compact one keeps the
        byte marks, any other is read event by event as JSON."""
        if first.startswith(VLLM_FIRST):
            self.mark = FINISH_MARK
            return
        self.by_json = True  # self.mark stays b"": every read is looked at
        key = first.find(b'":')  # the first key's colon: structure, never a value's text
        if first[key + 2 : key + 3] == b" ":
            self.separators = SPACED

    def _finishes(self, payload: bytes) -> bool:
        """Whether ``payload`` is a finishing event (some choice has a finish_reason)."""
        if not self.by_json:
            return FINISH_MARK in payload
        obj = _event_json(payload)
        choices = obj.get("choices") if isinstance(obj, dict) else None
        return isinstance(choices, list) and any(
            isinstance(c, dict) and c.get("finish_reason") is not None for c in choices
        )

    def _events(self, payloads: list[bytes]) -> list[bytes]:
        if not self.mark and not self.by_json and payloads:
            self._decide(payloads[0])
        out: list[bytes] = []
        for payload in payloads:
            if USAGE_MARK in payload and self._take_usage(payload, out):
                continue
            if self.strip and self._finishes(payload):
                if self.held is None:
                    self.held = []
                self.held.append(payload)
                continue
            out.append(payload)
        return out

    def _take_usage(self, payload: bytes, out: list[bytes]) -> bool:
        """Whether ``payload`` was the usage event and is not for the client."""
        if self.reader is not None:
            got = self.reader(payload)
            if got is not None and got.completion is None:
                self.prompt = got.prompt
            elif got is not None and got.completion is not None:
                self.usage = Usage(got.prompt, got.completion)
            return False  # the client asked for this protocol's stream as it is
        found = _read_usage_event(payload)
        if found is None:
            return False  # continuous usage on a token event (the client asked): pass on
        self.usage, fp = found
        self.events -= 1  # not a token event
        if not self.strip:
            return False
        for held in self.held or ():
            if fp is not None and FINGERPRINT_NAME not in held:
                held = _with_fingerprint(held, fp, self.separators)
            out.append(held)
        self.held = None
        return True

    def produced(self) -> int:
        """Completion tokens when no usage event came (the engine was killed, the client
        left): the token events read, less a chat stream's role event. vLLM sends one
        event per token step (its last token rides on the finishing event), so this is
        what was produced, give or take a ``[DONE]`` that came without a usage event."""
        return max(self.events - self.preamble, 0)


@dataclass(slots=True)
class Metering:
    """What one try on one engine got, filled in as it goes by the relay path that runs
    it, and read once when it ends (:func:`charged`), however it ends."""

    failed: bool = False  # an engine failure before any byte reached the client
    status: int = 0  # the engine's answer status, once its head came
    answer: Usage | None = None  # a whole answer's own count
    tap: StreamTap | None = None  # a stream's: its usage event and the token events read


def charged(meter: Metering, plan: UsagePlan | None) -> Usage:
    """What a try is counted for its key (the module's docstring says why)."""
    if meter.failed or meter.status not in (0, 200):
        return Usage(0, 0)
    tap = meter.tap
    if tap is not None and tap.usage is not None:
        return tap.usage
    if tap is None and meter.answer is not None:
        return meter.answer
    if plan is None:  # every relayed request has a plan (request_body.finish_body)
        return Usage(0, tap.produced() if tap is not None else 0)
    # Cut off before the engine's count (a break, a client gone, an abandoned engine):
    # a stream is charged the tokens its events read may hold (one each, unless the
    # engine puts several in one: UsagePlan.produced_bound; the engine stops within a
    # step of its connection closing), a whole answer everything it was allowed.
    if tap is not None:
        prompt = tap.prompt if tap.prompt is not None else plan.prompt_bound
        return Usage(prompt, plan.produced_bound(tap.produced()))
    return Usage(plan.prompt_bound, 0 if plan.stream else plan.completion_bound)
