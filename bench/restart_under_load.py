"""Restarts under a steady load, and how fast trouble is detected.

Two fake engines behind one daemon; a steady closed loop of clients through the gateway
(half of the requests streamed, half not) runs from start to end. On engine 0, in turn:

1. ``admin``: ``POST /admin/engines/0/restart`` (drain, then restart);
2. ``crash``: SIGKILL of engine 0's process;
3. ``hang``: its control knob ``hang=true`` (``/health`` stays 200, no token comes);
4. ``degraded``: its control knob ``preemptions_per_request=20`` (a preemption storm).

``/admin/status`` is polled every 25 ms to time each event: **detection** = event →
engine 0 leaves READY; **back** = event → READY again (a new process). Every request
is classified by when it ran: ended before the first event (baseline), or in flight at
some moment of an event's window (event → READY again). Reported per window: requests,
failures (streamed / not streamed), latency p50/p99/max, against the baseline.

    .venv/bin/python -m bench.restart_under_load [--clients 8] [--phases admin,crash,hang,degraded]
        [--json FILE.json] [--plot FILE.png]

``--json`` writes the windows and a per-second timeline (requests OK / failed by when
they ended, p99 of the OK ones, both engines' states from ``/admin/status`` every
0.25 s, restarts); ``--plot`` (or ``--json`` alone: next to it) draws that timeline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import plots
from bench._common import (
    Result,
    StatePoller,
    Table,
    client_session,
    completion_body,
    daemon,
    header,
    module_argv,
    ms,
    p99_per_bin,
    pct,
    per_bin,
    plot_path,
    request,
    wait_for_quiet,
    write_plot,
)

PHASES = ("admin", "crash", "hang", "degraded")
POLL_S = 0.025
STATES_EVERY_S = 0.25  # the timeline's engine states (the windows' timing polls at POLL_S)
LABELS = {
    "admin": "admin restart (drain → restart)",
    "crash": "crash (SIGKILL)",
    "hang": "hang (hang=true)",
    "degraded": "degradation (preemption storm)",
}


@dataclass
class Window:
    name: str
    start: float
    detected: float | None = None
    back: float | None = None
    states: list[str] = field(default_factory=list)
    end: float | None = None
    note: str = ""


async def poll_engine0(s: aiohttp.ClientSession, d: Any) -> dict[str, Any]:
    async with s.get(
        d.url + "/admin/status", headers=d.auth, timeout=aiohttp.ClientTimeout(total=5)
    ) as r:
        body = await r.json()
        return body["engines"][0]  # type: ignore[no-any-return]


async def watch(s: aiohttp.ClientSession, d: Any, w: Window, pid0: int, limit_s: float) -> None:
    """Follow engine 0's state until it is READY again with a new process."""
    deadline = time.monotonic() + limit_s
    last = "READY"
    while time.monotonic() < deadline:
        try:
            e = await poll_engine0(s, d)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            await asyncio.sleep(POLL_S)
            continue
        now = time.monotonic()
        state = e["state"]
        if state != last:
            w.states.append(f"{state}@{now - w.start:.2f}s")
            last = state
        if w.detected is None and state != "READY":
            w.detected = now
        if w.detected is not None and state == "READY" and e.get("pid") not in (None, pid0):
            w.back = now
            return
        await asyncio.sleep(POLL_S)
    w.note = f"not READY again within {limit_s:g} s"


async def run(args: argparse.Namespace, d: Any) -> dict[str, Any]:
    results: list[Result] = []
    stop = asyncio.Event()
    windows: list[Window] = []
    bodies = {True: completion_body(args.tokens, True), False: completion_body(args.tokens, False)}

    async with client_session() as s, client_session() as admin:

        async def worker(w: int) -> None:
            stream = w % 2 == 0
            while not stop.is_set():
                results.append(await request(s, d.url, d.admin_key, bodies[stream], stream))

        load = [asyncio.create_task(worker(w)) for w in range(args.clients)]
        t_start = time.monotonic()
        poller = StatePoller(d.url, d.auth, t_start, STATES_EVERY_S)
        polling = asyncio.create_task(poller.run(admin, stop))
        await asyncio.sleep(args.baseline_s)
        baseline_end = time.monotonic()
        for phase in args.phases:
            pid0 = d.engine_pid(0)
            w = Window(phase, time.monotonic())
            if phase == "admin":
                async with admin.post(d.url + "/admin/engines/0/restart", headers=d.auth) as r:
                    w.note = f"POST answered {r.status}"
            elif phase == "crash":
                os.kill(pid0, signal.SIGKILL)
            elif phase == "hang":
                await asyncio.to_thread(d.app.engine_control, 0, hang=True)
            elif phase == "degraded":
                await asyncio.to_thread(d.app.engine_control, 0, preemptions_per_request=20)
            w.start = time.monotonic() if phase != "admin" else w.start
            await watch(admin, d, w, pid0, args.phase_limit_s)
            w.end = time.monotonic()
            windows.append(w)
            print(
                f"  {phase}: detected in "
                f"{'-' if w.detected is None else f'{w.detected - w.start:.2f}'} s, "
                f"back in {'-' if w.back is None else f'{w.back - w.start:.2f}'} s",
                flush=True,
            )
            await asyncio.sleep(args.settle_s)
        stop.set()
        await asyncio.gather(*load, polling)
        t_end = time.monotonic()
        status = await poll_engine0(admin, d)
    return {
        "results": results,
        "windows": windows,
        "t_start": t_start,
        "t_end": t_end,
        "baseline_end": baseline_end,
        "engine0": status,
        "states": poller.samples(),
    }


