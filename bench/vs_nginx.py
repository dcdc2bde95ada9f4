"""The gateway against the floor: the same fake engine straight, through the appliance,
and through nginx, in one run with the order rotated every round (issue #24 item 4).

One daemon with ONE fast fake engine on its Unix socket (the appliance's default),
usage accounting on (the default), 64-token streamed completions, closed loop. nginx
(bench.nginx: Debian's package, one worker, ``proxy_buffering off``, keep-alive
upstream) relays to the very same socket, with the engine's per-spawn key passed
through. Each round runs every path once; the order rotates by one path per round
(direct, appliance, nginx; then appliance, nginx, direct; ...), so a machine getting
busier mid-run weighs on every path alike. Per concurrency it prints:

- added TTFT p50 (the path's p50 minus direct's, same run) and added whole-stream p50;
- the throughput ratio (SSE events per second through the path / straight);
- the proxy's CPU µs per relayed chunk: the process's own user+system CPU during its
  rounds / SSE events relayed (the appliance: the daemon process; nginx: master and
  worker). "net" takes off the proxy's background rate, measured while the other paths
  ran (the daemon's health checks; nginx has none);
- the appliance's CPU per chunk as a multiple of nginx's.

CPU time is the process's own, so a busy machine slows both but bills neither for the
other's work; the noise line says how busy the machine was.

``--pipe`` adds a Python byte pipe on uvloop (bench.pipe: the floor of a relay written in
Python), ``--router`` vllm-router in front of a pipe of its own (it reaches workers over
TCP only; its CPU is its own process's, its latency includes the pipe's hop),
``--floors`` two bare HTTP relays on the appliance's own engine side (bench.floors: one
on aiohttp's server, one on an asyncio protocol of its own), which split the appliance's
distance to the pipe into aiohttp's part and the appliance's own per-request work.

    .venv/bin/python -m bench.vs_nginx [--levels 1,16,64] [--rounds 3] [--round-s 3]
        [--pipe] [--router] [--floors] [--json FILE.json] [--plot FILE.png] [--profile-s 8]

Without nginx (not installed, and apt-get not available as root) it says so in one
line and measures direct and the appliance only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench import floors, nginx, pipe, plots, profile
from bench._common import (
    Daemon,
    Result,
    Table,
    client_session,
    closed_loop,
    completion_body,
    header,
    module_argv,
    pct,
    plot_path,
    request,
    wait_for_quiet,
    write_plot,
)
from bench._relay import Rounds, cpu_s, relay_daemon, rotation
from tests.fakes.router_proc import Router, install_router, run_router

PROXIES = ("appliance", "nginx", "pipe", "vllm-router", "aiohttp-relay", "raw-relay")


@dataclass
class Acc(Rounds):
    cpu: dict[str, float] = field(default_factory=dict)  # proxy -> CPU s during these rounds


@dataclass
class Paths:
    """Where each path sends a stream, and whose CPU is each proxy's."""

    send: dict[str, Callable[[int], Awaitable[Result]]]
    procs: dict[str, list[psutil.Process]]


async def measure(args: argparse.Namespace, paths: Paths) -> dict[tuple[int, str], Acc]:
    accs: dict[tuple[int, str], Acc] = defaultdict(Acc)
    names = list(paths.send)
    for name in names:  # warm-up: every keep-alive connection open on every path
        await closed_loop(max(args.levels), 1.5, paths.send[name])
    for c in args.levels:
        rounds = args.rounds * (2 if c == 1 else 1)  # 1 stream: few samples per round
        for r in range(rounds):
            for name in rotation(names, r):
                before = {p: cpu_s(*ps) for p, ps in paths.procs.items()}
                results, elapsed = await closed_loop(c, args.round_s, paths.send[name])
                a = accs[(c, name)]
                a.results += results
                a.elapsed += elapsed
                for p, ps in paths.procs.items():
                    a.cpu[p] = a.cpu.get(p, 0.0) + cpu_s(*ps) - before[p]
        line = ", ".join(f"{n} {accs[(c, n)].rate():.0f} ev/s" for n in names)
        print(f"  {c:>4} streams: {line}", flush=True)
    return accs


def cpu_per_chunk(accs: dict[tuple[int, str], Acc], c: int, proxy: str) -> tuple[float, float]:
    """The proxy's CPU µs per chunk it relayed: raw, and net of its rate while idle (the
    rounds of the other paths at this concurrency)."""
    mine = accs[(c, proxy)]
    if not mine.events:
        return float("nan"), float("nan")
    idle_cpu = idle_s = 0.0
    for (level, name), a in accs.items():
        if level == c and name != proxy:
            idle_cpu += a.cpu.get(proxy, 0.0)
            idle_s += a.elapsed
    bg = idle_cpu / idle_s if idle_s else 0.0
    raw = mine.cpu[proxy] / mine.events * 1e6
    return raw, (mine.cpu[proxy] - bg * mine.elapsed) / mine.events * 1e6


