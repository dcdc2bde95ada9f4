"""vllm-router in front of the appliance: what it adds, and what a second box gives.

Two daemons stand for two boxes (one fast fake engine each: 2 ms per token, 64-token
streams, max_inflight 64), box B sharing box A's keys file; two real vllm-routers run
beside them, R1 with box A alone and R2 with both (round robin, health checks on
/readyz as the Ansible role sets them). Rounds alternate, order reversed every round:

- ``box``: straight to box A's gateway;
- ``router+box``: through R1 to box A (what the router adds: TTFT p50/p99, and the
  router's CPU per relayed chunk, its process CPU during those rounds / SSE events);
- ``router+2 boxes``: through R2 (throughput against ``router+box``: a second box).

    .venv/bin/python -m bench.router_front [--levels 1,16,128] [--rounds 3] [--seconds 6]

The router comes from tests/fakes/router_proc.py (installed once under the user cache).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import psutil

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
    wait_for_quiet,
)
from tests.fakes.router_proc import install_router, run_router

MODES = ("box", "router+box", "router+2 boxes")


def share_keys(src: Path, dest: Path) -> None:
    """Box B takes box A's keys file as the role would push it (atomic replace)."""
    tmp = dest.with_name(".keys.push")
    shutil.copy2(src, tmp)
    os.replace(tmp, dest)


async def one_round(url: str, key: str, level: int, seconds: float) -> list[Result]:
    from bench._common import request

    body = completion_body(64, True)
    async with client_session() as session:
        results, _ = await closed_loop(
            level, seconds, lambda _w: request(session, url, key, body, True)
        )
    return results


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def report(
    data: dict[tuple[str, int], list[Result]],
    cpu: dict[tuple[str, int], float],
    walls: dict[tuple[str, int], float],
    levels: Sequence[int],
) -> str:
    table = Table(
        [
            "streams",
            "path",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "events/s",
            "router CPU µs/chunk",
            "failed",
        ]
    )
    for level in levels:
        for mode in MODES:
            rs = data[(mode, level)]
            ok = [r for r in rs if r.ok]
            events = sum(r.events for r in ok)
            rate = events / walls[(mode, level)] if walls[(mode, level)] else 0.0
            per_chunk = (
                f"{cpu[(mode, level)] / events * 1e6:.0f}" if mode != "box" and events else "–"
            )
            table.add(
                level,
                mode,
                ms(pct([r.ttft for r in ok], 50)),
                ms(pct([r.ttft for r in ok], 99)),
                f"{rate:.0f}",
                per_chunk,
                len(rs) - len(ok),
            )
    return table.markdown()


async def measure(
    args: argparse.Namespace, urls: dict[str, str], key: str, routers: dict[str, psutil.Process]
) -> str:
    levels = [int(x) for x in args.levels.split(",")]
    data: dict[tuple[str, int], list[Result]] = defaultdict(list)
    cpu: dict[tuple[str, int], float] = defaultdict(float)
    walls: dict[tuple[str, int], float] = defaultdict(float)
    for level in levels:
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
                proc = routers.get(mode)
                c0, t0 = (cpu_s(proc) if proc else 0.0), time.monotonic()
                data[(mode, level)] += await one_round(urls[mode], key, level, args.seconds)
                walls[(mode, level)] += time.monotonic() - t0
                cpu[(mode, level)] += (cpu_s(proc) - c0) if proc else 0.0
    return report(data, cpu, walls, levels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", default="1,16,128")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    args = p.parse_args()
    exe = install_router()
    if isinstance(exe, str):
        raise SystemExit(f"no vllm-router: {exe}")
    quiet = wait_for_quiet(max_wait_s=120)
    fake = ("--token-delay-ms", "2")
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(daemon(1, fake))
        b = stack.enter_context(daemon(1, fake))
        share_keys(
            Path(a.app.config["gateway"]["keys_file"]), Path(b.app.config["gateway"]["keys_file"])
        )
        b.app.wait_for(lambda: _answers(b.url, a.admin_key), 30, "box B to take A's keys")
        r1 = stack.enter_context(run_router(exe, a.tmp, [a.url]))
        r2 = stack.enter_context(run_router(exe, b.tmp, [a.url, b.url]))
        for r, n in ((r1, 1), (r2, 2)):
            r.wait_for(lambda r=r, n=n: sum(r.healthy().values()) == n, 60, "workers healthy")
        urls = {"box": a.url, "router+box": r1.url, "router+2 boxes": r2.url}
        procs = {
            "router+box": psutil.Process(r1.proc.pid),
            "router+2 boxes": psutil.Process(r2.proc.pid),
        }
        table = asyncio.run(measure(args, urls, a.admin_key, procs))
    print(header("vllm-router in front of the appliance", module_argv("bench.router_front"), quiet))
    print(table)


def _answers(url: str, key: str) -> bool:
    from tests.fakes.router_proc import http

    return http("GET", url + "/v1/models", key=key, timeout=2)[0] == 200


if __name__ == "__main__":
    main()
