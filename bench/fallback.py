"""Overflow fallback under a heat step: p99 TTFT and failed requests, fallback on vs off.

One daemon, two ``[[models]]`` on CPU with one fake engine each: ``chat`` (fallback
``small``) and ``small``. Closed-loop clients stream completions from ``chat``. In every
round a heat step (``file:`` telemetry) puts chat's GPU past the hard limit for the
middle part of the round, so chat's engine admits nothing new, then cools it again.

Modes, alternating rounds of the same run:

- **fallback on**: requests as clients send them; while chat is hot they go to small;
- **fallback off**: the same requests with ``X-Appliance-Fallback: never``; while chat is
  hot they wait in chat's queue, and those that wait past ``gateway.queue_timeout_s``
  get 503 (failed).

Reported per mode: requests, failed, TTFT p50/p99 over the whole round and over the
requests sent during the heat step, and the share answered by small (its
``X-Appliance-Model`` header).

    .venv/bin/python -m bench.fallback [--clients 8] [--rounds 4] [--round-s 9]
        [--heat-s 4] [--queue-timeout-s 2] [--json FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench._common import (
    DONE,
    ERROR_MARK,
    SSE_DATA,
    Daemon,
    Table,
    client_session,
    closed_loop,
    header,
    module_argv,
    ms,
    pct,
    wait_for_quiet,
)
from bench.heat_routing import write_sensors
from tests.fakes.appliance_proc import fake_engine_config, run_appliance

MODES = ("fallback on", "fallback off")
CHAT, SMALL = "chat", "small"
HOT, COOL = 95.0, 50.0


@dataclass(slots=True)
class Outcome:
    ok: bool
    start: float  # monotonic
    ttft: float
    in_heat: bool  # sent while chat was hot
    by_small: bool  # answered by the fallback (X-Appliance-Model: small)


class HeatStep:
    """Chat's GPU hot from ``start`` to ``end`` (monotonic) of the running round."""

    def __init__(self, sensors: Path, chat_index: int) -> None:
        self.sensors = sensors
        self.chat_index = chat_index
        self.start = self.end = 0.0

    def hot_now(self, t: float) -> bool:
        return self.start <= t < self.end

    async def run(self, delay_s: float, length_s: float) -> None:
        await asyncio.sleep(delay_s)
        temps = [COOL, COOL]
        temps[self.chat_index] = HOT
        self.start = time.monotonic()
        self.end = self.start + length_s
        write_sensors(self.sensors, temps)
        await asyncio.sleep(length_s)
        write_sensors(self.sensors, [COOL, COOL])


async def one_request(
    session: aiohttp.ClientSession, url: str, key: str, body: bytes, never: bool, heat: HeatStep
) -> Outcome:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if never:
        headers["X-Appliance-Fallback"] = "never"
    t0 = time.monotonic()
    in_heat = heat.hot_now(t0)
    ttft = 0.0
    try:
        async with session.post(url + "/v1/completions", data=body, headers=headers) as resp:
            by_small = resp.headers.get("X-Appliance-Model") == SMALL
            if resp.status != 200:
                await resp.read()
                return Outcome(False, t0, 0.0, in_heat, by_small)
            done = bad = False
            async for chunk in resp.content.iter_any():
                if not ttft and SSE_DATA in chunk:
                    ttft = time.monotonic() - t0
                bad = bad or ERROR_MARK in chunk
                done = done or DONE in chunk
            return Outcome(done and not bad, t0, ttft, in_heat, by_small)
    except (aiohttp.ClientError, TimeoutError, OSError):
        return Outcome(False, t0, ttft, in_heat, False)


async def wait_cool(cool: Any, timeout_s: float = 10.0) -> None:
    """Poll the daemon's status until chat's engine is cool again."""
    deadline = time.monotonic() + timeout_s
    for _ in iter(cool, True):
        if time.monotonic() > deadline:
            raise SystemExit("chat's engine never cooled down")
        await asyncio.sleep(0.1)


async def run(args: argparse.Namespace, d: Any, sensors: Path) -> dict[str, list[Outcome]]:
    engines = d.status()["engines"]
    chat_index = next(i for i, e in enumerate(engines) if e["model"] == CHAT)
    body = json.dumps(
        {"model": CHAT, "prompt": "hello there", "max_tokens": args.tokens, "stream": True}
    ).encode()
    out: dict[str, list[Outcome]] = defaultdict(list)
    heat = HeatStep(sensors, chat_index)

    def chat_cool() -> bool:
        return bool(d.status()["engines"][chat_index]["throttle_level"] == 0)

    async with client_session() as s:
        for r in range(args.rounds):
            mode = MODES[r % 2]
            never = mode == "fallback off"

            async def one(w: int, never: bool = never) -> Any:
                return await one_request(s, d.url, d.admin_key, body, never, heat)

            step = asyncio.create_task(heat.run((args.round_s - args.heat_s) / 3, args.heat_s))
            results, _ = await closed_loop(args.clients, args.round_s, one)
            await step
            out[mode] += results
            await wait_cool(chat_cool)  # the next round starts cool
            print(f"  round {r + 1}/{args.rounds} ({mode}) done", flush=True)
    return out


