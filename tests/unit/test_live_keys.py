"""Every key marked live is really live: after a reload the daemon behaves by the new value.

Without a daemon, two proofs: every live key gets the second, and each with a pure
consumer the first as well.

- **Behaviour** (``CASES``, one row per key with a pure consumer): the consumer is built
  once on a config accessor, as the gateway builds Admission on ``lambda:
  supervisor.config``; it is observed under the running config, the accessor is then
  pointed at what ``merge_live`` returns (what a SIGHUP does), and the same consumer,
  not a new one, must now behave as under the new value.
- **Reads** (every live key): each read of the key in the daemon's source happens at the
  time of use through the config in force then, never a copy made at start-up (see
  ``tests/unit/live_reads.py``). Keys read only inside the supervisor's tasks or a
  gateway handler (``DAEMON_ONLY``) rely on this, and some are shown by SIGHUP against a
  real daemon in the integration tests named there.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from appliance.config import Config, DegradationConfig, ThermalConfig, parse_config
from appliance.control import EngineStatus
from appliance.endpoint import EngineAddress
from appliance.engine import EngineState
from appliance.gateway.admission.gate import Admission
from appliance.gateway.errors import GatewayError
from appliance.gateway.relay.request_body import parse_body
from appliance.health import HealthHistory, Observation, assess
from appliance.policy import degradation
from appliance.policy.degradation import EMPTY_BASELINE, Baseline, EngineSample
from appliance.policy.thermal import ThermalPolicy, govern
from appliance.reload import LIVE_KEYS, merge_live
from appliance.supervisor import backoff_delay, restart_allowed
from tests.unit.live_reads import Read, package_reads, reads_in

REPO = Path(__file__).resolve().parents[2]
Observe = Callable[[], Awaitable[object]]
Probe = Callable[[Callable[[], Config]], Observe]  # build once on an accessor; observe often


@dataclass(frozen=True)
class Case:
    value: Any  # what the reload brings
    probe: Probe
    base: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # running TOML


# ---- gateway: what a request body is answered (request_body.parse_body per request) ----------
def request(route: str, body: dict[str, Any]) -> Probe:
    """The gateway's verdict on a body, given the gateway section in force (as each
    request's handler reads it) at call time."""

    def build(config: Callable[[], Config]) -> Observe:
        async def observe() -> object:
            cfg = config()
            raw = json.dumps({"model": "m", **body}).encode()
            try:
                parse_body(route, raw, {}, cfg.gateway, cfg.engine.max_model_len)
            except GatewayError as exc:
                return f"{exc.status} {exc.param}"
            return "accepted"

        return observe

    return build


LONG_CHAT = {"messages": [{"role": "user", "content": "a long question " * 200}]}


def prefix_of(body: dict[str, Any]) -> Probe:
    """How many prompt blocks the gateway hashes for prefix routing (0: none), given the
    gateway section in force at call time."""

    def build(config: Callable[[], Config]) -> Observe:
        async def observe() -> object:
            cfg = config()
            raw = json.dumps({"model": "m", **body}).encode()
            return len(parse_body("chat", raw, {}, cfg.gateway, cfg.engine.max_model_len).prefix)

        return observe

    return build


# ---- admission: one Admission, built once, observed before and after -------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


Scenario = Callable[[Admission, Clock], Awaitable[object]]


def admission(scenario: Scenario, state: EngineState = EngineState.READY) -> Probe:
    def build(config: Callable[[], Config]) -> Observe:
        clock = Clock()
        snaps = [EngineStatus(0, None, EngineAddress(port=9000), state, "k")]
        adm = Admission(config, lambda: snaps, lambda: True, clock=clock)

        async def observe() -> object:
            result = await scenario(adm, clock)
            # Each observation leaves the admission as it found it: nothing held, no one queued.
            assert adm.inflight(0) == 0 and adm.inflight_tokens(0) == 0 and adm.queue_depth == 0
            return result

        return observe

    return build


async def queue_or_refuse(adm: Admission, clock: Clock) -> object:
    """With no engine admitting: is a request queued, or refused at once?"""
    task = asyncio.ensure_future(adm.acquire(1))
    await asyncio.sleep(0)
    outcome = task.exception().code if task.done() else "queued"  # type: ignore[union-attr]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return outcome


async def wait_outcome(adm: Admission, clock: Clock) -> object:
    """With no engine admitting: how a queued request ends within 0.3 s."""
    try:
        await asyncio.wait_for(adm.acquire(1), 0.3)
    except GatewayError as exc:
        return exc.code
    except TimeoutError:
        return "still waiting"
    raise AssertionError("no engine admits: the request cannot have been given one")


