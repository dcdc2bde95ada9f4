"""The chaos soak's faults outside the happy path (issue #21): the supervisor SIGKILLed
and started again, the state disk full for a minute, an engine killed by the kernel's
OOM killer.

Each fault acts as an operator's box would see it, never through a test seam:

- **supervisor SIGKILL**: ``serve`` gets SIGKILL mid-load, then the same command line,
  environment and config are started again. Requests on the dead daemon end for their
  clients as connection errors (class ``on_killed_supervisor``, see
  :func:`connection_error_class`); after the new life is up, the processes of the old
  one still alive are counted (0: engines die with their supervisor, and the new one's
  sweep stops and names what did not) and a request must be answered.
- **disk full**: the state directory is a small tmpfs of its own (root only; otherwise
  the fault is skipped, saying why), filled to the last byte for a minute, then freed.
  Checked after (:func:`state_file_problems`, :func:`usage_kept`): usage.json is JSON,
  audit.log is whole JSON lines, keys.json is byte for byte what it was, and the tokens
  counted while the disk was full are in usage.json once it is written again.
- **engine OOM**: the engine's process tree moves into a child memory cgroup (v2
  ``memory.max``, else v1 ``memory.limit_in_bytes``) whose limit is then squeezed to
  what the tree uses, so its next allocation meets the kernel's OOM killer (the fake
  engine is also asked to allocate; real vLLM allocates by itself under load). Where no
  memory cgroup can be written the engine gets SIGKILL instead, and the record says so:
  its cause is then ``signal``, not ``oom``.

Each fault gives a :class:`FaultRecord`: its window, the exit cause the daemon named,
processes left, files damaged, and notes; ``bench.soak`` adds what requests did in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.soak_box import MIB, MemCage, StateDisk, make_cage, squeeze, tree_of
from bench.soak_checks import metric_sum, usage_kept, usage_total
from tests.fakes.appliance_proc import Appliance, alive, engine_count, get_json


@dataclass
class FaultRecord:
    """One fault as the report shows it; None where it does not apply."""

    fault: str
    at_s: float
    until_s: float | None = None
    exit_cause: str | None = None
    processes_left: int | None = None
    files_damaged: int | None = None
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=dict)  # filled in by bench.soak


# ---- the daemon, as an admin reaches it ----------------------------------------------


def admin_text(app: Appliance, admin: str, path: str) -> str:
    req = urllib.request.Request(app.url + path, headers={"Authorization": f"Bearer {admin}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return str(r.read().decode())
    except (OSError, ValueError):
        return ""


def admin_post(app: Appliance, admin: str, path: str, body: Any) -> int | None:
    req = urllib.request.Request(
        app.url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


def engine_view(app: Appliance, admin: str, i: int) -> dict[str, Any]:
    code, body = get_json(app.url + "/admin/status", headers={"Authorization": f"Bearer {admin}"})
    if code != 200 or not isinstance(body, dict):
        return {}
    return dict(body["engines"][i])


async def wait_until(cond: Callable[[], bool], timeout_s: float, every_s: float = 0.25) -> bool:
    """Whether ``cond`` (blocking, run in a thread) came true within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(cond):
            return True
        await asyncio.sleep(every_s)
    return False


async def named_exit(app: Appliance, admin: str, i: int, before: str | None) -> str | None:
    """Engine i's last_exit once it names an exit other than ``before`` (None: none
    within a minute), with the restart reason when the daemon gave one."""
    seen: dict[str, Any] = {}

    def changed() -> bool:
        seen.update(engine_view(app, admin, i))
        return seen.get("last_exit") not in (None, before)

    if not await wait_until(changed, 60):
        return None
    # last_exit is "<cause> <when>; <its last output line>": the cause is the point.
    words = str(seen["last_exit"]).split("; ", 1)[0]
    reason = seen.get("last_restart_reason")
    return f"{words} [restart reason: {reason}]" if reason else words


# ---- a fault's context ---------------------------------------------------------------


