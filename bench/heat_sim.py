"""A closed-loop GPU heat simulator: the appliance's own thermal policies against a
modelled workstation, over a team's working day, in a few seconds of CPU.

``python -m bench.heat_sim [--json FILE] [--plot FILE.png] [--hours H]`` runs every trace
(a cool room and a hot room) under every policy and prints one table per trace. The
JSON is ``{"traces": {"hot_room": {"none": {...}, "stepped": {...}, "new": {...}, ...},
"cool_room": {...}}, "model": {...}}``; each policy has ``tokens``, ``p95_wait_s``,
``minutes_above_soft``, ``peak_c``, ``energy_per_token_j``,
``level_changes_per_hour`` and more (see `Result`). ``new`` is the governor the
appliance runs by default (``[thermal] governor``'s default).

What runs inside the loop is the appliance's code, not a copy:
:func:`appliance.policy.thermal.govern` (stepped) and
:func:`appliance.policy.predictive.govern_predictive` (predictive) turn each reading
into a level, :func:`appliance.policy.thermal.scale_budget` turns the level into the
engine's sequence and token budgets exactly as the gateway's admission does
(``appliance/gateway/admission/gate.py``, ``loads``), and :func:`appliance.policy.routing.route`
picks the engine for each waiting request. What is modelled instead of run: the GPU,
its driver and vLLM's batch (below), and the gateway's queue (one FIFO, with
``max_queue`` and ``queue_timeout_s``; the real one also puts interactive keys before
batch ones, which changes who waits, not how many tokens the box serves).

The model, per GPU, one step per telemetry reading (1 s):

- **Heat** (first order): ``C dT/dt = P - (T - T_air) / R``, solved exactly over a step,
  so the steady state is ``T_air + R·P`` and the time constant ``R·C``. RTX 4090:
  ``R = 0.123 °C/W`` from a published measurement of a 4090 serving an LLM at 390 W
  and 72 °C, taken as a 24 °C room (the cool room here); the same source reads 67 °C
  at 300 W where this constant ``R`` gives 61 °C (the fans slow down as the card cools,
  which a constant ``R`` ignores), so ``R`` is the full-load figure and the model
  overstates what each watt saved cools, for every lever alike. ``τ = 90 s``: an
  assumption inside "tens of seconds to minutes" for an air-cooled card's core.
  The H200 preset (``--card h200``) is a second point, from this project's GPU check
  on an H200: idle 37-41 °C at 78-127 W, 52-59 °C at 276-400 W. ``R = 0.055 °C/W`` in
  33 °C air gives 37-40 °C idle and 55 °C at 400 W; at 276 W it says 48 °C (the check's
  loads were seconds long, not steady states, so its low-power readings ran warm).
- **Two cards, the upper one breathing the lower one's air**: the upper card's intake
  is the room plus ``0.0125 °C/W`` of the lower card's power (+4.9 °C at 390 W;
  an assumption in the range commonly reported for two stacked open-air cards).
- **Power from load**: a busy engine draws between idle (25 W) and its full-load draw
  at the card's default limit (390 W, the published figure), in proportion to the
  tokens it produces. That is the most favourable assumption for admission cuts (real
  decode draws a good part of full power even at small batches); the figures below
  still find admission the dearest lever.
- **vLLM's batch**: an engine with *n* sequences in flight produces
  ``tok_full · b(n) / b(max_inflight)`` tokens/s, ``b(n) = n / (n + 48)`` (decode
  gains throughput with batch size, with diminishing returns), shared equally by the
  sequences (processor sharing). ``tok_full = 2000`` tokens/s at 64 sequences, a
  mid-size model on a 4090; only ratios between policies matter.
- **Power limit**: drawing ``P`` below the demand ``P_dem`` serves
  ``(P / P_dem) ** 0.26`` of the tokens: a concave curve through (1, 1) and the
  published 4090 point, 93.4 % of the tokens at 300 W of 390 W (70 % power limit); the
  published RTX 3090 point (−22 % power, −7 % tokens) lies within a point of it
  (0.937). Decode is memory-bound, so clocks matter less than watts.
- **The driver's own slowdown**: above its temperature target (83 °C, the 4090's
  default GPU target) the driver lowers clocks, 4 % of the power per °C, reporting
  ``sw_thermal_slowdown``; ``sw_power_cap`` while the power limit binds. That is what
  the card does with no governor at all.

Policies (``POLICIES``): ``none`` (the driver alone), ``stepped`` (today's governor),
``stepped@76`` (today's with ``soft_limit_c = 76``: the operator's way to make it hold
the hot room below 80 °C, so the two governors compare at the same envelope),
``predictive`` (the new one, :mod:`appliance.policy.predictive`), each alone and with
a static power limit of 315 W (70 % of 450 W), and ``dynamic_limit``: a power-limit
step as the first lever (the limit follows the predicted temperature, integral action),
the predictive governor behind it.
The power limit exists only here for now: the appliance cannot set one yet
(``[thermal] power_limit_w`` is future work), so its rows say what it would buy.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from appliance.config import EngineConfig, GatewayConfig, ThermalConfig
from appliance.policy.predictive import (
    PredictiveState,
    PredictiveTuning,
    govern_predictive,
    predicted_c,
)
from appliance.policy.routing import EngineLoad, route
from appliance.policy.thermal import HARD_LEVEL, ThermalPolicy, govern, scale_budget

STEP_S = 1.0  # one telemetry reading (telemetry.interval_s's default)
N_HALF = 48.0  # sequences at which a batch gives half its asymptotic throughput
DEFAULT_GOVERNOR: str = ThermalConfig().governor  # the JSON's "new"


@dataclass(frozen=True, slots=True)
class Card:
    """One GPU model's thermal and power figures (see the module docstring's sources)."""

    name: str
    idle_w: float
    load_w: float  # full-load draw at the default power limit
    default_limit_w: float
    min_limit_w: float
    r_c_per_w: float
    tau_s: float
    driver_target_c: float
    driver_gain: float  # fraction of power the driver sheds per °C over its target
    tok_full: float  # tokens/s at max_inflight sequences and full power
    curve_exponent: float = 0.26  # tokens ∝ (power / demand) ** this

    @property
    def heat_capacity_j_per_c(self) -> float:
        return self.tau_s / self.r_c_per_w


RTX_4090 = Card(
    name="RTX 4090",
    idle_w=25.0,
    load_w=390.0,
    default_limit_w=450.0,
    min_limit_w=150.0,
    r_c_per_w=(72.0 - 24.0) / 390.0,
    tau_s=90.0,
    driver_target_c=83.0,
    driver_gain=0.04,
    tok_full=2000.0,
)
H200 = Card(
    name="H200",
    idle_w=75.0,
    load_w=400.0,
    default_limit_w=700.0,
    min_limit_w=200.0,
    r_c_per_w=0.055,
    tau_s=90.0,
    driver_target_c=85.0,
    driver_gain=0.04,
    tok_full=6000.0,
)
CARDS = {"4090": RTX_4090, "h200": H200}
STACK_C_PER_W = 0.0125  # upper card's intake warming per watt of the lower card
STATIC_LIMIT_W = 315.0  # 70 % of the 4090's 450 W: the published operating point


# ---- the physics (pure) ---------------------------------------------------------------
def steady_c(air_c: float, power_w: float, card: Card) -> float:
    """Where a card settles drawing ``power_w`` in ``air_c``: ``T_air + R·P``."""
    return air_c + card.r_c_per_w * power_w


def step_temperature(t_c: float, air_c: float, power_w: float, card: Card, dt_s: float) -> float:
    """The temperature ``dt_s`` later, the first-order model solved exactly."""
    target = steady_c(air_c, power_w, card)
    return target + (t_c - target) * math.exp(-dt_s / card.tau_s)


def batch_fraction(inflight: int, max_inflight: int) -> float:
    """Share of full throughput an engine gives with ``inflight`` sequences."""
    if inflight <= 0:
        return 0.0
    full = max_inflight / (max_inflight + N_HALF)
    return (inflight / (inflight + N_HALF)) / full


def throughput_fraction(power_fraction: float, card: Card) -> float:
    """Tokens served at ``power_fraction`` of the power the work asks for (≤ 1)."""
    return float(min(max(power_fraction, 0.0), 1.0) ** card.curve_exponent)


def driver_factor(t_c: float, card: Card) -> float:
    """Share of its demand the driver lets the card draw at ``t_c`` (clock slowdown)."""
    over = t_c - card.driver_target_c
    return 1.0 if over <= 0 else max(0.2, 1.0 - card.driver_gain * over)


@dataclass(frozen=True, slots=True)
class Draw:
    power_w: float
    speed: float  # fraction of the batch's tokens/s actually produced
    reasons: tuple[str, ...]


def gpu_draw(busy: float, limit_w: float, t_c: float, card: Card) -> Draw:
    """Power and speed of a card whose work asks for ``busy`` (0..1) of full load."""
    if busy <= 0:
        return Draw(card.idle_w, 1.0, ())
    demand = card.idle_w + (card.load_w - card.idle_w) * busy
    reasons: list[str] = []
    allowed = demand * driver_factor(t_c, card)
    if allowed < demand:
        reasons.append("sw_thermal_slowdown")
    if limit_w < allowed:
        allowed = limit_w
        reasons.append("sw_power_cap")
    return Draw(allowed, throughput_fraction(allowed / demand, card), tuple(reasons))


# ---- the workload ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    tokens: int  # output tokens it will produce
    cost: int  # what admission counts (prompt estimate + max_tokens)
    batch: bool = False


@dataclass(frozen=True, slots=True)
class Workload:
    """Interactive arrivals (fixed in advance, the same for every policy) and a batch
    job that keeps ``batch_concurrency`` requests outstanding in its window."""

    seconds: int
    arrivals: tuple[Request, ...]
    batch_window: tuple[float, float]
    batch_concurrency: int


def team_day(hours: float = 9.0, seed: int = 7) -> Workload:
    """A team's day from 08:30: a morning ramp, three bursts (a demo, a review, an
    incident), a lunch lull, a 90-minute batch job mid-afternoon, an idle evening.
    ``hours`` < 9 plays the same day compressed in time (for tests)."""
    scale = hours / 9.0
    rng = random.Random(seed)
    # (start h, end h, requests/s for the whole team), hours since 08:30
    profile = [
        (0.0, 1.0, 1.5),
        (1.0, 1.25, 9.0),  # burst
        (1.25, 3.0, 4.0),
        (3.0, 3.33, 10.0),  # burst
        (3.33, 4.0, 3.0),
        (4.0, 5.0, 0.6),  # lunch
        (5.0, 5.25, 9.0),  # burst
        (5.25, 6.5, 3.5),
        (6.5, 8.0, 3.0),  # the batch job's window adds its own load
        (8.0, 9.0, 0.3),
    ]
    seconds = round(hours * 3600)
    arrivals: list[Request] = []
    for start_h, end_h, rate in profile:
        t = start_h * 3600 * scale
        end = end_h * 3600 * scale
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            arrivals.append(Request(t, rng.randint(32, 600), 400 + 600))
    window = (6.5 * 3600 * scale, 8.0 * 3600 * scale)
    return Workload(seconds, tuple(arrivals), window, 160)


# ---- the policies ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    governor: str  # none | stepped | predictive
    static_limit_w: float = 0.0  # 0: the card's default
    dynamic_limit: bool = False  # the power limit follows the temperature first
    tuning: PredictiveTuning = field(default_factory=PredictiveTuning)
    soft_limit_c: float = 0.0  # 0: the box's; else the governor's own soft limit


POLICIES = (
    Policy("none", "none"),
    Policy("stepped", "stepped"),
    # Today's governor brought to the envelope the only way an operator can: a lower
    # soft_limit_c (76 is the highest that keeps the hot room below 80 °C).
    Policy("stepped@76", "stepped", soft_limit_c=76.0),
    Policy("predictive", "predictive"),
    Policy("none+315W", "none", STATIC_LIMIT_W),
    Policy("stepped+315W", "stepped", STATIC_LIMIT_W),
    Policy("predictive+315W", "predictive", STATIC_LIMIT_W),
    # Admission only as the backstop: it acts at the soft limit itself (no margin).
    Policy("dynamic_limit", "predictive", dynamic_limit=True, tuning=PredictiveTuning(margin_c=0)),
)
DYNAMIC_GAIN_W = 0.5  # W per °C per second of the limit's integral action
# The limit aims this far below the soft limit: below soft - hysteresis, so that the
# admission backstop, once it fires at a burst's start, can step down again (aimed at
# soft - 3 it held level 1 through the batch job: 96.7 % of the tokens instead of 99.3).
DYNAMIC_BELOW_C = 6.0


@dataclass(frozen=True, slots=True)
class Room:
    name: str
    air_c: float


ROOMS = (Room("cool_room", 24.0), Room("hot_room", 35.0))


# ---- the loop -------------------------------------------------------------------------
@dataclass(slots=True)
class _Gpu:
    temp_c: float
    limit_w: float
    level: int = 0
    state: PredictiveState = field(default_factory=PredictiveState)
    reasons: tuple[str, ...] = ()
    power_w: float = 0.0
    level_changes: int = 0
    changes_by_hour: dict[int, int] = field(default_factory=dict)
    limit_changes: int = 0
    above_soft_s: float = 0.0
    peak_c: float = -math.inf
    energy_j: float = 0.0


@dataclass(slots=True)
class _Engine:
    id: int
    virtual: float = 0.0  # tokens each of its sequences has been given so far
    finishing: list[tuple[float, int, Request]] = field(default_factory=list)  # heap
    outstanding: int = 0  # admission cost of its sequences


@dataclass(frozen=True, slots=True)
class Result:
    tokens: int
    requests: int
    refused: int  # gave up in the queue (queue_timeout_s) or found it full
    p95_wait_s: float
    minutes_above_soft: float  # minutes with any GPU above soft_limit_c
    gpu_minutes_above_soft: list[float]
    peak_c: float
    energy_per_token_j: float
    energy_kwh: float
    level_changes_per_hour: float  # the busiest GPU's admission level changes, day mean
    peak_hour_level_changes: int  # the busiest GPU's changes in its busiest clock hour
    limit_changes_per_hour: float  # power-limit changes of more than 5 W, busiest GPU
    series: dict[str, list[float]]  # one sample a minute, for the chart


def simulate(
    workload: Workload,
    room: Room,
    policy: Policy,
    card: Card = RTX_4090,
    thermal: ThermalConfig | None = None,
    engine: EngineConfig | None = None,
    gateway: GatewayConfig | None = None,
    gpus: int = 2,
) -> Result:
    """One policy over one day in one room; deterministic."""
    box = ThermalPolicy.from_config(thermal or ThermalConfig())  # the envelope measured
    th = box if not policy.soft_limit_c else replace(box, soft_limit_c=policy.soft_limit_c)
    eng = engine or EngineConfig()
    gw = gateway or GatewayConfig()
    limit = policy.static_limit_w or card.default_limit_w
    limit = min(max(limit, card.min_limit_w), card.default_limit_w)
    cards = [_Gpu(room.air_c + 5.0, limit) for _ in range(gpus)]
    engines = [_Engine(i) for i in range(gpus)]
    queue: deque[Request] = deque()
    arrivals = deque(workload.arrivals)
    waits: list[float] = []
    tokens = requests = refused = 0
    above_any_s = 0.0
    batch_out = 0
    series: dict[str, list[float]] = {"minute": [], "tokens_per_s": []}
    for i in range(gpus):
        series[f"gpu{i}_c"] = []
        series[f"gpu{i}_level"] = []
        series[f"gpu{i}_w"] = []
    minute_tokens = 0
    for second in range(workload.seconds):
        now = float(second)
        # 1. arrivals; the batch job tops itself up to its concurrency.
        while arrivals and arrivals[0].arrival_s <= now:
            _enqueue(queue, arrivals.popleft(), gw.max_queue, waits)
        lo, hi = workload.batch_window
        if lo <= now < hi:
            for _ in range(workload.batch_concurrency - batch_out):
                if _enqueue(queue, Request(now, 256, 400 + 512, batch=True), gw.max_queue, waits):
                    batch_out += 1
                else:
                    refused += 1
                    break
        # 2. the governor reads every GPU (its reasons are the last step's).
        for g in cards:
            old = g.level
            reading = float(round(g.temp_c))  # NVML reports whole degrees
            if policy.governor == "stepped":
                g.level = govern(reading, g.reasons, g.level, th)
            elif policy.governor == "predictive":
                g.state = govern_predictive(g.state, reading, g.reasons, now, th, policy.tuning)
                g.level = g.state.level
            if policy.dynamic_limit:
                _steer_limit(g, th, policy.tuning, card)
            if g.level != old:
                g.level_changes += 1
                hour = second // 3600
                g.changes_by_hour[hour] = g.changes_by_hour.get(hour, 0) + 1
        # 3. admission: the real budgets and the real router, queue head first.
        while queue:
            head = queue[0]
            if now - head.arrival_s > gw.queue_timeout_s:
                queue.popleft()
                waits.append(gw.queue_timeout_s)
                refused += 1
                batch_out -= head.batch
                continue
            loads = [_load(e, cards[e.id].level, eng) for e in engines]
            chosen = route(loads, head.cost)
            if chosen is None:
                break
            queue.popleft()
            waits.append(now - head.arrival_s)
            e = engines[chosen]
            heapq.heappush(e.finishing, (e.virtual + head.tokens, id(head), head))
            e.outstanding += head.cost
        # 4. each engine runs its batch for one step at what its GPU allows.
        step_tokens = 0
        for e, g in zip(engines, cards, strict=True):
            n = len(e.finishing)
            busy = batch_fraction(n, eng.max_inflight)
            draw = gpu_draw(busy, g.limit_w, g.temp_c, card)
            g.power_w, g.reasons = draw.power_w, draw.reasons
            if n:
                e.virtual += card.tok_full * busy * draw.speed * STEP_S / n
                while e.finishing and e.finishing[0][0] <= e.virtual:
                    _, _, done = heapq.heappop(e.finishing)
                    e.outstanding -= done.cost
                    step_tokens += done.tokens
                    requests += 1
                    batch_out -= done.batch
        tokens += step_tokens
        minute_tokens += step_tokens
        # 5. heat: the upper card (odd index) breathes the one below it.
        hot = False
        for i, g in enumerate(cards):
            air = room.air_c
            if i % 2 == 1:
                air += STACK_C_PER_W * cards[i - 1].power_w
            g.energy_j += g.power_w * STEP_S
            g.temp_c = step_temperature(g.temp_c, air, g.power_w, card, STEP_S)
            g.peak_c = max(g.peak_c, g.temp_c)
            if g.temp_c > box.soft_limit_c:
                g.above_soft_s += STEP_S
                hot = True
        above_any_s += STEP_S if hot else 0.0
        if second % 60 == 59:
            series["minute"].append((second + 1) / 60)
            series["tokens_per_s"].append(minute_tokens / 60)
            minute_tokens = 0
            for i, g in enumerate(cards):
                series[f"gpu{i}_c"].append(round(g.temp_c, 2))
                series[f"gpu{i}_level"].append(g.level)
                series[f"gpu{i}_w"].append(round(g.power_w, 1))
    hours = workload.seconds / 3600
    energy = sum(g.energy_j for g in cards)
    return Result(
        tokens=tokens,
        requests=requests,
        refused=refused,
        p95_wait_s=round(_percentile(waits, 0.95), 2),
        minutes_above_soft=round(above_any_s / 60, 1),
        gpu_minutes_above_soft=[round(g.above_soft_s / 60, 1) for g in cards],
        peak_c=round(max(g.peak_c for g in cards), 1),
        energy_per_token_j=round(energy / tokens, 4) if tokens else math.inf,
        energy_kwh=round(energy / 3.6e6, 3),
        level_changes_per_hour=round(max(g.level_changes for g in cards) / hours, 1),
        peak_hour_level_changes=max(max(g.changes_by_hour.values(), default=0) for g in cards),
        limit_changes_per_hour=round(max(g.limit_changes for g in cards) / hours, 1),
        series=series,
    )


def _enqueue(queue: deque[Request], r: Request, max_queue: int, waits: list[float]) -> bool:
    if len(queue) >= max_queue:  # 503 at once: counted as no wait, not served
        waits.append(0.0)
        return False
    queue.append(r)
    return True


def _load(e: _Engine, level: int, eng: EngineConfig) -> EngineLoad:
    """The engine as the gateway's admission presents it to the router."""
    return EngineLoad(
        id=e.id,
        accepting=level < HARD_LEVEL,
        inflight=len(e.finishing),
        outstanding_tokens=e.outstanding,
        max_inflight=scale_budget(eng.max_inflight, level),
        token_budget=scale_budget(eng.max_inflight_tokens, level),
        throttle_level=level,
    )


