"""A real vllm-router (the vLLM project's router, PyPI ``vllm-router``: a Rust binary in
a wheel) in front of appliance gateways, for integration tests and benchmarks.

The router is installed once into a throw-away venv under the user cache
(``$XDG_CACHE_HOME/llm-appliance/vllm-router-<version>``) and reused; a machine where
PyPI cannot be reached skips the tests that need it, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.fakes.engine_proc import free_port

# The version the Ansible role installs by default (llm_appliance_router_version).
ROUTER_VERSION = "0.1.17"


def router_venv() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "llm-appliance" / f"vllm-router-{ROUTER_VERSION}"


def install_router() -> Path | str:
    """The vllm-router executable, installed if needed; else why it cannot be had.

    A marker file is written last: a venv left half-made by an interrupted run is made
    again, never used."""
    venv = router_venv()
    exe, marker = venv / "bin" / "vllm-router", venv / "installed"
    if marker.exists() and exe.exists():
        return exe
    shutil.rmtree(venv, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        done = subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "-q",
                f"vllm-router=={ROUTER_VERSION}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot install vllm-router=={ROUTER_VERSION} into {venv}: {exc}"
    if done.returncode != 0:
        return f"pip could not install vllm-router=={ROUTER_VERSION}: {done.stderr[-400:]}"
    marker.write_text(ROUTER_VERSION)
    return exe


def http(
    method: str,
    url: str,
    body: Any = None,
    key: str | None = None,
    timeout: float = 10.0,
) -> tuple[int | None, Any]:
    """(status, JSON body or text); status None when nothing answered."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (OSError, ValueError):
        return None, None
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class Router:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> dict[str, bool]:
        """Each worker URL -> whether the router routes to it now."""
        status, body = http("GET", self.url + "/workers", timeout=2.0)
        if status != 200 or not isinstance(body, dict):
            return {}
        return {w["url"]: bool(w["is_healthy"]) for w in body.get("workers", [])}

    def wait_for(self, cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm-router exited before {what}:\n{self.log()[-3000:]}")
            if cond():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log()[-3000:]}")


# Health checks every second, two misses to leave, one answer to come back: the figures
# the Ansible role sets too (llm_appliance_router_health_*), so tests see what users see.
HEALTH_ARGS: tuple[str, ...] = (
    "--health-check-endpoint",
    "/readyz",
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "2",
    "--health-success-threshold",
    "1",
    "--worker-startup-check-interval",
    "1",
)


@contextlib.contextmanager
def run_router(
    exe: Path,
    tmp: Path,
    workers: Sequence[str],
    *extra: str,
    policy: str = "round_robin",
    health: Sequence[str] = HEALTH_ARGS,
) -> Iterator[Router]:
    """``health``: its health-check arguments (the workers' endpoint and pace)."""
    port = free_port()
    log_path = tmp / "router.log"
    argv = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers]
    argv += ["--policy", policy, "--prometheus-port", str(free_port()), *health, *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    router = Router(proc, port, log_path)
    try:
        yield router
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
