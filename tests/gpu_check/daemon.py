"""The daemon under check: `python -m appliance.cli serve --config <toml>`, run from the
checkout as an operator would run it, with stand-in GPU engines (fake_engine.py
``--gpu-share``) in place of vLLM; and how the check talks to it (HTTP with the admin key
first start wrote, signals, its log)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from tests.fakes.appliance_proc import write_config
from tests.fakes.engine_proc import FAKE_ENGINE_PATH, free_port

REPO = Path(__file__).resolve().parents[2]
MODEL = "gpu-check"
T = TypeVar("T")
# "2026-11-26 03:23:57,123 INFO appliance.supervisor.runner: engine-0: EXITED -> STARTING"
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


class CheckFailed(Exception):
    """One check cannot go on; the message is its ✗ line's figure."""


def base_config(
    work: Path, python: str, share: float, engine_env: dict[str, str]
) -> dict[str, Any]:
    """GPU engines on every GPU NVML shows, one per GPU, fed by NVML telemetry."""
    return {
        "gateway": {"port": free_port(), "keys_file": str(work / "keys.json")},
        "engine": {
            "device": "cuda",
            "served_model_name": MODEL,
            "command": [
                python,
                FAKE_ENGINE_PATH,
                "--served-model-name",
                "{served_model_name}",
                "--uds",
                "{uds}",
                "--disable-uvicorn-access-log",
                "--token-delay-ms",
                "1",
                "--gpu-share",
                str(share),
            ],
            "env": engine_env,
            # What `doctor` expects free on each GPU at an engine's start. Where NVML
            # lists our engines under PIDs this namespace cannot see (a container), it
            # takes their memory for a stranger's: 0.5 leaves room for that.
            "gpu_memory_utilization": 0.5,
            # torch's import and CUDA's start take a while on a cold box.
            "startup_timeout_s": 180,
            "stop_timeout_s": 10,
        },
        "telemetry": {"source": "nvml", "interval_s": 0.25},
        "thermal": {"soft_limit_c": 80, "hard_limit_c": 87},
        "health": {"interval_s": 1.0, "probe_timeout_s": 10.0, "failures_to_restart": 3},
        "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 1, "drain_timeout_s": 5},
    }


@dataclass
class Daemon:
    work: Path
    python: str
    env: dict[str, str]
    config: dict[str, Any]
    proc: subprocess.Popen[bytes] | None = None
    pids_seen: set[int] = field(default_factory=set)

    @property
    def config_path(self) -> Path:
        return self.work / "config.toml"

    @property
    def log_path(self) -> Path:
        return self.work / "daemon.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config['gateway']['port']}"

    def start(self) -> None:
        write_config(self.config_path, self.config)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", "appliance.cli", "serve", "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO,
            )
        self.pids_seen.add(self.proc.pid)

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """`llm-appliance ARGS --config <ours>`, with the daemon's environment."""
        argv = [self.python, "-m", "appliance.cli", *args, "--config", str(self.config_path)]
        return subprocess.run(
            argv, env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout
        )

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def admin_key(self) -> str:
        return (self.work / "admin.key").read_text().strip()

    def request(
        self, path: str, body: dict[str, Any] | None = None, timeout: float = 30
    ) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data)
        req.add_header("Authorization", f"Bearer {self.admin_key}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def status(self) -> dict[str, Any]:
        code, body = self.request("/admin/status", timeout=10)
        if code != 200:
            raise CheckFailed(f"/admin/status answered {code}: {body[:200]!r}")
        doc: dict[str, Any] = json.loads(body)
        self.pids_seen.update(e["pid"] for e in doc["engines"] if e.get("pid"))
        return doc

    def wait_for(self, probe: Callable[[], T | None], timeout: float, what: str) -> T:
        """``probe()``'s first true answer; CheckFailed (with the log) if the daemon
        exits or ``timeout`` passes first. Errors from ``probe`` count as "not yet"."""
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise CheckFailed(  # one line: the log's end (all of it is in daemon.log)
                    f"the daemon exited ({self.proc.returncode}) while waiting for {what}: "
                    + " | ".join(self.log_tail(4).splitlines())
                )
            try:
                got = probe()
                if got:
                    return got
            except (OSError, ValueError, KeyError, CheckFailed) as exc:
                last = f" (last: {exc})"
            if time.monotonic() > deadline:
                raise CheckFailed(f"no {what} after {timeout:.0f} s{last}")
            time.sleep(0.1)

    def engines_ready(self) -> list[dict[str, Any]] | None:
        engines = self.status()["engines"]
        ok = engines and all(e["state"] == "READY" for e in engines)
        return list(engines) if ok else None

    def reload(self, **sections: dict[str, Any]) -> None:
        """Rewrite the config with ``sections`` merged in, then SIGHUP."""
        for name, values in sections.items():
            self.config.setdefault(name, {}).update(values)
        write_config(self.config_path, self.config)
        self.signal(signal.SIGHUP)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def log_events(self, pattern: str, after: float = 0.0) -> list[tuple[float, str]]:
        """(wall time, line) of the daemon's log lines matching ``pattern``."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            stamp = _STAMP.match(line)
            if stamp is None or not re.search(pattern, line):
                continue
            when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if when >= after:
                out.append((when, line))
        return out

    def stop(self, timeout: float = 90) -> int | None:
        """SIGTERM, as systemd stops it; SIGKILL after ``timeout`` (None returned)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


def daemon_env(repo: Path, shim_dir: Path | None, run_id: str, work: Path) -> dict[str, str]:
    """The daemon's environment: our tree (behind the fake pynvml's directory, if any)
    on PYTHONPATH, its state and sockets under ``work``, and a mark on every process."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM")
    }
    path = [str(repo)] if shim_dir is None else [str(shim_dir), str(repo)]
    # Kept after ours: wheels carried to a GPU machine (docs/gpu-check.md) live there.
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    path += [p for p in inherited if p and p not in path]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["LLM_APPLIANCE_HOME"] = str(work / "home")
    run = work / "run"
    run.mkdir(mode=0o700, exist_ok=True)
    env["RUNTIME_DIRECTORY"] = str(run)
    env["GPU_CHECK_RUN"] = run_id
    return env
