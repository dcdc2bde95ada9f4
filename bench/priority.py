"""Priority into vLLM: an interactive request's first token behind a batch flood, real CPU.

Two daemons at once, each with ONE real vLLM engine on CPU (the packaged model, as the
e2e tests run it, with ``--max-num-seqs 4`` in ``engine.extra_args`` so a dozen streams
fill the engine's running batch and the rest wait inside the engine, not in the
gateway, whose ``max_inflight`` stays 64): one daemon with ``engine.scheduling =
"priority"`` (the default: vLLM ``--scheduling-policy priority``, a ``batch`` key's
requests sent with ``priority`` 10), one with ``"fcfs"``. Each round runs one flood on
each daemon, one after the other, the order flipped every round: a ``batch`` key sends
``--batch`` streams of ``--tokens`` tokens at once (``ignore_eos``, distinct prompts: no
prefix-cache hits), then ``--after`` seconds later an ``interactive`` key sends one
stream of ``--interactive-tokens`` tokens. Reported per scheduling: the interactive
stream's TTFT (send to its first token, through the gateway) and when the flood's last
stream ended, median and range over the rounds.

Real engines: wrap the run in ``flock /tmp/vllm-e2e.lock`` on a shared machine.

    flock /tmp/vllm-e2e.lock .venv/bin/python -m bench.priority [--rounds 3]
        [--batch 12] [--tokens 128] [--after 1.0] [--max-num-seqs 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from appliance import paths
from bench._common import (
    Daemon,
    Table,
    client_session,
    header,
    module_argv,
    request,
    wait_for_quiet,
)
from bench.real_throughput import body  # distinct prompts: no prefix-cache hit
from tests.fakes.appliance_proc import Appliance, real_engine_config, run_appliance

MODEL = paths.PACKAGED_MODEL_NAME
POLICIES = ("priority", "fcfs")


@dataclass(frozen=True)
class Run:
    """One flood and its interactive request on one daemon."""

    scheduling: str
    round: int
    ttft_s: float  # the interactive stream: send to its first token
    interactive_s: float  # ... to its end
    flood_end_s: float  # the flood's start to its last stream's end
    failed: int  # streams (flood and interactive) that did not end well


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    def ms(self) -> str:
        return f"{self.median * 1000:,.0f} ({self.low * 1000:,.0f}–{self.high * 1000:,.0f})"

    def s(self) -> str:
        return f"{self.median:.1f} ({self.low:.1f}–{self.high:.1f})"


def spread(values: Sequence[float]) -> Spread:
    """Median, lowest and highest of ``values`` (at least one)."""
    if not values:
        raise ValueError("no values")
    return Spread(statistics.median(values), min(values), max(values))


def order(r: int) -> tuple[str, ...]:
    """Round r's order of the two daemons: flipped every round, so neither always runs
    first (on a warmer or a quieter machine)."""
    return POLICIES if r % 2 == 0 else POLICIES[::-1]


def table(runs: Sequence[Run]) -> Table:
    """A row per scheduling: the interactive TTFT and the flood's end, median (range)
    over the rounds, each round's TTFT, and how many streams failed."""
    t = Table(
        [
            "engine.scheduling",
            "interactive TTFT ms, median (range)",
            "per round (ms)",
            "flood ended after s, median (range)",
            "failed streams",
        ]
    )
    for policy in POLICIES:
        mine = [r for r in runs if r.scheduling == policy]
        if not mine:
            continue
        t.add(
            policy,
            spread([r.ttft_s for r in mine]).ms(),
            " ".join(f"{r.ttft_s * 1000:,.0f}" for r in mine),
            spread([r.flood_end_s for r in mine]).s(),
            sum(r.failed for r in mine),
        )
    return t


def ratio_line(runs: Sequence[Run]) -> str:
    """fcfs's median interactive TTFT over priority's."""
    ttft = {p: [r.ttft_s for r in runs if r.scheduling == p] for p in POLICIES}
    if not all(ttft.values()):
        return ""
    a, b = statistics.median(ttft["fcfs"]), statistics.median(ttft["priority"])
    return f"fcfs / priority, median interactive TTFT: {a / b:.2f}x"


# ---------------------------------------------------------------------------- daemons


@contextlib.contextmanager
def real_daemons(args: argparse.Namespace) -> Iterator[dict[str, Daemon]]:
    """One daemon per scheduling, one real engine each, all READY; stopped after."""
    home = paths.appliance_home()
    if not paths.engine_python(home).exists():
        raise SystemExit(f"no engine venv under {home}: run scripts/setup first")
    with contextlib.ExitStack() as stack:
        started: list[tuple[str, Appliance, Path]] = []
        for policy in POLICIES:
            tmp = Path(tempfile.mkdtemp(prefix=f"llm-appliance-bench-{policy}-"))
            stack.callback(shutil.rmtree, tmp, True)
            cfg = real_engine_config(
                tmp,
                1,
                engine={
                    "scheduling": policy,
                    "extra_args": ["--max-num-seqs", str(args.max_num_seqs)],
                    "max_inflight": 64,
                },
                gateway={"queue_timeout_s": 300},
                # Rare, patient probes: a probe stuck behind the flood must not take the
                # engine out of routing, and an idle daemon should cost the other nothing.
                health={"interval_s": 30, "probe_timeout_s": 120, "failures_to_restart": 5},
            )
            app = stack.enter_context(
                run_appliance(tmp, cfg, env={"LLM_APPLIANCE_HOME": str(home)})
            )
            stack.callback(_stop, app)
            started.append((policy, app, tmp))
        out = {}
        for policy, app, tmp in started:
            app.wait_ready(timeout=600)
            d = Daemon(app, tmp, (tmp / "admin.key").read_text().strip())
            d.wait_engines_ready(timeout=600)
            out[policy] = d
        yield out


