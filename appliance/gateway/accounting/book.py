"""Tokens used per API key: counted from the engine's own ``usage``, kept across restarts.

Each try of a request on an engine, however it ends, adds its prompt and completion
tokens (the engine's own, or an upper bound when they never came: stream_tap.charged)
to its key id (never the
secret): to ``appliance_key_tokens_total{key,kind}`` and to :class:`UsageBook`, which
keeps per key the totals and hourly buckets (31 days of them, so ``keys usage --since``
can answer for any window up to that, at an hour's grain).

Energy per key (an estimate, :mod:`.energy`): each try's tokens are also counted per
engine with when the try began and ended there (:meth:`UsageBook.begin`, :meth:`finish`),
and at every telemetry tick (:meth:`UsageBook.energy_tick`, which the supervisor's heat
loop reaches through :meth:`appliance.control.GatewayLink.telemetry_read`) each GPU's
energy of the ticks whose tries have all ended is shared among the keys by those tokens
over time; the joules go into the same file, per key and per hour, beside the tokens. A
file from before energy was counted has none, and reads as such; a key whose energy
entry cannot be read loses that entry only (a warning), never its tokens.

Where: ``usage.json`` beside the keys file (``gateway.keys_file``; by default the state
directory), for the reasons audit.log is there: ``llm-appliance keys usage`` run by root
or the service user finds it from the config alone. The daemon writes it atomically
(:func:`appliance.fsutil.atomic_write`, 0600) every :data:`SAVE_INTERVAL_S` when something
changed, and on stop; a crash loses at most that interval.

A save that fails (a full disk) leaves the last good file as it was (atomic_write never
replaces it with a half one) and loses nothing: the counts stay in memory, keep counting,
and the whole of them is written by the next save that works. The failure is said once
per episode and counted (:attr:`UsageBook.writes`, :mod:`appliance.state_writes`), never
once per 10 s; requests never wait on the file.

A file that cannot be read as ours is renamed aside (``usage.json.corrupt-<time>``), with
an ERROR in the journal, and counting starts afresh: usage is worth keeping, never worth
refusing to start over.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from appliance.fsutil import SAFE_OPEN, FileWriteError, atomic_write
from appliance.gateway.accounting.energy import EnergyMeter, OpenTry
from appliance.gateway.accounting.plan import UsagePlan
from appliance.gateway.accounting.stream_tap import Metering, charged
from appliance.gateway.protocols.counts import is_count
from appliance.state_writes import WriteHealth, iso

log = logging.getLogger("appliance.gateway")

USAGE_FILE = "usage.json"
FORMAT = 1
SAVE_INTERVAL_S = 10.0
HOUR_S = 3600
KEEP_HOURS = 31 * 24
MAX_FILE_BYTES = 64 * 1024 * 1024
SETTLED = "usage_settled"  # on the client request: its tpm charge was settled


class UsageFileError(Exception):
    """The usage file exists but is not a usage file this version can read."""


def usage_path(keys_file: Path) -> Path:
    """Where the usage of the appliance whose keys file is ``keys_file`` is kept."""
    return keys_file.with_name(USAGE_FILE)


def _hour(ts: float) -> int:
    return int(ts // HOUR_S) * HOUR_S


class UsageCounts:
    """Per key id: totals and hourly buckets of prompt and completion tokens, and of the
    energy (joules) charged to it."""

    def __init__(self) -> None:
        self.totals: dict[str, list[int]] = {}
        self.hours: dict[str, dict[int, list[int]]] = {}
        self.energy: dict[str, float] = {}
        self.energy_hours: dict[str, dict[int, float]] = {}

    def add(self, key_id: str, prompt: int, completion: int, now: float) -> None:
        total = self.totals.setdefault(key_id, [0, 0])
        total[0] += prompt
        total[1] += completion
        bucket = self.hours.setdefault(key_id, {}).setdefault(_hour(now), [0, 0])
        bucket[0] += prompt
        bucket[1] += completion

    def add_energy(self, key_id: str, joules: float, now: float) -> None:
        if not (math.isfinite(joules) and joules > 0):
            return  # never an inf or NaN in the file (JSON has none, and a sum keeps it)
        self.energy[key_id] = self.energy.get(key_id, 0.0) + joules
        hours = self.energy_hours.setdefault(key_id, {})
        hour = _hour(now)
        hours[hour] = hours.get(hour, 0.0) + joules

    def energy_since(self, start: float | None) -> dict[str, float]:
        """Joules per key id that was charged any, as :meth:`since` counts tokens."""
        if start is None:
            return dict(self.energy)
        first = _hour(start)
        out: dict[str, float] = {}
        for key_id, hours in self.energy_hours.items():
            window = [j for h, j in hours.items() if h >= first]
            if window:
                out[key_id] = sum(window)
        return out

    def since(self, start: float | None) -> dict[str, tuple[int, int]]:
        """(prompt, completion) per key id: all time, or in the hours from the one holding
        ``start`` on (an hour's grain: the first hour counts whole)."""
        if start is None:
            return {k: (v[0], v[1]) for k, v in self.totals.items()}
        first = _hour(start)
        out: dict[str, tuple[int, int]] = {}
        for key_id, hours in self.hours.items():
            p = sum(v[0] for h, v in hours.items() if h >= first)
            c = sum(v[1] for h, v in hours.items() if h >= first)
            if p or c:
                out[key_id] = (p, c)
        return out

    def prune(self, now: float) -> None:
        oldest = _hour(now) - KEEP_HOURS * HOUR_S
        for hours in self.hours.values():
            for h in [h for h in hours if h < oldest]:
                del hours[h]
        for energy_hours in self.energy_hours.values():
            for h in [h for h in energy_hours if h < oldest]:
                del energy_hours[h]

    # ---- the file ----------------------------------------------------------------------
    def to_json(self, now: float) -> bytes:
        keys: dict[str, dict[str, Any]] = {}
        for key_id in sorted(self.totals.keys() | self.energy.keys()):
            total = self.totals.get(key_id, [0, 0])
            entry: dict[str, Any] = {
                "prompt_tokens": total[0],
                "completion_tokens": total[1],
                "hours": {str(h): v for h, v in sorted(self.hours.get(key_id, {}).items())},
            }
            if key_id in self.energy:  # fields of their own: an older reader ignores them
                entry["energy_j"] = round(self.energy[key_id], 3)
                entry["energy_hours"] = {
                    str(h): round(j, 3) for h, j in sorted(self.energy_hours[key_id].items())
                }
            keys[key_id] = entry
        doc = {"format": FORMAT, "saved_at": round(now, 3), "keys": keys}
        return json.dumps(doc, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes) -> UsageCounts:
        """Raises UsageFileError when ``raw`` is not a usage file of this format."""
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise UsageFileError(f"not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise UsageFileError(f"not a usage file of format {FORMAT}")
        keys = doc.get("keys")
        if not isinstance(keys, dict):
            raise UsageFileError("'keys' is not an object")
        counts = cls()
        for key_id, entry in keys.items():
            counts.totals[key_id] = _pair(entry, key_id)
            hours = entry.get("hours", {})
            if not isinstance(hours, dict):
                raise UsageFileError(f"key {key_id}: 'hours' is not an object")
            try:
                counts.hours[key_id] = {int(h): _counts(v, key_id) for h, v in hours.items()}
            except ValueError:
                raise UsageFileError(f"key {key_id}: an hour is not a number") from None
            if "energy_j" in entry:  # absent: counted before energy was (or never any)
                try:
                    _energy_of(counts, key_id, entry)
                except UsageFileError as exc:
                    # An estimate lost for one key is no reason to set everyone's
                    # token counts aside.
                    counts.energy.pop(key_id, None)
                    counts.energy_hours.pop(key_id, None)
                    log.warning("usage file: %s; that key's energy starts again from 0", exc)
        return counts


def _joules(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _energy_of(counts: UsageCounts, key_id: str, entry: dict[str, Any]) -> None:
    total, hours = entry["energy_j"], entry.get("energy_hours", {})
    if not _joules(total):
        raise UsageFileError(f"key {key_id}: energy_j is not a number of joules")
    if not isinstance(hours, dict) or not all(_joules(j) for j in hours.values()):
        raise UsageFileError(f"key {key_id}: 'energy_hours' is not an object of joules")
    try:
        counts.energy_hours[key_id] = {int(h): float(j) for h, j in hours.items()}
    except ValueError:
        raise UsageFileError(f"key {key_id}: an energy hour is not a number") from None
    counts.energy[key_id] = float(total)


def _pair(entry: Any, key_id: str) -> list[int]:
    if not isinstance(entry, dict):
        raise UsageFileError(f"key {key_id}: not an object")
    p, c = entry.get("prompt_tokens"), entry.get("completion_tokens")
    if not (is_count(p) and is_count(c)):
        raise UsageFileError(f"key {key_id}: token counts are not counts")
    return [p, c]


def _counts(v: Any, key_id: str) -> list[int]:
    if not (isinstance(v, list) and len(v) == 2 and all(is_count(x) for x in v)):
        raise UsageFileError(f"key {key_id}: an hourly bucket is not [prompt, completion]")
    return [v[0], v[1]]


def read_usage(path: Path) -> UsageCounts | None:
    """The counts in ``path``; None when there is no file yet. Raises UsageFileError when
    it cannot be read as one, OSError when it cannot be read at all."""
    try:
        fd = os.open(path, os.O_RDONLY | SAFE_OPEN)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise UsageFileError(f"larger than {MAX_FILE_BYTES} bytes")
    return UsageCounts.from_json(raw)


class PlannedRequest(Protocol):
    """What the book reads of a request as the relay parsed it (relay/request_body.py)."""

    @property
    def usage(self) -> UsagePlan | None: ...
    @property
    def tpm_charge(self) -> int: ...


class FinishedTry(Protocol):
    """What the book reads of one try on one engine (relay/answers.py's EngineCall):
    stated here so accounting does not import the relay."""

    @property
    def client(self) -> web.Request: ...
    @property
    def meter(self) -> Metering: ...
    @property
    def parsed(self) -> PlannedRequest: ...


class Settle(Protocol):
    """The rate limiter's side of a request's end (admission/ratelimit.py): the tokens
    used replace the estimate charged at admission. Stated here so accounting does not
    import admission."""

    def settle(
        self, key_id: str, tpm: int | None, estimate: int, used: int, now: float | None = None
    ) -> None: ...


class UsageBook:
    """The daemon's running count: the metric, the file, and its periodic save."""

    def __init__(self, path: Path, registry: CollectorRegistry, ratelimiter: Settle) -> None:
        self.path = path
        self.ratelimiter = ratelimiter
        self.counts = UsageCounts()
        self.dirty = False
        self.writes = WriteHealth(
            "usage.json",
            path,
            log,
            "usage keeps counting in memory and is saved whole by the next save that works "
            f"(every {SAVE_INTERVAL_S:.0f} s)",
        )
        self._task: asyncio.Task[None] | None = None
        self.energy = EnergyMeter()  # tries per engine, for the energy split
        self.monotonic: Callable[[], float] = time.monotonic  # the energy split's clock
        self._children: dict[str, tuple[Any, Any]] = {}
        self.tokens = Counter(
            "appliance_key_tokens",
            "Tokens used per API key id, from the engine's own usage (kind: prompt|completion)",
            ["key", "kind"],
            registry=registry,
        )

    def add(self, key_id: str, prompt: int, completion: int, now: float | None = None) -> None:
        if prompt <= 0 and completion <= 0:
            return
        self.counts.add(key_id, prompt, completion, time.time() if now is None else now)
        self.dirty = True
        children = self._children.get(key_id)
        if children is None:  # labels() per request is a lock and a dict lookup each
            children = (
                self.tokens.labels(key_id, "prompt"),
                self.tokens.labels(key_id, "completion"),
            )
            self._children[key_id] = children
        if prompt > 0:
            children[0].inc(prompt)
        if completion > 0:
            children[1].inc(completion)

    def energy_tick(
        self,
        readings: Mapping[int, float | None],
        gpus_of: Mapping[int, Collection[int]],
        now: float | None = None,
        mono: float | None = None,
    ) -> None:
        """A telemetry tick at ``mono`` (:attr:`monotonic`, the clock of :meth:`begin`): each
        GPU's energy reading (None: unknown), each engine's GPUs; the energy of the ticks
        whose tries have all ended is charged to the keys that used those GPUs then
        (:mod:`.energy`), in the hour of ``now`` (wall clock)."""
        charged = self.energy.tick(readings, gpus_of, self.monotonic() if mono is None else mono)
        when = time.time() if now is None else now
        for key_id, joules in charged.items():
            if joules > 0:
                self.counts.add_energy(key_id, joules, when)
                self.dirty = True

    def load(self) -> None:
        """The counts kept by the last run; a corrupt file is renamed aside (logged)."""
        try:
            counts = read_usage(self.path)
        except UsageFileError as exc:
            self._set_aside(str(exc))
            return
        except OSError as exc:
            log.error("cannot read %s (%s); counting usage afresh", self.path, exc.strerror or exc)
            return
        if counts is not None:
            self.counts = counts

    def _set_aside(self, why: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        try:
            os.replace(self.path, aside)
        except OSError as exc:
            log.error(
                "%s is not a usage file (%s) and cannot be renamed aside (%s); counting "
                "usage afresh, and the next save replaces it",
                self.path,
                why,
                exc.strerror or exc,
            )
            return
        log.error(
            "%s is not a usage file (%s): kept as %s; counting usage afresh", self.path, why, aside
        )

    def save(self, now: float | None = None) -> None:
        """Write the file if anything changed since the last write; errors are logged."""
        data = self._snapshot(time.time() if now is None else now)
        if data is not None:
            self._write(data)

    def _snapshot(self, now: float) -> bytes | None:
        """The file's next content, taken on the event loop (add() changes the counts
        there), or None when nothing changed."""
        if not self.dirty:
            return None
        self.counts.prune(now)
        self.dirty = False
        return self.counts.to_json(now)

    def _write(self, data: bytes) -> None:
        try:
            atomic_write(self.path, data)
        except FileWriteError as exc:
            self.dirty = True  # the counts in memory are whole: the next save writes them
            self.writes.failed(exc)  # said once per episode, counted every time
        else:
            self.writes.succeeded()

    # ---- a request's try ---------------------------------------------------------------
    def begin(self, engine_id: int) -> OpenTry:
        """A try begins on engine ``engine_id`` (relay/handlers.py, before the engine
        call): the energy split waits for its end (:mod:`.energy`)."""
        return self.energy.begin(engine_id, self.monotonic())

    def finish(self, call: FinishedTry, opened: OpenTry) -> None:
        """One try on engine ``engine_id`` ended, however it ended (relay/handlers.py calls
        this from the try's one ``finally``; ``opened``: what :meth:`begin` gave for it):
        count what it used for its key (:func:`charged`: the
        engine's own count, or a bound never below what the engine did), there too for
        the energy split, and debit the key's tpm bucket with that instead of the
        admission charge."""
        ended = self.monotonic()
        record = call.client.get("key")
        if record is None:
            self.energy.end(opened, None, 0, ended)
            return
        usage = charged(call.meter, call.parsed.usage)
        self.add(record.id, usage.prompt, usage.completion)
        used = usage.prompt + usage.completion
        self.energy.end(opened, record.id, used, ended)
        # The charge goes back once per request: a second engine's try (a retry after the
        # first failed before the client saw a byte, which counts nothing) debits what it
        # used, and is not given the charge back again.
        charge = 0 if call.client.get(SETTLED) else call.parsed.tpm_charge
        call.client[SETTLED] = True
        self.ratelimiter.settle(record.id, record.tpm, charge, usage.prompt + usage.completion)

    # ---- the daemon's life -------------------------------------------------------------
    def start(self) -> None:
        self.load()
        self._task = asyncio.get_running_loop().create_task(self._save_every())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.save()
        failing = self.writes.failing
        if failing is not None:
            log.error(
                "usage counted since %s is lost: %s could not be saved at stop (%s)",
                iso(failing.since),
                self.path,
                failing.reason,
            )

    async def _save_every(self) -> None:
        while True:
            await asyncio.sleep(SAVE_INTERVAL_S)
            data = self._snapshot(time.time())
            if data is not None:
                # Small and rare, but fsync can stall: off the event loop.
                await asyncio.to_thread(self._write, data)