def figures(args: argparse.Namespace, accs: dict[tuple[int, str], Acc], names: list[str]) -> Any:
    out: dict[str, Any] = {}
    for c in args.levels:
        d = accs[(c, "direct")]
        d_ttft, d_lat = pct([r.ttft for r in d.ok], 50), pct([r.total for r in d.ok], 50)
        row: dict[str, Any] = {"direct_events_per_s": round(d.rate(), 1)}
        for p in names:
            a = accs[(c, p)]
            raw, net = cpu_per_chunk(accs, c, p)
            row[p] = {
                "requests": len(a.results),
                "failed": len(a.results) - len(a.ok),
                "added_ttft_p50_ms": round((pct([r.ttft for r in a.ok], 50) - d_ttft) * 1e3, 3),
                "added_stream_p50_ms": round((pct([r.total for r in a.ok], 50) - d_lat) * 1e3, 3),
                "ratio": round(a.rate() / d.rate(), 4) if d.rate() else float("nan"),
                "cpu_us_per_chunk_raw": round(raw, 2),
                "cpu_us_per_chunk_net": round(net, 2),
            }
        if "nginx" in row:
            a, n = row["appliance"], row["nginx"]
            row["cpu_vs_nginx_raw"] = round(
                a["cpu_us_per_chunk_raw"] / n["cpu_us_per_chunk_raw"], 3
            )
            row["cpu_vs_nginx_net"] = round(
                a["cpu_us_per_chunk_net"] / n["cpu_us_per_chunk_net"], 3
            )
        out[str(c)] = row
    return out


def table(args: argparse.Namespace, figs: dict[str, Any], names: list[str]) -> Table:
    t = Table(
        [
            "streams",
            "path",
            "requests (failed)",
            "added TTFT p50 (ms)",
            "added stream p50 (ms)",
            "× direct throughput",
            "proxy CPU µs/chunk raw",
            "net",
            "appliance / nginx CPU raw (net)",
        ]
    )
    for c in args.levels:
        row = figs[str(c)]
        for p in names:
            f = row[p]
            vs = ""
            if p == "appliance" and "cpu_vs_nginx_raw" in row:
                vs = f"{row['cpu_vs_nginx_raw']:.2f}× ({row['cpu_vs_nginx_net']:.2f}×)"
            t.add(
                c,
                p,
                f"{f['requests']} ({f['failed']})",
                f"{f['added_ttft_p50_ms']:+.2f}",
                f"{f['added_stream_p50_ms']:+.2f}",
                f"{f['ratio']:.3f}",
                f"{f['cpu_us_per_chunk_raw']:.1f}",
                f"{f['cpu_us_per_chunk_net']:.1f}",
                vs,
            )
    return t


def _sender(
    session: aiohttp.ClientSession, url: str, key: str, body: bytes
) -> Callable[[int], Awaitable[Result]]:
    return lambda w: request(session, url, key, body, True)


async def run(
    args: argparse.Namespace,
    d: Daemon,
    ng: nginx.Nginx | None,
    pp: pipe.RelayProcess | None,
    rt: Router | None = None,
    fl: dict[str, pipe.RelayProcess] | None = None,
) -> dict[str, Any]:
    body = completion_body(args.tokens, stream=True)
    key = d.engine_key(0)
    async with contextlib.AsyncExitStack() as stack:
        gw = await stack.enter_async_context(client_session())
        direct = await stack.enter_async_context(client_session(d.engine_address(0)))
        eng_url = d.engine_url(0)
        send: dict[str, Callable[[int], Awaitable[Result]]] = {
            "direct": lambda w: request(direct, eng_url, key, body, True, 0),
            "appliance": lambda w: request(gw, d.url, d.admin_key, body, True),
        }
        procs = {"appliance": [psutil.Process(d.pid)]}
        if ng is not None:
            via = await stack.enter_async_context(client_session())
            send["nginx"] = lambda w: request(via, ng.url, key, body, True)
            procs["nginx"] = ng.processes()
        if pp is not None:
            raw = await stack.enter_async_context(client_session())
            send["pipe"] = lambda w: request(raw, pp.url, key, body, True)
            procs["pipe"] = pp.processes()
        if rt is not None:
            routed = await stack.enter_async_context(client_session())
            send["vllm-router"] = lambda w: request(routed, rt.url, key, body, True)
            procs["vllm-router"] = [psutil.Process(rt.proc.pid)]
        for server, floor in (fl or {}).items():
            via_floor = await stack.enter_async_context(client_session())
            send[f"{server}-relay"] = _sender(via_floor, floor.url, key, body)
            procs[f"{server}-relay"] = floor.processes()
        accs = await measure(args, Paths(send, procs))
        prof: dict[str, Any] = {}
        if args.profile_s > 0:
            out = Path(tempfile.mkdtemp(prefix="bench-profile-")) / "appliance-1.raw"
            rec = asyncio.create_task(profile.record(d.pid, args.profile_s, out, 500))
            await asyncio.sleep(0.3)
            await closed_loop(1, args.profile_s, send["appliance"])
            prof = {"py_spy": await rec, "path": str(out)}
            if out.exists():
                prof["profile"] = profile.parse(out)
    return {"accs": accs, "names": [p for p in PROXIES if p in procs], "profile": prof}


