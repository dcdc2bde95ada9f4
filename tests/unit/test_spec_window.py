"""An engine's speculation figures count from the moment it is READY.

Real vLLM's health probe asks for one token, which never speculates; only the users'
requests move the ``vllm:spec_decode_*`` counters. A request answered between READY and
the first health check must still show in "the acceptance rate over the last minute", so
the check that found the engine answering is the window's first sample. (A clean-clone CI
run once saw the first request land in exactly that gap, and the rate stay unknown.)
"""

from __future__ import annotations

import time
from typing import cast

import pytest

from appliance.config import parse_config
from appliance.control import CommandResult
from appliance.health import Observation
from appliance.supervisor.commands import Command, Probe
from appliance.supervisor.inbox import Inbox
from appliance.supervisor.watch import HealthWatch
from tests.unit.test_engine_runner import FakeProcess

CONFIG = parse_config({})


class SpeculatingProbe:
    """Health checks as vLLM answers them: a token each, counters moved only by users."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.drafts = self.draft_tokens = self.accepted = 0.0

    def users_request(self, drafts: float, draft_tokens: float, accepted: float) -> None:
        self.drafts += drafts
        self.draft_tokens += draft_tokens
        self.accepted += accepted

    async def observe(self, api_key: str, timeout_s: float) -> Observation:
        self.tokens += 1
        return Observation(
            True,
            True,
            self.tokens,
            0.0,
            spec_drafts=self.drafts,
            spec_draft_tokens=self.draft_tokens,
            spec_accepted_tokens=self.accepted,
        )


def refuse(command: Command) -> CommandResult:
    raise AssertionError(f"no command is sent in these tests: {command}")


def watch_of(probe: SpeculatingProbe) -> HealthWatch:
    return HealthWatch(
        FakeProcess(),  # not started: no exit yet, and its listener is its own
        cast(Probe, probe),
        Inbox(refuse),
        lambda: CONFIG,
    )


async def test_a_request_between_ready_and_the_first_check_counts() -> None:
    probe = SpeculatingProbe()
    watch = watch_of(probe)
    assert await watch.answered() is True  # READY
    probe.users_request(drafts=4, draft_tokens=16, accepted=12)
    await watch.check(ready_since=time.monotonic())
    figures = watch.spec_figures()
    assert figures.acceptance_rate == pytest.approx(0.75)
    assert figures.mean_accepted_length == pytest.approx(1 + 12 / 4)


async def test_no_request_since_ready_leaves_the_figures_unknown() -> None:
    probe = SpeculatingProbe()
    watch = watch_of(probe)
    assert await watch.answered() is True
    for _ in range(3):
        await watch.check(ready_since=time.monotonic())
    figures = watch.spec_figures()
    assert figures.acceptance_rate is None and figures.mean_accepted_length is None
