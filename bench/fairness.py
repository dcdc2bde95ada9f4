"""Fair share between keys: another key's request behind one key's flood, fake engines.

One daemon with 2 fake engines of ``engine.max_inflight`` 2 each: 4 engine slots. A key
("flood") sends ``--flood`` streams at once, of ``--tokens`` tokens ± ``--jitter``
(``--token-ms`` apart: about 1 s on average; spread so they do not all end together), so
all but 4 wait in the gateway's queue; ``--colleague-at`` seconds later a second key
("colleague") sends one stream of ``--tokens`` tokens. Reported per scenario,
median and range over the rounds:

- the colleague's TTFT (send to its first token): with a fair share the wait for the
  next free slot (at most one stream's length), without it the whole queue;
- how many of the flood's streams the colleague's passed (they got their first token
  after it did);
- the flood's throughput, with and without the colleague: its completed streams over the
  time from its start to its last stream's end, and its rate while it still had streams
  waiting (ends of all but its last 4 streams over the time of the last of those: what
  the colleague's one stream cost the flood while the box was full, without the tail).

Scenarios: the flood alone and with the colleague; the same with the flood key created
with ``max_inflight`` 2 (``keys create --max-inflight 2``: it holds at most 2 of the 4
slots, and the colleague's request finds a free one).

``--before REF`` (default 6adf404, before fair share; "" for none) runs the same
uncapped scenarios on a throw-away ``git worktree`` of REF, its daemon beside this
tree's (per-key ``max_inflight`` did not exist then); the order of every (tree,
scenario) is reversed every other round.

    .venv/bin/python -m bench.fairness [--rounds 3] [--flood 40] [--tokens 20]
        [--jitter 0.3] [--token-ms 50] [--colleague-at 0.5] [--before 6adf404] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench._common import (
    Daemon,
    Result,
    Table,
    client_session,
    completion_body,
    daemon,
    header,
    module_argv,
    request,
    wait_for_quiet,
)
from bench._trees import commit_label, head_label, worktree

THIS_TREE = "this tree"
SLOTS_PER_ENGINE = 2
ENGINES = 2
SLOTS = ENGINES * SLOTS_PER_ENGINE


@dataclass(frozen=True)
class Scenario:
    name: str
    cap: int  # the flood key's max_inflight (0: none)
    colleague: bool


SCENARIOS = (
    Scenario("flood alone", 0, False),
    Scenario("flood + colleague", 0, True),
    Scenario("flood --max-inflight 2, alone", 2, False),
    Scenario("flood --max-inflight 2 + colleague", 2, True),
)


@dataclass(frozen=True)
class Run:
    """One flood (and its colleague's request) on one tree's daemon."""

    tree: str
    scenario: str
    round: int
    flood_ok: int
    flood_failed: int
    flood_s: float  # the flood's start to its last stream's end
    flood_busy_rate: float  # its streams/s while it had streams waiting (steady_rate)
    colleague_ttft_s: float | None
    colleague_ok: bool | None
    passed: int | None  # flood streams whose first token came after the colleague's
    waiting_at_send: int | None  # the gateway's queue depth when the colleague sent

    @property
    def flood_rate(self) -> float:
        """The flood's completed streams per second."""
        return self.flood_ok / self.flood_s if self.flood_s > 0 else float("nan")


def lengths(n: int, tokens: int, jitter: float, seed: int = 35) -> list[int]:
    """``n`` stream lengths (tokens) spread evenly over ``tokens`` ± ``jitter`` (a share),
    in a fixed shuffled order: every run sends the same flood, and its streams do not all
    end together (equal streams on 4 slots end in waves of 4, which makes every figure
    move by a whole stream's length)."""
    lo, hi = tokens * (1 - jitter), tokens * (1 + jitter)
    out = [max(1, round(lo + (hi - lo) * i / max(1, n - 1))) for i in range(n)]
    random.Random(seed).shuffle(out)
    return out


def steady_rate(ends: Sequence[float], holds: int) -> float:
    """Streams ended per second while the flood still had streams waiting: the first
    ``len(ends) - holds`` ends (seconds from its start) over the time of the last of them.

    The whole flood's rate also counts its tail, where fewer than ``holds`` (the slots it
    may hold) of its streams are left to run: a single extra stream on the box (the
    colleague's) moves that tail by a whole stream's length."""
    k = len(ends) - holds
    if k <= 0:
        return float("nan")
    last = sorted(ends)[k - 1]
    return k / last if last > 0 else float("nan")


def first_token_at(r: Result) -> float:
    """When (monotonic) a stream's first token came; +inf if none came."""
    return r.start + r.ttft if r.ok or r.events else float("inf")


def passed(flood: Sequence[Result], colleague: Result) -> int:
    """How many of the flood's streams got their first token after the colleague's did."""
    mine = first_token_at(colleague)
    return sum(first_token_at(r) > mine for r in flood)


def spread(values: Sequence[float]) -> str:
    """``median (low–high)``; one value alone; "–" for none."""
    if not values:
        return "–"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:,.2f}"
    return f"{med:,.2f} ({min(values):,.2f}–{max(values):,.2f})"