def _steer_limit(g: _Gpu, th: ThermalPolicy, tuning: PredictiveTuning, card: Card) -> None:
    """The dynamic power step: the limit follows the predicted temperature (integral
    action on ``soft - DYNAMIC_BELOW_C``), within the card's constraints."""
    ahead = predicted_c(g.temp_c, g.state.trend_c_per_s, tuning)
    error = th.soft_limit_c - DYNAMIC_BELOW_C - ahead
    # A limit above what the card draws does nothing: lowering starts from the draw.
    base = min(g.limit_w, max(g.power_w, card.min_limit_w)) if error < 0 else g.limit_w
    new = base + DYNAMIC_GAIN_W * error * STEP_S
    new = min(max(new, card.min_limit_w), card.default_limit_w)
    if abs(new - g.limit_w) > 0 and round(new / 5) != round(g.limit_w / 5):
        g.limit_changes += 1
    g.limit_w = new


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


# ---- the comparison -------------------------------------------------------------------
def compare(
    hours: float = 9.0,
    card: Card = RTX_4090,
    policies: Sequence[Policy] = POLICIES,
    rooms: Sequence[Room] = ROOMS,
) -> dict[str, Any]:
    """Every policy in every room over the same day; ``new`` is the default governor's
    row again, under the name the issue's check reads."""
    day = team_day(hours)
    traces: dict[str, dict[str, Any]] = {}
    for room in rooms:
        rows: dict[str, Any] = {}
        for policy in policies:
            rows[policy.name] = asdict(simulate(day, room, policy, card))
        rows["new"] = rows[DEFAULT_GOVERNOR]
        traces[room.name] = rows
    return {
        "traces": traces,
        "model": {
            "card": asdict(card),
            "rooms": {r.name: r.air_c for r in rooms},
            "hours": hours,
            "stack_c_per_w": STACK_C_PER_W,
            "new": DEFAULT_GOVERNOR,
            "thermal": asdict(ThermalConfig()),
        },
    }


