"""Shared pieces of the benchmarks: a quiet machine, a daemon with fake engines, a load
generator, percentiles and tables.

Everything runs on loopback. The daemon is a real ``llm-appliance serve`` process
(started by ``tests.fakes.appliance_proc.run_appliance``) whose engines are the fast
fake engine. A client can go straight to an engine, bypassing the gateway, for the
"direct" side of a comparison: the engine's per-spawn key is read from its environment
(``VLLM_API_KEY`` in ``/proc/<engine pid>/environ``, readable by the same user), and
:meth:`Daemon.engine_address` says where it listens (its Unix socket in the daemon's
runtime directory, or ``127.0.0.1:port_base+i`` with ``engine.listen = "tcp"``);
``client_session(address)`` opens a session whose connector reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import psutil

from appliance.endpoint import EngineAddress
from tests.fakes.appliance_proc import (
    REPO,
    Appliance,
    fake_engine_config,
    get_json,
    run_appliance,
)

MODEL = "bench-model"
SSE_DATA = b"data: "
DONE = b"data: [DONE]"
ERROR_MARK = b'"error"'


# ---------------------------------------------------------------------------- machine


@dataclass
class Quiet:
    quiet: bool
    waited_s: float
    others: list[str]
    loadavg_before: tuple[float, float, float]
    busy_at_start: float = 0.0  # share of all CPUs busy just before the run
    polls: int = 0  # during the run: 1-s polls of `pgrep -f vllm`
    busy_polls: int = 0  # ... that found a vLLM process
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _cpu0: Any = None
    _busy_run: float | None = None

    def start_watching(self) -> None:
        """Poll for vLLM every second until stop_watching(), to say whether the run was quiet."""

        self._cpu0 = psutil.cpu_times()

        def loop() -> None:
            while not self._stop.wait(1.0):
                self.polls += 1
                if vllm_processes():
                    self.busy_polls += 1

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop_watching(self) -> None:
        if self._cpu0 is not None and self._busy_run is None:
            t0, t1 = self._cpu0, psutil.cpu_times()
            total = sum(t1) - sum(t0)
            idle = (t1.idle - t0.idle) + (getattr(t1, "iowait", 0) - getattr(t0, "iowait", 0))
            self._busy_run = (total - idle) / total if total > 0 else None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    @property
    def quiet_throughout(self) -> bool:
        return self.quiet and self.busy_polls == 0

    def describe(self) -> str:
        la = ", ".join(f"{x:.2f}" for x in self.loadavg_before)
        if self.quiet:
            extra = f" after waiting {self.waited_s:.0f} s" if self.waited_s >= 1 else ""
            start = (
                f"quiet at start (no vLLM process running{extra}; CPUs "
                f"{self.busy_at_start:.0%} busy; load average {la})"
            )
        else:
            start = (
                f"NOT quiet at start: {len(self.others)} vLLM process(es) still running after "
                f"{self.waited_s:.0f} s of waiting (CPUs {self.busy_at_start:.0%} busy; "
                f"load average {la})"
            )
        if self.polls:
            if self.busy_polls == 0:
                during = f"no vLLM process seen during the run ({self.polls} polls, 1 s apart)"
            else:
                during = (
                    f"**vLLM was running during {self.busy_polls} of {self.polls} one-second "
                    "polls of the run: figures disturbed**"
                )
            if self._busy_run is not None:
                during += f"; all CPUs {self._busy_run:.0%} busy on average during the run"
            return f"{start}; {during}"
        return start


def vllm_processes() -> list[str]:
    """Other processes whose command line mentions vllm (`pgrep -f vllm`), not ours."""
    try:
        out = subprocess.run(
            ["pgrep", "-af", "vllm"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    # Ours: this process, its parent, and what it started (--router runs vllm-router).
    mine = {os.getpid(), os.getppid()}
    with contextlib.suppress(psutil.Error):
        mine |= {c.pid for c in psutil.Process().children(recursive=True)}
    lines = []
    for line in out.splitlines():
        pid, _, cmd = line.partition(" ")
        if pid.isdigit() and int(pid) not in mine:
            lines.append(f"{pid} {cmd[:100]}")
    return lines


def machine_busy(sample_s: float = 2.0) -> float:
    """Share of all CPUs busy (every process) over ``sample_s`` seconds."""
    return float(psutil.cpu_percent(interval=sample_s)) / 100.0


def wait_for_quiet(max_wait_s: float = 600.0, poll_s: float = 30.0, busy_max: float = 0.4) -> Quiet:
    """Wait (polling every ``poll_s``) until no vLLM runs on the box and the CPUs are
    mostly idle (< ``busy_max`` over 2 s), up to ``max_wait_s``."""
    start = time.monotonic()
    others = vllm_processes()
    busy = machine_busy()
    while (others or busy > busy_max) and time.monotonic() - start < max_wait_s:
        print(
            f"  waiting for a quiet machine: {len(others)} vLLM process(es) running, "
            f"CPUs {busy:.0%} busy ({time.monotonic() - start:.0f} s so far)",
            flush=True,
        )
        time.sleep(poll_s)
        others = vllm_processes()
        busy = machine_busy()
    waited = time.monotonic() - start
    if others or busy > busy_max:
        print(f"  machine still busy after {waited:.0f} s; measuring anyway (noted)", flush=True)
    q = Quiet(not others, waited, others, os.getloadavg())
    q.busy_at_start = busy
    return q


def machine_line() -> str:
    return (
        f"{os.cpu_count()} CPU(s) ({platform.processor() or platform.machine()}), "
        f"Python {platform.python_version()}, aiohttp {aiohttp.__version__}"
    )


# ---------------------------------------------------------------------------- daemon


@dataclass
class Daemon:
    app: Appliance
    tmp: Path
    admin_key: str

    @property
    def url(self) -> str:
        return self.app.url

    @property
    def pid(self) -> int:
        return self.app.proc.pid

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def status(self) -> dict[str, Any]:
        code, body = get_json(self.url + "/admin/status", headers=self.auth)
        if code != 200:
            raise RuntimeError(f"/admin/status answered {code}: {body}")
        return body  # type: ignore[no-any-return]

    def engine_pid(self, i: int) -> int:
        pid = self.status()["engines"][i]["pid"]
        if not pid:
            raise RuntimeError(f"engine {i} has no pid")
        return int(pid)

    @property
    def listen(self) -> str:
        """How its engines listen: "unix" or "tcp" (``engine.listen``)."""
        return "tcp" if self.app.over_tcp else "unix"

    def engine_address(self, i: int) -> EngineAddress:
        """Where engine i listens; open a session to it with ``client_session(address)``."""
        if self.app.over_tcp:
            return EngineAddress(port=self.app.engine_port(i))
        return EngineAddress(uds=self.app.engine_socket(i))

    def engine_url(self, i: int) -> str:
        """Engine i's base URL, for a session from ``client_session(engine_address(i))``
        (over a Unix socket the URL names no socket: the session's connector does)."""
        return self.engine_address(i).base_url

    def engine_key(self, i: int) -> str:
        return engine_key_of(self.engine_pid(i))

    def wait_engines_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):
                if all(e["state"] == "READY" for e in self.status()["engines"]):
                    return
            time.sleep(0.05)
        raise RuntimeError("engines not all READY in time:\n" + self.app.log()[-3000:])