def result_data(data: dict[str, Any]) -> dict[str, Any]:
    """The --json: each window's timing, and the run's per-second timeline (the chart)."""
    t0 = data["t_start"]
    res: list[Result] = data["results"]
    duration = data["t_end"] - t0
    ended = [(r.start + r.total - t0, r) for r in res]

    def rel(x: float | None) -> float | None:
        return None if x is None else round(x - t0, 3)

    windows: list[Window] = data["windows"]
    return {
        "requests": len(res),
        "failed": sum(not r.ok for r in res),
        "windows": [
            {
                "name": w.name,
                "at_s": rel(w.start),
                "detected_s": rel(w.detected),
                "back_s": rel(w.back),
                "states": w.states,
                "note": w.note,
            }
            for w in windows
        ],
        "timeline": {
            "bin_s": 1.0,
            "duration_s": round(duration, 3),
            "counts": {
                "ok": per_bin([t for t, r in ended if r.ok], duration),
                "failed": per_bin([t for t, r in ended if not r.ok], duration),
            },
            "p99_ms": p99_per_bin([(t, r.total) for t, r in ended if r.ok], duration),
            "states": data["states"],
            "markers": [
                {"at_s": rel(w.start), "label": LABELS[w.name].split(" (")[0]} for w in windows
            ],
        },
    }


