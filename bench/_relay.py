"""What the relay benchmarks share (``bench.gateway_overhead``, ``bench.vs_nginx``,
``bench.tree_ab``): the daemon they load, a path's rounds summed up, the rotation of
paths between rounds, and a process's CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench._common import Daemon, Result, daemon
from tests.fakes.appliance_proc import REPO


def relay_daemon(
    token_delay_ms: float,
    top: int,
    listen: str = "unix",
    kv_cache_usage: str | None = None,
    loop: str = "uvloop",
    tree: Path = REPO,
) -> contextlib.AbstractContextManager[Daemon]:
    """A daemon with one fast fake engine listening as ``listen`` says, budgets above a
    load of ``top`` streams (this measures the relay, not admission's queue), the
    contract's health defaults, ``loop`` as its event loop and ``tree``'s code.
    ``kv_cache_usage``: the fixed KV usage the fake engine reports (None: its default of
    1 % per running request)."""
    kv = [] if kv_cache_usage is None else ["--kv-cache-usage", kv_cache_usage]
    return daemon(
        1,
        ["--token-delay-ms", f"{token_delay_ms:g}", "--max-num-seqs", str(4 * top), *kv],
        engine={
            "listen": listen,
            "max_inflight": 4 * top,
            "max_inflight_tokens": 10**8,
            "env": {"PYTHONPATH": str(REPO)},
        },
        gateway={"max_queue": 8 * top},
        # The contract's health defaults (the fakes' test config checks every 0.3 s).
        health={"interval_s": 2.0, "probe_timeout_s": 10.0, "failures_to_restart": 3},
        telemetry={"source": "none", "interval_s": 1.0},
        env={"LLM_APPLIANCE_EVENT_LOOP": loop},
        tree=tree,
    )


@dataclass
class Rounds:
    """One path's rounds at one concurrency, summed: every result and the wall time."""

    results: list[Result] = field(default_factory=list)
    elapsed: float = 0.0

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.ok]

    @property
    def events(self) -> int:
        return sum(r.events for r in self.results)

    def rate(self) -> float:
        return self.events / self.elapsed if self.elapsed else float("nan")


def rotation(paths: Sequence[str], r: int) -> list[str]:
    """Round r's order: the paths rotated by r, so each runs first, middle and last."""
    k = r % len(paths) if paths else 0
    return [*paths[k:], *paths[:k]]


def cpu_s(*procs: psutil.Process) -> float:
    """User+system CPU-seconds of these processes so far (one gone counts nothing)."""
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total
