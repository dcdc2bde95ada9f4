"""What reading a stream's usage costs per route, on vLLM 0.32's own stream bytes.

No engine, no daemon: the streams recorded from a real vLLM engine
(``tests/data/vllm-0.32-streams``: chat with the usage event the gateway asks for,
Responses, Messages) go through the gateway's tap (``usage_events.StreamTap`` with the
route's reader) as the relay feeds it: on the splice path one whole chunk per read, on
the HTTP/1.0 path the SSE bytes in 1,000-byte reads. ``--tokens N`` grows each stream to
N token events (the recorded ones repeated) and the final Responses event's text with it,
as a longer answer would. Per route: CPU µs per stream and ns per event (the process's
CPU time, so a busy machine slows it less than wall time), best of ``--repeat`` runs;
the usage read must be the engine's.

This is the protocol-specific part of the gateway's per-event work; the relay around it
(reads, writes, the event loop) is the same for every route (``bench.gateway_overhead
--route`` measures it whole). To compare two trees, run it with each on PYTHONPATH.

    .venv/bin/python -m bench.protocol_taps [--tokens 16,256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from appliance.gateway.accounting.stream_tap import StreamTap
from appliance.gateway.protocols import ROUTES
from appliance.gateway.protocols.counts import Usage
from bench._common import Table

DATA = Path(__file__).parents[1] / "tests" / "data" / "vllm-0.32-streams"
ROUTE_NAMES = ("chat", "responses", "messages")
TOKEN_EVENT = {
    "chat": b'"delta":{"content":',
    "responses": b"event: response.output_text.delta\n",
    "messages": b"event: content_block_delta\n",
}


def events(route: str, tokens: int) -> list[bytes]:
    """The recorded stream, its token events repeated to ``tokens`` of them."""
    raw = (DATA / f"{route}.sse").read_bytes()
    evs = [e + b"\n\n" for e in raw.split(b"\n\n") if e]
    at = [i for i, e in enumerate(evs) if TOKEN_EVENT[route] in e and b'"finish_reason":"' not in e]
    token_events = [evs[i] for i in at]
    grown = [token_events[i % len(token_events)] for i in range(tokens)]
    out = evs[: at[0]] + grown + evs[at[-1] + 1 :]
    if route == "responses":
        out = [_longer_text(e, tokens) for e in out]
    return out


def _longer_text(event: bytes, tokens: int) -> bytes:
    """The final event with an answer of ``tokens`` words, as vLLM would repeat it there."""
    if not event.startswith(b"event: response.completed\n"):
        return event
    head, body = event.split(b"data: ", 1)
    obj = json.loads(body)
    obj["response"]["output"][0]["content"][0]["text"] = " word" * tokens
    return head + b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def tap_for(route: str) -> Callable[[], StreamTap]:
    if route == "chat":  # the gateway asked for the usage event: it takes it out again
        return lambda: StreamTap(strip=True, preamble=1)
    spec = ROUTES[route]
    return lambda: StreamTap(strip=False, preamble=spec.preamble, reader=spec.event_usage)


def splice_path(make: Callable[[], StreamTap], evs: list[bytes]) -> Usage | None:
    tap = make()
    for e in evs:
        tap.wire(b"%x\r\n" % len(e) + e + b"\r\n", 1)
    tap.last(b"")
    return tap.usage


def http10_path(make: Callable[[], StreamTap], evs: list[bytes]) -> Usage | None:
    raw = b"".join(evs)
    tap, pending = make(), bytearray()
    for i in range(0, len(raw), 1000):
        tap.sse(raw[i : i + 1000], pending)
    tap.flush_sse(pending)
    return tap.usage


def best_s(run: Callable[[], object], n: int, repeat: int) -> float:
    """CPU seconds per call (the process's own: time another process takes from it on a
    shared machine is not counted), best of ``repeat`` runs of ``n`` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(n):
            run()
        best = min(best, (time.process_time() - t0) / n)
    return best


def measure(tokens: int, repeat: int) -> Table:
    t = Table(["route", "events", "splice µs/stream", "ns/event", "HTTP/1.0 µs/stream", "ns/event"])
    for route in ROUTE_NAMES:
        evs, make = events(route, tokens), tap_for(route)
        got = splice_path(make, evs)
        if got is None or got != http10_path(make, evs):
            raise SystemExit(f"{route}: the tap did not read the engine's usage ({got})")
        n = max(200, 200_000 // len(evs))
        s = best_s(lambda: splice_path(make, evs), n, repeat)  # noqa: B023
        h = best_s(lambda: http10_path(make, evs), n, repeat)  # noqa: B023
        t.add(route, len(evs), f"{s * 1e6:.1f}", f"{s * 1e9 / len(evs):.0f}", f"{h * 1e6:.1f}",
              f"{h * 1e9 / len(evs):.0f}")  # fmt: skip
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="16,256", help="token events per stream, comma-separated")
    ap.add_argument("--repeat", type=int, default=5, help="runs per figure; the best is kept")
    args = ap.parse_args()
    for tokens in (int(x) for x in args.tokens.split(",")):
        print(f"\n{tokens}-token streams (vLLM 0.32's bytes, {DATA.name}):\n")
        print(measure(tokens, args.repeat).markdown())


if __name__ == "__main__":
    main()
