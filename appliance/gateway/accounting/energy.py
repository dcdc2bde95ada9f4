"""Energy per key: each GPU's energy over a tick, shared by the tokens served on it then.

An estimate, and what it is built on: a GPU's energy counter (NVML's total energy, or a
sensors file's ``energy_j``: :attr:`appliance.telemetry.GpuReading.energy_j`) read at
every telemetry tick, and the tokens each key's tries used (prompt + completion, as the
usage book counts them) on each engine, with when each try began and ended there.

- **A tick's energy**: per GPU, the counter's increase since the last known reading
  (:func:`counter_delta`). A counter that went down was reset (a driver reload, a writer
  that started over) only when what it reads now could have been used in the interval
  (at most :data:`MAX_GPU_W` over it): then what it reads is what it used since. Any
  other step down (a writer's jitter, GPUs listed in another order), a rise no GPU could
  make in the interval, or a reading that is not finite, is no figure: nothing is
  charged and the count starts again from that reading. An unknown reading at either end
  is no figure either, and the next known one only starts the count again.
- **Who pays**: each try's tokens are spread evenly over its time on its engine (from
  its start there to its end), and a tick's energy is shared among the keys by the
  tokens their tries had in the tick: a try of ``n`` tokens lasting ``d`` seconds that
  overlapped the tick for ``o`` of them weighs ``n × o / d`` (a try of no duration: all
  its ``n`` in the tick it fell in). So a long stream pays for every tick it ran in, and
  short requests beside it pay for their own share of those ticks, not for the stream.
- **When**: a try's tokens are known only when it ends, so a GPU's tick is split once
  every try that overlapped it has ended: it waits (pending) while a try that began
  before the tick's end is still open on one of the GPU's engines. Pending ticks per GPU
  are thus bounded by the longest open try (a 10-minute stream at 5 s ticks: 120), and
  capped at :data:`MAX_PENDING_TICKS` whatever happens (the oldest then goes to idle,
  said once per episode); an ended try's record is dropped once no tick it overlapped
  can still be split.
- An engine on several GPUs (tensor parallel) has its tries on each of them, so it
  pays for the sum of its GPUs' energy; a GPU shared by several engines (on-demand models
  taking turns) shares its energy among their tries.
- **Idle**: a tick with no tokens in it is charged to nobody (an idle GPU's own draw, an
  engine loading, the energy of tries that failed without tokens).

Per try: :meth:`EnergyMeter.begin` and :meth:`EnergyMeter.end`, a dict insert and pop
and a list append (about a microsecond together; never per stream chunk). The split
runs once per telemetry tick. :func:`split_energy` is the rule, pure;
:class:`EnergyMeter` keeps what it needs from one tick to the next.
"""

from __future__ import annotations

import itertools
import logging
import math
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

log = logging.getLogger("appliance.gateway")

# Far above any one GPU's draw (an H200 or B200 SXM: 700-1000 W): a counter that rose
# faster over an interval, or a step down to more than that, is not a GPU's energy.
MAX_GPU_W = 2000.0
# At most this many ticks wait per GPU for their tries to end (an hour at 1 s ticks).
MAX_PENDING_TICKS = 3600


class Tick(NamedTuple):
    """One GPU's energy between two telemetry readings (joules; monotonic seconds)."""

    joules: float
    t0: float
    t1: float


# A try that ended: (start, end, key id, tokens): its key used that many tokens on its
# engine from start to end. A plain tuple: it is made once per request.
Ended = tuple[float, float, str, int]


@dataclass(frozen=True, slots=True)
class EnergySplit:
    """What some ticks' energy became: charged to keys, or idle (joules)."""

    per_key: dict[str, float] = field(default_factory=dict)
    idle_j: float = 0.0


def counter_delta(
    before: float | None, after: float | None, max_j: float = math.inf
) -> float | None:
    """A cumulative counter's increase between two readings; None when it is no figure:
    either is unknown or not finite, it rose by more than ``max_j`` (what a GPU can use
    in the interval), or it went down to more than ``max_j``. A step down to at most
    that is a reset (from 0, at some moment since ``before``): what it reads now was used
    since, so that is the increase, as Prometheus' increase() takes it."""
    if before is None or after is None or not (math.isfinite(before) and math.isfinite(after)):
        return None
    delta = after - before if after >= before else after
    return delta if delta <= max_j else None


def split_energy(ticks: Sequence[Tick], ended: Iterable[Ended]) -> EnergySplit:
    """One GPU's ``ticks`` (in time order, not overlapping) shared among the keys of the
    ``ended`` tries on its engines, each try's tokens spread evenly over its duration."""
    if not ticks:
        return EnergySplit()
    t1s = [t.t1 for t in ticks]
    weights: list[dict[str, float]] = [{} for _ in ticks]
    for start, end, key_id, tokens in ended:
        if tokens <= 0:
            continue
        duration = end - start
        if duration <= 0:  # all its tokens in the tick it fell in: (t0, t1]
            i = bisect_left(t1s, end)
            if i < len(ticks) and ticks[i].t0 < end:
                weights[i][key_id] = weights[i].get(key_id, 0.0) + tokens
            continue
        per_s = tokens / duration
        i = bisect_right(t1s, start)  # the first tick ending after the try began
        while i < len(ticks) and ticks[i].t0 < end:
            overlap = min(end, ticks[i].t1) - max(start, ticks[i].t0)
            if overlap > 0:
                weights[i][key_id] = weights[i].get(key_id, 0.0) + per_s * overlap
            i += 1
    per_key: dict[str, float] = {}
    idle = 0.0
    for tick, shares in zip(ticks, weights, strict=True):
        total = sum(shares.values())
        if total <= 0:
            idle += tick.joules
            continue
        for key_id, w in shares.items():
            per_key[key_id] = per_key.get(key_id, 0.0) + tick.joules * w / total
    return EnergySplit(per_key, idle)


