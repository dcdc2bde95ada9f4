"""What the status page costs the gateway: its CPU at 64 streams with the page open vs not.

One daemon, ONE fast fake engine (2 ms per token, 64-token streams), a closed loop of
``--streams`` streams through the gateway. Rounds alternate "page closed" / "page open"
(order flipped every round); in a page-open round a poller does what an open page does:
one ``GET /admin/history`` for the whole history, then one ``?after=SEQ`` a second
(``app.js``'s POLL_MS). Per mode it reports the daemon's CPU (user+system, % of one core)
and the streams relayed; the page's cost is the difference, as a share of the gateway's
CPU with the page closed.

That difference is a small number between two noisy ones, so the cost is also measured
directly: with no streams, ``--polls`` page polls back to back, the daemon's CPU per
poll (less its idle rate) times one poll a second. The history sampler runs in both modes
(it runs whether a page is open or not), so neither figure counts it; its tick is one
status snapshot every 2 s, in the idle rate.

    .venv/bin/python -m bench.status_page [--streams 64] [--rounds 4] [--round-s 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import psutil

from bench._common import (
    client_session,
    closed_loop,
    completion_body,
    daemon,
    header,
    module_argv,
    request,
    wait_for_quiet,
)

POLL_S = 1.0  # what app.js does


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


async def poll_page(session: aiohttp.ClientSession, url: str, key: str, stop: asyncio.Event) -> int:
    """An open page: the whole history once, then what is newer every POLL_S."""
    headers = {"Authorization": f"Bearer {key}"}
    seq, polls = 0, 0
    while not stop.is_set():
        async with session.get(f"{url}/admin/history?after={seq}", headers=headers) as resp:
            seq = (await resp.json())["seq"]
        polls += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_S)
    return polls


async def one_round(args: argparse.Namespace, d: Any, page: bool) -> dict[str, float]:
    proc = psutil.Process(d.pid)
    body = completion_body(args.tokens, True)
    async with client_session() as streams, client_session() as pages:
        stop = asyncio.Event()
        poller = asyncio.ensure_future(poll_page(pages, d.url, d.admin_key, stop)) if page else None
        c0, t0 = cpu_s(proc), time.monotonic()
        results, _ = await closed_loop(
            args.streams, args.round_s, lambda w: request(streams, d.url, d.admin_key, body, True)
        )
        c1, t1 = cpu_s(proc), time.monotonic()
        stop.set()
        polls = await poller if poller else 0
    ok = sum(r.ok for r in results)
    return {"cpu_pct": 100 * (c1 - c0) / (t1 - t0), "streams": ok, "polls": polls, "s": t1 - t0}


async def per_poll(d: Any, polls: int) -> tuple[float, float]:
    """The daemon's CPU per history poll (less its idle rate), and its idle rate (%)."""
    proc = psutil.Process(d.pid)
    c0, t0 = cpu_s(proc), time.monotonic()
    await asyncio.sleep(3.0)
    idle = (cpu_s(proc) - c0) / (time.monotonic() - t0)
    headers = {"Authorization": f"Bearer {d.admin_key}"}
    async with client_session() as s:
        c0, t0 = cpu_s(proc), time.monotonic()
        for _ in range(polls):
            async with s.get(f"{d.url}/admin/history?after=0", headers=headers) as resp:
                await resp.read()
        c1, t1 = cpu_s(proc), time.monotonic()
    return max(0.0, (c1 - c0) - idle * (t1 - t0)) / polls, 100 * idle


async def run(args: argparse.Namespace, d: Any) -> None:
    # A few samples in the ring: a steady poll carries the status and one or two new ones.
    await asyncio.sleep(args.warm_s)
    cost_s, idle_pct = await per_poll(d, args.polls)
    rounds: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for i in range(args.rounds):
        for page in (False, True) if i % 2 == 0 else (True, False):
            rounds[page].append(await one_round(args, d, page))
    closed = sum(r["cpu_pct"] for r in rounds[False]) / args.rounds
    opened = sum(r["cpu_pct"] for r in rounds[True]) / args.rounds
    streams = {p: sum(r["streams"] / r["s"] for r in rs) / args.rounds for p, rs in rounds.items()}
    direct = 100 * cost_s / POLL_S
    print("| mode | daemon CPU (% of a core) | streams/s |\n|---|---|---|")
    print(f"| page closed | {closed:.1f} | {streams[False]:.1f} |")
    print(f"| page open (1 poll/s) | {opened:.1f} | {streams[True]:.1f} |")
    print(
        f"\n- A/B difference: {opened - closed:+.2f} points of a core = "
        f"{100 * (opened - closed) / closed:+.2f} % of the gateway's CPU at {args.streams} streams"
        f"\n- direct: {1000 * cost_s:.2f} ms of CPU per poll (full status + new samples) → "
        f"{direct:.3f} % of a core at 1 poll/s = {100 * direct / closed:.2f} % of the gateway's "
        f"CPU at {args.streams} streams (idle daemon: {idle_pct:.2f} % of a core)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each mode")
    ap.add_argument("--round-s", type=float, default=5.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--polls", type=int, default=200, help="polls for the direct figure")
    ap.add_argument("--warm-s", type=float, default=4.0, help="history gathered before")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    args = ap.parse_args()
    quiet = wait_for_quiet(max_wait_s=0 if args.no_wait else 600)
    print(header("Status page cost", module_argv("bench.status_page"), quiet))
    with daemon(1, ["--token-delay-ms", "2"]) as d:
        asyncio.run(run(args, d))


if __name__ == "__main__":
    main()
