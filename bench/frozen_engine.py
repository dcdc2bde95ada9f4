"""A frozen engine under a closed loop: with the SUSPECT state, and before it.

Issue 15, section 1, "Measure". Two fake engines behind one daemon; a closed loop of
``--clients`` streamed completions through the gateway; after a warm-up, engine 0's
API server gets SIGSTOP (no SIGCONT: the supervisor declares it hung after
``failures_to_restart`` failed checks, kills it and starts a new one) and the loop goes
on for ``--after-s`` seconds. Reported, for the requests that *start* after the freeze:
how many, how many failed, TTFT p50/p99, and how many went to the frozen engine; and
when the last of those started, when engine 0 went SUSPECT, was declared hung and was
READY again.

Two kinds of client (``--patience-s``), each run on both sides:

- *patient* (0): each waits for its answer. Routing prefers the engine with the least
  outstanding work, and the requests stuck on the frozen engine count as its work, so
  it stops being chosen as soon as it holds more than the live engine, with or without
  SUSPECT;
- *impatient* (P > 0): a client that gets no byte for P seconds gives up, closes the
  connection and sends its next request, as a client with a read timeout does. Each
  give-up frees a slot on the frozen engine, which then looks idle again: this is where
  a frozen but READY engine keeps being offered new requests.

The two sides are two daemons of two trees of this repository, run the same way:

- ``before``: a ``git worktree`` of ``--before`` (default 1fa4061, the parent of the
  commit that added SUSPECT: a READY engine that fails a check keeps getting new work
  until it is declared hung), removed at the end;
- ``after``: this working tree as it is (or a worktree of ``--after REF``).

Each daemon runs ``python -m appliance.cli serve`` with its tree as cwd and
PYTHONPATH, and that tree's own ``tests/fakes/fake_engine.py`` as the engine command,
``--port {port}`` (``engine.listen = "tcp"`` where the tree knows the key; the older
tree listens on TCP only). Sides alternate (before, after, after, before, ...) so drift
in the machine hits both.

**Which engine answered.** The gateway does not say. A request started after the
freeze and before the verdict went to the frozen engine when its first token came 1 s
or more after it started, or never (the live engine answers in milliseconds; a request
on the frozen one waits for the verdict and is retried elsewhere, or its client gives
up). Requests as slow that started after the verdict are counted apart: on this busy
machine they met a stall of the box, not the frozen engine. With patient
clients also the *gateway count*: engine 0's ``inflight`` in ``/admin/status``, polled
every 100 ms, rises once per request admitted to it between the freeze and the verdict
(nothing on a frozen engine ends before then; with impatient clients a slot freed and
taken again within one poll shows no change, so it is not used there).

SUSPECT / hung times come from the daemon's log lines (``engine0: READY -> SUSPECT``,
``health check failed (1/N)``, ``hung``, ``gave up N request(s)``; millisecond stamps);
READY again and the states seen from the polls of ``/admin/status``.

    .venv/bin/python -m bench.frozen_engine [--rounds 2] [--patience-s 0,2] [--out x.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench._common import (
    MODEL,
    Quiet,
    Result,
    Table,
    client_session,
    completion_body,
    header,
    module_argv,
    ms,
    pct,
    request,
    wait_for_quiet,
)
from bench._trees import git, worktree
from tests.fakes.appliance_proc import fake_engine_config, get_json, write_config

REPO = Path(__file__).resolve().parents[1]
BEFORE_REF = "1fa4061"
POLL_S = 0.1
GOLDEN = 0.618034  # successive multiples mod 1 spread evenly over [0, 1)
STUCK_S = 1.0  # first token later than this: it was on the frozen engine
SERVING = ("READY", "SUSPECT")  # engine 0 before the verdict (SUSPECT: "after" only)
LOG_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: engine0: (.*)$", re.MULTILINE
)


# ---------------------------------------------------------------------------- trees


@dataclass
class Tree:
    side: str  # "before" or "after"
    path: Path
    label: str  # what ran: a commit, or the working tree at a commit
    has_listen: bool  # the config knows engine.listen (the engines then default to unix)


def make_tree(side: str, path: Path, ref: str | None) -> Tree:
    if ref is None:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "appliance")
        label = f"working tree at {head}" + (
            " (uncommitted changes in appliance/)" if dirty else ""
        )
    else:
        label = git("rev-parse", "--short", f"{ref}^{{commit}}")
    config_src = (path / "appliance" / "config.py").read_text()
    has_listen = re.search(r"^\s+listen: ", config_src, re.MULTILINE) is not None
    check_imports_from(path)
    return Tree(side, path, label, has_listen)


def check_imports_from(path: Path) -> None:
    """The daemon must run this tree's code, not an installed copy of the package."""
    out = subprocess.run(
        [sys.executable, "-c", "import appliance; print(appliance.__file__)"],
        cwd=path,
        env={**os.environ, "PYTHONPATH": str(path)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(out).resolve().is_relative_to(path.resolve()):
        raise RuntimeError(f"from {path}, `import appliance` gives {out}")


# ---------------------------------------------------------------------------- daemon


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    tmp: Path
    url: str
    log_path: Path
    admin_key: str = ""
    # Processes to kill at the end, as psutil handles: one whose pid was reused since
    # (the frozen engine is killed by the daemon itself) is then not ours to kill.
    known: list[psutil.Process] = field(default_factory=list)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict[str, Any] | None:
        code, body = get_json(self.url + "/admin/status", headers=self.auth)
        return body if code == 200 and isinstance(body, dict) else None

    def wait_for(self, what: str, cond: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited before {what}:\n{self.log()[-3000:]}")
            if cond():
                return
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what}:\n{self.log()[-3000:]}")


def engine_command(tree: Tree, token_delay_ms: float) -> list[str]:
    return [
        sys.executable,
        str(tree.path / "tests" / "fakes" / "fake_engine.py"),
        "--served-model-name",
        "{served_model_name}",
        "--disable-uvicorn-access-log",
        "--token-delay-ms",
        f"{token_delay_ms:g}",
        "--port",
        "{port}",
    ]


def daemon_config(tree: Tree, tmp: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The same settings for both trees; only ``engine.listen`` differs (absent before)."""
    engine: dict[str, Any] = {
        "served_model_name": MODEL,
        "command": engine_command(tree, args.token_delay_ms),
    }
    if tree.has_listen:
        engine["listen"] = "tcp"
    return fake_engine_config(
        tmp,
        2,
        engine=engine,
        telemetry={"source": "none", "interval_s": 1.0},
        health={
            "interval_s": args.health_interval_s,
            "probe_timeout_s": args.probe_timeout_s,
            "failures_to_restart": args.failures_to_restart,
        },
        restart={"backoff_initial_s": 0.5, "backoff_max_s": 5, "drain_timeout_s": 30},
    )


def daemon_env(tree: Tree, tmp: Path) -> dict[str, str]:
    drop = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LLM_APPLIANCE_CONFIG")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.pop("JOURNAL_STREAM", None)  # without it the log lines carry their timestamps
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700)
    env.update(
        PYTHONPATH=str(tree.path),
        LLM_APPLIANCE_HOME=str(tmp / "home"),
        RUNTIME_DIRECTORY=str(run_dir),
    )
    return env


@contextlib.contextmanager
def start_daemon(tree: Tree, args: argparse.Namespace) -> Iterator[tuple[Daemon, dict[str, Any]]]:
    """``llm-appliance serve`` from ``tree``, both engines READY; killed whole after."""
    tmp = Path(tempfile.mkdtemp(prefix=f"frozen-engine-{tree.side}-"))
    cfg = daemon_config(tree, tmp, args)
    cfg_path = write_config(tmp / "config.toml", cfg)
    log_path = tmp / "appliance.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "appliance.cli", "serve", "--config", str(cfg_path)],
            cwd=tree.path,
            env=daemon_env(tree, tmp),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    d = Daemon(proc, tmp, f"http://127.0.0.1:{cfg['gateway']['port']}", log_path)
    try:
        d.wait_for("/readyz 200", lambda: get_json(d.url + "/readyz")[0] == 200, 60)
        d.admin_key = (tmp / "admin.key").read_text().strip()

        def all_ready() -> bool:
            st = d.status()
            return st is not None and all(e["state"] == "READY" for e in st["engines"])

        d.wait_for("engines READY", all_ready, 30)
        yield d, cfg
    finally:
        stop_daemon(d)
        if args.keep:
            print(f"  (daemon files kept in {tmp})", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def stop_daemon(d: Daemon) -> None:
    """SIGKILL the daemon and every engine it started (a stopped process dies too)."""
    with contextlib.suppress(psutil.Error):
        d.known += psutil.Process(d.proc.pid).children(recursive=True)
    if d.proc.poll() is None:
        d.proc.kill()
        d.proc.wait(10)
    for p in d.known:
        with contextlib.suppress(psutil.Error):
            if p.is_running():  # the same process (pid and start time), not a reused pid
                p.kill()


# ---------------------------------------------------------------------------- one run


@dataclass
class Sample:
    t: float  # monotonic
    state: str  # engine 0's
    pid: int | None
    inflight: int


@dataclass
class RunData:
    results: list[Result]
    samples: list[Sample]
    t_start: float
    t_freeze: float
    wall_freeze: float  # time.time() at the SIGSTOP, to place the log's lines
    deadline: float
    frozen_pid: int
    log: str
    patience_s: float


async def engine0(s: aiohttp.ClientSession, d: Daemon) -> Sample:
    async with s.get(
        d.url + "/admin/status", headers=d.auth, timeout=aiohttp.ClientTimeout(total=5)
    ) as r:
        e = (await r.json())["engines"][0]
    return Sample(time.monotonic(), str(e["state"]), e.get("pid"), int(e.get("inflight", 0)))


async def poll(s: aiohttp.ClientSession, d: Daemon, out: list[Sample], stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            out.append(await engine0(s, d))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_S)


def load_session(patience_s: float) -> aiohttp.ClientSession:
    """The clients' session; with a patience, a client waits at most that long for a byte
    (its first token, or the next) before it gives up, closes the connection and moves on
    to its next request, as a client with a read timeout does."""
    if not patience_s:
        return client_session()
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=120, sock_connect=10, sock_read=patience_s),
        trust_env=False,
        auto_decompress=False,
    )


async def scenario(
    d: Daemon, args: argparse.Namespace, patience_s: float, warmup_s: float
) -> RunData:
    body = completion_body(args.tokens, True)
    results: list[Result] = []
    pending: dict[int, float] = {}  # worker -> start of the request it waits on
    samples: list[Sample] = []
    deadline = [float("inf")]  # set at the freeze
    stop_polling = asyncio.Event()

    async with load_session(patience_s) as s, client_session() as admin:

        async def worker(w: int) -> None:
            while time.monotonic() < deadline[0]:
                pending[w] = time.monotonic()
                results.append(await request(s, d.url, d.admin_key, body, True))
                del pending[w]

        t_start = time.monotonic()
        load = [asyncio.create_task(worker(w)) for w in range(args.clients)]
        poller = asyncio.create_task(poll(admin, d, samples, stop_polling))
        await asyncio.sleep(warmup_s)
        before = await engine0(admin, d)
        if before.pid is None or before.state != "READY":
            raise RuntimeError(f"engine 0 not READY with a pid before the freeze: {before}")
        samples.append(before)
        frozen = psutil.Process(before.pid)
        d.known.append(frozen)
        frozen.send_signal(signal.SIGSTOP)
        t_freeze, wall_freeze = time.monotonic(), time.time()
        deadline[0] = t_freeze + args.after_s
        _, late = await asyncio.wait(load, timeout=args.after_s + args.drain_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        now = time.monotonic()
        # A request still waiting when we gave up is counted, as a failure.
        for start in pending.values():
            results.append(Result(False, start, 0.0, now - start, 0, error="unfinished at the end"))
        stop_polling.set()
        await poller
    return RunData(
        results,
        samples,
        t_start,
        t_freeze,
        wall_freeze,
        deadline[0],
        before.pid,
        d.log(),
        patience_s,
    )


# ---------------------------------------------------------------------------- figures


@dataclass
class Summary:
    side: str
    round: int
    tree: str
    patience_s: float  # 0: clients wait for their answer
    started_after: int  # requests started in [freeze, end of the loop)
    failed_after: int
    ttft_after_s: list[float]  # OK ones
    to_frozen_gateway: int | None  # patient clients only (see gateway_count)
    to_frozen_client: int
    last_to_frozen_s: float | None  # start of the last stuck request, after the freeze
    inflight_at_freeze: int  # on engine 0 when it froze (started before)
    failed_in_flight_at_freeze: int
    warm_ttft_s: list[float]
    verdict_s: float | None  # the frozen engine out for good: log "hung", else the polls
    slow_later: int  # first token >= STUCK_S but started after the verdict: not on it
    states: list[str]
    ready_again_s: float | None  # polls: READY with a new pid
    log_events: dict[str, float]  # seconds after the freeze, from the daemon's log
    gave_up: int | None
    errors: dict[str, int]

    def ttft(self, p: float) -> float:
        return pct(self.ttft_after_s, p)


def stuck(r: Result) -> bool:
    """No first token within STUCK_S: it sat on the frozen engine until the verdict."""
    if r.ok:
        return r.ttft >= STUCK_S
    return r.events == 0 and r.total >= STUCK_S


def gateway_count(data: RunData) -> int | None:
    """Rises of engine 0's in-flight count from the freeze to the verdict.

    Exact with patient clients only: nothing on a frozen engine ends before the verdict,
    so the count only rises. When clients give up, a slot freed and taken again within
    one poll shows no change at all; None then.
    """
    if data.patience_s:
        return None
    ordered = sorted(data.samples, key=lambda x: x.t)
    # From the last poll before the SIGSTOP on, while engine 0 is still that process.
    first = max((i for i, x in enumerate(ordered) if x.t <= data.t_freeze), default=0)
    seq = [x for x in ordered[first:] if x.pid == data.frozen_pid]
    if not seq:
        return None
    rises, prev = 0, seq[0]
    for x in seq[1:]:
        if x.state not in SERVING:
            break  # the verdict: the gateway gives up what is on it
        rises += max(0, x.inflight - prev.inflight)
        prev = x
    return rises


def log_events(data: RunData) -> tuple[dict[str, float], int | None]:
    """Engine 0's first events after the freeze, seconds after it, from the log."""
    marks = {
        "first failed check": "health check failed (1/",
        "SUSPECT": "-> SUSPECT",
        "hung": "hung (",
        "STOPPING": "-> STOPPING",
        "READY again": "STARTING -> READY",
    }
    found: dict[str, float] = {}
    gave_up = None
    for m in LOG_LINE.finditer(data.log):
        when = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        rel = when - data.wall_freeze
        if rel < -0.5:
            continue  # the log's clock has ms: a line of the freeze's own ms may read early
        text = m.group(2)
        for name, needle in marks.items():
            if name not in found and needle in text:
                found[name] = rel
        g = re.search(r"gave up (\d+) request", text)
        if g and gave_up is None:
            gave_up = int(g.group(1))
    return found, gave_up


def summarize(side: str, rnd: int, tree: Tree, data: RunData) -> Summary:
    res = data.results
    after = [r for r in res if data.t_freeze <= r.start < data.deadline]
    at_freeze = [r for r in res if r.start < data.t_freeze < r.start + r.total]
    warm = [
        r.ttft
        for r in res
        if r.ok and r.start >= data.t_start + 1.0 and r.start + r.total < data.t_freeze
    ]
    states: list[str] = []
    out_s = ready_again = None
    for x in data.samples:
        if x.t < data.t_freeze:
            continue
        rel = x.t - data.t_freeze
        label = x.state if x.pid == data.frozen_pid or x.pid is None else f"{x.state} (new pid)"
        if not states or states[-1].split("@")[0] != label:
            states.append(f"{label}@{rel:.1f}s")
        if out_s is None and x.pid == data.frozen_pid and x.state not in SERVING:
            out_s = rel
        if ready_again is None and x.state == "READY" and x.pid not in (None, data.frozen_pid):
            ready_again = rel
    events, gave_up = log_events(data)
    verdict = events.get("hung", out_s)
    # Only a request that started while the frozen process could still be chosen went
    # to it; one slow to start later met a stall of this busy machine, not the engine.
    cut = data.t_freeze + (verdict if verdict is not None else float("inf"))
    to_frozen = [r for r in after if stuck(r) and r.start < cut]
    errors: dict[str, int] = {}
    for r in after:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return Summary(
        side=side,
        round=rnd,
        tree=tree.label,
        patience_s=data.patience_s,
        started_after=len(after),
        failed_after=sum(not r.ok for r in after),
        ttft_after_s=[r.ttft for r in after if r.ok],
        to_frozen_gateway=gateway_count(data),
        to_frozen_client=len(to_frozen),
        last_to_frozen_s=max((r.start - data.t_freeze for r in to_frozen), default=None),
        inflight_at_freeze=len(at_freeze),
        failed_in_flight_at_freeze=sum(not r.ok for r in at_freeze),
        warm_ttft_s=warm,
        verdict_s=verdict,
        slow_later=sum(stuck(r) and r.start >= cut for r in after),
        states=states,
        ready_again_s=ready_again,
        log_events=events,
        gave_up=gave_up,
        errors=errors,
    )


def secs(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def patience(p: float) -> str:
    return "patient" if not p else f"give up after {p:g} s"


def round_table(runs: Sequence[Summary]) -> Table:
    t = Table(
        [
            "run",
            "side",
            "clients",
            "started after freeze",
            "failed",
            "TTFT p50 / p99 / max (ms)",
            "to frozen: gateway / client",
            "last to it (s)",
            "SUSPECT (s)",
            "hung (s)",
            "READY again (s)",
            "engine 0 states seen (polls)",
        ]
    )
    for i, r in enumerate(runs, 1):
        t.add(
            i,
            r.side,
            patience(r.patience_s),
            r.started_after,
            r.failed_after,
            f"{ms(r.ttft(50))} / {ms(r.ttft(99))} / {ms(r.ttft(100))}",
            f"{'–' if r.to_frozen_gateway is None else r.to_frozen_gateway} / {r.to_frozen_client}",
            secs(r.last_to_frozen_s),
            secs(r.log_events.get("SUSPECT")),
            secs(r.log_events.get("hung")),
            secs(r.ready_again_s),
            " → ".join(r.states),
        )
    return t


def side_by_side(runs: Sequence[Summary], trees: dict[str, Tree]) -> Table:
    sides = ("before", "after")
    by = {s: [r for r in runs if r.side == s] for s in sides}
    t = Table(["", *(f"{s} ({trees[s].label})" for s in sides)])

    def each(fn: Any) -> list[str]:
        return [" / ".join(str(fn(r)) for r in by[s]) for s in sides]

    def pooled(p: float, attr: str) -> list[str]:
        return [ms(pct([x for r in by[s] for x in getattr(r, attr)], p)) for s in sides]

    t.add("requests started after the freeze (per run)", *each(lambda r: r.started_after))
    t.add("… failed", *each(lambda r: r.failed_after))
    t.add("TTFT p50 (ms), runs pooled", *pooled(50, "ttft_after_s"))
    t.add("TTFT p99 (ms), runs pooled", *pooled(99, "ttft_after_s"))
    t.add("TTFT p99 (ms), per run", *each(lambda r: ms(r.ttft(99))))
    t.add(
        f"went to the frozen engine: started before the verdict, first token ≥ "
        f"{STUCK_S:g} s or never (per run)",
        *each(lambda r: r.to_frozen_client),
    )
    if any(r.to_frozen_gateway is not None for r in runs):
        t.add(
            "went to the frozen engine: gateway count (per run)",
            *each(lambda r: "–" if r.to_frozen_gateway is None else r.to_frozen_gateway),
        )
    t.add(
        "the last of them started (s after the freeze)",
        *each(lambda r: secs(r.last_to_frozen_s)),
    )
    t.add(
        "first failed check, log (s after the freeze)",
        *each(lambda r: secs(r.log_events.get("first failed check"))),
    )
    t.add("SUSPECT, log (s)", *each(lambda r: secs(r.log_events.get("SUSPECT"))))
    t.add("declared hung, log (s)", *each(lambda r: secs(r.log_events.get("hung"))))
    t.add(
        f"first token ≥ {STUCK_S:g} s, started after the verdict (machine stalls)",
        *each(lambda r: r.slow_later),
    )
    t.add(
        "requests given up at the verdict (log)",
        *each(lambda r: "–" if r.gave_up is None else r.gave_up),
    )
    t.add("READY again, new pid (s)", *each(lambda r: secs(r.ready_again_s)))
    t.add(
        "requests in flight at the freeze (of them failed)",
        *each(lambda r: f"{r.inflight_at_freeze} ({r.failed_in_flight_at_freeze})"),
    )
    t.add("warm-up TTFT p50 (ms), runs pooled", *pooled(50, "warm_ttft_s"))
    t.add("warm-up TTFT p99 (ms), runs pooled", *pooled(99, "warm_ttft_s"))
    return t


def report(
    args: argparse.Namespace,
    quiet: Quiet,
    runs: Sequence[Summary],
    trees: dict[str, Tree],
    cfg: dict[str, Any],
) -> str:
    head = header("Frozen engine: SUSPECT vs before", module_argv("bench.frozen_engine"), quiet)
    h = cfg["health"]
    setup = (
        f"- load: {args.clients} closed-loop clients through the gateway, streamed "
        f"{args.tokens}-token completions; 2 fake engines at `--token-delay-ms "
        f"{args.token_delay_ms:g}`, on TCP ports; warm-up {args.warmup_s:g} s plus a phase "
        f"spread over one health interval (the same phases on both sides), then SIGSTOP "
        f"of engine 0's process (never SIGCONT) and {args.after_s:g} s more of the loop\n"
        f"- health: `interval_s = {h['interval_s']}`, `probe_timeout_s = "
        f"{h['probe_timeout_s']}`, `failures_to_restart = {h['failures_to_restart']}`; "
        f"restart `backoff_initial_s = {cfg['restart']['backoff_initial_s']}`; engine "
        f"`stop_timeout_s = {cfg['engine']['stop_timeout_s']}`\n"
        f"- before = `{trees['before'].label}` (a worktree of `{args.before}`), after = "
        f"`{trees['after'].label}`; run order: "
        f"{', '.join(f'{r.side} ({patience(r.patience_s)})' for r in runs)}\n"
        f"- went to the frozen engine (the gateway does not say which engine answered): a "
        f"request started after the freeze and before the verdict whose first token came "
        f"{STUCK_S:g} s or more after it started, or never (the live engine answers in "
        f"milliseconds; one on the frozen engine waits for the verdict, then is retried "
        f"elsewhere, or its client gives up); with patient clients also the *gateway "
        f"count*: the rises of engine 0's `inflight` in `/admin/status` (polled every "
        f"{POLL_S * 1000:.0f} ms) from the freeze to the verdict (nothing on a frozen "
        f"engine ends, so each rise is a request admitted to it)\n"
        f"- times are seconds after the SIGSTOP: SUSPECT, hung and the first failed check "
        f"from the daemon's log (ms stamps); READY again and states from the polls\n"
    )
    out = [head, setup]
    for p in args.patience_s:
        which = (
            "Patient clients (each waits for its answer)"
            if not p
            else f"Impatient clients (a client that gets no byte for {p:g} s gives up, closes "
            "the connection and sends its next request)"
        )
        out.append(f"{which}:\n")
        out.append(side_by_side([r for r in runs if r.patience_s == p], trees).markdown() + "\n")
    out.append("Each run:\n")
    out.append(round_table(runs).markdown() + "\n")
    errors: dict[str, int] = {}
    for r in runs:
        for k, v in r.errors.items():
            key = f"{r.side}, {patience(r.patience_s)}: {k}"
            errors[key] = errors.get(key, 0) + v
    if errors:
        et = Table(["side, clients: failure of a request started after the freeze", "requests"])
        for k, v in sorted(errors.items(), key=lambda kv: -kv[1]):
            et.add(k, v)
        out.append(et.markdown() + "\n")
    return "\n".join(out)


# ---------------------------------------------------------------------------- main


def order(rounds: int, patiences: Sequence[float]) -> list[tuple[str, float]]:
    """For each kind of client: before, after, after, before, ...: each side first as
    often as the other."""
    out: list[tuple[str, float]] = []
    for i in range(rounds):
        for p in patiences:
            sides = ("before", "after") if i % 2 == 0 else ("after", "before")
            out += [(side, p) for side in sides]
    return out


def run_all(args: argparse.Namespace, trees: dict[str, Tree]) -> tuple[list[Summary], Any]:
    runs: list[Summary] = []
    raw: list[dict[str, Any]] = []
    cfg: dict[str, Any] = {}
    seen: dict[tuple[str, float], int] = {}
    for i, (side, p) in enumerate(order(args.rounds, args.patience_s), 1):
        tree = trees[side]
        # When the first check after the freeze fails depends on where in the health
        # interval the freeze falls: spread it over the interval, the same for both sides.
        k = seen[side, p] = seen.get((side, p), -1) + 1
        phase = (k * GOLDEN % 1.0) * args.health_interval_s
        print(f"  run {i}: {side} ({tree.label}), {patience(p)} clients", flush=True)
        try:
            with start_daemon(tree, args) as (d, run_cfg):
                data = asyncio.run(scenario(d, args, p, args.warmup_s + phase))
        except RuntimeError as exc:
            if side == "after" and args.after is None:
                # Others edit this tree while it runs: a file caught half-edited.
                raise RuntimeError(
                    f"{exc}\n(the working tree; --after HEAD runs a commit)"
                ) from None
            raise
        cfg = run_cfg
        s = summarize(side, i, tree, data)
        runs.append(s)
        raw.append(
            {
                "side": side,
                "patience_s": p,
                "warmup_s": args.warmup_s + phase,
                "summary": {k: v for k, v in asdict(s).items() if not k.endswith("_s")}
                | {
                    "ttft_p50_ms": s.ttft(50) * 1000,
                    "ttft_p99_ms": s.ttft(99) * 1000,
                    "verdict_s": s.verdict_s,
                    "ready_again_s": s.ready_again_s,
                    "last_to_frozen_s": s.last_to_frozen_s,
                },
                # Every request: start (s after the freeze), TTFT, total, ok.
                "requests": [
                    [round(r.start - data.t_freeze, 4), round(r.ttft, 4), round(r.total, 4), r.ok]
                    for r in data.results
                ],
                "engine0_polls": [
                    [round(x.t - data.t_freeze, 3), x.state, x.pid, x.inflight]
                    for x in data.samples
                ],
            }
        )
        print(
            f"    {s.started_after} started after the freeze, {s.failed_after} failed; TTFT "
            f"p50 {ms(s.ttft(50))} ms, p99 {ms(s.ttft(99))} ms; to the frozen engine "
            f"{'–' if s.to_frozen_gateway is None else s.to_frozen_gateway} (gateway) / "
            f"{s.to_frozen_client} (client); "
            f"SUSPECT {secs(s.log_events.get('SUSPECT'))} s, hung "
            f"{secs(s.log_events.get('hung'))} s",
            flush=True,
        )
    return runs, {"config": cfg, "runs": raw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", default=BEFORE_REF, help="the ref without SUSPECT")
    ap.add_argument(
        "--after", default=None, help="a ref for the after side (default: this working tree)"
    )
    ap.add_argument("--rounds", type=int, default=2, help="runs of each side, each kind of client")
    ap.add_argument(
        "--patience-s",
        default="0,2",
        help="kinds of client, comma-separated: 0 = waits for its answer; P = gives up "
        "after P s without a byte (first token or next) and sends its next request",
    )
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--token-delay-ms", type=float, default=5.0)
    ap.add_argument("--warmup-s", type=float, default=4.0)
    ap.add_argument("--after-s", type=float, default=25.0, help="the loop after the freeze")
    ap.add_argument("--drain-s", type=float, default=20.0, help="then wait for the last ones")
    ap.add_argument("--health-interval-s", type=float, default=1.0)
    ap.add_argument("--probe-timeout-s", type=float, default=3.0)
    ap.add_argument("--failures-to-restart", type=int, default=3)
    ap.add_argument("--quiet-wait-s", type=float, default=30.0, help="at most, for a quiet box")
    ap.add_argument("--keep", action="store_true", help="keep each daemon's files")
    ap.add_argument("--out", type=Path, help="write every figure and request as JSON here")
    args = ap.parse_args()
    try:
        args.patience_s = [float(x) for x in args.patience_s.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--patience-s: numbers, comma-separated, not {args.patience_s!r}")
    if not args.patience_s or any(p < 0 for p in args.patience_s):
        ap.error("--patience-s: at least one value, none negative")
    t0 = time.monotonic()
    quiet = wait_for_quiet(args.quiet_wait_s)
    quiet.start_watching()
    with contextlib.ExitStack() as stack:
        before_path = stack.enter_context(worktree(prefix="frozen-engine-", ref=args.before))
        after_path = (
            REPO
            if args.after is None
            else stack.enter_context(worktree(prefix="frozen-engine-", ref=args.after))
        )
        trees = {
            "before": make_tree("before", before_path, args.before),
            "after": make_tree("after", after_path, args.after),
        }
        runs, raw = run_all(args, trees)
    quiet.stop_watching()
    print()
    text = report(args, quiet, runs, trees, raw["config"])
    print(text)
    print(f"(took {time.monotonic() - t0:.0f} s)")
    if args.out:
        raw["trees"] = {k: {"label": v.label, "has_listen": v.has_listen} for k, v in trees.items()}
        raw["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.out.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
