"""py-spy helpers: record a process for a few seconds and summarise where its CPU went.

``py-spy record --format raw --nolineno`` writes one collapsed stack per line
(``frame;frame;...;leaf count``, each frame ``function (file)``); only on-CPU samples
are asked for (no ``--idle``), and samples whose leaf is the event loop's
``epoll_wait`` are dropped as idle too (py-spy does not always tell), so the shares below
are shares of the process's CPU time in Python code. (Under uvloop the loop's C code has
no Python frame: those samples are dropped with the idle ones.)
"""

from __future__ import annotations

import asyncio
import collections
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench._common import Table

# Leaves that mean "waiting in epoll": asyncio's selector; with uvloop the whole loop is C
# code under Runner.run, so there the leaf stands for idle time and uvloop's own work.
IDLE_LEAVES = ("EpollSelector.select (selectors.py)", "Runner.run (asyncio/runners.py)")
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*)\)$")


def py_spy() -> str | None:
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


async def record(pid: int, seconds: float, out: Path, rate: int = 200) -> str:
    """Record ``pid`` for ``seconds``; returns py-spy's last output line."""
    exe = py_spy()
    if exe is None:
        return "py-spy not installed (.venv/bin/pip install py-spy)"
    proc = await asyncio.create_subprocess_exec(
        exe,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(1, round(seconds))),
        "--rate",
        str(rate),
        "--nonblocking",
        "--nolineno",
        "--format",
        "raw",
        "-o",
        str(out),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    text, _ = await proc.communicate()
    lines = [x for x in text.decode(errors="replace").splitlines() if x.strip()]
    return lines[-2] if len(lines) >= 2 else (lines[-1] if lines else "")


def short_file(path: str) -> str:
    for marker in ("site-packages/", "/work/main/", "lib/python3.11/", "lib/python3.12/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


@dataclass
class Profile:
    total: int
    self_counts: collections.Counter[str]
    incl_counts: collections.Counter[str]
    file_self: collections.Counter[str]
    idle: int = 0  # samples waiting in epoll, left out of the shares

    def share(self, n: int) -> str:
        return f"{100.0 * n / self.total:.1f} %" if self.total else "–"


def parse(path: Path) -> Profile:
    self_c: collections.Counter[str] = collections.Counter()
    incl_c: collections.Counter[str] = collections.Counter()
    file_c: collections.Counter[str] = collections.Counter()
    total = idle = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        names = []
        leaf_file = ""
        for raw in stack.split(";"):
            m = FRAME.match(raw)
            if m is None:
                continue  # process / thread pseudo-frames
            leaf_file = short_file(m["file"])
            names.append(f"{m['func']} ({leaf_file})")
        if not names:
            continue
        if names[-1] in IDLE_LEAVES:
            idle += n  # py-spy does not always see a thread blocked in epoll as idle
            continue
        total += n
        self_c[names[-1]] += n
        file_c[leaf_file] += n
        for name in set(names):
            incl_c[name] += n
    return Profile(total, self_c, incl_c, file_c, idle)


def category(file: str) -> str:
    if file.startswith("appliance/"):
        return f"appliance: {file}"
    if file.startswith("aiohttp/"):
        return "aiohttp (HTTP parse/serialise, streams, client and server)"
    if file.startswith(("asyncio/", "selectors.py")):
        return "asyncio event loop (scheduling, selector, transports)"
    if file.startswith("prometheus_client/"):
        return "prometheus_client"
    if file.startswith(("multidict/", "yarl/", "propcache/")):
        return "multidict / yarl (headers, URLs)"
    return "other: " + file.split("/")[0]


def tables(p: Profile, top: int = 15) -> tuple[Table, Table, Table]:
    cats: collections.Counter[str] = collections.Counter()
    for f, n in p.file_self.items():
        cats[category(f)] += n
    by_cat = Table(["where the CPU samples end (self time, grouped)", "share"])
    for name, n in cats.most_common(12):
        by_cat.add(name, p.share(n))
    by_self = Table(["function (self time)", "share"])
    for name, n in p.self_counts.most_common(top):
        by_self.add(f"`{name}`", p.share(n))
    by_incl = Table(["function (inclusive time)", "share"])
    for name, n in p.incl_counts.most_common(top + 10):
        by_incl.add(f"`{name}`", p.share(n))
    return by_cat, by_self, by_incl
