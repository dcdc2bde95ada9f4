"""Requests in flight per LoRA adapter name, so that removing an adapter cuts none.

A request for an adapter is counted from the moment the relay resolves its name until
its answer ends (the middleware's last word), whether it waits in the queue or streams.
The supervisor asks through the link (:meth:`Gateway.adapter_requests`) before it
unloads a removed adapter from the engines: the name is already gone from routing then,
so the count only falls. Without the wait, a request admitted before the removal could
reach the engine after it and get vLLM's own 404.
"""

from __future__ import annotations

from collections import Counter

from aiohttp import web

_HELD = "appliance.adapter_held"  # the adapter name a request is counted under


class AdapterWork:
    def __init__(self) -> None:
        self._count: Counter[str] = Counter()

    def begin(self, request: web.Request, name: str) -> None:
        if request.get(_HELD) is None:
            request[_HELD] = name
            self._count[name] += 1

    def end(self, request: web.Request) -> None:
        name = request.get(_HELD)
        if name is not None:
            request[_HELD] = None
            self._count[name] -= 1
            if self._count[name] <= 0:
                del self._count[name]

    def count(self, name: str) -> int:
        return self._count.get(name, 0)
