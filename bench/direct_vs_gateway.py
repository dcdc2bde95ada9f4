"""One engine straight vs through the gateway: the same closed loop, rounds alternating.

Shared by ``bench.real_throughput`` (streamed tokens) and ``bench.embeddings`` (embedded
inputs). "Direct" rounds hit the very engine the gateway relays to, on its own address
with its per-spawn key; rounds alternate direct / gateway with the order flipped every
round, so a machine that gets busier mid-run weighs on both paths alike.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import psutil

from bench._common import Daemon, Result, Table, client_session, closed_loop, ms, pct

PATHS = ("direct", "gateway")
# One request: (session, base URL, key, worker number) -> its result.
Send = Callable[[aiohttp.ClientSession, str, str, int], Awaitable[Result]]
# (concurrency, path) -> (every result, seconds measured)
Samples = dict[tuple[int, str], tuple[list[Result], float]]


@dataclass(frozen=True)
class Round:
    results: list[Result]
    seconds: float
    daemon_cpu_s: float = 0.0  # the daemon's CPU (user + system) over the round


# (concurrency, path) -> each round, in order
Rounds = dict[tuple[int, str], list[Round]]


async def alternate(
    d: Daemon,
    engine_id: int,
    levels: Sequence[int],
    rounds: int,
    round_s: float,
    send: Send,
    unit: str,
) -> Samples:
    """``rounds`` rounds of ``round_s`` seconds per path at each concurrency of ``levels``,
    after a short warm-up of each path (connections open, engine warm)."""
    loads = await alternate_loads(d, engine_id, levels, rounds, round_s, {"": send}, unit)
    return merged(loads[""])


async def alternate_loads(
    d: Daemon,
    engine_id: int,
    levels: Sequence[int],
    rounds: int,
    round_s: float,
    sends: Mapping[str, Send],
    unit: str,
) -> dict[str, Rounds]:
    """:func:`alternate` for several loads (routes, say) in one run: at each concurrency,
    each round runs every load in turn, direct and gateway, the order of the two flipped
    from one load and one round to the next, so the loads share the machine's moods too."""
    url, key = d.engine_url(engine_id), d.engine_key(engine_id)
    out: dict[str, Rounds] = {name: {} for name in sends}
    daemon = psutil.Process(d.pid)

    def daemon_cpu() -> float:
        t = daemon.cpu_times()
        return float(t.user + t.system)

    async with client_session() as gw, client_session(d.engine_address(engine_id)) as direct:

        def one(send: Send, path: str) -> Callable[[int], Awaitable[Result]]:
            s, base, k = (direct, url, key) if path == "direct" else (gw, d.url, d.admin_key)
            return lambda w: send(s, base, k, w)

        for send in sends.values():
            for path in PATHS:
                await closed_loop(max(levels), 3.0, one(send, path))
        for c in levels:
            for r in range(rounds):
                for i, (name, send) in enumerate(sends.items()):
                    for path in PATHS if (r + i) % 2 == 0 else PATHS[::-1]:
                        cpu = daemon_cpu()
                        results, seconds = await closed_loop(c, round_s, one(send, path))
                        done = Round(results, seconds, daemon_cpu() - cpu)
                        out[name].setdefault((c, path), []).append(done)
            print(f"  {c} {unit} done", flush=True)
    return out


def merged(rounds: Rounds) -> Samples:
    """Every round's results of a path and concurrency together, and their seconds."""
    return {
        k: ([r for one in got for r in one.results], sum(one.seconds for one in got))
        for k, got in rounds.items()
    }


def daemon_cpu_per_event(rounds: Rounds, c: int) -> tuple[float, float]:
    """The daemon's CPU µs per SSE event of the gateway rounds at ``c``: raw, and net of
    its background rate (health checks, timers) measured in the direct rounds, when it
    relays nothing."""
    direct, gw = rounds[(c, "direct")], rounds[(c, "gateway")]
    events = sum(r.events for one in gw for r in one.results if r.ok)
    cpu = sum(one.daemon_cpu_s for one in gw)
    secs = sum(one.seconds for one in direct)
    background = sum(one.daemon_cpu_s for one in direct) / secs if secs else 0.0
    net = cpu - background * sum(one.seconds for one in gw)
    return (cpu * 1e6 / events, net * 1e6 / events) if events else (float("nan"),) * 2


def round_ratios(rounds: Rounds, c: int, m: Measure) -> list[float]:
    """Gateway over direct, round by round (the same round of both paths), at ``c``."""
    ratios = []
    pairs = zip(rounds[(c, "direct")], rounds[(c, "gateway")], strict=True)
    for dr, gr in pairs:
        drate = m.rate_of([r for r in dr.results if r.ok], dr.seconds) if dr.seconds else 0.0
        grate = m.rate_of([r for r in gr.results if r.ok], gr.seconds) if gr.seconds else 0.0
        ratios.append(grate / drate if drate else float("nan"))
    return ratios


@dataclass(frozen=True)
class Measure:
    """What a comparison counts and how its table and JSON name it."""

    load: str  # the concurrency column: "streams", "clients"
    rate: str  # "tokens/s", "inputs/s"
    rate_key: str  # the rates' key in the JSON figures: "tok_s", "inputs_s"
    latency: str  # "TTFT", "latency"
    rate_of: Callable[[list[Result], float], float]  # (good results, seconds) -> rate
    latency_of: Callable[[Result], float]


def compare(levels: Sequence[int], samples: Samples, m: Measure) -> tuple[Table, dict[str, Any]]:
    """Per concurrency: requests, failures, both rates and their ratio, latency p50/p99."""
    t = Table(
        [
            m.load,
            "requests direct / gw",
            "failed",
            f"{m.rate} direct",
            f"{m.rate} gw",
            "ratio gw/direct",
            f"{m.latency} p50 direct / gw (ms)",
            f"{m.latency} p99 direct / gw (ms)",
        ]
    )
    figures: dict[str, Any] = {}
    for c in levels:
        (dres, delapsed), (gres, gelapsed) = samples[(c, "direct")], samples[(c, "gateway")]
        dok, gok = [r for r in dres if r.ok], [r for r in gres if r.ok]
        drate = m.rate_of(dok, delapsed) if delapsed else float("nan")
        grate = m.rate_of(gok, gelapsed) if gelapsed else float("nan")
        ratio = grate / drate if drate else float("nan")
        dt, gt = [m.latency_of(r) for r in dok], [m.latency_of(r) for r in gok]
        t.add(
            c,
            f"{len(dres)} / {len(gres)}",
            f"{len(dres) - len(dok)} / {len(gres) - len(gok)}",
            f"{drate:.1f}",
            f"{grate:.1f}",
            f"{ratio:.3f}",
            f"{ms(pct(dt, 50))} / {ms(pct(gt, 50))}",
            f"{ms(pct(dt, 99))} / {ms(pct(gt, 99))}",
        )
        figures[str(c)] = {"ratio": round(ratio, 4), m.rate_key: [round(drate, 1), round(grate, 1)]}
    return t, figures