def engine_key_of(pid: int) -> str:
    """The engine's per-spawn key, from its environment (``VLLM_API_KEY``).

    The supervisor hands it over there, not on the command line any local user can
    read; ``/proc/<pid>/environ`` is readable by the engine's own user and root only.
    """
    try:
        return str(psutil.Process(pid).environ()["VLLM_API_KEY"])
    except KeyError:
        raise RuntimeError(f"no VLLM_API_KEY in the environment of engine pid {pid}") from None


@contextlib.contextmanager
def daemon(
    engines: int,
    fake_args: Sequence[str],
    keep: bool = False,
    env: dict[str, str] | None = None,
    tree: Path = REPO,
    **overrides: dict[str, Any],
) -> Iterator[Daemon]:
    """A running daemon with ``engines`` fake engines, READY, and its admin key.

    ``env`` is added to the daemon's environment (engines inherit it). Engines listen
    as ``engine={"listen": ...}`` says (the appliance's default: Unix sockets). ``tree``:
    whose daemon code runs (the fake engine is always this tree's).
    """
    tmp = Path(tempfile.mkdtemp(prefix="llm-appliance-bench-"))
    # Each daemon its own runtime directory, even when this shell has one (two daemons
    # at once would otherwise put their engine sockets at the same paths).
    env = {"RUNTIME_DIRECTORY": str(tmp / "run"), **(env or {})}
    try:
        engine_over = {"served_model_name": MODEL, **overrides.pop("engine", {})}
        cfg = fake_engine_config(tmp, engines, *fake_args, engine=engine_over, **overrides)
        with run_appliance(tmp, cfg, env=env, tree=tree) as app:
            app.wait_ready(timeout=60)
            key = (tmp / "admin.key").read_text().strip()
            d = Daemon(app, tmp, key)
            d.wait_engines_ready()
            yield d
    finally:
        if keep:
            print(f"  (daemon files kept in {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- client


@dataclass(slots=True)
class Result:
    ok: bool
    start: float  # monotonic
    ttft: float  # seconds to the first data event (streams) or to the body (others)
    total: float
    events: int  # SSE data events received (token chunks, final chunk, [DONE])
    stream: bool = True
    status: int = 0
    error: str = ""
    target: int = -1  # which engine (direct) or -1 (gateway)


# What a stream of each route ends with when it ends well (chat and completions: OpenAI's
# [DONE]; Responses: its completed event; Messages: message_stop).
STREAM_ENDS = {
    "completions": DONE,
    "chat": DONE,
    "responses": b"event: response.completed",
    "messages": b"event: message_stop",
}


def route_stream(route: str, tokens: int, prompt: str = "hello there") -> tuple[str, bytes]:
    """(path, body) of a stream of ``tokens`` tokens on ``route`` (STREAM_ENDS' keys)."""
    chat = [{"role": "user", "content": prompt}]
    path, fields = {
        "completions": ("/v1/completions", {"prompt": prompt, "max_tokens": tokens}),
        "chat": ("/v1/chat/completions", {"messages": chat, "max_tokens": tokens}),
        "responses": ("/v1/responses", {"input": prompt, "max_output_tokens": tokens}),
        "messages": ("/v1/messages", {"messages": chat, "max_tokens": tokens}),
    }[route]
    return path, json.dumps({"model": MODEL, "stream": True, **fields}).encode()


def completion_body(max_tokens: int, stream: bool, prompt: str = "hello there") -> bytes:
    return json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    ).encode()