def _stop(app: Appliance) -> None:
    """SIGTERM, as systemd would: the daemon takes its engine's whole tree down."""
    if app.proc.poll() is None:
        app.signal(signal.SIGTERM)
        with contextlib.suppress(Exception):
            app.wait_exit(90)


async def new_key(s: aiohttp.ClientSession, d: Daemon, name: str, priority: str) -> str:
    async with s.post(
        d.url + "/admin/keys", json={"name": name, "priority": priority}, headers=d.auth
    ) as r:
        doc = await r.json()
        if r.status != 201:
            raise RuntimeError(f"POST /admin/keys answered {r.status}: {doc}")
        return str(doc["key"])


# ---------------------------------------------------------------------------- run


async def one_flood(
    args: argparse.Namespace, s: aiohttp.ClientSession, d: Daemon, keys: dict[str, str]
) -> tuple[float, float, float, int]:
    """(interactive TTFT, interactive total, flood end, failures) of one flood."""
    t0 = time.monotonic()
    flood = [
        asyncio.create_task(request(s, d.url, keys["batch"], body(args.tokens, 0), True))
        for _ in range(args.batch)
    ]
    await asyncio.sleep(args.after)
    mine = await request(s, d.url, keys["interactive"], body(args.interactive_tokens, 0), True)
    done = await asyncio.gather(*flood)
    end = max(r.start + r.total for r in done) - t0
    failed = sum(not r.ok for r in done) + (not mine.ok)
    for r in [*done, mine]:
        if not r.ok:
            print(f"    a stream failed: {r.error}", flush=True)
    return mine.ttft, mine.total, end, failed


async def run(args: argparse.Namespace, daemons: dict[str, Daemon]) -> list[Run]:
    runs: list[Run] = []
    async with client_session(total_s=1800) as s:
        keys = {}
        for policy, d in daemons.items():
            keys[policy] = {
                "batch": await new_key(s, d, "flood", "batch"),
                "interactive": await new_key(s, d, "colleague", "interactive"),
            }
            # Warm-up: the first requests of a fresh engine are slower (compilation).
            await asyncio.gather(
                *(request(s, d.url, keys[policy]["batch"], body(16, 0), True) for _ in range(4))
            )
        for r in range(args.rounds):
            for policy in order(r):
                ttft, total, end, failed = await one_flood(args, s, daemons[policy], keys[policy])
                runs.append(Run(policy, r, ttft, total, end, failed))
                print(
                    f"  round {r + 1} {policy:>8}: interactive TTFT {ttft * 1000:,.0f} ms, "
                    f"flood ended after {end:.1f} s, {failed} failed",
                    flush=True,
                )
                await asyncio.sleep(1.0)
    return runs


def report(args: argparse.Namespace, quiet: Any, runs: Sequence[Run]) -> str:
    out = [
        header(
            "Priority into vLLM: interactive TTFT behind a batch flood (real vLLM, CPU)",
            module_argv("bench.priority"),
            quiet,
        ),
        f"- load: 2 daemons, 1 real vLLM engine each ({MODEL}, CPU, "
        f"`--max-num-seqs {args.max_num_seqs}`), `engine.scheduling` priority vs fcfs; per "
        f"round and daemon a `batch` key sends {args.batch} streams of {args.tokens} tokens "
        f"(ignore_eos) at once, an `interactive` key one stream of "
        f"{args.interactive_tokens} tokens {args.after:g} s later, through the gateway; "
        f"{args.rounds} rounds, daemon order flipped every round\n",
        table(runs).markdown(),
        "",
        ratio_line(runs),
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="floods per scheduling")
    ap.add_argument("--batch", type=int, default=12, help="the batch key's streams per flood")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per batch stream")
    ap.add_argument("--interactive-tokens", type=int, default=16)
    ap.add_argument("--after", type=float, default=1.0, help="seconds from flood to the request")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="vLLM's running batch")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    quiet = wait_for_quiet(0 if args.no_wait else 300)
    started = time.monotonic()
    with real_daemons(args) as daemons:
        print(f"engines READY after {time.monotonic() - started:.0f} s", flush=True)
        runs = asyncio.run(run(args, daemons))
    print(report(args, quiet, runs))
    if args.json:
        doc = {"args": vars(args), "runs": [asdict(r) for r in runs]}
        Path(args.json).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