def table(runs: Sequence[Run], trees: Sequence[str]) -> Table:
    """A row per (tree, scenario) that ran: the colleague's TTFT, the flood streams it
    passed, the flood's throughput and duration, failures; median (range) over rounds."""
    t = Table(
        [
            "tree",
            "scenario",
            "colleague TTFT s",
            "flood streams passed",
            "flood streams/s",
            "... while it had streams waiting",
            "flood took s",
            "failed",
        ]
    )
    for tree in trees:
        for sc in SCENARIOS:
            mine = [r for r in runs if r.tree == tree and r.scenario == sc.name]
            if not mine:
                continue
            ttft = [r.colleague_ttft_s for r in mine if r.colleague_ttft_s is not None]
            by = [float(r.passed) for r in mine if r.passed is not None]
            failed = sum(r.flood_failed + (r.colleague_ok is False) for r in mine)
            t.add(
                tree,
                sc.name,
                spread(ttft),
                spread(by).replace(".00", ""),
                spread([r.flood_rate for r in mine]),
                spread([r.flood_busy_rate for r in mine]),
                spread([r.flood_s for r in mine]),
                failed,
            )
    return t


def schedule(pairs: Sequence[tuple[str, Scenario]], r: int) -> list[tuple[str, Scenario]]:
    """Round r's order of the (tree, scenario) pairs: reversed every other round."""
    return list(pairs) if r % 2 == 0 else list(pairs)[::-1]


# ---------------------------------------------------------------------------- daemons


@contextlib.contextmanager
def daemons(args: argparse.Namespace) -> Iterator[dict[str, Daemon]]:
    """This tree's daemon, and ``--before``'s on a worktree of it, both READY."""
    fake = ["--token-delay-ms", str(args.token_ms)]
    sections: dict[str, Any] = {
        "engine": {"max_inflight": SLOTS_PER_ENGINE},
        # The capped flood's last stream waits about flood/2 slot-seconds.
        "gateway": {"queue_timeout_s": 300, "max_queue": 1024},
        "health": {"interval_s": 2.0, "probe_timeout_s": 5.0, "failures_to_restart": 100},
    }
    with contextlib.ExitStack() as stack:
        out = {THIS_TREE: stack.enter_context(daemon(ENGINES, fake, **sections))}
        if args.before:
            tree = stack.enter_context(worktree(args.before, prefix="bench-fairness-"))
            out[args.before] = stack.enter_context(daemon(ENGINES, fake, tree=tree, **sections))
        yield out


async def new_key(s: aiohttp.ClientSession, d: Daemon, name: str, cap: int) -> str:
    doc: dict[str, Any] = {"name": name}
    if cap:
        doc["max_inflight"] = cap
    async with s.post(d.url + "/admin/keys", json=doc, headers=d.auth) as r:
        got = await r.json()
        if r.status != 201:
            raise RuntimeError(f"POST /admin/keys answered {r.status}: {got}")
        return str(got["key"])


async def queue_depth(s: aiohttp.ClientSession, d: Daemon) -> int | None:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        async with s.get(d.url + "/admin/status", headers=d.auth) as r:
            return int((await r.json())["queue_depth"])
    return None


# ---------------------------------------------------------------------------- run


