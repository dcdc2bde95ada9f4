"""Energy per key: each GPU's energy over an interval, shared by the tokens served on it.

An estimate, and what it is built on: a GPU's energy counter (NVML's total energy, or a
sensors file's ``energy_j``: :attr:`appliance.telemetry.GpuReading.energy_j`) read at
every telemetry tick, and the tokens each key's requests used (prompt + completion, as
the usage book counts them) on each engine. Each tick, per GPU:

- its energy since the last tick (a counter that went down was reset, by a driver
  reload or a writer that started over: what it reads now is what it used since, never
  a negative use; an unknown reading at either end is no figure at all, and the next
  known one only starts the count again);
- plus any energy it held back (below), shared by the tokens counted in this interval
  on the engines that use that GPU, in proportion to each key's tokens. An engine on
  several GPUs (tensor parallel) counts its tokens on each, so it gets the sum of its
  GPUs' energy; a GPU shared by several engines (on-demand models taking turns) shares
  its energy among their tokens.
- **Held back**: tokens are counted when a request ends, so a GPU busy with a long
  request uses energy in intervals where nothing of it has been counted yet. When no
  tokens were counted on a GPU's engines but one of them has requests in flight, its
  energy is held for the next interval that counts tokens there.
- **Idle**: energy in an interval with no tokens and nothing in flight on the GPU's
  engines is charged to nobody (an idle GPU's own draw, an engine loading, the energy of
  requests that failed without tokens).

Tokens are counted per request where usage is already counted (:mod:`.book`), never per
stream chunk; the split runs once per telemetry tick, over at most a few GPUs and the
keys that used them since the last one. :func:`split_energy` is the rule, pure;
:class:`EnergyMeter` keeps what it needs from one tick to the next.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EnergySplit:
    """What one interval's energy became: charged to keys, held back, or idle (joules)."""

    per_key: dict[str, float] = field(default_factory=dict)
    held: dict[int, float] = field(default_factory=dict)  # per GPU, for the next interval
    idle_j: float = 0.0


def counter_delta(before: float | None, after: float | None) -> float | None:
    """A cumulative counter's increase between two readings; None when either is unknown.
    A lower reading is a reset (from 0, at some moment since ``before``): what it reads
    now was used since, so that is the increase, as Prometheus' increase() takes it."""
    if before is None or after is None:
        return None
    return after - before if after >= before else after


def split_energy(
    deltas: Mapping[int, float],
    tokens: Mapping[int, Mapping[str, int]],
    gpus_of: Mapping[int, Collection[int]],
    busy: Collection[int] = (),
    held: Mapping[int, float] | None = None,
) -> EnergySplit:
    """One interval's energy shared among keys by their tokens.

    ``deltas``: joules per GPU (telemetry index) this interval, known ones only.
    ``tokens``: per engine id, tokens per key id counted this interval.
    ``gpus_of``: per engine id, its GPUs (telemetry indexes).
    ``busy``: engine ids with requests in flight at the tick.
    ``held``: joules per GPU held back from earlier intervals.
    """
    held = held or {}
    per_key: dict[str, float] = {}
    held_now: dict[int, float] = {}
    idle = 0.0
    on_gpu: dict[int, list[int]] = {}  # GPU -> the engines using it
    for engine, gpus in gpus_of.items():
        for g in gpus:
            on_gpu.setdefault(g, []).append(engine)
    for gpu in sorted(set(deltas) | set(held)):
        energy = deltas.get(gpu, 0.0) + held.get(gpu, 0.0)
        engines = on_gpu.get(gpu, [])
        shares: dict[str, int] = {}
        for engine in engines:
            for key_id, n in tokens.get(engine, {}).items():
                if n > 0:
                    shares[key_id] = shares.get(key_id, 0) + n
        total = sum(shares.values())
        if total > 0:
            for key_id, n in shares.items():
                per_key[key_id] = per_key.get(key_id, 0.0) + energy * n / total
        elif any(e in busy for e in engines):
            held_now[gpu] = energy
        else:
            idle += energy
    return EnergySplit(per_key, held_now, idle)


class EnergyMeter:
    """Tokens per engine and key since the last tick, each GPU's last energy reading and
    the energy held back; :meth:`tick` turns them into joules per key."""

    def __init__(self) -> None:
        self.tokens: dict[int, dict[str, int]] = {}  # engine id -> key id -> tokens
        self.last: dict[int, float] = {}  # GPU -> its last known energy reading (J)
        self.held: dict[int, float] = {}  # GPU -> joules held for requests in flight
        self.idle_j = 0.0  # charged to nobody, since the daemon started

    def count(self, engine_id: int, key_id: str, tokens: int) -> None:
        """A request ended on ``engine_id``: its key used ``tokens`` there (per request)."""
        if tokens <= 0:
            return
        per_key = self.tokens.setdefault(engine_id, {})
        per_key[key_id] = per_key.get(key_id, 0) + tokens

    def tick(
        self,
        readings: Mapping[int, float | None],
        gpus_of: Mapping[int, Collection[int]],
        busy: Collection[int],
    ) -> dict[str, float]:
        """This tick's energy readings (per GPU; None: unknown) -> joules per key id."""
        deltas: dict[int, float] = {}
        for gpu, now in readings.items():
            delta = counter_delta(self.last.get(gpu), now)
            if delta is not None:
                deltas[gpu] = delta
            if now is None:
                self.last.pop(gpu, None)  # a gap: the next known reading starts afresh
            else:
                self.last[gpu] = now
        for gpu in [g for g in self.last if g not in readings]:
            del self.last[gpu]  # no longer read at all
        tokens, self.tokens = self.tokens, {}
        split = split_energy(deltas, tokens, gpus_of, busy, self.held)
        self.held = split.held
        self.idle_j += split.idle_j
        return split.per_key
