"""Why an engine's process ended, named: the cause in ``last_exit``, the journal and the
restart reason (``appliance_engine_restarts_total{reason}``).

An engine the supervisor stops is named by the runner's reason (drain, heat, degradation,
admin, hung, start-up timeout). An engine that ended without being asked is classified
here, by :func:`classify`, a pure function of its exit status, its last output lines, the
phase it was in and whether the OOM killer's counters moved while it ran:

- failed to bind its address (vLLM binds before it loads anything);
- failed to load the model (vLLM's "EngineCore failed to start" and friends, at start);
- killed by a signal we did not send, "likely the kernel's OOM killer" when it is SIGKILL
  and the OOM kill counter of our cgroup (``memory.events``) or the kernel's
  (``/proc/vmstat``) went up since it started;
- exited after a process of its tree died (vLLM says so: :func:`child_death`), "likely
  killed by the kernel's OOM killer" when those counters went up: the OOM killer takes
  the biggest process, which in vLLM is a worker or the EngineCore, not the API server;
  the API server then shuts down and exits 0, which alone would read "exited by itself";
- exited by itself, with its status.
"""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance.engine import RestartReason

# vLLM binds its socket before it loads the model (entrypoints/launchers/api_server/
# entry.py: setup_server); uvicorn's and the fake's words for a bind that failed.
_BIND = re.compile(r"error while attempting to bind|Address already in use|\[Errno 98\]")
# vLLM 0.32: v1/engine/core.py "EngineCore failed to start." and v1/engine/utils.py
# "Engine core initialization failed." (a model it cannot read, a KV cache that does not
# fit, ...); the fake engine's injected start failure says "Engine failed to start".
_LOAD = re.compile(
    r"EngineCore failed to start|Engine core initialization failed|"
    r"Engine failed to start"
)
# vLLM 0.32's words for a process of its tree that died under it: v1/executor/
# multiproc_executor.py "Worker proc VllmWorker-0 died unexpectedly (exit code: -9)",
# v1/engine/core_client.py "engine core exited unexpectedly", older "Engine core proc
# EngineCore_0 died unexpectedly". The shutdown that follows prints far more than the
# output tail keeps, so the relay remembers the first such line of a life.
_CHILD_DIED = ("died unexpectedly", "exited unexpectedly")
OomCounts = tuple[int | None, int | None]  # (our cgroup's oom_kill, the kernel's oom_kill)


@dataclass(frozen=True)
class ExitCause:
    reason: RestartReason
    words: str  # for last_exit and the journal: "killed by signal SIGKILL, which ..."


def child_death(line: str) -> str | None:
    """What vLLM said of a process of its tree that died (its message, without the log
    prefix), if ``line`` says one did; else None. Cheap: read once per output line."""
    if not any(words in line for words in _CHILD_DIED):
        return None
    return line.rsplit("] ", 1)[-1].strip()


def classify(
    code: int,
    tail: Sequence[str],
    starting: bool,
    oom_moved: bool,
    child_died: str | None = None,
) -> ExitCause:
    """The cause of an exit the supervisor did not ask for (``code``: the API server's
    return code, negative for a signal; ``child_died``: :func:`child_death`'s words from
    this life's output, if any)."""
    text = "\n".join(tail)
    if code < 0:
        name = _signal_name(-code)
        if -code == signal.SIGKILL and oom_moved:
            return ExitCause(
                RestartReason.OOM,
                f"killed by {name}, likely the kernel's OOM killer (its OOM kill count rose)",
            )
        return ExitCause(
            RestartReason.SIGNAL, f"killed by {name}, which the supervisor did not send"
        )
    died = f'exited with status {code} after a process of its tree died ("{child_died}")'
    if child_died is not None and oom_moved:
        return ExitCause(
            RestartReason.OOM,
            f"{died}, likely killed by the kernel's OOM killer (its OOM kill count rose)",
        )
    if _BIND.search(text):
        return ExitCause(RestartReason.BIND_FAILED, f"failed to bind its address (status {code})")
    if starting and _LOAD.search(text):
        return ExitCause(RestartReason.LOAD_FAILED, f"failed to load the model (status {code})")
    if child_died is not None:
        return ExitCause(RestartReason.EXITED, died)
    return ExitCause(RestartReason.EXITED, f"exited by itself with status {code}")


def oom_moved(before: OomCounts, after: OomCounts) -> bool:
    """Whether either OOM kill counter rose (one that cannot be read does not count)."""
    return any(
        b is not None and a is not None and a > b for b, a in zip(before, after, strict=True)
    )


def oom_counts() -> OomCounts:
    """The OOM kill counters now: our cgroup's (v2; engines share the service's cgroup) and
    the kernel's. Cheap (two small reads), taken at spawn and at exit only."""
    return _cgroup_oom_kills(), _field(Path("/proc/vmstat"), "oom_kill")


def _cgroup_oom_kills() -> int | None:
    """cgroup v2's ``memory.events``, else v1's ``memory.oom_control`` (kernel 4.13+)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                where = Path("/sys/fs/cgroup", path.lstrip("/"), "memory.events")
            elif "memory" in controllers.split(","):
                where = Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.oom_control")
            else:
                continue
            found = _field(where, "oom_kill")
            if found is not None:
                return found
    return None


def _field(path: Path, key: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return None


def _signal_name(num: int) -> str:
    try:
        return f"signal {signal.Signals(num).name}"
    except ValueError:
        return f"signal {num}"