async def one_run(
    args: argparse.Namespace, s: aiohttp.ClientSession, tree: str, d: Daemon, sc: Scenario, r: int
) -> Run:
    flooder = await new_key(s, d, "flood", sc.cap)
    colleague = await new_key(s, d, "colleague", 0) if sc.colleague else ""
    body = completion_body(args.tokens, True)
    bodies = [completion_body(n, True) for n in lengths(args.flood, args.tokens, args.jitter)]
    t0 = time.monotonic()
    flood = [asyncio.create_task(request(s, d.url, flooder, b, True)) for b in bodies]
    mine: Result | None = None
    waiting = None
    if sc.colleague:
        await asyncio.sleep(args.colleague_at)
        waiting = await queue_depth(s, d)
        mine = await request(s, d.url, colleague, body, True)
    done = await asyncio.gather(*flood)
    ok = [x for x in done if x.ok]
    end = max(x.start + x.total for x in done) - t0
    for x in [*done, *([mine] if mine else [])]:
        if not x.ok:
            print(f"    a stream failed: {x.error}", flush=True)
    return Run(
        tree,
        sc.name,
        r,
        len(ok),
        len(done) - len(ok),
        end,
        steady_rate([x.start + x.total - t0 for x in ok], min(sc.cap or SLOTS, SLOTS)),
        mine.ttft if mine else None,
        mine.ok if mine else None,
        passed(done, mine) if mine else None,
        waiting,
    )


async def run(args: argparse.Namespace, ds: dict[str, Daemon]) -> list[Run]:
    pairs = [
        (tree, sc)
        for tree in ds
        for sc in SCENARIOS
        if tree == THIS_TREE or not sc.cap  # per-key max_inflight is this tree's
    ]
    runs: list[Run] = []
    async with client_session() as s:
        for d in ds.values():  # warm-up: every keep-alive connection opened
            key = await new_key(s, d, "warm-up", 0)
            body = completion_body(2, True)
            await asyncio.gather(*(request(s, d.url, key, body, True) for _ in range(8)))
        for r in range(args.rounds):
            for tree, sc in schedule(pairs, r):
                one = await one_run(args, s, tree, ds[tree], sc, r)
                runs.append(one)
                who = (
                    f"colleague TTFT {one.colleague_ttft_s:.2f} s (passed {one.passed}), "
                    if one.colleague_ttft_s is not None
                    else ""
                )
                print(
                    f"  round {r + 1} {tree} / {sc.name}: {who}flood {one.flood_rate:.2f} "
                    f"streams/s in {one.flood_s:.1f} s",
                    flush=True,
                )
                await asyncio.sleep(0.5)
    return runs


def report(args: argparse.Namespace, quiet: Any, runs: Sequence[Run], trees: list[str]) -> str:
    labels = {
        THIS_TREE: head_label(),
        **({args.before: commit_label(args.before)} if args.before else {}),
    }
    out = [
        header("Fair share between keys (fake engines)", module_argv("bench.fairness"), quiet),
        "- trees: " + ", ".join(f"{t} = {labels[t]}" for t in trees),
        f"- load: {ENGINES} fake engines x engine.max_inflight {SLOTS_PER_ENGINE} = {SLOTS} "
        f"slots; the flood key sends {args.flood} streams of {args.tokens} tokens "
        f"± {args.jitter:.0%} (evenly spread, shuffled), {args.token_ms:g} ms apart "
        f"(~{args.tokens * args.token_ms / 1000:.1f} s each on average) at once, the "
        f"colleague key one stream of {args.tokens} tokens {args.colleague_at:g} s later; "
        f"{args.rounds} rounds, order reversed every other round; figures are median "
        f"(range) over the rounds\n",
        table(runs, trees).markdown(),
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="runs of every scenario per tree")
    ap.add_argument("--flood", type=int, default=40, help="the flood key's streams")
    ap.add_argument("--tokens", type=int, default=20, help="tokens per stream")
    ap.add_argument(
        "--jitter", type=float, default=0.3, help="flood stream lengths: tokens ± this share"
    )
    ap.add_argument("--token-ms", type=float, default=50.0, help="the fake engine's token delay")
    ap.add_argument(
        "--colleague-at", type=float, default=0.5, help="seconds from the flood to the colleague"
    )
    ap.add_argument(
        "--before", default="6adf404", help='a commit to run beside this tree ("": none)'
    )
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    quiet = wait_for_quiet(0 if args.no_wait else 120)
    with daemons(args) as ds:
        quiet.start_watching()
        try:
            runs = asyncio.run(run(args, ds))
        finally:
            quiet.stop_watching()
        trees = list(ds)
    print(report(args, quiet, runs, trees))
    if args.json:
        doc = {"args": vars(args), "runs": [asdict(r) | {"flood_rate": r.flood_rate} for r in runs]}
        Path(args.json).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
