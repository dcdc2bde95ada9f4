"""How much JSON structure one request body may carry.

A body's size is bounded (``gateway.max_body_bytes``), but not what it becomes in memory:
``"tools":[{},{},...]`` is 3 bytes per empty object in the body and about 70 in the
daemon, and costs nothing in tokens, so 40 such 1 MiB bodies passed admission at cost ~0
and took the daemon's RSS from 49 MB to 456 MB while they waited for an engine (and the
engine's own parser would pay again). So a body may hold at most :data:`MAX_CONTAINERS`
objects and arrays, :data:`MAX_VALUES` values in all and :data:`MAX_DEPTH` levels of
nesting, far above what any chat, tools or embeddings request needs (a 128-tool request
with full JSON schemas is a few thousand containers), and beyond that it is a 400 that
names the limit before it is admitted anywhere.

Counted in two steps, so the usual request pays two byte counts and nothing else:

1. :func:`may_exceed` bounds the structure from the raw bytes: every ``{``, ``[`` and
   ``,`` counted as if none sat inside a string. Under the limits, the body is within
   them (strings can only make the true count smaller), which is nearly every request.
2. Only above that bound, :func:`check_structure` counts the parsed body exactly (prompt
   text full of commas and braces is not structure). An exact count over the raw bytes
   would need a string-aware scan: in Python, slow or (with a regex over quoted strings)
   quadratic on a body of escaped quotes. ``json.loads`` runs on the event loop, one body
   at a time, so at most one over-limit body is ever in memory, and it is dropped at
   once.
"""

from __future__ import annotations

from typing import Any

MAX_CONTAINERS = 16_384
MAX_VALUES = 262_144
MAX_DEPTH = 128


class TooMuchStructure(ValueError):
    """The body is over one of the limits; ``str()`` names it for the client."""


def may_exceed(raw: bytes) -> bool:
    """Whether ``raw`` could be over a limit: an upper bound from byte counts alone."""
    containers = raw.count(b"{") + raw.count(b"[")
    if containers <= MAX_DEPTH:  # so nesting is within MAX_DEPTH too
        return containers + raw.count(b",") + 1 > MAX_VALUES
    return True


def check_structure(body: Any) -> None:
    """Raise :class:`TooMuchStructure` when the parsed ``body`` is over a limit.

    Iterative (no recursion on a deep body) and it stops at the first limit passed, so
    its work is bounded by the limits, not by the body."""
    values = 1  # every value seen so far: popped or waiting on the stack
    containers = 0
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        containers += 1
        if containers > MAX_CONTAINERS:
            raise TooMuchStructure(
                f"the request body holds more than {MAX_CONTAINERS} JSON objects and arrays, "
                "the most the gateway accepts in one request"
            )
        if depth > MAX_DEPTH:
            raise TooMuchStructure(
                f"the request body nests JSON more than {MAX_DEPTH} levels deep, the most "
                "the gateway accepts"
            )
        values += len(children)
        if values > MAX_VALUES:
            raise TooMuchStructure(
                f"the request body holds more than {MAX_VALUES} JSON values, the most the "
                "gateway accepts in one request"
            )
        stack.extend((child, depth + 1) for child in children)