def report(args: argparse.Namespace, quiet: Any, data: dict[str, Any], cfg: dict[str, Any]) -> str:
    res: list[Result] = data["results"]
    windows: list[Window] = data["windows"]
    # Before: requests that ended before the first event (the first 0.5 s, connection
    # set-up, left out).
    base = [
        r
        for r in res
        if r.start >= data["t_start"] + 0.5 and r.start + r.total < data["baseline_end"]
    ]
    base_lat = [r.total for r in base if r.ok]

    t = Table(
        [
            "window",
            "detection",
            "READY again",
            "requests (stream / not)",
            "failed (stream / not)",
            "latency p50 / p99 / max (ms)",
            "p99 vs before",
            "engine 0 states seen",
        ]
    )

    def row(name: str, sel: list[Result], det: str, back: str, states: str) -> None:
        st = [r for r in sel if r.stream]
        ns = [r for r in sel if not r.stream]
        lat = [r.total for r in sel if r.ok]
        rel = pct(lat, 99) / pct(base_lat, 99) if base_lat and lat else float("nan")
        t.add(
            name,
            det,
            back,
            f"{len(st)} / {len(ns)}",
            f"{sum(not r.ok for r in st)} / {sum(not r.ok for r in ns)}",
            f"{ms(pct(lat, 50))} / {ms(pct(lat, 99))} / {ms(max(lat, default=float('nan')))}",
            f"{rel:.2f}×",
            states,
        )

    row(f"before (first {args.baseline_s:g} s)", base, "–", "–", "READY")
    errors: Counter[str] = Counter()
    for w in windows:
        end = w.back if w.back is not None else (w.end or w.start)
        # In the window: every request in flight at some time between event and READY.
        sel = [r for r in res if r.start <= end and r.start + r.total >= w.start]
        errors.update(f"{w.name}: {r.error}" for r in sel if not r.ok)
        det = "–" if w.detected is None else f"{(w.detected - w.start) * 1000:.0f} ms"
        back = "–" if w.back is None else f"{w.back - w.start:.2f} s"
        row(
            LABELS[w.name],
            sel,
            det,
            back,
            " → ".join(w.states) + (f" ({w.note})" if w.note else ""),
        )
    total_failed = sum(not r.ok for r in res)
    head = header(
        "Restart under load and detection times", module_argv("bench.restart_under_load"), quiet
    )
    h, rs, dg = cfg["health"], cfg["restart"], cfg["degradation"]
    setup = (
        f"- load: {args.clients} closed-loop clients through the gateway (half streamed, half "
        f"not), {args.tokens}-token completions, 2 fake engines at "
        f"`--token-delay-ms {args.token_delay_ms:g}`; {len(res)} requests in all, "
        f"{total_failed} failed\n"
        f"- health: `interval_s = {h['interval_s']}`, `probe_timeout_s = "
        f"{h['probe_timeout_s']}`, `failures_to_restart = {h['failures_to_restart']}`; "
        f"restart: `backoff_initial_s = {rs['backoff_initial_s']}`, `drain_timeout_s = "
        f"{rs['drain_timeout_s']}`; engine: `stop_timeout_s = "
        f"{cfg['engine']['stop_timeout_s']}`; degradation: `window_s = {dg['window_s']}`, "
        f"`max_preemptions_per_min = {dg['max_preemptions_per_min']}`, `hang_s = "
        f"{dg['hang_s']}`\n"
        f"- detection = event → engine 0 not READY in `/admin/status` (polled every "
        f"{POLL_S * 1000:.0f} ms); READY again = event → READY with a new pid\n"
    )
    out = [head, setup, t.markdown() + "\n"]
    if errors:
        out.append("Failures by window and cause:\n")
        ft = Table(["window: cause", "requests"])
        for k, v in errors.most_common():
            ft.add(k, v)
        out.append(ft.markdown() + "\n")
    e0 = data["engine0"]
    out.append(
        f"Engine 0 at the end: state {e0['state']}, restarts {e0['restarts']}, "
        f"by reason {e0.get('restarts_by_reason')}\n"
    )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--token-delay-ms", type=float, default=5.0)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--baseline-s", type=float, default=5.0)
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--phase-limit-s", type=float, default=90.0)
    ap.add_argument("--health-interval-s", type=float, default=0.5)
    ap.add_argument("--probe-timeout-s", type=float, default=1.0)
    ap.add_argument("--failures-to-restart", type=int, default=3)
    ap.add_argument(
        "--contract-defaults",
        action="store_true",
        help="use the contract's [health] and [degradation] defaults (slow: detection in "
        "tens of seconds) instead of the fast settings above",
    )
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the windows and timeline here")
    ap.add_argument(
        "--plot",
        default="",
        help="draw the run's timeline into this PNG (default: next to --json; needs "
        "matplotlib, the 'bench' extra)",
    )
    args = ap.parse_args()
    args.phases = [p for p in args.phases.split(",") if p]
    bad = set(args.phases) - set(PHASES)
    if bad:
        ap.error(f"unknown phases {sorted(bad)}; choose from {PHASES}")
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    quiet.start_watching()
    t0 = time.monotonic()
    cfg = {
        "health": {
            "interval_s": args.health_interval_s,
            "probe_timeout_s": args.probe_timeout_s,
            "failures_to_restart": args.failures_to_restart,
        },
        "restart": {
            "backoff_initial_s": 0.5,
            "backoff_max_s": 5,
            "drain_timeout_s": 30,
            "max_restarts_per_hour": 20,
        },
        "degradation": {
            "window_s": 6,
            "max_preemptions_per_min": 30,
            "hang_s": 3,
            "leak_hold_s": 3,
            "baseline_warmup_s": 5,
        },
    }
    if args.contract_defaults:
        cfg["health"] = {"interval_s": 2.0, "probe_timeout_s": 10.0, "failures_to_restart": 3}
        cfg["degradation"] = {
            "window_s": 60,
            "max_preemptions_per_min": 30,
            "hang_s": 30,
            "leak_hold_s": 30,
            "baseline_warmup_s": 60,
        }
    with daemon(
        2,
        ["--token-delay-ms", f"{args.token_delay_ms:g}"],
        telemetry={"source": "none", "interval_s": 1.0},
        health=cfg["health"],
        restart=cfg["restart"],
        degradation=cfg["degradation"],
    ) as d:
        cfg["engine"] = {"stop_timeout_s": d.app.config["engine"].get("stop_timeout_s", 20.0)}
        data = asyncio.run(run(args, d))
    quiet.stop_watching()
    print()
    print(report(args, quiet, data, cfg))
    print(f"(took {time.monotonic() - t0:.0f} s)")
    result = result_data(data)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    write_plot(plots.restart_under_load, result, plot_path(args.plot, args.json))


if __name__ == "__main__":
    main()