async def small_behind_big(adm: Admission, clock: Clock) -> object:
    """A big waiter that does not fit, queued 5 s ago: does a small one behind it pass?"""
    await adm.acquire(600)
    big = asyncio.ensure_future(adm.acquire(500))
    await asyncio.sleep(0)
    clock.now += 5
    small = asyncio.ensure_future(adm.acquire(100))
    await asyncio.sleep(0)
    passed = adm.queue_depth == 1  # only the big one still waits
    big.cancel()
    if passed:
        adm.release(await small, 100)
    else:
        small.cancel()
    await asyncio.gather(big, small, return_exceptions=True)
    adm.release(0, 600)
    return "passed" if passed else "held"


async def sequence_budget(adm: Admission, clock: Clock) -> object:
    return adm.loads()[0].max_inflight


async def big_request(adm: Admission, clock: Clock) -> object:
    """A request that costs 5000 tokens: taken, or refused as never fitting?"""
    try:
        adm.check_cost(5000)
    except GatewayError as exc:
        return exc.code
    return "fits"


# ---- thermal governor: the level of one reading, policy from the config in force -------
def thermal(temperature_c: float, previous_level: int = 0) -> Probe:
    def build(config: Callable[[], Config]) -> Observe:
        async def observe() -> object:
            policy = ThermalPolicy.from_config(config().thermal)
            return govern(temperature_c, (), previous_level, policy)

        return observe

    return build


# ---- health, backoff and budgets: pure functions the engine tasks call with the config --
def hang_verdict(config: Callable[[], Config]) -> Observe:
    """A second failed check in a row, no tokens: suspect, or hung (replace it)?"""

    async def observe() -> object:
        failed = Observation(health_ok=True, probe_ok=False, generation_tokens=5.0)
        verdict, _ = assess(failed, HealthHistory(1, 5.0), config().health.failures_to_restart)
        return verdict.value

    return observe


def backoff(failures: int) -> Probe:
    def build(config: Callable[[], Config]) -> Observe:
        async def observe() -> object:
            r = config().restart
            return backoff_delay(failures, r.backoff_initial_s, r.backoff_max_s)

        return observe

    return build


def budget(key: str) -> Probe:
    """Six restarts in the last hour: may one more happen?"""

    def build(config: Callable[[], Config]) -> Observe:
        async def observe() -> object:
            now = 10_000.0
            return restart_allowed([now - 60.0] * 6, now, getattr(config().restart, key))

        return observe

    return build


# ---- degradation detector: a verdict on samples, policy from the config in force -------
NOW = 1000.0


def samples(t0: float, **fields: Callable[[float], float | None]) -> list[EngineSample]:
    """One sample every 5 s from t0 to NOW; each field a function of t (absent: None)."""
    out = []
    t = t0
    while t <= NOW:
        values = {name: f(t) for name, f in fields.items()}
        rss = values.get("rss")
        out.append(
            EngineSample(
                t=t,
                preemptions_total=values.get("pre"),
                generation_tokens_total=values.get("gen"),
                running=values.get("run"),
                waiting=values.get("wait"),
                kv_cache_usage=values.get("kv"),
                rss_bytes=None if rss is None else int(rss),
            )
        )
        t += 5.0
    return out


def policy_of(cfg: Config) -> degradation.DegradationPolicy:
    """The detector's policy from [degradation], field by field, as the supervisor builds
    it (test_every_degradation_key_is_a_policy_field keeps the names in step)."""
    d = cfg.degradation
    return degradation.DegradationPolicy(
        **{f.name: getattr(d, f.name) for f in dataclasses.fields(d)}
    )


def verdict_on(window: Sequence[EngineSample], baseline: Baseline = EMPTY_BASELINE) -> Probe:
    def build(config: Callable[[], Config]) -> Observe:
        async def observe() -> object:
            return degradation.assess(window, baseline, policy_of(config()), NOW).reason

        return observe

    return build


def learned_rss(config: Callable[[], Config]) -> Observe:
    """Ready since 50 s, samples all along: is a baseline learned yet?"""
    window = samples(950.0, rss=lambda t: 1000.0, run=lambda t: 0.0)

    async def observe() -> object:
        learned = degradation.learn_baseline(window, EMPTY_BASELINE, policy_of(config()), 950, NOW)
        return learned.rss_bytes

    return observe


BASELINE = Baseline(tokens_per_s_per_request=10.0, rss_bytes=1000, samples=5, running=1.0)

