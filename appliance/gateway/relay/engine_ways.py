"""What the two ways to an engine need (via_client.py, via_splice.py): the config in
force (read per request: a SIGHUP may change its live keys), aiohttp's
client sessions per engine, the keep-alive pool of spliced streams, and the first-byte
timer. The relay gets one of these from app.py instead of the whole gateway."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from appliance.config import Config
from appliance.endpoint import EngineAddress, EngineOwner
from appliance.gateway.wire.upstream_pool import UpstreamPool


class FirstByte(Protocol):
    """Records the time to a request's first byte (``GatewayMetrics.first_byte``)."""

    def __call__(self, route: str, model: str, started: float) -> None: ...


class EngineSessions:
    """Non-streamed requests' engine connections: one aiohttp client session per engine
    address (a Unix socket needs a connector of its own), made on first use."""

    def __init__(self, owner_of: Callable[[EngineAddress], EngineOwner | None]) -> None:
        self._owner_of = owner_of  # whose a TCP engine's connections must be
        self._sessions: dict[EngineAddress, aiohttp.ClientSession] = {}

    def session_for(self, address: EngineAddress) -> aiohttp.ClientSession:
        session = self._sessions.get(address)
        if session is None:
            # Many concurrent requests: aiohttp's default of 100 connections would queue
            # them. Idle connections are dropped after 2 s, before vLLM's own 5 s close can
            # race a request sent on one (aiohttp does not retry a POST;
            # upstream_pool.MAX_IDLE_S likewise). A TCP engine's new connections are
            # checked to be its own before a request is written on them.
            connector = address.connector(
                self._owner_of(address), limit=0, force_close=False, keepalive_timeout=2.0
            )
            session = aiohttp.ClientSession(
                connector=connector,
                trust_env=False,
                auto_decompress=False,
            )
            self._sessions[address] = session
        return session

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()


@dataclass(frozen=True)
class EngineWays:
    config: Callable[[], Config]
    sessions: EngineSessions
    upstreams: UpstreamPool
    first_byte: FirstByte
