"""Gateway overhead: the same fake engine, straight to it vs through the gateway, same run.

One daemon with ONE fast fake engine (2 ms per token, 64-token streams). The engine's
per-spawn key is read from its environment (``VLLM_API_KEY``), and the client reaches
it where it listens (its Unix socket, or its TCP port), so the "direct" rounds hit the
very engine the gateway relays to. Rounds alternate direct / gateway (order flipped
every round) at each concurrency; each round is a closed loop of N streams for a fixed
time. Per concurrency it reports:

- TTFT (send → first SSE event) and whole-stream latency, p50/p99, both paths, and the
  difference ("added");
- throughput (SSE events per second, ~tokens/s) of both paths and their ratio;
- the gateway's own CPU per relayed chunk: (user+system CPU of the daemon process
  during the gateway rounds) / (SSE events relayed). "net" subtracts the daemon's
  background CPU rate (health checks, timers), measured during the direct rounds of
  the same concurrency, when the daemon relays nothing;
- CPU use of the client, engine and daemon, as a share of the machine, to show when
  the machine rather than the gateway is the limit.

``--listen both`` (the default) runs two such daemons side by side, one whose engine
listens on a Unix socket (``engine.listen = "unix"``, the appliance's default) and one
on a TCP port (``"tcp"``), in alternating rounds of the same run (unix and tcp, direct
and gateway, the whole order reversed every other round), reports each as above, then
the gateway's CPU per chunk of the two side by side with their ratio unix/tcp.
``--listen unix`` or ``--listen tcp`` measures one daemon only.

Then (``--profile-levels``, 1 and 64 streams by default) py-spy records each daemon
under a gateway-only load and the table of where its CPU goes is printed.

    .venv/bin/python -m bench.gateway_overhead [--levels 1,16,64,256] [--rounds 3]
        [--listen unix|tcp|both] [--json FILE.json] [--plot FILE.png]

``--plot`` (or ``--json`` alone: the PNG goes next to it) draws the gateway's CPU per
chunk and the latency it adds against concurrency (``bench.plots``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench import plots, profile
from bench._common import (
    STREAM_ENDS,
    Daemon,
    Result,
    Table,
    client_session,
    closed_loop,
    header,
    module_argv,
    ms,
    pct,
    plot_path,
    request,
    route_stream,
    wait_for_quiet,
    write_plot,
)
from bench._relay import Rounds, cpu_s, relay_daemon

PATHS = ("direct", "gateway")
MODES = ("unix", "tcp")
MODE_NAMES = {"unix": "engines on Unix sockets", "tcp": "engines on 127.0.0.1 TCP ports"}


@dataclass
class Acc(Rounds):
    daemon_cpu: float = 0.0
    engine_cpu: float = 0.0
    client_cpu: float = 0.0
    sys_busy: float = 0.0  # whole machine, every process: busy CPU-seconds
    sys_all: float = 0.0  # whole machine: all CPU-seconds


# (listen mode, concurrency, path)
Accs = dict[tuple[str, int, str], Acc]


def sys_cpu() -> tuple[float, float]:
    """(busy, total) CPU-seconds of the whole machine so far."""
    t = psutil.cpu_times()
    total = sum(t)
    return total - t.idle - getattr(t, "iowait", 0.0), total


@dataclass
class Target:
    """One daemon under test and the ways to load it: straight to its engine, or through
    its gateway."""

    d: Daemon
    daemon_p: psutil.Process
    engine_p: psutil.Process
    gw: aiohttp.ClientSession
    direct: aiohttp.ClientSession
    eng_url: str
    eng_key: str

    route: str = "completions"  # which route's streams (--route)

    def one(self, path: str, body: bytes) -> Callable[[int], Awaitable[Result]]:
        url, _ = route_stream(self.route, 0)
        end = STREAM_ENDS[self.route]
        if path == "direct":
            return lambda w: request(
                self.direct, self.eng_url, self.eng_key, body, True, 0, url, end
            )
        return lambda w: request(self.gw, self.d.url, self.d.admin_key, body, True, -1, url, end)


def schedule(modes: Sequence[str], r: int) -> list[tuple[str, str]]:
    """Round r's (mode, path) order: every pair once, the whole order reversed every other
    round, so no pair always runs first or after the same neighbour (drift cancels)."""
    order = [(m, p) for m in modes for p in PATHS]
    return order if r % 2 == 0 else order[::-1]


async def run(args: argparse.Namespace, daemons: dict[str, Daemon]) -> dict[str, Any]:
    client_p = psutil.Process(os.getpid())
    _, body = route_stream(args.route, args.tokens)
    accs: Accs = defaultdict(Acc)
    profs: list[dict[str, Any]] = []
    engines: dict[str, dict[str, Any]] = {}

    async with contextlib.AsyncExitStack() as stack:
        targets: dict[str, Target] = {}
        for mode, d in daemons.items():
            targets[mode] = Target(
                d,
                psutil.Process(d.pid),
                psutil.Process(d.engine_pid(0)),
                await stack.enter_async_context(client_session()),
                await stack.enter_async_context(client_session(d.engine_address(0))),
                d.engine_url(0),
                d.engine_key(0),
                args.route,
            )

        # Warm-up at the highest concurrency: opens every keep-alive connection on both
        # paths (client→engine, client→gateway, gateway→engine) before anything counts.
        top = max(args.levels)
        for t in targets.values():
            for path in PATHS:
                await closed_loop(top, 1.5, t.one(path, body))
        for c in args.levels:
            rounds = args.rounds * (2 if c == 1 else 1)  # 1 stream: few samples per round
            for r in range(rounds):
                for mode, path in schedule(args.listen, r):
                    t, a = targets[mode], accs[(mode, c, path)]
                    before = (cpu_s(t.daemon_p), cpu_s(t.engine_p), cpu_s(client_p), *sys_cpu())
                    results, elapsed = await closed_loop(c, args.round_s, t.one(path, body))
                    after = (cpu_s(t.daemon_p), cpu_s(t.engine_p), cpu_s(client_p), *sys_cpu())
                    a.results += results
                    a.elapsed += elapsed
                    a.daemon_cpu += after[0] - before[0]
                    a.engine_cpu += after[1] - before[1]
                    a.client_cpu += after[2] - before[2]
                    a.sys_busy += after[3] - before[3]
                    a.sys_all += after[4] - before[4]
                    await asyncio.sleep(0.2)
            for mode in args.listen:
                g, dr = accs[(mode, c, "gateway")], accs[(mode, c, "direct")]
                label = f" ({mode})" if len(args.listen) > 1 else ""
                print(
                    f"  {c:>4} streams{label}: direct {dr.rate():8.0f} ev/s, gateway "
                    f"{g.rate():8.0f} ev/s, failures {len(dr.results) - len(dr.ok)}/"
                    f"{len(g.results) - len(g.ok)}",
                    flush=True,
                )

        for mode, t in targets.items():
            for c in args.profile_levels:
                out = Path(tempfile.mkdtemp(prefix="bench-profile-")) / f"gateway-{mode}-{c}.raw"
                rec = asyncio.create_task(
                    profile.record(t.d.pid, args.profile_s, out, args.profile_rate)
                )
                await asyncio.sleep(0.3)
                await closed_loop(c, args.profile_s, t.one("gateway", body))
                line = await rec
                prof: dict[str, Any] = {
                    "path": str(out),
                    "py_spy": line,
                    "concurrency": c,
                    "mode": mode,
                }
                if out.exists():
                    prof["profile"] = profile.parse(out)
                profs.append(prof)
            engines[mode] = t.d.status()["engines"][0]
    return {"accs": accs, "profiles": profs, "engines": engines}


def mode_tables(
    args: argparse.Namespace, accs: Accs, mode: str
) -> tuple[Table, Table, dict[str, Any]]:
    """The latency and the throughput/CPU tables of one listen mode, and its figures."""
    ncpu = os.cpu_count() or 1
    lat = Table(
        [
            "streams",
            "TTFT p50 direct / gw (ms)",
            "added p50",
            "TTFT p99 direct / gw (ms)",
            "added p99",
            "stream p50 direct / gw (ms)",
            "added p50",
            "stream p99 direct / gw (ms)",
            "added p99",
        ]
    )
    thr = Table(
        [
            "streams",
            "requests direct / gw",
            "failed",
            "events/s direct",
            "events/s gw",
            "ratio gw/direct",
            "gw CPU µs/chunk raw",
            "net",
            "CPU ours direct / gw",
            "CPU all direct / gw",
            "engine µs/chunk direct / gw",
        ]
    )
    figures: dict[str, Any] = {}
    for c in args.levels:
        dr, g = accs[(mode, c, "direct")], accs[(mode, c, "gateway")]
        dt = [r.ttft for r in dr.ok]
        gt = [r.ttft for r in g.ok]
        dl = [r.total for r in dr.ok]
        gl = [r.total for r in g.ok]
        f = {
            "ttft_p50": (pct(dt, 50), pct(gt, 50)),
            "ttft_p99": (pct(dt, 99), pct(gt, 99)),
            "lat_p50": (pct(dl, 50), pct(gl, 50)),
            "lat_p99": (pct(dl, 99), pct(gl, 99)),
        }
        cells = []
        for k in ("ttft_p50", "ttft_p99", "lat_p50", "lat_p99"):
            a, b = f[k]
            cells += [f"{ms(a)} / {ms(b)}", ms(b - a)]
        lat.add(c, *cells)
        ratio = g.rate() / dr.rate() if dr.rate() else float("nan")
        raw, net = gw_cpu_per_chunk(dr, g)

        def busy(a: Acc) -> float:
            return (a.daemon_cpu + a.engine_cpu + a.client_cpu) / (a.elapsed * ncpu)

        def sys_busy(a: Acc) -> float:
            return a.sys_busy / a.sys_all if a.sys_all else float("nan")

        eng = (
            dr.engine_cpu / dr.events * 1e6 if dr.events else float("nan"),
            g.engine_cpu / g.events * 1e6 if g.events else float("nan"),
        )
        thr.add(
            c,
            f"{len(dr.results)} / {len(g.results)}",
            f"{len(dr.results) - len(dr.ok)} / {len(g.results) - len(g.ok)}",
            f"{dr.rate():.0f}",
            f"{g.rate():.0f}",
            f"{ratio:.3f}",
            f"{raw:.1f}",
            f"{net:.1f}",
            f"{busy(dr):.0%} / {busy(g):.0%}",
            f"{sys_busy(dr):.0%} / {sys_busy(g):.0%}",
            f"{eng[0]:.1f} / {eng[1]:.1f}",
        )
        figures[str(c)] = {
            **{k: [round(x * 1000, 3) for x in v] for k, v in f.items()},
            "ratio": round(ratio, 4),
            "gw_cpu_us_per_chunk_raw": round(raw, 2),
            "gw_cpu_us_per_chunk_net": round(net, 2),
            "busy": [round(busy(dr), 3), round(busy(g), 3)],
            "sys_busy": [round(sys_busy(dr), 3), round(sys_busy(g), 3)],
            "events_per_stream": round(g.events / max(1, len(g.results)), 1),
            "events_per_s": [round(dr.rate(), 1), round(g.rate(), 1)],
        }
    return lat, thr, figures


def gw_cpu_per_chunk(dr: Acc, g: Acc) -> tuple[float, float]:
    """The daemon's CPU µs per relayed SSE event: raw, and net of its background rate
    (measured in the direct rounds, when it relays nothing)."""
    if not g.events:
        return float("nan"), float("nan")
    bg_rate = dr.daemon_cpu / dr.elapsed if dr.elapsed else 0.0
    raw = g.daemon_cpu / g.events * 1e6
    net = (g.daemon_cpu - bg_rate * g.elapsed) / g.events * 1e6
    return raw, net


def comparison(
    args: argparse.Namespace, figures: dict[str, dict[str, Any]]
) -> tuple[Table, dict[str, Any]]:
    """Unix sockets vs TCP, side by side per concurrency: the gateway's CPU per chunk
    (the figure the issue asks for: expect unix ≤ tcp) and what it buys."""
    t = Table(
        [
            "streams",
            "gw CPU µs/chunk raw unix / tcp",
            "unix/tcp",
            "net unix / tcp",
            "unix/tcp",
            "events/s gw unix / tcp",
            "ratio gw/direct unix / tcp",
            "TTFT p50 added unix / tcp (ms)",
            "stream p50 added unix / tcp (ms)",
        ]
    )
    out: dict[str, Any] = {}
    for c in args.levels:
        u, p = figures["unix"][str(c)], figures["tcp"][str(c)]

        def rel(key: str, u: dict[str, Any] = u, p: dict[str, Any] = p) -> float:
            return float(u[key] / p[key]) if p[key] else float("nan")

        def added(f: dict[str, Any], key: str) -> float:
            return float(f[key][1] - f[key][0])

        raw_r, net_r = rel("gw_cpu_us_per_chunk_raw"), rel("gw_cpu_us_per_chunk_net")
        t.add(
            c,
            f"{u['gw_cpu_us_per_chunk_raw']:.1f} / {p['gw_cpu_us_per_chunk_raw']:.1f}",
            f"{raw_r:.3f}",
            f"{u['gw_cpu_us_per_chunk_net']:.1f} / {p['gw_cpu_us_per_chunk_net']:.1f}",
            f"{net_r:.3f}",
            f"{u['events_per_s'][1]:.0f} / {p['events_per_s'][1]:.0f}",
            f"{u['ratio']:.3f} / {p['ratio']:.3f}",
            f"{added(u, 'ttft_p50'):.2f} / {added(p, 'ttft_p50'):.2f}",
            f"{added(u, 'lat_p50'):.2f} / {added(p, 'lat_p50'):.2f}",
        )
        out[str(c)] = {
            "gw_cpu_us_per_chunk_raw": [u["gw_cpu_us_per_chunk_raw"], p["gw_cpu_us_per_chunk_raw"]],
            "gw_cpu_us_per_chunk_net": [u["gw_cpu_us_per_chunk_net"], p["gw_cpu_us_per_chunk_net"]],
            "raw_ratio_unix_tcp": round(raw_r, 4),
            "net_ratio_unix_tcp": round(net_r, 4),
        }
    return t, out


def report(args: argparse.Namespace, quiet: Any, data: dict[str, Any]) -> str:
    accs: Accs = data["accs"]
    modes: list[str] = args.listen
    both = len(modes) > 1
    out = [header("Gateway overhead", module_argv("bench.gateway_overhead"), quiet)]
    kv = args.kv_cache_usage
    tables = {m: mode_tables(args, accs, m) for m in modes}
    figures = {m: tables[m][2] for m in modes}
    if both:
        listen = (
            "engines on Unix sockets and on TCP: two daemons side by side, rounds "
            "alternating unix/tcp and direct/gateway, the whole order reversed every round"
        )
    else:
        listen = f'{MODE_NAMES[modes[0]]} (`engine.listen = "{modes[0]}"`)'
    eps = figures[modes[0]][str(args.levels[-1])]["events_per_stream"]
    out.append(
        f"- the daemon's event loop: {args.daemon_loop} (the engine: asyncio's)\n"
        f"- listen: {listen}\n"
        f"- load: 1 fake engine, `--token-delay-ms {args.token_delay_ms:g}`, KV usage "
        f"reported {'1 % per running request' if kv == 'derived' else kv}, "
        f"{args.tokens}-token streams on {route_stream(args.route, 0)[0]}; closed loop; "
        f"{args.rounds} rounds × {args.round_s:g} s per path per concurrency "
        f"(1 stream: {2 * args.rounds} rounds), direct/gateway alternating; "
        f"~{eps} SSE events per stream\n"
    )
    for m in modes:
        lat, thr, _ = tables[m]
        if both:
            name = MODE_NAMES[m]
            out.append(f'### {name[0].upper()}{name[1:]} (`engine.listen = "{m}"`)\n')
        out.append("Latency (ms; 'added' = gateway − direct, same run):\n")
        out.append(lat.markdown() + "\n")
        out.append("Throughput and CPU:\n")
        out.append(thr.markdown() + "\n")
    result: dict[str, Any] = figures[modes[0]]
    if both:
        cmp, cmp_figures = comparison(args, figures)
        out.append("### Gateway CPU per chunk, Unix sockets vs TCP (same run)\n")
        out.append(
            "The daemon's CPU per relayed SSE event with its engine on a Unix socket and on "
            "a TCP port; a ratio unix/tcp of 1 or less means the Unix socket costs the "
            "gateway no more than TCP did.\n"
        )
        out.append(cmp.markdown() + "\n")
        result = {**figures, "unix_vs_tcp": cmp_figures}
    for prof in data["profiles"]:
        where = f" ({prof['mode']})" if both else ""
        if "profile" not in prof:
            out.append(
                f"(profile at {prof['concurrency']} streams{where} failed: {prof['py_spy']})\n"
            )
            continue
        p = prof["profile"]
        by_cat, by_self, by_incl = profile.tables(p)
        out.append(
            f"py-spy profile of the daemon{where}: {prof['concurrency']} stream(s) through the "
            f"gateway for {args.profile_s:g} s at {args.profile_rate} Hz, {p.total} on-CPU "
            f"samples ({p.idle} more idle in epoll, or in uvloop's C code, left out; "
            f"{prof['py_spy'].removeprefix('py-spy> ')}); raw stacks in `{prof['path']}`.\n"
        )
        out.append(by_cat.markdown() + "\n")
        out.append(by_self.markdown() + "\n")
        out.append(by_incl.markdown() + "\n")
    for m, e in data["engines"].items():
        where = f" ({m})" if both else ""
        out.append(
            f"Engine{where} at the end: kv_cache_usage {e.get('kv_cache_usage')}, KV breaker "
            f"open: {e.get('kv_breaker_open')}, restarts {e.get('restarts')}.\n"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    write_plot(plots.gateway_overhead, result, plot_path(args.plot, args.json))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--levels", default="1,16,64,256", help="concurrent streams, comma-separated")
    ap.add_argument(
        "--rounds", type=int, default=3, help="rounds per path and listen mode per concurrency"
    )
    ap.add_argument("--round-s", type=float, default=3.0, help="seconds per round")
    ap.add_argument(
        "--route",
        choices=sorted(STREAM_ENDS),
        default="completions",
        help="which route's streams to load (the fake engine speaks each)",
    )
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--token-delay-ms", type=float, default=2.0)
    ap.add_argument(
        "--profile-levels",
        default="1,64",
        help="concurrencies to profile with py-spy after the measurements ('' = none)",
    )
    ap.add_argument("--profile-s", type=float, default=8.0)
    ap.add_argument("--profile-rate", type=int, default=500, help="py-spy samples per second")
    ap.add_argument(
        "--kv-cache-usage",
        default="0.2",
        help="fixed KV usage the fake engine reports; 'derived' = its default of 1 %% per "
        "running request, which trips the gateway's KV breaker (> 0.92) above ~92 streams",
    )
    ap.add_argument(
        "--daemon-loop",
        choices=("asyncio", "uvloop"),
        default="uvloop",
        help="the daemon's event loop (LLM_APPLIANCE_EVENT_LOOP); uvloop is the "
        "appliance's default, asyncio its fallback",
    )
    ap.add_argument(
        "--listen",
        choices=("unix", "tcp", "both"),
        default="both",
        help="how the engine listens (engine.listen); 'both': a daemon of each kind, "
        "measured in alternating rounds of the same run, and the gateway's CPU per chunk "
        "compared side by side",
    )
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    ap.add_argument(
        "--plot",
        default="",
        help="draw CPU per chunk and added latency vs concurrency into this PNG "
        "(default: next to --json; needs matplotlib, the 'bench' extra)",
    )
    args = ap.parse_args()
    args.listen = list(MODES) if args.listen == "both" else [args.listen]
    args.levels = [int(x) for x in args.levels.split(",")]
    args.profile_levels = [int(x) for x in args.profile_levels.split(",") if x]
    kv = None if args.kv_cache_usage == "derived" else args.kv_cache_usage
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    quiet.start_watching()
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        daemons = {
            mode: stack.enter_context(
                relay_daemon(args.token_delay_ms, max(args.levels), mode, kv, args.daemon_loop)
            )
            for mode in args.listen
        }
        data = asyncio.run(run(args, daemons))
    quiet.stop_watching()
    print()
    print(report(args, quiet, data))
    print(f"(took {time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