# A try under way, as :meth:`EnergyMeter.begin` numbers it.
OpenTry = int


def _end_of(ended: Ended) -> float:
    return ended[1]


class EnergyMeter:
    """The tries open and ended per engine, each GPU's last energy reading and its ticks
    waiting to be split; :meth:`tick` turns them into joules per key."""

    def __init__(self, max_pending: int = MAX_PENDING_TICKS) -> None:
        self.open: dict[OpenTry, tuple[int, float]] = {}  # -> (engine id, since when)
        self._numbers = itertools.count()
        # engine id -> tries not yet wholly split, in the order they ended (one clock)
        self.ended: dict[int, list[Ended]] = {}
        self.last: dict[int, tuple[float, float]] = {}  # GPU -> (last known J, when)
        self.pending: dict[int, deque[Tick]] = {}  # GPU -> ticks waiting for tries to end
        self.idle_j = 0.0  # charged to nobody, since the daemon started
        self.max_pending = max_pending
        self._capped: set[int] = set()  # GPUs whose cap was said, until they catch up

    def begin(self, engine_id: int, now: float) -> OpenTry:
        """A try begins on ``engine_id``: the ticks from ``now`` on wait for its end."""
        opened = next(self._numbers)
        self.open[opened] = (engine_id, now)
        return opened

    def end(self, opened: OpenTry, key_id: str | None, tokens: int, now: float) -> None:
        """The try ended at ``now``; its key (None: none) used ``tokens`` there."""
        try_ = self.open.pop(opened, None)
        if try_ is not None and key_id is not None and tokens > 0:
            self.record(try_[0], key_id, tokens, try_[1], now)

    def record(self, engine_id: int, key_id: str, tokens: int, start: float, end: float) -> None:
        """A try that ended at ``end`` (never before the last one recorded)."""
        ended = self.ended.get(engine_id)
        if ended is None:
            ended = self.ended[engine_id] = []
        ended.append((start, end, key_id, tokens))

    def tick(
        self,
        readings: Mapping[int, float | None],
        gpus_of: Mapping[int, Collection[int]],
        now: float,
    ) -> dict[str, float]:
        """This tick's energy readings (per GPU; None: unknown) at ``now`` (monotonic),
        each engine's GPUs -> joules per key id, for the ticks that could be split."""
        for gpu, reading in readings.items():
            self._read(gpu, reading, now)
        for gpu in [g for g in self.last if g not in readings]:
            del self.last[gpu]  # no longer read at all
        on_gpu: dict[int, list[int]] = {}
        for engine, gpus in gpus_of.items():
            for g in gpus:
                on_gpu.setdefault(g, []).append(engine)
        oldest_open: dict[int, float] = {}  # engine -> when its oldest open try began
        for e, start in self.open.values():
            if start < oldest_open.get(e, math.inf):
                oldest_open[e] = start
        per_key: dict[str, float] = {}
        for gpu in list(self.pending):
            engines = on_gpu.get(gpu, [])
            blocked = min((oldest_open.get(e, math.inf) for e in engines), default=math.inf)
            queue = self.pending[gpu]
            ready: list[Tick] = []
            while queue and queue[0].t1 <= blocked:  # no open try began before its end
                ready.append(queue.popleft())
            if ready:
                split = split_energy(ready, (r for e in engines for r in self.ended.get(e, ())))
                for key_id, joules in split.per_key.items():
                    per_key[key_id] = per_key.get(key_id, 0.0) + joules
                self.idle_j += split.idle_j
            if not queue:
                del self.pending[gpu]
                self._capped.discard(gpu)
        self._forget_ended(gpus_of, now)
        return per_key

    def _read(self, gpu: int, reading: float | None, now: float) -> None:
        if reading is None or not math.isfinite(reading):
            self.last.pop(gpu, None)  # a gap: the next known reading starts afresh
            return
        before = self.last.get(gpu)
        self.last[gpu] = (reading, now)
        if before is None or now <= before[1]:
            return
        joules = counter_delta(before[0], reading, MAX_GPU_W * (now - before[1]))
        if joules is None:
            return  # no figure: the count starts again from this reading
        queue = self.pending.setdefault(gpu, deque())
        queue.append(Tick(joules, before[1], now))
        if len(queue) > self.max_pending:
            dropped = queue.popleft()
            self.idle_j += dropped.joules
            if gpu not in self._capped:
                self._capped.add(gpu)
                log.warning(
                    "energy per key: gpu%d has had a try open for over %d telemetry ticks; "
                    "its oldest ticks' energy is charged to nobody until it ends",
                    gpu,
                    self.max_pending,
                )

    def _forget_ended(self, gpus_of: Mapping[int, Collection[int]], now: float) -> None:
        """Drop the ended tries no tick still waiting (or to come) on their GPUs overlaps:
        a GPU's next ticks begin at its first pending tick, else at its last reading."""
        horizon: dict[int, float] = {}
        for engine in list(self.ended):
            gpus = gpus_of.get(engine)
            if not gpus:
                del self.ended[engine]  # an engine gone: nothing of its can be split
                continue
            since = now
            for g in gpus:
                if g not in horizon:
                    queue = self.pending.get(g)
                    if queue:
                        horizon[g] = queue[0].t0
                    else:
                        last = self.last.get(g)
                        horizon[g] = now if last is None else last[1]
                since = min(since, horizon[g])
            ended = self.ended[engine]
            done = bisect_right(ended, since, key=_end_of)  # they are in the order they ended
            if done == len(ended):
                del self.ended[engine]
            elif done:
                del ended[:done]
