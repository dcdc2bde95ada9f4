"""The pool of keep-alive connections to the engines that streamed requests use.

One idle list per engine address (socket or port), most recently used first; a
connection goes back only when its answer was read whole (splice.py's
``UpstreamConnection.finished``), and one idle too long is closed instead of reused, as
is one the engine wrote to while it was idle (it closes itself: splice.py's ``_stray``).
A new connection to a TCP engine is checked to be the engine's before the request is
written on it (``EngineAddress.connect`` with the engine's owner): once per connection,
not per request; a Unix socket's needs no check.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import cast

from appliance.endpoint import EngineAddress, EngineOwner
from appliance.gateway.wire.http1 import UpstreamError
from appliance.gateway.wire.splice import UpstreamConnection

MAX_IDLE_PER_ENGINE = 1024
# vLLM's server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): reusing
# one near that age races its close, and the request would fail as if the engine had.
# Idle longer than this, a connection is closed instead of reused.
MAX_IDLE_S = 2.0
CONNECT_TIMEOUT_S = 5.0


class UpstreamPool:
    """Keep-alive connections to the engines, per engine address (socket or port)."""

    def __init__(self, owner_of: Callable[[EngineAddress], EngineOwner | None]) -> None:
        """``owner_of``: whose processes a TCP engine's connections must reach."""
        self._owner_of = owner_of
        self._idle: collections.defaultdict[
            EngineAddress, collections.deque[UpstreamConnection]
        ] = collections.defaultdict(collections.deque)

    async def acquire(self, address: EngineAddress) -> UpstreamConnection:
        idle = self._idle[address]
        loop = asyncio.get_running_loop()
        fresh_after = loop.time() - MAX_IDLE_S
        while idle:
            conn = idle.pop()  # the most recently used first
            if conn.transport is None or conn.transport.is_closing():
                continue
            if not conn.finished:  # never one with bytes beyond its last answer
                conn.transport.close()
                continue
            if conn.idle_since < fresh_after:
                # This one and all older ones are too close to the engine's own close.
                conn.transport.close()
                while idle:
                    old = idle.popleft()
                    if old.transport is not None:
                        old.transport.close()
                break
            return conn
        try:
            _, protocol = await asyncio.wait_for(
                address.connect(UpstreamConnection, self._owner_of(address)), CONNECT_TIMEOUT_S
            )
            conn = cast(UpstreamConnection, protocol)
        except TimeoutError:
            raise UpstreamError("timeout connecting to the engine", timed_out=True) from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to the engine ({type(exc).__name__})") from None
        return conn

    def release(self, address: EngineAddress, conn: UpstreamConnection) -> None:
        """Back to the pool when its answer was read whole; closed otherwise (which, in
        the middle of an answer, is what makes vLLM abort the generation)."""
        if conn.transport is None:
            return
        idle = self._idle[address]
        if conn.finished and len(idle) < MAX_IDLE_PER_ENGINE:
            conn.idle_since = asyncio.get_running_loop().time()
            idle.append(conn)
        else:
            conn.transport.close()

    def close(self) -> None:
        for idle in self._idle.values():
            while idle:
                conn = idle.pop()
                if conn.transport is not None:
                    conn.transport.close()
