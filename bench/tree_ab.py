"""Trees side by side: the gateway's CPU per relayed chunk of several commits, one run.

One daemon per tree (a throw-away ``git worktree`` of each revision, or ``.`` for this
working tree as it is), each the daemon ``bench.gateway_overhead`` loads (one fast fake
engine on a Unix socket, the default path; this tree's fake engine and config for all).
Each round runs every tree once at each concurrency, a closed loop of N streams through
that tree's gateway, the order rotated by one tree every round, so no tree always runs
first or after the same neighbour. Per tree: the daemon's CPU (psutil user+system)
during its own rounds per SSE event relayed ("raw"), and "net" of its background rate,
measured while the other trees ran. The ratio to the first tree is taken per round and
its median printed with its range: on a shared machine only such ratios mean anything.

    .venv/bin/python -m bench.tree_ab --trees 9bec8ce,17acb14,. [--levels 16,64]
        [--rounds 4] [--round-s 3] [--json FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench._common import (
    Daemon,
    Table,
    client_session,
    closed_loop,
    header,
    pct,
    request,
    route_stream,
    wait_for_quiet,
)
from bench._relay import cpu_s, relay_daemon, rotation
from bench._trees import commit_label, head_label, worktree
from tests.fakes.appliance_proc import REPO

THIS_TREE = "."


@dataclass
class Side:
    """One tree's figures at one concurrency, summed over its rounds."""

    cpu: float = 0.0  # the daemon's CPU-seconds during its own rounds
    elapsed: float = 0.0
    events: int = 0
    requests: int = 0
    failed: int = 0
    ttft: list[float] = field(default_factory=list)
    idle_cpu: float = 0.0  # ... while the other trees ran
    idle_s: float = 0.0
    per_round: list[float] = field(default_factory=list)  # raw µs per chunk

    def raw(self) -> float:
        return self.cpu / self.events * 1e6 if self.events else float("nan")

    def net(self) -> float:
        bg = self.idle_cpu / self.idle_s if self.idle_s else 0.0
        return (self.cpu - bg * self.elapsed) / self.events * 1e6 if self.events else float("nan")


def round_ratios(sides: dict[str, Side], base: str) -> dict[str, list[float]]:
    """Each tree's raw CPU per chunk over the base tree's, round by round."""
    b = sides[base].per_round
    return {n: [x / y for x, y in zip(s.per_round, b, strict=True) if y] for n, s in sides.items()}


async def run(args: argparse.Namespace, daemons: dict[str, Daemon]) -> dict[int, dict[str, Side]]:
    url, body = route_stream("completions", args.tokens)
    procs = {n: psutil.Process(d.pid) for n, d in daemons.items()}
    out: dict[int, dict[str, Side]] = {}
    async with contextlib.AsyncExitStack() as stack:
        sessions = {n: await stack.enter_async_context(client_session()) for n in daemons}

        def one(name: str) -> Any:
            d, s = daemons[name], sessions[name]
            return lambda w: request(s, d.url, d.admin_key, body, True, -1, url)

        for name in daemons:  # warm-up: every keep-alive connection opened, nothing counted
            await closed_loop(max(args.levels), 1.5, one(name))
        for c in args.levels:
            sides = out[c] = {n: Side() for n in daemons}
            for r in range(args.rounds):
                for name in rotation(list(daemons), r):
                    before = {n: cpu_s(p) for n, p in procs.items()}
                    results, elapsed = await closed_loop(c, args.round_s, one(name))
                    for n, p in procs.items():
                        used, s = cpu_s(p) - before[n], sides[n]
                        if n != name:
                            s.idle_cpu, s.idle_s = s.idle_cpu + used, s.idle_s + elapsed
                            continue
                        events = sum(x.events for x in results)
                        s.cpu, s.elapsed, s.events = (
                            s.cpu + used,
                            s.elapsed + elapsed,
                            s.events + events,
                        )
                        s.requests += len(results)
                        s.failed += sum(not x.ok for x in results)
                        s.ttft += [x.ttft for x in results if x.ok]
                        s.per_round.append(used / events * 1e6 if events else float("nan"))
                    await asyncio.sleep(0.2)
            print(
                f"  {c} streams: " + ", ".join(f"{n} {s.raw():.1f}" for n, s in sides.items()),
                flush=True,
            )
    return out


