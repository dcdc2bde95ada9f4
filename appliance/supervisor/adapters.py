"""LoRA adapters served as models (issue 23): the one owner of which adapters each model
serves, and of the admin's ones kept across restarts.

::

    gateway: add_adapter / remove_adapter ──► AdapterBook (here)
        add:     folder, name and rank checked ─► wanted ─► SyncAdapters to each runner
                 of the base model (each loads it on its engine, from its own task)
                 ─► all loaded: kept in adapters.json; one refused: taken back, 4xx
        remove:  forgotten ─► SyncAdapters (each unloads it) ─► adapters.json
    a runner, before its engine is READY (a start, a wake): synced to ``wanted``

A model's adapters in the config are its own from the start (vLLM ``--lora-modules``);
the admin's are kept in ``adapters.json`` beside the keys file (0600, written
atomically), loaded again at every start of an engine, and their ranks size the
engines' ``--max-lora-rank`` at the daemon's next start. A config reload changes
neither (a model's keys need a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from appliance.config import Config, ServedModel
from appliance.config.lora import NAME_RULE, AdapterError, UnsafeAdapter, adapter_rank, good_name
from appliance.control import AdapterResult, AdapterStatus
from appliance.fsutil import FileWriteError
from appliance.supervisor.adapters_file import Kept, KeptFileError, read_file, write_file
from appliance.supervisor.commands import SyncAdapters
from appliance.supervisor.runner import EngineRunner

log = logging.getLogger("appliance.supervisor")

ANSWER_WAIT_S = 120.0  # every engine's load (vLLM reads the weights) answered by then
NO_ANSWER = "*"  # in _sync's errors: an engine that did not answer in time
# A removal waits for requests still queued for the adapter (see AdapterBook._settle).
SETTLE_MAX_S = 60.0
SETTLE_MARGIN_S = 5.0
SETTLE_POLL_S = 0.05


def read_kept(path: Path, served: Sequence[ServedModel]) -> tuple[list[Kept], str | None]:
    """The admin's adapters kept in ``path``, those that still fit the config (a base
    model gone or a name now the config's is left out, said once); and why the file
    cannot be used (None: it can), said in the journal."""
    try:
        kept, warning = read_file(path)
    except KeptFileError as exc:
        log.error("%s: no adapter added at run time is served", exc)
        return [], str(exc)
    if warning is not None:
        log.warning("%s", warning)
    models = {m.name for m in served}
    taken = {n for m in served for n in (*m.names, *(a.name for a in m.adapters))}
    out = []
    for k in kept:
        if k.model not in models or k.name in taken or not good_name(k.name):
            log.warning("%s: adapter %s (of %s) left out: no longer fits", path, k.name, k.model)
            continue
        taken.add(k.name)
        out.append(k)
    return out, None


class AdapterBook:
    def __init__(
        self,
        config: Callable[[], Config],
        path: Path,
        busy: Callable[[str], int] = lambda name: 0,
    ) -> None:
        """``busy``: the gateway's requests for an adapter name not yet answered."""
        self._config = config
        self._path = path
        self._busy = busy
        kept, self._unreadable = read_kept(path, config().served)
        self._kept = {k.name: k for k in kept}
        self._runners: list[EngineRunner] = []
        self._lock = asyncio.Lock()  # one admin change at a time
        self._names: dict[str, str] = {}
        self._index()

    def attach(self, runners: Sequence[EngineRunner]) -> None:
        self._runners = list(runners)

    def kept_ranks(self) -> dict[str, list[int]]:
        """Per model, the ranks of its kept adapters (the plan sizes --max-lora-rank)."""
        out: dict[str, list[int]] = {}
        for k in self._kept.values():
            with contextlib.suppress(AdapterError):  # said when its engines load it
                out.setdefault(k.model, []).append(adapter_rank(k.path))
        return out

    # ---- what the gateway and the runners read ----------------------------------------
    def names(self) -> Mapping[str, str]:
        return self._names

    def adapters(self) -> tuple[AdapterStatus, ...]:
        config = tuple(
            AdapterStatus(a.name, m.name, a.path, "config")
            for m in self._config().served
            for a in m.adapters
        )
        admin = (AdapterStatus(k.name, k.model, k.path, "admin") for k in self._kept.values())
        return (*config, *admin)

    def wanted(self, model: str) -> dict[str, str]:
        """What the engines of ``model`` should serve: adapter name -> folder."""
        return {a.name: a.path for a in self.adapters() if a.model == model}

    def _index(self) -> None:
        # Replaced, never changed in place: the gateway may hold the last one.
        self._names = {a.name: a.model for a in self.adapters()}

    # ---- the admin's changes ----------------------------------------------------------
    async def add(self, model: str, name: str, path: str) -> AdapterResult:
        async with self._lock:
            base = self._config().model(model)
            refused = self._unusable() or self._check_add(base, name, path)
            if refused is not None:
                return refused
            assert base is not None
            self._kept[name] = Kept(name, base.name, path)  # wanted: the engines load it
            errors = await self._sync(base.name)
            failed = errors.get(name)
            late = errors.get(NO_ANSWER)  # not known to serve it: never routed there
            saved = None if failed is not None or late else await self._save()
            if failed is not None or late or saved is not None:
                del self._kept[name]
                if late:  # told, not awaited: the late engine would hold the admin again
                    self._tell(base.name)
                else:
                    await self._sync(base.name)  # taken back where it did load
                return saved or _add_failed(name, failed, late)
            self._index()  # routed only now: each engine serves it
            log.info("adapter %s: added to %s from %s", name, base.name, path)
            return AdapterResult(200)

    async def remove(self, model: str, name: str) -> AdapterResult:
        async with self._lock:
            base = self._config().model(model)
            owner = self._names.get(name)
            if base is None or owner != base.name:
                what = f"'{model}'" if base is None else f"the model '{base.name}'"
                return AdapterResult(404, f"{what} has no adapter '{name}'", "adapter_not_found")
            if (unusable := self._unusable()) is not None:
                return unusable
            kept = self._kept.pop(name, None)
            if kept is None:
                return AdapterResult(
                    409,
                    f"the adapter '{name}' is in the config (its model's adapters): remove it "
                    "there and restart the service",
                    "adapter_in_config",
                )
            saved = await self._save()
            if saved is not None:
                self._kept[name] = kept
                return saved
            self._index()  # no new request is routed to it
            await self._settle(name)
            await self._sync(base.name)
            log.info("adapter %s: removed from %s", name, base.name)
            return AdapterResult(200)

    async def _settle(self, name: str) -> None:
        """Wait for the gateway's requests for ``name`` to end, so that one admitted
        before the removal never reaches an engine after it (vLLM would answer 404 in its
        own words). Bounded by the time a request may wait in the queue: past it, those
        left are streaming, and vLLM 0.32's unload only forgets the name, it lets a
        running request finish (entrypoints/openai/models/serving.py)."""
        bound = min(self._config().gateway.queue_timeout_s, SETTLE_MAX_S) + SETTLE_MARGIN_S
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:  # polled, as stopping.drain polls in_flight
            if not self._busy(name):
                return
            await asyncio.sleep(SETTLE_POLL_S)

    def _unusable(self) -> AdapterResult | None:
        """Refused while adapters.json could not be read at start: a change would write
        over the adapters in it."""
        if self._unreadable is None:
            return None
        message = f"{self._unreadable}, then restart the service; until then"
        return AdapterResult(503, f"{message} no adapter can be added or removed", "state_file")

    def _check_add(self, base: ServedModel | None, name: str, path: str) -> AdapterResult | None:
        """Why the adapter cannot be added (a 4xx), or None."""
        if base is None:
            return AdapterResult(404, "no model has that name", "model_not_found")
        if not good_name(name):
            return AdapterResult(400, f"name: {NAME_RULE}", "invalid_request")
        if self._config().model(name) is not None or name in self._names:
            return AdapterResult(
                409,
                f"'{name}' is already a model, alias or adapter name; adapter names are "
                "model names and must be unique",
                "name_taken",
            )
        try:
            rank = adapter_rank(path)
        except UnsafeAdapter as exc:
            return AdapterResult(400, f"path {path!r}: {exc}", "adapter_unsafe")
        except AdapterError as exc:
            return AdapterResult(400, f"path {path!r}: {exc}", "adapter_invalid")
        return _rank_problem(base, rank, [r.spec.lora_rank for r in self._mine(base.name)])

    def _mine(self, model: str) -> list[EngineRunner]:
        return [r for r in self._runners if r.spec.model == model]

    def _tell(self, model: str) -> None:
        """Every engine of ``model`` told to serve what is wanted, nobody waiting."""
        for r in self._mine(model):
            r.tell(SyncAdapters())

    async def _sync(self, model: str) -> dict[str, str]:
        """Every engine of ``model`` made to serve what is wanted; what failed, by name."""
        loop = asyncio.get_running_loop()
        asked = []
        for r in self._mine(model):
            done: asyncio.Future[dict[str, str]] = loop.create_future()
            r.tell(SyncAdapters(done))
            asked.append(done)
        errors: dict[str, str] = {}
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ANSWER_WAIT_S):
                for done in asked:
                    errors |= await done
        for done in asked:
            # The timeout cancels the future it was awaiting: cancelled = no answer.
            if done.cancelled() or not done.done():
                done.cancel()
                errors[NO_ANSWER] = f"an engine did not answer within {ANSWER_WAIT_S:g} s"
        return errors

    async def _save(self) -> AdapterResult | None:
        """adapters.json written (None), or the 5xx saying why not (nothing changed)."""
        try:
            await asyncio.to_thread(write_file, self._path, list(self._kept.values()))
        except (FileWriteError, OSError) as exc:
            log.error("%s could not be written: %s", self._path, exc)
            return AdapterResult(503, f"{self._path} could not be written: {exc}", "state_file")
        return None


def _add_failed(name: str, failed: str | None, late: str | None) -> AdapterResult:
    if failed is not None:
        return AdapterResult(400, f"the engine could not load it: {failed}", "adapter_invalid")
    log.warning("adapter %s: not added: %s", name, late)
    message = f"{late} (nothing kept; the engines unload it where it loaded): retry later"
    return AdapterResult(503, message, "engine_busy")


def _rank_problem(base: ServedModel, rank: int, engine_ranks: list[int]) -> AdapterResult | None:
    """Whether the base model's engines can take an adapter of ``rank``."""
    if not engine_ranks or min(engine_ranks) == 0:
        return AdapterResult(
            409,
            f"the engines of '{base.name}' run without LoRA: a model serves adapters when "
            "it has some in the config (adapters = [...]) or extra_args has --enable-lora; "
            "change the config and restart the service",
            "lora_off",
        )
    if rank > min(engine_ranks):
        return AdapterResult(
            409,
            f"its LoRA rank {rank} is above the engines' --max-lora-rank {min(engine_ranks)}; "
            'set a larger one in the model\'s extra_args (e.g. ["--max-lora-rank", "64"]) '
            "and restart the service",
            "rank_too_large",
        )
    return None
