"""Finding and ending an engine's whole process tree. Used by the supervisor only.

vLLM's API server forks an EngineCore, which forks workers; when the API server dies
(or is SIGKILLed) those children live on and keep GPU memory (vllm#55510). So an
engine's tree is found four ways, and a process found by any of them is ended:

- its process group (each engine is started in its own session, pgid = its pid);
- the descendants of its first process while that still exists;
- the members the supervisor remembered while the tree was whole (pid and start time,
  so a reused pid is never hit), which still finds a child that left the group;
- every process whose environment carries the engine's tag (``LLM_APPLIANCE_ENGINE``).
  vLLM renames its children with setproctitle, which blanks their environment as
  /proc shows it, so the tag finds the API server and anything forked without a
  rename, not EngineCore or workers: the first three ways cover those.

The supervisor also makes itself a child subreaper, so orphans re-parent to it rather
than to PID 1 and their exit statuses can be collected here (no zombies).

When the supervisor itself dies (kill -9, a crash, the OOM killer), each API server gets
a parent-death signal (:func:`parent_death_signal`) and takes its own children down; what
still outlives it is swept by the next start (appliance.supervisor.leftovers).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
TAG_ENV = "LLM_APPLIANCE_ENGINE"


def become_subreaper() -> bool:
    """Orphaned engine processes re-parent to us, so we can reap them (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def parent_death_signal(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send ``sig`` to the child when we die.

    Runs in the child between fork and exec, so it must do almost nothing: prctl was
    looked up here, before the fork. The kernel ties PR_SET_PDEATHSIG to the *thread*
    that forked the child, not the process: spawn only from the event loop's thread (the
    main thread), never from a worker thread, or the engine would get the signal when
    that thread ends. If we died before prctl took effect, the child was re-parented
    already: it signals itself, as the kernel would have. None where prctl is missing.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return arm


def _tagged(proc: psutil.Process, tag: str | None) -> bool:
    try:
        return bool(proc.environ().get(TAG_ENV) == tag)
    except (psutil.Error, OSError):
        return False


Members = dict[int, float]  # pid -> create_time


def find_tree(
    tag: str | None, root_pid: int | None = None, known: Members | None = None
) -> list[psutil.Process]:
    """Every live process of one engine, root first where it still exists (``tag``
    None: not by the tag, for trees whose tag alone does not make them ours)."""
    found: dict[int, psutil.Process] = {}
    for pid, created in (known or {}).items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                found[pid] = proc
    if root_pid is not None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(root_pid)
            if root.status() != psutil.STATUS_ZOMBIE:
                found[root.pid] = root
            for child in root.children(recursive=True):
                found[child.pid] = child
        with contextlib.suppress(OSError):
            pgid = root_pid  # started with start_new_session: its pid is its group id
            for proc in psutil.process_iter(["pid"]):
                with contextlib.suppress(psutil.Error, OSError):
                    if os.getpgid(proc.pid) == pgid:
                        found.setdefault(proc.pid, proc)
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]) if tag is not None else ():
        if proc.pid != me and proc.pid not in found and _tagged(proc, tag):
            found[proc.pid] = proc
    live = []
    for proc in found.values():
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                live.append(proc)
    return live


