"""Gateway overhead: the same fake engine, straight to it vs through the gateway, same run.

One daemon with ONE fast fake engine (2 ms per token, 64-token streams). The engine's
per-boot key is read from ``/proc/<engine pid>/cmdline``, so the "direct" rounds hit the
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

Then (``--profile``, on by default) py-spy records the daemon under a gateway-only load
and the table of where its CPU goes is printed.

    .venv/bin/python -m bench.gateway_overhead [--levels 1,16,64,256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench import profile
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
    request,
    wait_for_quiet,
)
from tests.fakes.appliance_proc import REPO

PATHS = ("direct", "gateway")


@dataclass
class Acc:
    results: list[Result] = field(default_factory=list)
    elapsed: float = 0.0
    daemon_cpu: float = 0.0
    engine_cpu: float = 0.0
    client_cpu: float = 0.0
    sys_busy: float = 0.0  # whole machine, every process: busy CPU-seconds
    sys_all: float = 0.0  # whole machine: all CPU-seconds

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.ok]

    @property
    def events(self) -> int:
        return sum(r.events for r in self.results)

    def rate(self) -> float:
        return self.events / self.elapsed if self.elapsed else float("nan")


def sys_cpu() -> tuple[float, float]:
    """(busy, total) CPU-seconds of the whole machine so far."""
    t = psutil.cpu_times()
    total = sum(t)
    return total - t.idle - getattr(t, "iowait", 0.0), total


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


async def run(args: argparse.Namespace, d: Any) -> dict[str, Any]:
    daemon_p = psutil.Process(d.pid)
    engine_p = psutil.Process(d.engine_pid(0))
    client_p = psutil.Process(os.getpid())
    eng_url, eng_key = d.engine_url(0), d.engine_key(0)
    body = completion_body(args.tokens, stream=True)
    accs: dict[tuple[int, str], Acc] = defaultdict(Acc)

    async with client_session() as s:

        def one(path: str) -> Any:
            if path == "direct":
                return lambda w: request(s, eng_url, eng_key, body, True, 0)
            return lambda w: request(s, d.url, d.admin_key, body, True)

        # Warm-up at the highest concurrency: opens every keep-alive connection on both
        # paths (client→engine, client→gateway, gateway→engine) before anything counts.
        top = max(args.levels)
        for path in PATHS:
            await closed_loop(top, 1.5, one(path))
        for c in args.levels:
            rounds = args.rounds * (2 if c == 1 else 1)  # 1 stream: few samples per round
            for r in range(rounds):
                order = PATHS if r % 2 == 0 else PATHS[::-1]
                for path in order:
                    a = accs[(c, path)]
                    before = (cpu_s(daemon_p), cpu_s(engine_p), cpu_s(client_p), *sys_cpu())
                    results, elapsed = await closed_loop(c, args.round_s, one(path))
                    after = (cpu_s(daemon_p), cpu_s(engine_p), cpu_s(client_p), *sys_cpu())
                    a.results += results
                    a.elapsed += elapsed
                    a.daemon_cpu += after[0] - before[0]
                    a.engine_cpu += after[1] - before[1]
                    a.client_cpu += after[2] - before[2]
                    a.sys_busy += after[3] - before[3]
                    a.sys_all += after[4] - before[4]
                    await asyncio.sleep(0.2)
            g, dr = accs[(c, "gateway")], accs[(c, "direct")]
            print(
                f"  {c:>4} streams: direct {dr.rate():8.0f} ev/s, gateway {g.rate():8.0f} ev/s, "
                f"failures {len(dr.results) - len(dr.ok)}/{len(g.results) - len(g.ok)}",
                flush=True,
            )

        profs: list[dict[str, Any]] = []
        for c in args.profile_levels:
            out = Path(tempfile.mkdtemp(prefix="bench-profile-")) / f"gateway-{c}.raw"
            rec = asyncio.create_task(profile.record(d.pid, args.profile_s, out, args.profile_rate))
            await asyncio.sleep(0.3)
            results, _ = await closed_loop(c, args.profile_s, one("gateway"))
            line = await rec
            prof: dict[str, Any] = {"path": str(out), "py_spy": line, "concurrency": c}
            if out.exists():
                prof["profile"] = profile.parse(out)
            profs.append(prof)
        status = d.status()["engines"][0]
    return {"accs": accs, "profiles": profs, "engine": status}


def report(args: argparse.Namespace, quiet: Any, data: dict[str, Any]) -> str:
    accs: dict[tuple[int, str], Acc] = data["accs"]
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
        dr, g = accs[(c, "direct")], accs[(c, "gateway")]
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
        bg_rate = dr.daemon_cpu / dr.elapsed if dr.elapsed else 0.0
        raw = g.daemon_cpu / g.events * 1e6 if g.events else float("nan")
        net = (g.daemon_cpu - bg_rate * g.elapsed) / g.events * 1e6 if g.events else float("nan")

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
        }
    out = [header("Gateway overhead", module_argv("bench.gateway_overhead"), quiet)]
    kv = args.kv_cache_usage
    out.append(
        f"- the daemon's event loop: {args.daemon_loop} (the engine: asyncio's)\n"
        f"- load: 1 fake engine, `--token-delay-ms {args.token_delay_ms:g}`, KV usage "
        f"reported {'1 % per running request' if kv == 'derived' else kv}, "
        f"{args.tokens}-token streams on /v1/completions; closed loop; "
        f"{args.rounds} rounds × {args.round_s:g} s per path per concurrency "
        f"(1 stream: {2 * args.rounds} rounds), direct/gateway alternating; "
        f"~{figures[str(args.levels[-1])]['events_per_stream']} SSE events per stream\n"
    )
    out.append("Latency (ms; 'added' = gateway − direct, same run):\n")
    out.append(lat.markdown() + "\n")
    out.append("Throughput and CPU:\n")
    out.append(thr.markdown() + "\n")
    for prof in data["profiles"]:
        if "profile" not in prof:
            out.append(f"(profile at {prof['concurrency']} streams failed: {prof['py_spy']})\n")
            continue
        p = prof["profile"]
        by_cat, by_self, by_incl = profile.tables(p)
        out.append(
            f"py-spy profile of the daemon: {prof['concurrency']} stream(s) through the "
            f"gateway for {args.profile_s:g} s at {args.profile_rate} Hz, {p.total} on-CPU "
            f"samples ({p.idle} more idle in epoll, or in uvloop's C code, left out; "
            f"{prof['py_spy'].removeprefix('py-spy> ')}); raw stacks in `{prof['path']}`.\n"
        )
        out.append(by_cat.markdown() + "\n")
        out.append(by_self.markdown() + "\n")
        out.append(by_incl.markdown() + "\n")
    e = data["engine"]
    out.append(
        f"Engine at the end: kv_cache_usage {e.get('kv_cache_usage')}, KV breaker open: "
        f"{e.get('kv_breaker_open')}, restarts {e.get('restarts')}.\n"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--levels", default="1,16,64,256", help="concurrent streams, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per path per concurrency")
    ap.add_argument("--round-s", type=float, default=3.0, help="seconds per round")
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
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    args.profile_levels = [int(x) for x in args.profile_levels.split(",") if x]
    kv = [] if args.kv_cache_usage == "derived" else ["--kv-cache-usage", args.kv_cache_usage]
    env = {"LLM_APPLIANCE_EVENT_LOOP": args.daemon_loop}
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    quiet.start_watching()
    t0 = time.monotonic()
    top = max(args.levels)
    with daemon(
        1,
        ["--token-delay-ms", f"{args.token_delay_ms:g}", "--max-num-seqs", str(4 * top), *kv],
        # Budgets above the load: this measures the relay, not admission's queue.
        engine={
            "max_inflight": 4 * top,
            "max_inflight_tokens": 10**8,
            "env": {"PYTHONPATH": str(REPO)},
        },
        gateway={"max_queue": 8 * top},
        # The contract's health defaults (the fakes' test config checks every 0.3 s).
        health={"interval_s": 2.0, "probe_timeout_s": 10.0, "failures_to_restart": 3},
        telemetry={"source": "none", "interval_s": 1.0},
        env=env,
    ) as d:
        data = asyncio.run(run(args, d))
    quiet.stop_watching()
    print()
    print(report(args, quiet, data))
    print(f"(took {time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
