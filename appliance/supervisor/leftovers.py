"""What a previous life of this appliance left running, found and stopped at start.

Engines get a parent-death signal (see ``process.py``), so they normally go with their
supervisor. What can still be left: engines of an older version (no such signal), a
tree whose API server could not act on SIGTERM (hung, stopped), children that escaped
it. Outside systemd (``./scripts/run``, tmux, a container without init) nothing else
would end them: a new life would start its engines beside them (unix sockets: the GPU
memory is taken) or fail to bind their ports (tcp) and loop in crash restarts.

Whose a process is, is decided by :func:`is_leftover` from what the process shows
(uid, the appliance's variables in its environment, its command line, whether the
supervisor that started it still runs) and who we are. Conservative by design: a
process of another user, another appliance instance, or without our tag, or one whose
supervisor still runs, is never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import psutil

from appliance import proctree
from appliance.engine import INSTANCE_ENV, SUPERVISOR_ENV, EngineSpec
from appliance.supervisor.process import EngineProcess
from appliance.telemetry import GpuReading, TelemetrySource

log = logging.getLogger("appliance.supervisor")

# Leftovers have no clients and nothing to finish: SIGTERM, this long, then SIGKILL.
LEFTOVER_GRACE_S = 2.0
# The tag older versions gave an engine: an 8-hex boot id and the engine's index.
_OLD_TAG = re.compile(r"[0-9a-f]{8}-[0-9]+")
_VARS = (proctree.TAG_ENV, INSTANCE_ENV, SUPERVISOR_ENV)


@dataclass(frozen=True)
class Ours:
    """Who we are, as a leftover of ours would show it."""

    uid: int
    instance: str
    ports: frozenset[int] = frozenset()  # engine TCP ports (engine.listen = "tcp")
    sockets: frozenset[str] = frozenset()  # engine socket paths (engine.listen = "unix")
    models: frozenset[str] = frozenset()  # served model names


@dataclass(frozen=True)
class Candidate:
    """What one process shows of itself."""

    pid: int
    uid: int
    env: Mapping[str, str]  # the appliance's variables only
    argv: tuple[str, ...] = ()
    supervised: bool = False  # the supervisor that started it still runs
    created: float = 0.0


def is_leftover(proc: Candidate, ours: Ours) -> bool:
    """Whether ``proc`` is an engine process a previous life of this appliance left.

    - Another uid, no tag, or a supervisor that still runs: never.
    - With an instance (this version on): ours exactly when the instance is ours.
    - A tag only (older versions): ours only if the tag has the old form and its
      command line names one of our engines' addresses (TCP port, or socket path) and
      one of our served models: an orphan of this user's appliance serving our model
      where our engine must listen. Outside systemd the socket directory was a new
      temporary one each life: such an orphan is not matched (it holds no address of
      ours; on a GPU its memory is what keeps it in the way).
    """
    if proc.uid != ours.uid or proctree.TAG_ENV not in proc.env or proc.supervised:
        return False
    instance = proc.env.get(INSTANCE_ENV)
    if instance is not None:
        return instance == ours.instance
    if not _OLD_TAG.fullmatch(proc.env[proctree.TAG_ENV]):
        return False
    at_our_address = (
        _option(proc.argv, "--port") in {str(p) for p in ours.ports}
        or _option(proc.argv, "--uds") in ours.sockets
    )
    return at_our_address and _option(proc.argv, "--served-model-name") in ours.models


def _option(argv: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in a command line (``--x V`` or ``--x=V``), else None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def ours_from(specs: Iterable[EngineSpec], instance: str) -> Ours:
    specs = list(specs)
    return Ours(
        uid=os.getuid(),
        instance=instance,
        ports=frozenset(s.address.port for s in specs if s.address.port is not None),
        sockets=frozenset(str(s.address.uds) for s in specs if s.address.uds is not None),
        models=frozenset(s.served_model_name for s in specs if s.served_model_name),
    )


def _alive(pid: int, created: str) -> bool:
    """Whether process ``pid`` runs and started at ``created`` (lineage_env's format)."""
    try:
        return f"{psutil.Process(pid).create_time():.2f}" == created
    except psutil.Error:
        return False


def _supervised(proc: psutil.Process, env: Mapping[str, str]) -> bool:
    """Whether the supervisor that started ``proc`` still runs. Older versions did not
    say which one it was: then any ancestor that looks like ``llm-appliance serve``."""
    said = env.get(SUPERVISOR_ENV)
    if said is not None:
        pid, _, created = said.partition("@")
        return pid.isdigit() and _alive(int(pid), created)
    with contextlib.suppress(psutil.Error):
        for parent in proc.parents():
            line = parent.cmdline()
            if "serve" in line and any("appliance" in arg for arg in line):
                return True
    return False


def _candidate(proc: psutil.Process) -> Candidate | None:
    try:
        env = proc.environ()  # another user's: AccessDenied, unless we are root
        if proctree.TAG_ENV not in env:
            return None
        mine = {k: env[k] for k in _VARS if k in env}
        return Candidate(
            pid=proc.pid,
            uid=proc.uids().real,
            env=mine,
            argv=tuple(proc.cmdline()),
            supervised=_supervised(proc, mine),
            created=proc.create_time(),
        )
    except (psutil.Error, OSError):
        return None


def find(ours: Ours) -> list[Candidate]:
    """Every live process a previous life of ours left (blocking: reads /proc)."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        cand = _candidate(proc)
        if cand is not None and is_leftover(cand, ours):
            found.append(cand)
    return found


def stop(found: Sequence[Candidate], grace_s: float = LEFTOVER_GRACE_S) -> tuple[list[str], int]:
    """Stop each leftover's whole tree as an engine's is stopped (process group,
    descendants; SIGTERM, ``grace_s``, SIGKILL): each process stopped, described for
    the journal (``pid 123 (python3, engine tag 1a2b3c4d-0)``), and how many survived
    SIGKILL. Blocking: run it in a thread."""
    by_tag: dict[str, list[Candidate]] = {}
    for cand in found:
        by_tag.setdefault(cand.env[proctree.TAG_ENV], []).append(cand)
    named: list[str] = []
    left = 0
    for tag, procs in by_tag.items():
        # The group leader is the API server as a supervisor starts one: its own session.
        leaders = [c.pid for c in procs if _leads_group(c.pid)]
        root = leaders[0] if leaders else None
        known = {c.pid: c.created for c in procs}
        # Not by tag (None): another appliance's engine may carry the same one; the
        # leftovers found, their process group and descendants are the tree.
        for proc in proctree.find_tree(None, root, known):
            with contextlib.suppress(psutil.Error):
                named.append(f"pid {proc.pid} ({proc.name()}, engine tag {tag})")
        left += proctree.kill_tree(None, root, grace_s, known).left
    return named, left


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


async def sweep(
    processes: Sequence[EngineProcess],
    instance: str,
    source: TelemetrySource,
    stopping: Callable[[], bool],
) -> list[Candidate]:
    """Find and stop what a previous life left, then wait, as after an engine stop, for
    our engines' ports and GPU memory to be free; one journal line names the pids."""
    found = await asyncio.to_thread(find, ours_from((p.spec for p in processes), instance))
    if not found:
        return []
    named, left = await asyncio.to_thread(stop, found)
    poll_s = 0.5

    def readings(gpus: Sequence[int]) -> list[GpuReading | None]:
        now = {r.index: r for r in source.read()}  # never raises (TelemetrySource.read)
        return [now.get(g) for g in gpus]

    await asyncio.gather(
        *(
            p.wait_resources_free(functools.partial(readings, p.spec.gpus), stopping, poll_s)
            for p in processes
        )
    )
    log.warning(
        "stopped %d engine process(es) a previous run of this appliance left behind "
        "(its supervisor died without stopping them): %s%s",
        len(named),
        ", ".join(named),
        f"; {left} survived SIGKILL" if left else "",
    )
    return found
