"""Run `llm-appliance serve` as a real process for integration tests.

The daemon is started the way an admin would start it (its console script, a TOML
config, real signals), with engines replaced by the fake engine through the
``engine.command`` override. Teardown kills whatever is left of the daemon and every
engine tree, even when a test fails half-way.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.fakes.engine_proc import FAKE_ENGINE_PATH, free_port, free_port_run
from tests.fakes.uds_http import uds_request

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "appliance.cli"]


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def engine_count(config: dict[str, Any]) -> int:
    """How many CPU engines a test config starts: [engine].cpu_engines, or with
    [[models]] each model's own cpu_engines (default: [engine]'s)."""
    default = int(config.get("engine", {}).get("cpu_engines", 1))
    models = config.get("models") or []
    return sum(int(m.get("cpu_engines", default)) for m in models) if models else default


def write_config(path: Path, sections: dict[str, Any]) -> Path:
    """TOML from ``{section: {key: value}}``; a list of tables (``"models": [{...}]``)
    becomes one ``[[section]]`` block per table."""
    lines = []
    for name, values in sections.items():
        tables = values if isinstance(values, list) else [values]
        for table in tables:
            lines.append(f"[[{name}]]" if isinstance(values, list) else f"[{name}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
            lines.append("")
    path.write_text("\n".join(lines))
    return path


def fake_engine_config(
    tmp: Path, engines: int = 2, *fake_args: str, **overrides: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """A config whose engines are fake engines on free ports, checked fast."""
    gw_port = free_port()
    port_base = free_port_run(engines)
    cfg: dict[str, dict[str, Any]] = {
        "gateway": {"port": gw_port, "keys_file": str(tmp / "keys.json")},
        "engine": {
            "device": "cpu",
            "cpu_engines": engines,
            "port_base": port_base,
            # The engine key reaches the fake engine as VLLM_API_KEY, as it reaches vLLM.
            "command": [
                sys.executable,
                FAKE_ENGINE_PATH,
                "--served-model-name",
                "{served_model_name}",
                "--disable-uvicorn-access-log",
                *fake_args,
            ],
            "startup_timeout_s": 20,
            "stop_timeout_s": 5,
        },
        "telemetry": {"source": "none", "interval_s": 0.2},
        "health": {"interval_s": 0.3, "probe_timeout_s": 1.0, "failures_to_restart": 2},
        "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 1, "drain_timeout_s": 5},
    }
    for section, values in overrides.items():
        cfg.setdefault(section, {}).update(values)
    engine = cfg["engine"]
    if "command" not in overrides.get("engine", {}):
        tcp = engine.get("listen") == "tcp"
        engine["command"] += ["--port", "{port}"] if tcp else ["--uds", "{uds}"]
    return cfg


# Health checks on, but one answer that took a second on a loaded machine does not take
# an engine out of routing (SUSPECT): for tests that need every engine READY while they
# act (drain one, expect a model to answer itself, ...), not for tests of the checks.
STEADY_HEALTH: dict[str, Any] = {"probe_timeout_s": 5.0, "failures_to_restart": 5}


def real_engine_config(
    tmp: Path, engines: int = 2, **overrides: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """A config with ``engines`` real vLLM engines on CPU (what set-up made), on free ports.

    Nothing sets ``engine.command``: the real vLLM command line is what runs. Sections in
    ``overrides`` are merged key by key into the defaults.
    """
    cfg: dict[str, dict[str, Any]] = {
        "gateway": {"port": free_port(), "keys_file": str(tmp / "keys.json")},
        "engine": {
            "device": "cpu",
            "cpu_engines": engines,
            "port_base": free_port_run(engines),
            "max_model_len": 1024,
            "startup_timeout_s": 300,
            "cpu_kvcache_space_gib": 1,
        },
        "telemetry": {"source": "none"},
        # CPU engines under load are slow to answer the 1-token probe.
        "health": {"interval_s": 2, "probe_timeout_s": 20, "failures_to_restart": 3},
    }
    for section, values in overrides.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def get_json(
    url: str, timeout: float = 2.0, headers: dict[str, str] | None = None
) -> tuple[int | None, Any]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body or b"null")
        except ValueError:
            return e.code, body.decode(errors="replace")
    except (OSError, ValueError):
        return None, None


@dataclass
class Appliance:
    proc: subprocess.Popen[bytes]
    config: dict[str, dict[str, Any]]
    log_path: Path
    run_dir: Path
    known_pids: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config['gateway']['port']}"

    def engine_port(self, i: int) -> int:
        return int(self.config["engine"]["port_base"]) + i

    @property
    def over_tcp(self) -> bool:
        return bool(self.config["engine"].get("listen") == "tcp")

    def engine_socket(self, i: int) -> str:
        """Engine i's Unix socket (the daemon runs with RUNTIME_DIRECTORY = run_dir)."""
        return str(self.run_dir / f"engine{i}.sock")

    def engine_request(
        self,
        i: int,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 2.0,
    ) -> tuple[int | None, Any]:
        """Straight to engine i, over its socket or port: (status, JSON body or text)."""
        try:
            if self.over_tcp:
                conn = http.client.HTTPConnection("127.0.0.1", self.engine_port(i), timeout=timeout)
                try:
                    conn.request(method, path, body=body, headers=headers or {})
                    resp = conn.getresponse()
                    status, raw = resp.status, resp.read()
                finally:
                    conn.close()
            else:
                status, raw = uds_request(
                    self.engine_socket(i), method, path, body, headers, timeout
                )
        except (OSError, http.client.HTTPException):
            return None, None
        try:
            return status, json.loads(raw or b"null")
        except ValueError:
            return status, raw.decode(errors="replace")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> None:
        """/readyz is 200: *some* engine admits work (the contract's meaning). With more
        than one engine the others may still be STARTING: see :meth:`wait_all_ready`."""
        self.wait_for(lambda: get_json(self.url + "/readyz")[0] == 200, timeout, "readyz 200")

    def wait_all_ready(self, timeout: float = 30.0) -> None:
        """/readyz is 200 and lists every engine as READY.

        Engines start side by side, each pinned to its own cores: on a busy machine the
        one sharing a core with other work can be READY seconds after the first, so a
        test that touches every engine must wait for all of them, not for /readyz alone.
        """
        n = engine_count(self.config)

        def all_ready() -> bool:
            code, body = get_json(self.url + "/readyz")
            return (
                code == 200 and isinstance(body, dict) and body.get("engines_ready") == [*range(n)]
            )

        self.wait_for(all_ready, timeout, f"readyz 200 with all {n} engine(s) READY")

    def wait_for(self, cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not cond():
                raise AssertionError(
                    f"daemon exited ({self.proc.returncode}) before {what}:\n" + self.log()[-4000:]
                )
            if cond():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}:\n" + self.log()[-4000:])

    def engine_stats(self, i: int) -> dict[str, Any] | None:
        status, body = self.engine_request(i, "GET", "/fake/stats", timeout=1.0)
        return body if status == 200 else None

    def engine_control(self, i: int, **knobs: Any) -> None:
        self.engine_request(
            i,
            "POST",
            "/fake/control",
            json.dumps(knobs).encode(),
            {"Content-Type": "application/json"},
        )

    def tree(self) -> list[psutil.Process]:
        try:
            children: list[psutil.Process] = psutil.Process(self.proc.pid).children(recursive=True)
            return children
        except psutil.Error:
            return []

    def remember_tree(self) -> set[int]:
        pids = {p.pid for p in self.tree()}
        for i in range(engine_count(self.config)):
            stats = self.engine_stats(i)
            if stats and stats.get("child_pid"):
                pids.add(int(stats["child_pid"]))
        self.known_pids |= pids
        return pids

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("daemon did not exit:\n" + self.log()[-4000:]) from None


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
    return out


