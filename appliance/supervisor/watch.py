"""One engine's checks, and what they learned (for its runner, which acts on them).

A check: the listener where the engine should be is its own (TCP), a health observation
in layers (:func:`appliance.health.observe`), the pure verdict
(:func:`appliance.health.assess`), and, when healthy, a degradation sample judged over
its window (:mod:`appliance.supervisor.sampling`). This module decides nothing about the
engine's state: it reports an :class:`Outcome`, and the runner, the only code that
changes the engine, acts. Every await here goes through the runner's inbox, so commands
are answered while a check is in flight.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from appliance.config import Config
from appliance.health import HealthHistory, Observation, Verdict, assess
from appliance.policy.degradation import Verdict as DegradationVerdict
from appliance.policy.speculation import SpecFigures, SpecSample, spec_figures
from appliance.supervisor.commands import Probe, ProcessHandle
from appliance.supervisor.inbox import Inbox
from appliance.supervisor.sampling import DegradationWatch


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one check found."""

    verdict: Verdict | None  # None: the process exited meanwhile, or the listener is lost
    observation: Observation | None = None
    degradation: DegradationVerdict | None = None  # judged only when healthy
    listener_lost: bool = False  # nobody, or someone else, listens where the engine did


# "Over the last minute": samples come one per health check (health.interval_s, 2 s by
# default); enough are kept for a minute at intervals down to 0.25 s.
SPEC_WINDOW_S = 60.0
SPEC_SAMPLES = 256


class HealthWatch:
    """The health history, the last observation and the degradation window of one engine."""

    def __init__(
        self,
        process: ProcessHandle,
        probe: Probe,
        inbox: Inbox,
        config: Callable[[], Config],  # the config in force (a reload replaces it)
    ) -> None:
        self._process = process
        self._probe = probe
        self._inbox = inbox
        self._config = config
        self.history = HealthHistory()
        self.observed: Observation | None = None  # the last check's figures
        self.degradation = DegradationWatch()
        # Speculative decoding's counters over the last minutes (none without speculation).
        self.spec_samples: collections.deque[SpecSample] = collections.deque(maxlen=SPEC_SAMPLES)

    def open(self) -> None:
        self._probe.open()

    async def close(self) -> None:
        await self._probe.close()

    async def _observe(self) -> Observation:
        return await self._inbox.busy(
            self._probe.observe(self._process.api_key, self._config().health.probe_timeout_s)
        )

    async def answered(self) -> bool | None:
        """While starting: True once a real completion came back (the watch starts
        afresh); None not yet; False: someone else listens on the engine's port."""
        owner = await self._inbox.busy(self._process.listener_is_ours())
        if owner is not True:
            return owner
        obs = await self._observe()
        if not (obs.health_ok and obs.probe_ok):
            return None
        self.history = HealthHistory(0, obs.generation_tokens)
        self.observed = obs
        # The window's first sample: a request answered before the first check must count.
        self.spec_samples.clear()
        self._keep_spec_sample(obs)
        await self._inbox.busy(self._process.remember_tree())
        return True

    def _keep_spec_sample(self, obs: Observation) -> None:
        if obs.spec_drafts is None or obs.spec_draft_tokens is None:
            return
        accepted = obs.spec_accepted_tokens or 0.0
        now = time.monotonic()
        self.spec_samples.append(SpecSample(now, obs.spec_drafts, obs.spec_draft_tokens, accepted))

    def spec_figures(self) -> SpecFigures:
        """Acceptance over the last minute (see :mod:`appliance.policy.speculation`)."""
        return spec_figures(self.spec_samples, time.monotonic(), SPEC_WINDOW_S)

    async def check(self, ready_since: float | None) -> Outcome:
        """One health pass of a running engine."""
        if await self._inbox.busy(self._process.listener_is_ours()) is not True:
            return Outcome(None, listener_lost=True)  # named in the log; no probe sent
        obs = await self._observe()
        if self._process.returncode is not None:
            return Outcome(None, obs)  # it crashed, it did not hang: the watch sees the exit
        self.observed = obs
        self._keep_spec_sample(obs)
        config = self._config()
        verdict, self.history = assess(obs, self.history, config.health.failures_to_restart)
        if verdict is not Verdict.HEALTHY:
            return Outcome(verdict, obs)
        now = time.monotonic()
        rss = await self._inbox.busy(self._process.sample_tree())
        started = ready_since if ready_since is not None else now
        judged = self.degradation.judge(obs, rss, now, started, config.degradation)
        return Outcome(verdict, obs, judged)

    async def kv_usage(self) -> float | None:
        """The engine's KV cache usage alone (read often while its KV breaker is open)."""
        timeout_s = self._config().health.probe_timeout_s
        return await self._inbox.busy(self._probe.kv_usage(timeout_s))
