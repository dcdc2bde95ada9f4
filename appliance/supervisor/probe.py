"""How a runner asks its engine how it is: health checks and KV reads over HTTP.

One client session per engine, whose connector reaches that engine's address only (a
Unix socket needs a connector of its own); the checks themselves are in
:mod:`appliance.health`.
"""

from __future__ import annotations

import aiohttp

from appliance.engine import EngineSpec
from appliance.health import Observation, observe, read_kv_usage


class HttpProbe:
    def __init__(self, spec: EngineSpec) -> None:
        self._spec = spec
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=self._spec.address.connector(limit=0), trust_env=False
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def observe(self, api_key: str, timeout_s: float) -> Observation:
        """One health check in layers (see :func:`appliance.health.observe`)."""
        assert self._session is not None
        spec = self._spec
        return await observe(
            self._session,
            spec.address.base_url,
            api_key,
            spec.served_model_name,
            timeout_s,
            task=spec.task,
        )

    async def kv_usage(self, timeout_s: float) -> float | None:
        assert self._session is not None
        return await read_kv_usage(self._session, self._spec.address.base_url, timeout_s)
