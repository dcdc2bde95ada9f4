"""What prefix routing costs per request: hashing a long prompt and looking it up.

A chat request of about 20k tokens (~80 kB of text: a shared system prompt, a long
document, a few turns), parsed as the relay parses it (``request_body.parse_body``) with
``gateway.prefix_routing`` on and off, and the parts on their own: the prompt text, its
block hashes, the lookup and the record in an index filled to its bound. The best of
several rounds, in µs (timeit's advice: slower rounds measure the other processes on
the box, not the code), printed; no daemon, no engine.

    .venv/bin/python -m bench.prefix_cost [--rounds 7] [--number 200] [--kb 80]

Compare with the gateway's whole added TTFT at one stream (docs/performance.md:
+0.74-0.97 ms) and with json.loads of the same body, which every request pays already.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import timeit
from collections.abc import Callable

from appliance.config import GatewayConfig
from appliance.gateway.admission.prefix_index import INDEX_BLOCKS, PrefixIndex, prompt_blocks
from appliance.gateway.protocols import prompt_text
from appliance.gateway.relay.request_body import parse_body


def body(kb: int) -> bytes:
    rng = random.Random(1)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(5000)]
    doc = " ".join(rng.choices(words, k=kb * 1024 // 6))[: kb * 1024 - 3000]
    msgs = [
        {"role": "system", "content": "You are a careful assistant. " * 40},
        {"role": "user", "content": doc + "\nWhat is this about?"},
    ]
    for t in range(3):
        msgs += [
            {"role": "assistant", "content": f"Answer {t}: " + "it is about words. " * 20},
            {"role": "user", "content": f"Follow-up {t}?"},
        ]
    return json.dumps({"model": "m", "max_tokens": 64, "messages": msgs}).encode()


def best_us(fn: Callable[[], object], rounds: int, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=rounds)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--kb", type=int, default=80)
    a = ap.parse_args()
    raw = body(a.kb)
    on, off = GatewayConfig(prefix_routing=True), GatewayConfig(prefix_routing=False)
    fields = json.loads(raw)
    text = prompt_text.chat(fields) or ""
    blocks = prompt_blocks(text)
    # An index at its bound: other conversations' blocks, then this one's on engine 0.
    index = PrefixIndex()
    filler = 0
    while len(index) < INDEX_BLOCKS:
        index.record(filler % 2, tuple(range(filler * 1000, filler * 1000 + 1000)))
        filler += 1
    index.record(0, blocks)

    def lookup_and_record() -> None:
        index.matched(blocks)
        index.record(0, blocks)

    def run(fn: Callable[[], object]) -> float:
        return best_us(fn, a.rounds, a.number)

    rows = [
        ("json.loads of the body (paid today)", run(lambda: json.loads(raw))),
        (
            "parse_body, prefix_routing = false",
            run(lambda: parse_body("chat", raw, {}, off, 32768)),
        ),
        ("parse_body, prefix_routing = true", run(lambda: parse_body("chat", raw, {}, on, 32768))),
        ("  prompt text (protocols/prompt_text)", run(lambda: prompt_text.chat(fields))),
        ("  block hashes (prompt_blocks)", run(lambda: prompt_blocks(text))),
        ("  lookup + record in a full index", run(lookup_and_record)),
    ]
    forget = PrefixIndex()
    for i in range(INDEX_BLOCKS // 1000):
        forget.record(i % 2, tuple(range(i * 1000, i * 1000 + 1000)))
    forget_us = best_us(lambda: forget.forget(0), 1, 1)  # once: then nothing is left
    print(
        f"prompt: {len(raw) / 1024:.0f} kB body, {len(text):,} characters of prompt text "
        f"(~{len(text) // 4:,} tokens), {len(blocks)} blocks; index {len(index):,} blocks"
    )
    for name, us in rows:
        print(f"{name:<42} {us:9.1f} µs")
    added = rows[2][1] - rows[1][1]
    print(f"{'added per request (on - off)':<42} {added:9.1f} µs")
    print(f"{'forget one engine (full index, rare)':<42} {forget_us:9.1f} µs")


if __name__ == "__main__":
    main()
