"""One engine's LoRA adapters: made to match what its model wants, from its runner's task.

The runner keeps the engine's state; this keeps whether its adapters may be out of date
(an admin's add or remove: :class:`~appliance.supervisor.commands.SyncAdapters`, or a
start or wake) and syncs them: what the engine serves is read from the engine itself
(vLLM lists its adapters in ``/v1/models``), what is wanted from
:mod:`~appliance.supervisor.adapters`; the missing ones are loaded, the unwanted ones
unloaded, through vLLM's development routes on the engine's private socket. Nothing
here changes the engine's lifecycle state, and a failed load never stops the engine: it
is said in the journal and to the admin who asked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from appliance.config.lora import AdapterError, adapter_rank
from appliance.engine import EngineSpec
from appliance.supervisor.commands import AdapterClient, SyncAdapters
from appliance.supervisor.inbox import Inbox

log = logging.getLogger("appliance.supervisor")

SYNC_TIMEOUT_S = 60.0  # one load: vLLM reads the weights and puts them on the device


class EngineAdapters:
    def __init__(
        self,
        spec: EngineSpec,
        wanted: Callable[[], Mapping[str, str]] | None,
        client: AdapterClient | None,
    ) -> None:
        self.spec = spec
        self._wanted = wanted
        self._client = client
        self.stale = False  # a sync is due at the runner's next look
        self._asked: list[asyncio.Future[dict[str, str]]] = []

    @property
    def enabled(self) -> bool:
        """Whether this engine serves adapters at all (started with --enable-lora)."""
        return bool(self.spec.lora_rank) and self._wanted is not None and self._client is not None

    def obey(self, command: SyncAdapters, running: bool) -> None:
        """An admin's change: sync at the next look; its asker waits for that sync when
        the engine runs, else is answered now (a start or wake syncs it before READY)."""
        self.stale = self.enabled
        if command.done is None:
            return
        if running and self.stale:
            self._asked.append(command.done)
        elif not command.done.done():
            command.done.set_result({})

    async def sync(self, api_key: str, inbox: Inbox) -> None:
        """Load what is wanted and missing, unload what is served and not wanted; each
        failure said once in the journal and to the askers of this sync."""
        asked, self._asked, self.stale = self._asked, [], False
        errors = await inbox.busy(self._sync(api_key)) if self.enabled else {}
        for done in asked:
            if not done.done():
                done.set_result(errors)

    def drop_askers(self) -> None:
        """The engine is going down: its askers are answered (it syncs at its next start)."""
        asked, self._asked = self._asked, []
        for done in asked:
            if not done.done():
                done.set_result({})

    async def _sync(self, api_key: str) -> dict[str, str]:
        assert self._wanted is not None and self._client is not None
        client, name = self._client, self.spec.name
        served = await client.served_adapters(api_key, SYNC_TIMEOUT_S)
        if isinstance(served, str):
            log.error("%s: its LoRA adapters could not be read (%s)", name, served)
            return dict.fromkeys(self._wanted(), served)
        errors: dict[str, str] = {}
        wanted = dict(self._wanted())
        for adapter in sorted(set(served) - set(wanted)):
            failed = await client.unload_adapter(api_key, adapter, SYNC_TIMEOUT_S)
            self._said(errors, adapter, "unloaded", failed)
        for adapter, path in sorted(wanted.items()):
            if served.get(adapter) == path:
                continue
            if adapter in served:  # the same name from another folder: replaced
                await client.unload_adapter(api_key, adapter, SYNC_TIMEOUT_S)
            failed = _unsafe(path)  # checked again: the folder may have changed since
            if failed is None:
                failed = await client.load_adapter(api_key, adapter, path, SYNC_TIMEOUT_S)
            self._said(errors, adapter, "loaded", failed)
        return errors

    def _said(self, errors: dict[str, str], adapter: str, done: str, failed: str | None) -> None:
        if failed is None:
            log.info("%s: LoRA adapter %s %s", self.spec.name, adapter, done)
            return
        errors[adapter] = failed
        log.error("%s: LoRA adapter %s could not be %s: %s", self.spec.name, adapter, done, failed)


def _unsafe(path: str) -> str | None:
    """Why the appliance will not hand vLLM this folder now (config/lora.py), or None."""
    try:
        adapter_rank(path)
    except AdapterError as exc:
        return f"path {path!r}: {exc}"
    return None