def tree_pids(root_pid: int) -> set[int]:
    """The pids of a process and all its descendants (empty when it is gone)."""
    try:
        root = psutil.Process(root_pid)
        return {root_pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.Error:
        return set()


def tree_snapshot(root_pid: int) -> tuple[int | None, Members]:
    """Resident memory of a process and all its descendants (the degradation detector's
    view of an engine: vLLM's memory lives mostly in EngineCore and workers), and the
    members, to remember for when the root is gone."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *_descendants(root)]
    except psutil.Error:
        return None, {}
    total = 0
    members: Members = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += int(proc.memory_info().rss)
            members[proc.pid] = proc.create_time()
    return total, members


# Each thread's children, as the kernel lists them (CONFIG_PROC_CHILDREN, on in the usual
# distribution kernels). Without it, psutil finds children by reading every process's
# /proc entry: ~1 ms per sample on a box with a hundred processes, every health check.
_CHILDREN_FILES = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _descendants(root: psutil.Process) -> list[psutil.Process]:
    """The descendants of ``root``, reading only the tree's own /proc entries.

    The kernel's children lists are exact only for a still tree, so this serves the
    RSS sample (a child missed while being born is seen at the next sample), never the
    ownership checks (:func:`tree_pids`) or the kill (:func:`find_tree`).
    """
    if not _CHILDREN_FILES:
        return list(root.children(recursive=True))
    found: list[psutil.Process] = []
    parents = [root.pid]
    while parents:
        pid = parents.pop()
        for child in _children_of(pid):
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(child))
                parents.append(child)
    return found


def _children_of(pid: int) -> list[int]:
    """The pids of ``pid``'s children (any of its threads may have forked them)."""
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children  # it is gone
    for tid in tasks:
        with (
            contextlib.suppress(OSError, ValueError),
            open(f"/proc/{pid}/task/{tid}/children") as f,
        ):
            children += (int(x) for x in f.read().split())
    return children


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            proc.send_signal(sig)


def reap_orphans(pids: set[int], skip: int | None = None) -> None:
    """Collect exit statuses of our own (re-parented) children among ``pids``.

    ``skip`` is the engine's root process, whose status asyncio's child watcher owns; we
    never call waitpid(-1), which would steal it.
    """
    for pid in pids:
        if pid == skip:
            continue
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


@dataclass(frozen=True)
class KillResult:
    terminated: int  # processes that exited after SIGTERM
    killed: int  # processes that needed SIGKILL
    left: int  # processes still there after SIGKILL (should be 0)


def kill_tree(
    tag: str | None, root_pid: int | None, timeout_s: float, known: Members | None = None
) -> KillResult:
    """SIGTERM the whole tree, wait up to ``timeout_s``, SIGKILL what is left, reap.

    Blocking (it polls); the supervisor runs it in a thread.
    """
    procs = find_tree(tag, root_pid, known)
    all_pids = {p.pid for p in procs}
    if not procs:
        return KillResult(0, 0, 0)
    signal_all(procs, signal.SIGTERM)
    if root_pid is not None:
        with contextlib.suppress(OSError):
            os.killpg(root_pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    alive = procs
    while alive and time.monotonic() < deadline:
        reap_orphans(all_pids, skip=root_pid)
        time.sleep(0.05)
        alive = find_tree(tag, root_pid, known)
        all_pids |= {p.pid for p in alive}
    terminated = len(all_pids) - len(alive)
    killed = len(alive)
    if alive:
        log.warning(
            "engine tree %s: %d process(es) ignored SIGTERM for %.0f s; sending SIGKILL",
            tag,
            len(alive),
            timeout_s,
        )
        signal_all(alive, signal.SIGKILL)
        if root_pid is not None:
            with contextlib.suppress(OSError):
                os.killpg(root_pid, signal.SIGKILL)
        end = time.monotonic() + 5.0
        while alive and time.monotonic() < end:
            reap_orphans(all_pids, skip=root_pid)
            time.sleep(0.05)
            alive = find_tree(tag, root_pid, known)
    reap_orphans(all_pids, skip=root_pid)
    return KillResult(terminated, killed, len(alive))


def port_holder(port: int, host: str = "127.0.0.1") -> tuple[int | None, str] | None:
    """Who listens on ``host:port``: (pid, name), (None, "unknown") if not ours to see, or None.

    Used to report a foreign process on an engine port by name and pid (never killed).
    """
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        conns = []
    for c in conns:
        if (
            c.status == psutil.CONN_LISTEN
            and c.laddr
            and c.laddr.port == port
            and c.laddr.ip in (host, "0.0.0.0", "::", "::ffff:" + host)
        ):
            if c.pid is None:
                return None, "unknown"
            try:
                return c.pid, psutil.Process(c.pid).name()
            except psutil.Error:
                return c.pid, "unknown"
    return None


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