def client_session(
    address: EngineAddress | None = None, total_s: float = 120.0
) -> aiohttp.ClientSession:
    """A client session over TCP (the gateway), or one that reaches the engine at
    ``address`` however it listens (a Unix socket: every request goes to that socket).
    ``total_s``: the longest one request may take (a queued stream on a slow CPU engine
    can take minutes)."""
    # limit=0: aiohttp's default of 100 connections would queue streams beyond 100.
    # A TCP engine is the benchmark's own, measured directly: no owner to check it with.
    connector = (
        aiohttp.TCPConnector(limit=0, force_close=False)
        if address is None or address.port is not None
        else address.connector(None, limit=0, force_close=False)
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=total_s, sock_connect=10),
        trust_env=False,
        auto_decompress=False,
    )


async def request(
    session: aiohttp.ClientSession,
    base_url: str,
    key: str,
    body: bytes,
    stream: bool,
    target: int = -1,
    path: str = "/v1/completions",
    done_mark: bytes = DONE,
) -> Result:
    """One request (/v1/completions unless ``path`` says another route); a stream is OK
    only if it ends with ``done_mark`` (STREAM_ENDS) and no error."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    t0 = time.monotonic()
    ttft = 0.0
    events = 0
    try:
        async with session.post(base_url + path, data=body, headers=headers) as resp:
            if resp.status != 200 or not stream:
                data = await resp.read()
                now = time.monotonic()
                ok = resp.status == 200 and b'"choices"' in data
                err = "" if ok else f"{resp.status} {data[:120]!r}"
                return Result(ok, t0, now - t0, now - t0, 0, stream, resp.status, err, target)
            done = bad = False
            async for chunk in resp.content.iter_any():
                n = chunk.count(SSE_DATA)
                if n and not events:
                    ttft = time.monotonic() - t0
                events += n
                if ERROR_MARK in chunk:
                    bad = True
                if done_mark in chunk:
                    done = True
            now = time.monotonic()
            ok = done and not bad
            err = "" if ok else ("error event" if bad else "stream ended without [DONE]")
            return Result(ok, t0, ttft, now - t0, events, stream, resp.status, err, target)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        now = time.monotonic()
        return Result(False, t0, ttft, now - t0, events, stream, 0, type(exc).__name__, target)


R = TypeVar("R")  # what one request gives: a Result, or a benchmark's own record


async def closed_loop(
    concurrency: int, duration_s: float, one: Callable[[int], Awaitable[R]]
) -> tuple[list[R], float]:
    """``concurrency`` workers, each issuing requests back to back until the deadline.

    Returns every result and the wall time from start until the last request ended.
    """
    results: list[R] = []
    t0 = time.monotonic()
    deadline = t0 + duration_s

    async def worker(w: int) -> None:
        while time.monotonic() < deadline:
            results.append(await one(w))

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return results, time.monotonic() - t0


# ---------------------------------------------------------------------------- figures


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100), linear between closest ranks; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(x: float) -> str:
    return "–" if x != x else f"{x * 1000:.2f}"


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        widths = [
            max(len(h), *(len(r[i]) for r in self.rows)) if self.rows else len(h)
            for i, h in enumerate(self.headers)
        ]
        line = "| " + " | ".join(h.ljust(w) for h, w in zip(self.headers, widths, strict=True))
        sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        out = [line + " |", sep]
        for r in self.rows:
            out.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
        return "\n".join(out)


def header(title: str, argv: Sequence[str], quiet: Quiet) -> str:
    cmd = ".venv/bin/python -m " + " ".join([argv[0], *argv[1:]])
    return (
        f"## {title}\n\n"
        f"- command: `{cmd}`\n"
        f"- machine: {machine_line()}\n"
        f"- noise: {quiet.describe()}\n"
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
    )


def module_argv(module: str) -> list[str]:
    return [module, *sys.argv[1:]]


# ---------------------------------------------------------------------------- timelines


class StatePoller:
    """Engine states over a run, from ``/admin/status`` every ``every_s``, for a timeline.

    ``samples()`` gives ``{"t": [...], "engines": [[state of engine i at each t], ...],
    "restarts": [{"at_s", "engine", "reason"}]}``; a poll that failed (the daemon busy,
    a key being replaced) records ``None`` for every engine rather than guessing.
    A restart is a rise of an engine's ``restarts`` counter between two polls.
    """

    def __init__(self, url: str, headers: dict[str, str], t0: float, every_s: float) -> None:
        self.url = url
        self.headers = headers
        self.t0 = t0
        self.every_s = every_s
        self.t: list[float] = []
        self.states: list[list[str | None]] = []
        self.restarts: list[dict[str, Any]] = []
        self._last: dict[int, tuple[int, dict[str, int]]] = {}

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.poll(session)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)

    async def poll(self, session: aiohttp.ClientSession) -> None:
        now = time.monotonic() - self.t0
        try:
            async with session.get(
                self.url + "/admin/status",
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=2),
            ) as r:
                engines = (await r.json())["engines"] if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            engines = None
        self.t.append(round(now, 3))
        if engines is None:
            self.states.append([None] * len(self.states[-1] if self.states else []))
            return
        self.states.append([str(e["state"]) for e in engines])
        for i, e in enumerate(engines):
            count, by_reason = int(e.get("restarts") or 0), dict(e.get("restarts_by_reason") or {})
            before = self._last.get(i)
            if before is not None and count > before[0]:
                rose = [k for k, v in by_reason.items() if v > before[1].get(k, 0)]
                reason = ",".join(rose) or "?"
                self.restarts.append({"at_s": round(now, 3), "engine": i, "reason": reason})
            self._last[i] = (count, by_reason)

    def samples(self) -> dict[str, Any]:
        n = max((len(s) for s in self.states), default=0)
        engines = [[s[i] if i < len(s) else None for s in self.states] for i in range(n)]
        return {"t": self.t, "engines": engines, "restarts": self.restarts}


def per_bin(times: Sequence[float], duration_s: float, bin_s: float = 1.0) -> list[int]:
    """How many of ``times`` (seconds since the start) fall in each ``bin_s`` bin."""
    counts = [0] * max(1, int(duration_s / bin_s) + 1)
    for t in times:
        if t >= 0:
            counts[min(len(counts) - 1, int(t / bin_s))] += 1
    return counts


def p99_per_bin(
    points: Sequence[tuple[float, float]], duration_s: float, bin_s: float = 1.0
) -> list[float | None]:
    """p99 latency (ms) of the (end time, latency s) points in each bin; None when empty."""
    groups: list[list[float]] = [[] for _ in per_bin([], duration_s, bin_s)]
    for t, lat in points:
        if t >= 0:
            groups[min(len(groups) - 1, int(t / bin_s))].append(lat)
    return [round(pct(g, 99) * 1000, 2) if g else None for g in groups]


def write_plot(
    chart: Callable[[dict[str, Any], Path], None], data: dict[str, Any], path: str
) -> None:
    """Draw ``chart`` of ``data`` into ``path`` (PNG), or say in one line why not.

    matplotlib is a bench-only extra (`pip install -e '.[bench]'`): without it the bench
    still prints its tables and writes its JSON."""
    if not path:
        return
    try:
        chart(data, Path(path))
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("matplotlib"):
            raise
        print(f"(no PNG written to {path}: matplotlib is not installed; pip install '.[bench]')")
        return
    print(f"(chart written to {path})")


def plot_path(plot: str, json_path: str | None) -> str:
    """Where the chart goes: ``--plot``, else next to the JSON (``x.json`` → ``x.png``)."""
    if plot or not json_path:
        return plot
    return str(Path(json_path).with_suffix(".png"))