@contextlib.contextmanager
def run_appliance(
    tmp: Path,
    config: dict[str, Any],
    env: dict[str, str] | None = None,
    *,
    config_via_env: bool = False,
    tree: Path = REPO,
) -> Iterator[Appliance]:
    """The daemon, running: with `--config`, or as the unit runs it (``config_via_env``:
    the path in $LLM_APPLIANCE_CONFIG, so a missing file means defaults, not an error).
    ``tree``: whose code runs (a benchmark's ``git worktree`` of another commit)."""
    cfg_path = write_config(tmp / "config.toml", config)
    log_path = tmp / "appliance.log"
    full_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
    }
    full_env["PYTHONPATH"] = str(tree)
    full_env.setdefault("LLM_APPLIANCE_HOME", str(tmp / "home"))
    # As systemd's RuntimeDirectory= would: engine sockets land at a known place.
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700, exist_ok=True)
    full_env.setdefault("RUNTIME_DIRECTORY", str(run_dir))
    full_env.update(env or {})
    argv = [*CLI, "serve"]
    if config_via_env:
        full_env["LLM_APPLIANCE_CONFIG"] = str(cfg_path)
    else:
        argv += ["--config", str(cfg_path)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            # `python -m` puts the working directory first on sys.path.
            cwd=tree,
        )
    app = Appliance(proc, config, log_path, Path(full_env["RUNTIME_DIRECTORY"]))
    try:
        yield app
    finally:
        app.remember_tree() if proc.poll() is None else None
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        for pid in alive(app.known_pids):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        # Engines tagged by this daemon that we never saw (started after the last look).
        for p in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(p.info["cmdline"] or [])
                if FAKE_ENGINE_PATH in cmd and any(
                    f"--port {app.engine_port(i)}" in cmd or f"--uds {app.engine_socket(i)}" in cmd
                    for i in range(engine_count(config))
                ):
                    p.kill()