CASES: dict[str, Case] = {
    "gateway.max_tokens_cap": Case(
        8192, request("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000})
    ),
    "gateway.max_n": Case(1, request("completions", {"prompt": "x", "n": 2})),
    "gateway.max_best_of": Case(1, request("completions", {"prompt": "x", "best_of": 2})),
    "gateway.max_prompts": Case(1, request("completions", {"prompt": ["x", "y"]})),
    # Whether a request's prompt is hashed for prefix routing (empty: least-loaded only).
    "gateway.prefix_routing": Case(False, prefix_of(LONG_CHAT)),
    "gateway.max_queue": Case(
        2, admission(queue_or_refuse, EngineState.STARTING), {"gateway": {"max_queue": 0}}
    ),
    "gateway.queue_timeout_s": Case(0.05, admission(wait_outcome, EngineState.STARTING)),
    "gateway.queue_aging_s": Case(
        1.0,
        admission(small_behind_big),
        {"engine": {"max_inflight": 8, "max_inflight_tokens": 1000}},
    ),
    "engine.max_inflight": Case(3, admission(sequence_budget)),
    "engine.max_inflight_tokens": Case(1000, admission(big_request)),
    "thermal.soft_limit_c": Case(75.0, thermal(78.0)),
    "thermal.hard_limit_c": Case(84.0, thermal(85.0)),
    "thermal.hysteresis_c": Case(2.0, thermal(76.0, previous_level=1)),
    "health.failures_to_restart": Case(2, hang_verdict),
    "restart.backoff_initial_s": Case(5.0, backoff(1)),
    "restart.backoff_max_s": Case(100.0, backoff(10)),
    "restart.max_restarts_per_hour": Case(7, budget("max_restarts_per_hour")),
    "restart.max_planned_restarts_per_hour": Case(7, budget("max_planned_restarts_per_hour")),
    # 40 preemptions in the window's first 30 s, none since: a storm over 60 s, not over 30.
    "degradation.window_s": Case(
        30.0, verdict_on(samples(940.0, pre=lambda t: min(t, 970.0) * 4 / 3))
    ),
    "degradation.max_preemptions_per_min": Case(
        50.0, verdict_on(samples(940.0, pre=lambda t: t * 40 / 60))
    ),
    # Work present, no token for the last 20 s.
    "degradation.hang_s": Case(
        15.0,
        verdict_on(samples(940.0, run=lambda t: 1.0, gen=lambda t: min(t, 980.0))),
    ),
    "degradation.leak_kv_usage": Case(
        0.99, verdict_on(samples(940.0, kv=lambda t: 0.95, run=lambda t: 0.0))
    ),
    # KV usage high (with nothing running) for the last 20 s.
    "degradation.leak_hold_s": Case(
        15.0,
        verdict_on(samples(940.0, kv=lambda t: 0.95 if t >= 980 else 0.1, run=lambda t: 0.0)),
    ),
    # 3 tokens/s for the one running request; baseline 10.
    "degradation.slowdown_ratio": Case(
        0.2, verdict_on(samples(940.0, run=lambda t: 1.0, gen=lambda t: 3 * t), BASELINE)
    ),
    "degradation.rss_growth_ratio": Case(
        2.0, verdict_on(samples(940.0, rss=lambda t: 1600.0), BASELINE)
    ),
    "degradation.baseline_warmup_s": Case(10.0, learned_rss),
}

# Live keys read only inside the supervisor's engine and telemetry tasks or a gateway
# handler, with no pure function between the config and the behaviour: their reads are
# checked below; where named, an integration test changes them by SIGHUP on a real daemon.
LIVE_RELOAD = "test_live_reload.py::test_a_sighup_puts_new_limits_in_force"
DAEMON_ONLY: dict[str, str | None] = {
    "gateway.metrics_public": LIVE_RELOAD,
    "gateway.max_answer_bytes": None,
    "gateway.stall_timeout_s": None,
    "gateway.key_token_share": None,
    "gateway.stored_responses_per_key": None,
    "engine.startup_timeout_s": None,
    "engine.stop_timeout_s": LIVE_RELOAD,
    "telemetry.interval_s": None,
    "thermal.heat_restart_after_s": None,
    "thermal.heat_restore_after_s": None,
    # Switched by a reload in tests/unit/test_heat_watch.py (the heat loop reads it at
    # each reading).
    "thermal.governor": None,
    "health.interval_s": (
        "test_operator_paths.py::test_health_interval_changed_by_reload_applies_to_running_engines"
    ),
    "health.probe_timeout_s": None,
    "restart.drain_timeout_s": LIVE_RELOAD,
    "restart.degradation_restart": None,
}


def test_every_live_key_is_proved_one_way_or_the_other() -> None:
    assert not set(CASES) & set(DAEMON_ONLY)
    assert set(CASES) | set(DAEMON_ONLY) == LIVE_KEYS, (
        "a key marked live needs a row here: "
        f"{sorted(LIVE_KEYS - set(CASES) - set(DAEMON_ONLY))}; rows for keys not live: "
        f"{sorted((set(CASES) | set(DAEMON_ONLY)) - LIVE_KEYS)}"
    )


@pytest.mark.parametrize("test_id", sorted({t for t in DAEMON_ONLY.values() if t}))
def test_the_named_integration_tests_exist(test_id: str) -> None:
    path, name = test_id.split("::")
    source = (REPO / "tests" / "integration" / path).read_text(encoding="utf-8")
    assert re.search(rf"^def {name}\(", source, re.MULTILINE), test_id


def configs(key: str, case: Case) -> tuple[Config, Config]:
    """(running, from the file a SIGHUP reads): ``case.base`` with the key changed."""
    section, name = key.split(".")
    old = parse_config(case.base, "/etc/llm-appliance/config.toml")
    raw = {s: dict(v) for s, v in case.base.items()}
    raw.setdefault(section, {})[name] = case.value
    return old, parse_config(raw, "/etc/llm-appliance/config.toml")


@pytest.mark.parametrize("key", sorted(CASES))
async def test_a_reload_changes_what_the_running_consumer_does(key: str) -> None:
    case = CASES[key]
    old, new = configs(key, case)
    merged, live, restart = merge_live(old, new)
    assert (live, restart) == ([key], [])
    section, name = key.split(".")
    assert getattr(getattr(merged, section), name) == case.value

    in_force = [old]
    observe = case.probe(lambda: in_force[0])  # built once, like the daemon's consumers
    before = await observe()
    in_force[0] = merged  # what a SIGHUP does to the supervisor's config
    after = await observe()
    under_new = await case.probe(lambda: new)()
    assert before != after, f"{key}: the same {before!r} before and after the reload"
    assert after == under_new, f"{key}: {after!r} after the reload, {under_new!r} from a start"


def test_every_degradation_key_is_a_policy_field() -> None:
    """The supervisor builds the detector's policy from [degradation] name for name."""
    policy_fields = {f.name for f in dataclasses.fields(degradation.DegradationPolicy)}
    assert {f.name for f in dataclasses.fields(DegradationConfig)} <= policy_fields


# ---- reads: at the time of use, through the config in force ---------------------------
READS: dict[str, list[Read]] = collections.defaultdict(list)
for _read in package_reads():
    READS[_read.key].append(_read)


@pytest.mark.parametrize("key", sorted(LIVE_KEYS))
def test_every_live_key_is_read_at_the_time_of_use(key: str) -> None:
    reads = READS.get(key, [])
    assert reads, f"{key} is marked live but nothing in appliance/ reads it"
    kept = [str(r) for r in reads if r.kept]
    assert not kept, f"{key} is marked live but a read outlives a reload: {kept}"


CACHED = """
class Cached:
    def __init__(self, config: Config) -> None:
        self.config = config
        queue = config.gateway.max_queue                  # copied at construction
        self.limit = queue
        self.timeout_s = self.config.gateway.queue_timeout_s

    def later(self) -> None:
        self.seen = self.config.health.interval_s       # stored on the object
        self.thermal = self.config.thermal              # a whole section kept

    def per_call(self) -> int:
        g = self.config.gateway                           # an alias, read now
        return g.max_queue + self._config().engine.max_inflight
"""


def test_the_read_finder_tells_a_copy_from_a_read_at_the_time_of_use() -> None:
    found = {(r.key, r.where.split(":")[1], r.kept) for r in reads_in("x.py", CACHED)}
    assert found == {
        ("gateway.max_queue", "Cached.__init__", "read once, in __init__"),
        ("gateway.queue_timeout_s", "Cached.__init__", "stored in self.timeout_s"),
        ("health.interval_s", "Cached.later", "stored in self.seen"),
        *(
            (f"thermal.{f.name}", "Cached.later", "stored in self.thermal")
            for f in dataclasses.fields(ThermalConfig)
        ),
        ("gateway.max_queue", "Cached.per_call", None),
        ("engine.max_inflight", "Cached.per_call", None),
    }
