"""Start and stop the fake vLLM engine (``fake_engine.py``) as a real subprocess.

Usage in tests::

    port = free_port()
    proc = start_fake_engine(port, "KEY", "--token-delay-ms", "5")
    try:
        ...  # http://127.0.0.1:{port}/v1 with "Authorization: Bearer KEY"
    finally:
        stop_fake_engine(proc)

or ``with fake_engine(api_key="KEY") as eng: eng.base_url, eng.stats(), eng.control(hang=True)``.

The engine is started in a new session (its own process group, pgid == pid) unless
``new_session=False``, so ``stop_fake_engine`` can kill the whole tree, including a
``--spawn-child`` child that outlived its parent.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

FAKE_ENGINE_PATH = str(Path(__file__).resolve().with_name("fake_engine.py"))
# The modules fake_engine.py imports from beside it when run as a lone script (a copy in
# a container, without the repository on sys.path): copy them with it.
FAKE_ENGINE_SIBLINGS = tuple(
    str(Path(FAKE_ENGINE_PATH).with_name(name))
    for name in ("fake_protocols.py", "fake_sleep.py", "fake_lora.py")
)
DEFAULT_MODEL_NAME = "smollm2"


# Ports handed out by this process, never handed out again: a test picks several before
# anything binds them (the gateway's, then a run for the engines).
_HANDED_OUT: set[int] = set()
_LISTEN_PORTS = (10000, 32768)  # under Linux's default ephemeral range


def _below_ephemeral() -> tuple[int, int]:
    """Ports no outgoing connection takes: the kernel picks those from
    ip_local_port_range, so a port chosen under it stays free until the test binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _LISTEN_PORTS
    return (_LISTEN_PORTS[0], low) if low > _LISTEN_PORTS[0] + 1000 else (1024, low)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, under the ephemeral range, not handed out
    before by this process."""
    low, high = _below_ephemeral()
    for _ in range(200):
        port = random.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port_run(n: int) -> int:
    """The first of n consecutive free ports (engines use port_base + i)."""
    for _ in range(50):
        base = free_port()
        run = range(base + 1, base + n)
        if base + n <= 65536 and all(_bindable(p) for p in run):
            _HANDED_OUT.update(run)
            return base
    raise RuntimeError("no run of free ports")


def _bindable(port: int, host: str = "127.0.0.1") -> bool:
    if port in _HANDED_OUT:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def fake_engine_command(
    port: int,
    api_key: str | None,
    *extra_args: str,
    host: str = "127.0.0.1",
    served_model_name: str | None = DEFAULT_MODEL_NAME,
    python: str = sys.executable,
) -> list[str]:
    cmd = [python, FAKE_ENGINE_PATH, "--host", host, "--port", str(port)]
    if api_key is not None:
        cmd += ["--api-key", api_key]
    if served_model_name is not None and "--served-model-name" not in extra_args:
        cmd += ["--served-model-name", served_model_name]
    if "--model" not in extra_args:
        cmd += ["--model", "/models/fake"]
    cmd += [str(a) for a in extra_args]
    return cmd


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """Status code of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):
        return None


def wait_healthy(
    port: int,
    proc: subprocess.Popen[Any] | None = None,
    timeout: float = 15.0,
    host: str = "127.0.0.1",
) -> None:
    """Wait until GET /health answers 200; raise if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    url = f"http://{host}:{port}/health"
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"fake engine exited with code {proc.returncode} before healthy")
        if http_status(url, timeout=1.0) == 200:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"fake engine on port {port} not healthy after {timeout}s")
        time.sleep(0.02)


def start_fake_engine(
    port: int,
    api_key: str | None,
    *extra_args: str,
    served_model_name: str | None = DEFAULT_MODEL_NAME,
    timeout: float = 15.0,
    wait: bool = True,
    env: dict[str, str] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    new_session: bool = True,
) -> subprocess.Popen[bytes]:
    """Start fake_engine.py on 127.0.0.1:port and (by default) wait for /health == 200.

    On failure to become healthy the process tree is killed before raising.
    """
    cmd = fake_engine_command(port, api_key, *extra_args, served_model_name=served_model_name)
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env=env,
        start_new_session=new_session,
    )
    proc.own_process_group = new_session  # type: ignore[attr-defined]
    if wait:
        try:
            wait_healthy(port, proc, timeout)
        except BaseException:
            stop_fake_engine(proc, timeout=1.0)
            raise
    return proc


def pid_alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_fake_engine(
    proc: subprocess.Popen[Any], timeout: float = 5.0, extra_pids: tuple[int, ...] = ()
) -> int | None:
    """SIGTERM the engine, wait, then SIGKILL its whole process group and extra_pids.

    Safe to call twice and on an already-dead process. Returns the exit code.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=5)
    # The group outlives its leader while any member (e.g. a spawned child) lives.
    if getattr(proc, "own_process_group", False):
        kill_group(proc.pid)
    for pid in extra_pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return proc.returncode


def _json_request(url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def engine_stats(port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """GET /fake/stats."""
    return dict(_json_request(f"http://{host}:{port}/fake/stats"))


def engine_control(port: int, host: str = "127.0.0.1", **knobs: Any) -> dict[str, Any]:
    """POST /fake/control with knobs (hang=True, token_delay_ms=50, ...); returns stats."""
    return dict(_json_request(f"http://{host}:{port}/fake/control", knobs))


@dataclass
class FakeEngineHandle:
    proc: subprocess.Popen[bytes]
    port: int
    api_key: str | None
    model: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def stats(self) -> dict[str, Any]:
        return engine_stats(self.port)

    def control(self, **knobs: Any) -> dict[str, Any]:
        return engine_control(self.port, **knobs)


@contextlib.contextmanager
def fake_engine(
    *extra_args: str,
    api_key: str | None = "test-engine-key",
    port: int | None = None,
    served_model_name: str = DEFAULT_MODEL_NAME,
    **kwargs: Any,
) -> Iterator[FakeEngineHandle]:
    """Context manager: a healthy fake engine, whose whole tree is killed on exit."""
    port = port or free_port()
    proc = start_fake_engine(
        port, api_key, *extra_args, served_model_name=served_model_name, **kwargs
    )
    child: int | None = None
    try:
        with contextlib.suppress(Exception):
            child = engine_stats(port).get("child_pid")
        yield FakeEngineHandle(proc, port, api_key, served_model_name)
    finally:
        stop_fake_engine(proc, extra_pids=(child,) if child else ())
