"""How a runner asks its engine how it is: health checks and KV reads over HTTP.

One client session per engine, whose connector reaches that engine's address only (a
Unix socket needs a connector of its own). Over TCP the connector is the same checked
one the gateway's relay uses (:meth:`appliance.endpoint.EngineAddress.connector`): each
new connection must reach a socket of the engine's own process tree before the probe
writes its request (and the engine key) on it. The checks themselves are in
:mod:`appliance.health`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import aiohttp

from appliance import proctree
from appliance.endpoint import EngineOwner
from appliance.engine import EngineSpec
from appliance.health import Observation, observe, read_kv_usage


class HttpProbe:
    def __init__(self, spec: EngineSpec, pid: Callable[[], int | None]) -> None:
        """``pid``: the engine's API server now (None: not running)."""
        self._spec = spec
        # A refused connection is a failed check; the listener check before each one
        # (watch.py) names who holds the port.
        self._owner = EngineOwner(pid=pid, tree=proctree.tree_pids)
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=self._spec.address.connector(self._owner, limit=0), trust_env=False
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

    # ---- sleep mode (commands.Sleeper): vLLM's development routes, private socket only --
    async def sleep(self, api_key: str, timeout_s: float) -> str | None:
        return await self._post("/sleep?level=1", api_key, timeout_s)

    async def wake_up(self, api_key: str, timeout_s: float) -> str | None:
        return await self._post("/wake_up", api_key, timeout_s)

    # ---- LoRA adapters (commands.AdapterClient): development routes, private socket only --
    async def served_adapters(self, api_key: str, timeout_s: float) -> dict[str, str] | str:
        """The adapters the engine serves (vLLM lists them in /v1/models with a parent)."""
        assert self._session is not None
        try:
            async with self._session.get(
                self._spec.address.base_url + "/v1/models",
                headers={"Authorization": f"Bearer {api_key}"},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as r:
                body = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            return f"GET /v1/models: {e.__class__.__name__}: {e}"
        cards = body.get("data") if isinstance(body, dict) else None
        if not isinstance(cards, list):
            return "GET /v1/models: not a model list"
        return {
            str(c.get("id")): str(c.get("root"))
            for c in cards
            if isinstance(c, dict) and c.get("parent")
        }

    async def load_adapter(
        self, api_key: str, name: str, path: str, timeout_s: float
    ) -> str | None:
        body = {"lora_name": name, "lora_path": path}
        return await self._post("/v1/load_lora_adapter", api_key, timeout_s, body)

    async def unload_adapter(self, api_key: str, name: str, timeout_s: float) -> str | None:
        return await self._post("/v1/unload_lora_adapter", api_key, timeout_s, {"lora_name": name})

    async def _post(
        self, path: str, api_key: str, timeout_s: float, body: dict[str, str] | None = None
    ) -> str | None:
        """None when the engine says 200; else why not (its own message when it gave one)."""
        assert self._session is not None
        url = self._spec.address.base_url + path
        try:
            async with self._session.post(
                url,
                headers={"Authorization": f"Bearer {api_key}"},
                json=body,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as r:
                if r.status == 200:
                    return None
                text = (await r.text())[:2000]
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return f"POST {path}: {e.__class__.__name__}: {e}"
        return f"POST {path}: HTTP {r.status}: {_message(text)}"


def _message(text: str) -> str:
    """vLLM's error message out of its answer (``{"error": {"message": ...}}``), else the
    text as it came."""
    try:
        error = json.loads(text).get("error")
        return str(error.get("message")) if isinstance(error, dict) else text
    except (ValueError, AttributeError):
        return text
