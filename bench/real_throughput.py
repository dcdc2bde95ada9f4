"""Gateway cost on real vLLM: one CPU engine, straight to it vs through the gateway.

One daemon with ONE real vLLM engine on CPU (every usable core), listening on its Unix
socket (the appliance's default). The engine's per-spawn key is read from the API
server's environment (``VLLM_API_KEY``), so the "direct" rounds hit the very engine the
gateway relays to, over the same socket. Rounds alternate direct / gateway
(order flipped every round) at each concurrency; each round is a closed loop of N
streams of ``--tokens`` tokens (``ignore_eos``) for a fixed time. Per concurrency it
reports tokens/s of both paths and their ratio, and TTFT p50/p99 of both.

On this machine the engine, the gateway and the client share two cores, so every CPU
cycle the gateway spends is one the engine does not get: the ratio is a worst case for
a GPU box, where the engine's work is on the GPU.

    .venv/bin/python -m bench.real_throughput [--levels 1,4,16] [--rounds 3] [--round-s 10]
        [--route completions|chat|responses|messages[,...]]

Several routes (``--route chat,responses,messages``) are measured in one run, each round
running every route in turn, so they are compared under the same load on the machine;
a last table gives each route's ratio round by round (its spread is the run's noise)
and the daemon's CPU per relayed event (net: less its background rate, measured in the
direct rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from appliance import paths
from bench._common import (
    STREAM_ENDS,
    Daemon,
    Result,
    Table,
    header,
    module_argv,
    request,
    route_stream,
    wait_for_quiet,
)
from bench.direct_vs_gateway import (
    Measure,
    Rounds,
    Send,
    alternate_loads,
    compare,
    daemon_cpu_per_event,
    merged,
    round_ratios,
)
from tests.fakes.appliance_proc import real_engine_config, run_appliance

MODEL = paths.PACKAGED_MODEL_NAME


@contextlib.contextmanager
def real_daemon() -> Iterator[Daemon]:
    home = paths.appliance_home()
    if not paths.engine_python(home).exists():
        raise SystemExit(f"no engine venv under {home}: run scripts/setup first")
    tmp = Path(tempfile.mkdtemp(prefix="llm-appliance-bench-real-"))
    cfg = real_engine_config(
        tmp, 1, health={"interval_s": 5, "probe_timeout_s": 30, "failures_to_restart": 5}
    )
    try:
        with run_appliance(tmp, cfg, env={"LLM_APPLIANCE_HOME": str(home)}) as app:
            app.wait_ready(timeout=300)
            d = Daemon(app, tmp, (tmp / "admin.key").read_text().strip())
            d.wait_engines_ready(timeout=300)
            yield d
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def body(tokens: int, n: int, route: str = "completions") -> bytes:
    if route != "completions":
        # Distinct prompts (no prefix-cache hit favours a path); ignore_eos where the
        # route's request takes it (vLLM's chat and Responses do; Messages does not).
        prompt = f"{secrets.token_hex(4)} Write a story about a lighthouse keeper."
        raw = json.loads(route_stream(route, tokens, prompt)[1])
        raw["model"] = MODEL
        if route in ("chat", "responses"):
            raw["ignore_eos"] = True
        return json.dumps(raw).encode()
    return json.dumps(
        {
            "model": MODEL,
            # Distinct prompts: no prefix-cache hit makes one path look faster.
            "prompt": f"{secrets.token_hex(4)} Write a story about a lighthouse keeper.",
            "max_tokens": tokens,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()


def sender(args: argparse.Namespace, route: str) -> Send:
    path, _ = route_stream(route, 0)
    end = STREAM_ENDS[route]

    async def send(s: aiohttp.ClientSession, base: str, key: str, w: int) -> Result:
        return await request(s, base, key, body(args.tokens, w, route), True, -1, path, end)

    return send


async def run(args: argparse.Namespace, d: Daemon) -> dict[str, Rounds]:
    sends = {route: sender(args, route) for route in args.route}
    return await alternate_loads(d, 0, args.levels, args.rounds, args.round_s, sends, "streams")


def streamed_tokens(ok: list[Result], elapsed: float) -> float:
    # Events minus the final chunk and [DONE]: one event per token.
    return sum(max(0, r.events - 2) for r in ok) / elapsed


TOKENS = Measure("streams", "tokens/s", "tok_s", "TTFT", streamed_tokens, lambda r: r.ttft)


def summary(args: argparse.Namespace, loads: dict[str, Rounds]) -> Table:
    """Per route and concurrency: the ratio of all rounds together, and round by round
    (their median shrugs off a round that another process on the machine spoilt)."""
    t = Table(
        [
            "route",
            "streams",
            "ratio gw/direct",
            "per round",
            "rounds' median / mean",
            "daemon CPU µs/event raw / net",
        ]
    )
    for route, rounds in loads.items():
        for c in args.levels:
            per = round_ratios(rounds, c, TOKENS)
            whole = compare([c], merged(rounds), TOKENS)[1][str(c)]["ratio"]
            t.add(
                route_stream(route, 0)[0],
                c,
                f"{whole:.3f}",
                " ".join(f"{r:.3f}" for r in per),
                f"{statistics.median(per):.3f} / {statistics.fmean(per):.3f}",
                "{:.1f} / {:.1f}".format(*daemon_cpu_per_event(rounds, c)),
            )
    return t


def report(args: argparse.Namespace, quiet: Any, loads: dict[str, Rounds]) -> str:
    out = [header("Gateway cost on real vLLM (CPU)", module_argv("bench.real_throughput"), quiet)]
    paths = ", ".join(route_stream(r, 0)[0] for r in args.route)
    out.append(
        f"- load: 1 real vLLM engine (SmolLM2-135M, --enforce-eager, all cores, on a Unix "
        f"socket), {args.tokens}-token streams on {paths} (ignore_eos but on messages, "
        f'whose request has no such field: its streams may end sooner; "tokens" counts '
        f"SSE events, framing events included, alike on both paths); closed loop; "
        f"{args.rounds} rounds × {args.round_s:g} s per path per concurrency"
        f"{' per route, routes interleaved in each round' if len(args.route) > 1 else ''}, "
        f"direct/gateway alternating\n"
    )
    figures: dict[str, Any] = {}
    for route, rounds in loads.items():
        t, figures[route] = compare(args.levels, merged(rounds), TOKENS)
        out.append(f"**{route_stream(route, 0)[0]}**\n\n" + t.markdown() + "\n")
    out.append(summary(args, loads).markdown() + "\n")
    if args.json:
        # One route: its figures as before, not keyed by route.
        doc = figures[args.route[0]] if len(args.route) == 1 else figures
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,4,16", help="concurrent streams, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per path per concurrency")
    ap.add_argument("--round-s", type=float, default=10.0, help="seconds per round")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument(
        "--route",
        default="completions",
        help=f"which routes' streams, comma-separated, interleaved in each round "
        f"({', '.join(sorted(STREAM_ENDS))})",
    )
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    args.route = [r for r in args.route.split(",") if r]
    if not args.route or any(r not in STREAM_ENDS for r in args.route):
        ap.error(f"--route: each of {', '.join(sorted(STREAM_ENDS))}")
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    started = time.monotonic()
    with real_daemon() as d:
        print(f"engine READY after {time.monotonic() - started:.0f} s", flush=True)
        # No quiet.start_watching(): it counts vLLM processes, and this run's engine is one.
        loads = asyncio.run(run(args, d))
    print(report(args, quiet, loads))


if __name__ == "__main__":
    main()
