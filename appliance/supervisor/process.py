"""One engine's operating-system side: its processes, output, address and resources.

:class:`EngineProcess` spawns the engine (a new key each time, its environment built
explicitly, pinned to its cores), relays its output (prefixed, the key redacted), tells
whether the TCP listener where the engine should be is its own, kills its whole process
tree, and waits until its port and GPU memory are free again. It holds no lifecycle
state: the engine's runner decides, this module does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from appliance import endpoint, proctree
from appliance.engine import EngineSpec, RestartReason, new_api_key, with_batched_tokens
from appliance.supervisor import exits
from appliance.telemetry import GpuReading

# How long an exit waits for the engine's last output to be read (wait()).
OUTPUT_DRAIN_S = 1.0
log = logging.getLogger("appliance.supervisor")

GPU_MEMORY_WAIT_S = 60.0
PORT_FREE_WAIT_S = 30.0
OUTPUT_TAIL_LINES = 30
GPU_MEMORY_FREE_SHARE = 0.1  # below this share of a GPU's memory in use, it counts as free

# What an engine's API server gets when the supervisor dies, however it dies. SIGTERM,
# not SIGKILL: vLLM 0.32's EngineCore has no parent watch of its own (no prctl, getppid
# or death pipe in vllm/v1/engine/; only workers watch EngineCore, through the death pipe
# of vllm/v1/executor/multiproc_executor.py:726-760 and :834-856), so the API server must
# live long enough to end it. On SIGTERM it does: entrypoints/launchers/launcher.py:251-279
# stops the engine client with vllm_config.shutdown_timeout (0 by default, config/vllm.py:
# 443: abort), whose process manager (v1/engine/utils.py:335-348 -> v1/utils.py:605-658)
# terminates EngineCore and at once kill_process_tree()s it (SIGKILL, children first).
# During start-up, api_server/entry.py:169-174 turns SIGTERM into KeyboardInterrupt, which
# unwinds the same context managers. Whatever still outlives it is swept at next start.
ENGINE_PARENT_DEATH_SIGNAL = signal.SIGTERM
PDEATHSIG_THREAD = (
    "the kernel sends an engine its parent-death signal when the thread that forked it "
    "ends; spawn from the event loop's (main) thread"
)


class EngineProcess:
    """The processes of one engine, across its spawns."""

    def __init__(self, spec: EngineSpec, lineage: Mapping[str, str] | None = None) -> None:
        self.spec = spec
        # Added to its environment: which appliance and supervisor started it (a later
        # life of the supervisor finds its leftovers by these).
        self._lineage = dict(lineage or {})
        self.api_key = ""  # this spawn's engine key (new at every spawn)
        self.output_tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
        self._last_exit: str | None = None
        # What vLLM said of a process of its tree that died, this life (exits.child_death)
        self._child_died: str | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._relay: asyncio.Task[None] | None = None
        self._members: proctree.Members = {}  # its tree, last seen whole
        self._oom_at_spawn: exits.OomCounts = (None, None)  # OOM kill counters then

    @property
    def started(self) -> bool:
        """Whether the last spawn started a process."""
        return self._proc is not None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    @property
    def pid(self) -> int | None:
        """The API server's pid while it runs."""
        if self._proc is None or self._proc.returncode is not None:
            return None
        return self._proc.pid

    def port_taken(self) -> bool:
        """With engine.listen = "tcp": whether someone else holds the engine's port (logged;
        that process is neither used nor killed)."""
        port = self.spec.address.port
        if port is None or proctree.port_is_free(port):
            return False
        log.error(
            "%s: port %d is already in use by %s; not starting there and "
            "not killing it: stop that process or change engine.port_base",
            self.spec.name,
            port,
            endpoint.describe_listener(port),
        )
        return True

    def remove_stale_socket(self) -> None:
        if self.spec.address.uds is not None:
            endpoint.remove_stale_socket(self.spec.address.uds)

    async def spawn(self, batched_tokens: int | None) -> None:
        """Start the engine with a new key (``started`` says whether it did)."""
        spec = self.spec
        # A new key per spawn: a key that leaked (a command line, a core dump) is
        # worthless once the engine it belonged to is gone.
        self.api_key = new_api_key()
        self._oom_at_spawn = await asyncio.to_thread(exits.oom_counts)
        # Its exit is judged by its own output, not by what an earlier spawn said.
        self.output_tail.clear()
        self._child_died = None
        argv = with_batched_tokens(spec.argv_with_key(self.api_key), batched_tokens)
        log.info(
            "%s: starting on %s, listening on %s: %s",
            spec.name,
            f"GPU {','.join(map(str, spec.gpus))}" if spec.gpus else "CPU",
            spec.address,
            " ".join(argv).replace(self.api_key, "***"),
        )
        # Output goes through a pipe of our own rather than asyncio's subprocess pipes:
        # vLLM's orphaned children keep the write end open after the API server dies, and
        # asyncio's Process.wait() waits for its pipes to close, so a crash would go
        # unnoticed for as long as an orphan lives.
        rfd, wfd = os.pipe()
        if threading.current_thread() is not threading.main_thread():
            log.warning("%s: spawned off the main thread: %s", spec.name, PDEATHSIG_THREAD)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                env={**spec.env_with_key(self.api_key), **self._lineage},
                stdin=asyncio.subprocess.DEVNULL,
                stdout=wfd,
                stderr=wfd,
                start_new_session=True,
                preexec_fn=proctree.parent_death_signal(ENGINE_PARENT_DEATH_SIGNAL),
            )
        except OSError as exc:
            os.close(rfd)
            log.error("%s: cannot start %s: %s", spec.name, spec.argv[0], exc)
            self._proc = None
            return
        finally:
            os.close(wfd)
        if spec.cpus:
            # Set before the child gets far: the interpreter needs a few ms to start and
            # vLLM's first children come seconds later, so the whole tree inherits it.
            try:
                os.sched_setaffinity(self._proc.pid, spec.cpus)
            except OSError as exc:
                log.warning("%s: cannot pin to cores %s: %s", spec.name, spec.cpus, exc)
        self._relay = asyncio.create_task(self._relay_output(rfd), name=f"relay-{spec.name}")

    async def _relay_output(self, fd: int) -> None:
        """Copy the engine tree's output to ours, line by line, prefixed and key-redacted."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
        )
        prefix = f"[{self.spec.name}] "
        key = self.api_key  # this spawn's: the next spawn's relay has its own
        out = sys.stdout
        try:
            while True:
                try:
                    raw = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    continue  # an over-long line: drop it rather than stop relaying
                if not raw:
                    return
                line = raw.decode("utf-8", "replace").rstrip().replace(key, "***")
                self.output_tail.append(line)
                # This life's only: an orphan of the last one may still write here.
                if self._child_died is None and key == self.api_key:
                    self._child_died = exits.child_death(line)
                out.write(prefix + line + "\n")
                out.flush()
        finally:
            transport.close()

    async def wait(self) -> int:
        """Until the API server exits; its return code. What it wrote before it exited
        is read first (up to OUTPUT_DRAIN_S): its last line is often why it exited, and
        on a loaded box the relay can still be behind when the exit is seen."""
        assert self._proc is not None
        code = await self._proc.wait()
        if self._relay is not None:
            # EOF comes once every writer is gone; a child still holding the pipe (an
            # orphaned EngineCore) would keep it open, hence the bound.
            await asyncio.wait({self._relay}, timeout=OUTPUT_DRAIN_S)
        return code

    async def wait_exit(self, timeout_s: float) -> None:
        """Until the API server exits or ``timeout_s`` passes, whichever is first."""
        if self._proc is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._proc.wait()), timeout_s)

    def log_exit(self, when: str) -> RestartReason:
        """An exit we did not ask for: its cause named in last_exit and the journal, and
        returned as the restart reason."""
        code = self.returncode or 0
        moved = exits.oom_moved(self._oom_at_spawn, exits.oom_counts())
        cause = exits.classify(
            code, self.output_tail, when == "while starting", moved, self._child_died
        )
        self._last_exit = f"{cause.words} {when}; {self.exit_reason()}"
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
        tail = "\n    ".join(list(self.output_tail)[-10:])
        log.error(
            "%s: exited with %s %s (cause: %s)%s",
            self.spec.name,
            how,
            when,
            cause.words,
            f"; last output:\n    {tail}" if tail else "",
        )
        return cause.reason

    @property
    def last_exit(self) -> str | None:
        """Why it last exited and when (``log_exit``'s line); None until it first does."""
        return self._last_exit

    def exit_reason(self) -> str:
        """One line on why it exited, from its last output: the last line that names an
        error (vLLM's own refusal of a bad argument, a CUDA error, ...), else its last
        line, else its exit status. Shown in ``status`` beside a FAILED engine."""
        code = self.returncode or 0
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
        lines = [line.strip() for line in self.output_tail if line.strip()]
        named = [line for line in lines if _ERROR_WORDS.search(line)]
        said = (named or lines or [""])[-1]
        return f"exited with {how}" + (f": {said[:MAX_REASON_CHARS]}" if said else "")

    async def listener_is_ours(self) -> bool | None:
        """Before the engine key goes anywhere: who listens where the engine should.

        A Unix socket in our private directory can only be the engine's. A TCP port can
        be bound by any local process while the engine is still importing, so the
        listener's socket must be one the engine's own processes hold. True: ours;
        None: nobody listens yet; False: someone else does (logged; this check sent it
        nothing, and no connection of ours writes to it: each is checked on its own).
        """
        port = self.spec.address.port
        if port is None:
            return True
        if self._proc is None:
            return None
        pids = await asyncio.to_thread(proctree.tree_pids, self._proc.pid)
        ours = await asyncio.to_thread(endpoint.tcp_listener_is_ours, port, pids)
        if ours is False:
            who = await asyncio.to_thread(endpoint.describe_listener, port)
            # Only what is true here: this check wrote nothing, and the probe and the
            # relay write only on connections checked to be the engine's (the gateway
            # logs any it refused). What reached the port before is not ours to know.
            log.error(
                "%s: port %d is held by %s, not by the engine's own processes; the "
                "engine is not used. This check sent it nothing, and connections that "
                "reach it are closed unsent (the gateway logs each engine it refused); "
                'stop that process or use engine.listen = "unix"',
                self.spec.name,
                port,
                who,
            )
        return ours

    async def remember_tree(self) -> None:
        """Note the whole tree once the engine is up (its orphans are killed with it)."""
        if self.pid is not None:
            _, self._members = await asyncio.to_thread(proctree.tree_snapshot, self.pid)

    async def sample_tree(self) -> int | None:
        """The tree's RSS now (None: unknown); members seen are remembered too."""
        if self.pid is None:
            return None
        rss, members = await asyncio.to_thread(proctree.tree_snapshot, self.pid)
        self._members.update(members)
        return rss

    async def kill_tree(self, timeout_s: float, why: str = "") -> None:
        """SIGTERM the whole tree, SIGKILL what is left after ``timeout_s``, reap. ``why``
        (the runner's reason) names the exit in last_exit when the engine was running."""
        proc = self._proc
        if why and proc is not None and proc.returncode is None:
            self._last_exit = f"stopped by the supervisor ({why})"
        root = proc.pid if proc is not None else None
        if proc is not None and proc.returncode is not None:
            # The API server is gone: what is left has no clients and nothing to finish
            # gracefully, and vLLM's orphaned EngineCore takes 10-20 s to obey SIGTERM.
            timeout_s = min(timeout_s, 1.0)
        result = await asyncio.to_thread(
            proctree.kill_tree, self.spec.tag, root, timeout_s, dict(self._members)
        )
        self._members.clear()
        if proc is not None:
            with contextlib.suppress(TimeoutError, ProcessLookupError):
                await asyncio.wait_for(proc.wait(), 5.0)
        if result.killed:
            log.warning("%s: %d process(es) needed SIGKILL", self.spec.name, result.killed)
        if result.left:
            log.error("%s: %d process(es) survived SIGKILL", self.spec.name, result.left)

    async def wait_resources_free(
        self,
        readings: Callable[[], Sequence[GpuReading | None]],
        stopping: Callable[[], bool],
        poll_s: float,
    ) -> None:
        """Until its TCP port is free (bounded) and, on GPUs, the memory of every one of
        them released (a tensor-parallel engine holds memory on each of its GPUs)."""
        port = self.spec.address.port
        deadline = time.monotonic() + PORT_FREE_WAIT_S
        while port is not None and not proctree.port_is_free(port):
            if time.monotonic() > deadline or proctree.port_holder(port) is not None:
                break  # someone else's now: reported when we try to start
            await asyncio.sleep(0.2)
        if not self.spec.gpus:
            return
        # vLLM's orphans used to keep GPU memory after the API server died (vllm#55510);
        # a new engine started before it is released fails to allocate its KV cache.
        deadline = time.monotonic() + GPU_MEMORY_WAIT_S
        said, busy = False, list[tuple[int, GpuReading | None]]()
        while time.monotonic() < deadline and not stopping():
            now = readings()
            busy = [(g, r) for g, r in zip(self.spec.gpus, now, strict=True) if _in_use(r)]
            if not busy:
                return
            if not said:
                log.info("%s: waiting for GPU %s memory to be freed", self.spec.name, _gpus(busy))
                said = True
            await asyncio.sleep(poll_s)
        if said and not stopping():
            log.warning(
                "%s: GPU %s memory still in use after %.0f s (%s); going on anyway",
                self.spec.name,
                _gpus(busy),
                GPU_MEMORY_WAIT_S,
                _holders(busy),
            )


def _gpus(busy: Sequence[tuple[int, GpuReading | None]]) -> str:
    return ",".join(str(g) for g, _ in busy)


def _holders(busy: Sequence[tuple[int, GpuReading | None]]) -> str:
    """Who holds the memory, as NVML tells (pids), for the journal."""
    pids = sorted({p for _, r in busy if r is not None and r.pids for p in r.pids})
    if pids:
        return "held by pid " + ", ".join(map(str, pids))
    if all(r is not None and r.pids == () for _, r in busy):
        return "NVML lists no process holding it"
    return "NVML does not tell which processes hold it"


def _in_use(r: GpuReading | None) -> bool:
    """Whether a GPU's memory is still mostly taken (False when it cannot be told)."""
    if r is None or r.memory_used_bytes is None or r.memory_total_bytes is None:
        return False
    return r.memory_used_bytes >= GPU_MEMORY_FREE_SHARE * r.memory_total_bytes


# What marks an output line as the engine saying why it failed.
_ERROR_WORDS = re.compile(r"Error|Exception|error:|refused|invalid", re.IGNORECASE)
MAX_REASON_CHARS = 300