def figures(out: dict[str, list[Outcome]]) -> dict[str, dict[str, Any]]:
    res: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        all_ = out[mode]
        ok = [o for o in all_ if o.ok]
        hot = [o for o in all_ if o.in_heat]
        hot_ok = [o for o in hot if o.ok]
        res[mode] = {
            "requests": len(all_),
            "failed": len(all_) - len(ok),
            "requests_in_heat": len(hot),
            "failed_in_heat": len(hot) - len(hot_ok),
            "ttft_p50_ms": round(pct([o.ttft for o in ok], 50) * 1000, 2),
            "ttft_p99_ms": round(pct([o.ttft for o in ok], 99) * 1000, 2),
            "ttft_p99_in_heat_ms": round(pct([o.ttft for o in hot_ok], 99) * 1000, 2),
            "answered_by_small": sum(o.by_small for o in ok),
        }
    return res


def report(args: argparse.Namespace, quiet: Any, out: dict[str, list[Outcome]]) -> str:
    t = Table(
        [
            "mode",
            "requests (failed)",
            "sent while hot (failed)",
            "TTFT p50 / p99 (ms)",
            "TTFT p99 of those sent while hot (ms)",
            "answered by small",
        ]
    )
    for mode, f in figures(out).items():
        ok = [o for o in out[mode] if o.ok]
        hot_ok = [o for o in out[mode] if o.ok and o.in_heat]
        t.add(
            mode,
            f"{f['requests']} ({f['failed']})",
            f"{f['requests_in_heat']} ({f['failed_in_heat']})",
            f"{ms(pct([o.ttft for o in ok], 50))} / {ms(pct([o.ttft for o in ok], 99))}",
            ms(pct([o.ttft for o in hot_ok], 99)),
            str(f["answered_by_small"]),
        )
    head = header("Fallback under a heat step", module_argv("bench.fallback"), quiet)
    setup = (
        f"- setup: 2 fake engines (`--token-delay-ms {args.token_delay_ms:g}`), models chat "
        f"(fallback small) and small, `max_inflight = {args.max_inflight}`, "
        f"`queue_timeout_s = {args.queue_timeout_s:g}`; {args.clients} closed-loop clients "
        f"on chat, {args.tokens}-token streams; {args.rounds} rounds × {args.round_s:g} s, "
        f"modes alternating; in every round chat's GPU at {HOT:g} °C (hard limit 87) for "
        f"{args.heat_s:g} s from a third of the way in\n"
    )
    return "\n".join([head, setup, t.markdown() + "\n"])


@contextlib.contextmanager
def two_models(args: argparse.Namespace, sensors: Path) -> Iterator[Daemon]:
    """A daemon serving chat (fallback small) and small, one fake engine each, READY."""
    tmp = Path(tempfile.mkdtemp(prefix="llm-appliance-bench-"))
    try:
        cfg: dict[str, Any] = fake_engine_config(
            tmp,
            2,
            "--token-delay-ms",
            f"{args.token_delay_ms:g}",
            engine={"max_inflight": args.max_inflight},
            gateway={"queue_timeout_s": args.queue_timeout_s},
            telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
            thermal={"soft_limit_c": 80, "hard_limit_c": 87, "hysteresis_c": 5},
            health={"interval_s": 2.0, "probe_timeout_s": 10.0, "failures_to_restart": 3},
        )
        cfg["models"] = [
            {"name": CHAT, "cpu_engines": 1, "fallback": SMALL},
            {"name": SMALL, "cpu_engines": 1},
        ]
        with run_appliance(tmp, cfg, env={"RUNTIME_DIRECTORY": str(tmp / "run")}) as app:
            app.wait_all_ready(timeout=60)
            d = Daemon(app, tmp, (tmp / "admin.key").read_text().strip())
            yield d
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients on chat")
    ap.add_argument("--rounds", type=int, default=4, help="rounds in all, modes alternating")
    ap.add_argument("--round-s", type=float, default=9.0)
    ap.add_argument("--heat-s", type=float, default=4.0, help="the heat step's length")
    ap.add_argument("--queue-timeout-s", type=float, default=2.0, help="gateway.queue_timeout_s")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--token-delay-ms", type=float, default=5.0)
    ap.add_argument("--max-inflight", type=int, default=16, help="engine.max_inflight")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    quiet.start_watching()
    t0 = time.monotonic()
    sensors = Path(tempfile.mkdtemp(prefix="bench-fallback-")) / "sensors.json"
    write_sensors(sensors, [COOL, COOL])
    with two_models(args, sensors) as d:
        out = asyncio.run(run(args, d, sensors))
    quiet.stop_watching()
    print()
    print(report(args, quiet, out))
    print(f"(took {time.monotonic() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures(out), indent=2))


if __name__ == "__main__":
    main()