COLUMNS = (
    ("tokens", "tokens", "{:,}"),
    ("vs none", "", "{}"),
    ("refused", "refused", "{}"),
    ("p95 wait s", "p95_wait_s", "{:.1f}"),
    ("min > soft", "minutes_above_soft", "{:.1f}"),
    ("peak °C", "peak_c", "{:.1f}"),
    ("J/token", "energy_per_token_j", "{:.3f}"),
    ("levels/h", "level_changes_per_hour", "{:.1f}"),
    ("levels, worst h", "peak_hour_level_changes", "{}"),
    ("limit/h", "limit_changes_per_hour", "{:.1f}"),
)


def table(rows: dict[str, Any]) -> str:
    """One trace's policies as a Markdown table (``new`` is not repeated)."""
    base = rows["none"]["tokens"] or 1
    head = "| policy | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for name, r in rows.items():
        if name == "new":
            continue
        cells = []
        for _, key, fmt in COLUMNS:
            cells.append(f"{100 * r['tokens'] / base:.1f} %" if not key else fmt.format(r[key]))
        label = f"{name} (new)" if name == DEFAULT_GOVERNOR else name
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.heat_sim", description=__doc__)
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--plot", default="", help="draw the day's chart here (PNG)")
    parser.add_argument("--hours", type=float, default=9.0, help="length of the day")
    parser.add_argument("--card", choices=sorted(CARDS), default="4090")
    args = parser.parse_args(argv)
    data = compare(args.hours, CARDS[args.card])
    for name, rows in data["traces"].items():
        air = data["model"]["rooms"][name]
        print(f"\n{name} ({air:g} °C room, {data['model']['card']['name']} x2):\n")
        print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    if args.plot:
        from bench._common import write_plot
        from bench.plots import heat_sim

        write_plot(heat_sim, data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