def report(
    figures: dict[int, dict[str, Side]], labels: dict[str, str]
) -> tuple[str, dict[str, Any]]:
    names = list(labels)
    table = Table(
        [
            "streams",
            "tree",
            "requests (failed)",
            "TTFT p50 ms",
            "CPU µs/chunk raw",
            "net",
            f"raw / {labels[names[0]]}, median of rounds (range)",
            "raw per round",
        ]
    )
    data: dict[str, Any] = {}
    for c, sides in figures.items():
        ratios = round_ratios(sides, names[0])
        for n, s in sides.items():
            rs = ratios[n]
            ratio = f"{statistics.median(rs):.3f} ({min(rs):.3f}–{max(rs):.3f})" if rs else "–"
            table.add(
                c,
                labels[n],
                f"{s.requests} ({s.failed})",
                f"{pct(s.ttft, 50) * 1000:.2f}",
                f"{s.raw():.1f}",
                f"{s.net():.1f}",
                ratio,
                " ".join(f"{x:.1f}" for x in s.per_round),
            )
            data.setdefault(str(c), {})[labels[n]] = {
                "raw": round(s.raw(), 2),
                "net": round(s.net(), 2),
                "per_round": s.per_round,
                "ratio_median": round(statistics.median(rs), 4) if rs else None,
                "ttft_p50_ms": round(pct(s.ttft, 50) * 1000, 3),
                "failed": s.failed,
            }
    return table.markdown(), data


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench.tree_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--trees", required=True, help="revisions, comma-separated; '.' = this tree")
    ap.add_argument("--levels", default="16,64", help="concurrent streams, comma-separated")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per tree per concurrency")
    ap.add_argument("--round-s", type=float, default=3.0, help="seconds per round")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--token-delay-ms", type=float, default=2.0)
    ap.add_argument("--kv-cache-usage", default="0.2")
    ap.add_argument("--daemon-loop", choices=("asyncio", "uvloop"), default="uvloop")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    args = ap.parse_args(argv)
    args.trees = [t.strip() for t in args.trees.split(",") if t.strip()]
    args.levels = [int(x) for x in args.levels.split(",")]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    quiet.start_watching()
    t0 = time.monotonic()
    labels: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        daemons: dict[str, Daemon] = {}
        for i, ref in enumerate(args.trees):
            name = f"{i}:{ref}"
            tree = REPO if ref == THIS_TREE else stack.enter_context(worktree(ref))
            labels[name] = head_label() if ref == THIS_TREE else commit_label(ref)
            kv = None if args.kv_cache_usage == "derived" else args.kv_cache_usage
            relay = relay_daemon(
                args.token_delay_ms, max(args.levels), "unix", kv, args.daemon_loop, tree
            )
            daemons[name] = stack.enter_context(relay)
        figures = asyncio.run(run(args, daemons))
    quiet.stop_watching()
    table, data = report(figures, labels)
    print()
    print(header("Trees side by side", ["bench.tree_ab", *sys.argv[1:]], quiet))
    print(
        f"1 fake engine per daemon on a Unix socket, --token-delay-ms {args.token_delay_ms:g}, "
        f"{args.tokens}-token streamed completions, closed loop, {args.rounds} rounds × "
        f"{args.round_s:g} s per tree per concurrency, order rotated every round\n"
    )
    print(table)
    print(f"(took {time.monotonic() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"labels": labels, "figures": data}, indent=2))


if __name__ == "__main__":
    main()
