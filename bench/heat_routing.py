"""Heat-aware routing vs round-robin, with one of two engines hot and slowed.

Two fake engines behind one daemon. Engine 0 plays a GPU at soft-limit heat: its
``file:`` telemetry says 84 °C (soft 80, hard 87 → throttle level 2, half the budget)
and it generates 3× slower (``token_delay_ms`` × 3 through its control knob), as a
clock-throttled GPU would. Engine 1 is cool (60 °C) at full speed.

The same fixed closed-loop load (N clients, each sending a streamed completion as soon
as its previous one ended) runs, in alternating rounds of the same run:

- **heat-aware**: through the gateway, as the appliance routes today;
- **round-robin**: the client alternates requests between the two engines directly,
  over their Unix sockets (the appliance's default ``engine.listen``; engine keys from
  each engine's ``VLLM_API_KEY``), at most ``max_inflight`` requests per engine (the
  same cap the gateway applies per engine), extra requests waiting their turn on their
  engine. It pays no gateway hop, which favours it.

Reported per mode and load: request latency p50/p90/p99 (send → last byte), TTFT p99,
throughput (requests/s, tokens/s) and the share of requests each engine served.

    .venv/bin/python -m bench.heat_routing [--levels 16,24,32] [--rounds 2] [--round-s 6]
        [--json FILE.json] [--plot FILE.png]

``--json`` writes the figures per load and mode; ``--plot`` (or ``--json`` alone: the
PNG goes next to it) draws latency and throughput of both modes (``bench.plots``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench import plots
from bench._common import (
    Result,
    Table,
    client_session,
    closed_loop,
    completion_body,
    daemon,
    header,
    module_argv,
    ms,
    pct,
    plot_path,
    request,
    wait_for_quiet,
    write_plot,
)

MODES = ("heat-aware", "round-robin")


def write_sensors(path: Path, temps: list[float]) -> None:
    gpus = [
        {
            "index": i,
            "temperature_c": t,
            "power_w": 300,
            "power_limit_w": 450,
            "memory_used_bytes": 0,
            "memory_total_bytes": 25757220864,
            "utilization": 0.9,
            "throttle_reasons": [],
        }
        for i, t in enumerate(temps)
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.replace(path)


def round_robin(
    sessions: list[aiohttp.ClientSession],
    urls: list[str],
    keys: list[str],
    body: bytes,
    cap: int,
) -> Callable[[int], Awaitable[Result]]:
    """Strict alternation between the engines, at most ``cap`` in flight on each.

    ``sessions[i]`` reaches engine i (a Unix socket is one connector per engine)."""
    caps = [asyncio.Semaphore(cap) for _ in urls]
    turn = itertools.count()

    async def one(w: int) -> Result:
        i = next(turn) % len(urls)
        t0 = time.monotonic()
        async with caps[i]:
            r = await request(sessions[i], urls[i], keys[i], body, True, i)
        # Latency as the client sees it: waiting for a slot counts.
        r.ttft += r.start - t0
        r.total += r.start - t0
        r.start = t0
        return r

    return one


async def run(args: argparse.Namespace, d: Any) -> dict[tuple[int, str], dict[str, Any]]:
    urls = [d.engine_url(i) for i in range(2)]
    keys = [d.engine_key(i) for i in range(2)]
    body = completion_body(args.tokens, stream=True)
    out: dict[tuple[int, str], dict[str, Any]] = defaultdict(
        lambda: {"results": [], "elapsed": 0.0, "served": Counter()}
    )

    def served_now() -> list[int]:
        return [int(d.app.engine_stats(i)["requests"]) for i in range(2)]

    async with contextlib.AsyncExitStack() as stack:
        s = await stack.enter_async_context(client_session())
        direct = [
            await stack.enter_async_context(client_session(d.engine_address(i))) for i in range(2)
        ]
        for n in args.levels:
            rr = round_robin(direct, urls, keys, body, args.max_inflight)

            async def gw(w: int) -> Result:
                return await request(s, d.url, d.admin_key, body, True)

            # Warm both paths' connections.
            await closed_loop(n, 1.0, gw)
            await closed_loop(n, 1.0, rr)
            for r in range(args.rounds):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    before = served_now()
                    results, elapsed = await closed_loop(
                        n, args.round_s, gw if mode == "heat-aware" else rr
                    )
                    after = served_now()
                    o = out[(n, mode)]
                    o["results"] += results
                    o["elapsed"] += elapsed
                    for i in range(2):
                        o["served"][i] += after[i] - before[i]
                    await asyncio.sleep(0.3)
            print(f"  {n} clients done", flush=True)
    return out


def figures(args: argparse.Namespace, out: dict[tuple[int, str], Any]) -> dict[str, Any]:
    """Per load and mode, what the table shows, as numbers (the --json and the chart)."""
    levels: dict[str, dict[str, Any]] = {}
    for n in args.levels:
        for mode in MODES:
            o = out[(n, mode)]
            res: list[Result] = o["results"]
            ok = [r for r in res if r.ok]
            lat = [r.total for r in ok]
            served = o["served"]

            def r_ms(x: float) -> float:
                return round(x * 1000, 2)

            levels.setdefault(str(n), {})[mode] = {
                "requests": len(res),
                "failed": len(res) - len(ok),
                "lat_p50_ms": r_ms(pct(lat, 50)),
                "lat_p90_ms": r_ms(pct(lat, 90)),
                "lat_p99_ms": r_ms(pct(lat, 99)),
                "ttft_p99_ms": r_ms(pct([r.ttft for r in ok], 99)),
                "req_per_s": round(len(ok) / o["elapsed"], 2),
                # minus the finish chunk and [DONE]
                "tokens_per_s": round(sum(max(0, r.events - 2) for r in ok) / o["elapsed"], 1),
                # Health probes also reach the engines (~1 per interval each): small, included.
                "share_hot": round(served[0] / max(1, served[0] + served[1]), 4),
            }
    return {"levels": levels}


def report(args: argparse.Namespace, quiet: Any, out: dict[tuple[int, str], Any]) -> str:
    t = Table(
        [
            "clients",
            "routing",
            "requests (failed)",
            "latency p50 / p90 / p99 (ms)",
            "TTFT p99 (ms)",
            "req/s",
            "tokens/s",
            "share on hot engine 0",
        ]
    )
    summary = Table(["clients", "p99 heat-aware vs round-robin", "throughput heat-aware / rr"])
    for n in args.levels:
        p99s, rates = {}, {}
        for mode in MODES:
            o = out[(n, mode)]
            res: list[Result] = o["results"]
            ok = [r for r in res if r.ok]
            lat = [r.total for r in ok]
            tokens = sum(max(0, r.events - 2) for r in ok)  # minus finish chunk and [DONE]
            served = o["served"]
            # Health probes also reach the engines (~1 per interval each): small, included.
            share = served[0] / max(1, served[0] + served[1])
            p99s[mode] = pct(lat, 99)
            rates[mode] = len(ok) / o["elapsed"]
            t.add(
                n,
                mode,
                f"{len(res)} ({len(res) - len(ok)})",
                f"{ms(pct(lat, 50))} / {ms(pct(lat, 90))} / {ms(pct(lat, 99))}",
                ms(pct([r.ttft for r in ok], 99)),
                f"{rates[mode]:.1f}",
                f"{tokens / o['elapsed']:.0f}",
                f"{share:.0%}",
            )
        better = 1 - p99s["heat-aware"] / p99s["round-robin"]
        summary.add(
            n,
            f"{better:.0%} lower ({ms(p99s['heat-aware'])} vs {ms(p99s['round-robin'])} ms)",
            f"{rates['heat-aware'] / rates['round-robin']:.2f}×",
        )
    head = header("Heat-aware routing vs round-robin", module_argv("bench.heat_routing"), quiet)
    setup = (
        f"- setup: 2 fake engines, `--token-delay-ms {args.token_delay_ms:g}`; engine 0 "
        f"slowed to {3 * args.token_delay_ms:g} ms/token and reported at 84 °C "
        f"(soft 80, hard 87 → throttle level 2: its budget halved to "
        f"{max(1, args.max_inflight // 2)}); engine 1 at 60 °C; `max_inflight = "
        f"{args.max_inflight}`; {args.tokens}-token streams; {args.rounds} rounds × "
        f"{args.round_s:g} s per mode per load, modes alternating; round-robin goes "
        f"straight to the engines' Unix sockets\n"
    )
    return "\n".join([head, setup, t.markdown() + "\n", summary.markdown() + "\n"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--levels", default="16,24,32", help="closed-loop clients, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per mode per load")
    ap.add_argument("--round-s", type=float, default=6.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--token-delay-ms", type=float, default=5.0, help="the cool engine's speed")
    ap.add_argument("--max-inflight", type=int, default=16, help="engine.max_inflight")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    ap.add_argument(
        "--plot",
        default="",
        help="draw latency and throughput per mode into this PNG (default: next to --json; "
        "needs matplotlib, the 'bench' extra)",
    )
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    quiet.start_watching()
    t0 = time.monotonic()
    sensors = Path(tempfile.mkdtemp(prefix="bench-heat-")) / "sensors.json"
    write_sensors(sensors, [84.0, 60.0])
    with daemon(
        2,
        ["--token-delay-ms", f"{args.token_delay_ms:g}"],
        engine={"max_inflight": args.max_inflight},
        telemetry={"source": f"file:{sensors}", "interval_s": 0.5},
        thermal={"soft_limit_c": 80, "hard_limit_c": 87, "hysteresis_c": 5},
        health={"interval_s": 2.0, "probe_timeout_s": 10.0, "failures_to_restart": 3},
    ) as d:
        d.app.engine_control(0, token_delay_ms=3 * args.token_delay_ms)
        deadline = time.monotonic() + 10
        while d.status()["engines"][0]["throttle_level"] != 2:
            if time.monotonic() > deadline:
                raise SystemExit("engine 0 never reached throttle level 2")
            time.sleep(0.1)
        out = asyncio.run(run(args, d))
        levels = [e["throttle_level"] for e in d.status()["engines"]]
    quiet.stop_watching()
    print()
    print(report(args, quiet, out))
    print(f"(throttle levels at the end: {levels}; took {time.monotonic() - t0:.0f} s)")
    result = figures(args, out)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    write_plot(plots.heat_routing, result, plot_path(args.plot, args.json))


if __name__ == "__main__":
    main()