@dataclass
class Faults:
    """What the new faults act on and where they record."""

    app: Appliance
    admin: str
    disk: StateDisk
    fake: bool
    t0: float
    note: Callable[[str], None]
    user_key: str
    model: str
    down: list[tuple[float, float | None]]  # the supervisor's dead windows (shared)
    records: list[FaultRecord] = field(default_factory=list)
    journals: list[Path] = field(default_factory=list)  # every life's log
    cages: list[MemCage] = field(default_factory=list)
    pending: list[asyncio.Task[None]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def record(self, fault: str) -> FaultRecord:
        rec = FaultRecord(fault, round(self.now(), 1))
        self.records.append(rec)
        return rec

    def close_when_ready(self, rec: FaultRecord, i: int, cage: MemCage | None = None) -> None:
        """End ``rec``'s window when engine i is READY again, in the background: a real
        engine takes minutes to come back on a busy box, and the schedule goes on."""

        async def watch() -> None:
            if cage is not None:  # empty once the supervisor stopped the killed tree
                await wait_until(cage.remove, 60, 1.0)
            view = functools.partial(engine_view, self.app, self.admin, i)
            if await wait_until(lambda: view().get("state") == "READY", 900, 0.5):
                rec.until_s = round(self.now(), 1)

        self.pending.append(asyncio.create_task(watch()))

    async def settle(self, timeout_s: float) -> None:
        """Give the windows still open ``timeout_s`` to close; a fault whose engine is
        not READY by then says so."""
        if self.pending:
            await asyncio.wait(self.pending, timeout=timeout_s)
        for task in self.pending:
            task.cancel()
        for rec in self.records:
            if rec.until_s is None and rec.skipped is None:
                rec.notes.append("its engine was not READY again when the load ended")

    def cleanup(self) -> None:
        for cage in self.cages:
            cage.remove()
        self.disk.free()


def env_of(pid: int) -> tuple[list[str], Mapping[str, str], str]:
    proc = psutil.Process(pid)
    return proc.cmdline(), proc.environ(), proc.cwd()


# ---- the faults ----------------------------------------------------------------------


async def kill_supervisor(f: Faults) -> FaultRecord:
    """SIGKILL ``serve`` mid-load, start it again as it was started, and check the new
    life: nothing of the old one left, the sweep's journal line, a request served."""
    rec = f.record("supervisor SIGKILL and restart")
    app = f.app
    argv, env, cwd = env_of(app.proc.pid)
    old_tree = set(tree_of(app.proc.pid)) - {app.proc.pid}
    f.down.append((f.now(), None))
    app.proc.send_signal(signal.SIGKILL)
    code = await asyncio.to_thread(app.proc.wait)
    f.note(f"SIGKILL supervisor (pid {app.proc.pid}, {len(old_tree)} engine processes)")
    rec.exit_cause = f"serve ended by SIGKILL (return code {code})"
    log_path = app.log_path.with_name(f"appliance.life{len(f.journals) + 1}.log")
    _start_again(app, argv, env, cwd, log_path)
    f.journals.append(log_path)
    f.note(f"serve started again (pid {app.proc.pid})")
    answers = await wait_until(lambda: get_json(app.url + "/healthz")[0] == 200, 120)
    f.down[-1] = (f.down[-1][0], f.now())
    ready = answers and await wait_until(lambda: all_ready(app), 600)
    rec.until_s = round(f.now(), 1)
    rec.processes_left = len(alive(old_tree))
    swept = [ln for ln in app.log().splitlines() if "left behind" in ln]
    rec.notes.append(swept[0].split("WARNING", 1)[-1].strip() if swept else "sweep: nothing left")
    served = await asyncio.to_thread(_one_answer, f)
    rec.notes.append(f"new life ready: {bool(ready)}; a chat request answered: {served}")
    return rec


def _start_again(
    app: Appliance, argv: list[str], env: Mapping[str, str], cwd: str, log_path: Path
) -> None:
    """``serve`` again, as the last life was started; its journal to ``log_path``."""
    with open(log_path, "wb") as log:
        app.proc = subprocess.Popen(argv, env=dict(env), cwd=cwd, stdout=log, stderr=log)
    app.log_path = log_path


def all_ready(app: Appliance) -> bool:
    body = get_json(app.url + "/readyz")[1]
    n = engine_count(app.config)
    return isinstance(body, dict) and body.get("engines_ready") == list(range(n))


def _one_answer(f: Faults) -> bool:
    req = urllib.request.Request(
        f.app.url + "/v1/chat/completions",
        data=json.dumps(
            {"model": f.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        ).encode(),
        headers={"Authorization": f"Bearer {f.user_key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return bool(r.status == 200 and json.loads(r.read()).get("choices"))
    except (OSError, ValueError):
        return False


async def disk_full(f: Faults, seconds: float) -> FaultRecord:
    """Fill the state disk for ``seconds``, free it, check the files and the usage."""
    rec = f.record("state disk full")
    if not f.disk.mounted:
        rec.skipped = f"skipped: {f.disk.why_not}"
        f.note(f"disk-full fault skipped: {f.disk.why_not}")
        return rec
    keys_before = f.disk.read("keys.json") or b""
    filled = await asyncio.to_thread(f.disk.fill)
    f.note(f"state disk filled ({filled} bytes)")
    # Once a usage save has failed, none is in flight that could still land: the file
    # and the live counters are then a fair baseline.
    failing = await wait_until(lambda: "usage.json" in _failing_files(f), 30)
    file_before = usage_total(f.disk.read("usage.json"))
    live_before = _live_tokens(f)
    refused = await asyncio.to_thread(admin_post, f.app, f.admin, "/admin/keys", {"name": "x"})
    await asyncio.sleep(max(0.0, rec.at_s + seconds - f.now()))
    live_after = _live_tokens(f)
    f.disk.free()
    f.note("state disk freed")
    # usage.json is saved every 10 s; an admin action (refused, but audited) makes
    # audit.log write what waited. keys.json stays "failing" until a key is written.
    written = await wait_until(lambda: "usage.json" not in _failing_files(f), 60)
    await asyncio.to_thread(admin_post, f.app, f.admin, "/admin/keys", {"name": ""})
    await wait_until(lambda: "audit.log" not in _failing_files(f), 10)
    rec.until_s = round(f.now(), 1)
    problems = f.disk.problems(keys_before)
    lost = usage_kept(file_before, usage_total(f.disk.read("usage.json")), live_before, live_after)
    problems += [lost] if lost else []
    if live_after == live_before:
        rec.notes.append(
            "usage kept: NOT exercised, no tokens were counted while the disk was full"
        )
    rec.files_damaged = len(problems)
    rec.notes += problems
    rec.notes.append(
        f"usage save failed while full: {failing}; written again after: {written}; "
        f"tokens counted while full: {live_after - live_before}; "
        f"key created while full: HTTP {refused}"
    )
    return rec


def _failing_files(f: Faults) -> set[str]:
    code, body = get_json(
        f.app.url + "/admin/status", headers={"Authorization": f"Bearer {f.admin}"}
    )
    if code != 200 or not isinstance(body, dict):
        return {"?"}
    return {str(x["file"]) for x in body.get("state_write_failures") or []}


def _live_tokens(f: Faults) -> int:
    return metric_sum(admin_text(f.app, f.admin, "/metrics"), "appliance_key_tokens_total")


async def engine_oom(f: Faults, i: int) -> FaultRecord:
    """Engine i's tree into a memory cgroup squeezed until the OOM killer acts (SIGKILL,
    said so, where no memory cgroup can be written); the cause the daemon names."""
    rec = f.record(f"engine{i} OOM-killed")
    view = engine_view(f.app, f.admin, i)
    pid, before = view.get("pid"), view.get("last_exit")
    if not pid:
        rec.skipped = f"skipped: engine{i} had no process"
        return rec
    pids = tree_of(int(pid))
    cage, why = make_cage(f"soak-oom-{os.getpid()}-{i}")
    killed = False
    if cage is not None:
        f.cages.append(cage)
        killed = await _oom_in(f, cage, i, pids)
        rec.notes.append(f"memory cgroup {'v2' if cage.v2 else 'v1'} {cage.path}")
        if not killed:
            rec.notes.append("the OOM killer did not act within 90 s")
    else:
        rec.notes.append(f"no writable memory cgroup ({why})")
    if not killed:
        with contextlib.suppress(OSError):
            os.kill(int(pid), signal.SIGKILL)
        rec.notes.append("fell back to SIGKILL: the cause should then read 'signal', not 'oom'")
        f.note(f"SIGKILL engine{i} (pid {pid}) in place of an OOM kill")
    rec.exit_cause = await named_exit(f.app, f.admin, i, before)
    f.close_when_ready(rec, i, cage)
    return rec


async def _oom_in(f: Faults, cage: MemCage, i: int, pids: list[int]) -> bool:
    await asyncio.to_thread(cage.add, pids)
    cage.limit(cage.usage() + 16 * MIB)
    f.note(f"engine{i} in a memory cgroup, its limit squeezed (pids {pids})")
    if f.fake:  # the fake engine holds little and allocates less: ask it to
        asyncio.get_running_loop().run_in_executor(
            None, lambda: f.app.engine_control(i, allocate_mib=256)
        )
    killed = await asyncio.to_thread(squeeze, cage, pids, 90)
    if killed:
        f.note(f"engine{i} OOM-killed by the kernel")
    return killed