def report(args: argparse.Namespace, quiet: Any, data: dict[str, Any], why: str) -> str:
    names: list[str] = data["names"]
    figs = figures(args, data["accs"], names)
    out = [header("The gateway against nginx", module_argv("bench.vs_nginx"), quiet)]
    out.append(
        f"- nginx: {why}\n"
        f"- load: 1 fake engine on a Unix socket, `--token-delay-ms {args.token_delay_ms:g}`, "
        f"{args.tokens}-token streams on /v1/completions, usage accounting on; closed loop; "
        f"{args.rounds} rounds × {args.round_s:g} s per path per concurrency (1 stream: "
        f"{2 * args.rounds}), order rotated every round\n"
    )
    out.append(table(args, figs, names).markdown() + "\n")
    prof = data["profile"]
    if prof.get("profile") is not None:
        p = prof["profile"]
        by_cat, by_self, by_incl = profile.tables(p, top=25)
        out.append(
            f"py-spy profile of the daemon, 1 stream for {args.profile_s:g} s: {p.total} "
            f"on-CPU samples ({p.idle} idle left out); raw stacks in `{prof['path']}`.\n"
        )
        out += [by_cat.markdown() + "\n", by_self.markdown() + "\n", by_incl.markdown() + "\n"]
    elif prof:
        out.append(f"(profile failed: {prof['py_spy']})\n")
    if args.json:
        Path(args.json).write_text(json.dumps(figs, indent=2))
    write_plot(plots.vs_nginx, figs, plot_path(args.plot, args.json))
    return "\n".join(out)


@contextlib.contextmanager
def router_path(engine_socket: str) -> Iterator[Router | None]:
    """vllm-router in front of the engine, through a pipe of its own (the router reaches
    its workers over TCP only): the pipe's hop is in its latency, not in its CPU. None,
    said in one line, when the router cannot be had."""
    exe = install_router()
    if isinstance(exe, str):
        print(f"  vllm-router left out: {exe}", flush=True)
        yield None
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    health = ("--health-check-endpoint", "/health", "--health-check-interval-secs", "5")
    try:
        with (
            pipe.run_pipe(engine_socket) as hop,
            run_router(exe, tmp, [hop.url], health=health) as rt,
        ):
            rt.wait_for(lambda: any(rt.healthy().values()), 30, "the engine healthy")
            yield rt
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--levels", default="1,16,64", help="concurrent streams, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per path per concurrency")
    ap.add_argument("--round-s", type=float, default=3.0, help="seconds per round")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--token-delay-ms", type=float, default=2.0)
    ap.add_argument("--profile-s", type=float, default=0.0, help="py-spy the daemon at 1 stream")
    ap.add_argument(
        "--pipe",
        action="store_true",
        help="also a Python byte pipe on uvloop (bench.pipe): the floor of a Python relay",
    )
    ap.add_argument(
        "--router",
        action="store_true",
        help="also vllm-router 0.1.17 (installed under the user cache when missing), in "
        "front of a pipe of its own to the engine socket (it speaks TCP only)",
    )
    ap.add_argument(
        "--floors",
        action="store_const",
        const=floors.SERVERS,
        default=(),
        help="also two bare relays on the appliance's own engine side (bench.floors): "
        "aiohttp's server, and an asyncio protocol of its own",
    )
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    ap.add_argument("--plot", default="", help="PNG of the figures (default: next to --json)")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    exe, why = nginx.ensure_nginx()
    if exe is None:
        print(f"  nginx left out: {why}", flush=True)
    else:
        why = f"{nginx.version(exe)}, {why}; one worker, proxy_buffering off, keepalive 64"
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    quiet.start_watching()
    t0, top = time.monotonic(), max(args.levels)
    with contextlib.ExitStack() as stack:
        loop = os.environ.get("LLM_APPLIANCE_EVENT_LOOP", "uvloop")
        d = stack.enter_context(relay_daemon(args.token_delay_ms, top, loop=loop))
        ng = None
        if exe is not None:
            sock = d.engine_address(0).uds
            assert sock is not None  # engine.listen = "unix" above
            ng = stack.enter_context(nginx.run_nginx(exe, sock))
        sock = d.engine_address(0).uds
        assert sock is not None  # engine.listen = "unix"
        pp = stack.enter_context(pipe.run_pipe(sock)) if args.pipe else None
        rt = stack.enter_context(router_path(sock)) if args.router else None
        fl = {s: stack.enter_context(floors.run_floor(s, sock)) for s in args.floors}
        data = asyncio.run(run(args, d, ng, pp, rt, fl))
    quiet.stop_watching()
    print()
    print(report(args, quiet, data, why))
    print(f"(took {time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
