"""Who can reach what, and what never leaks: checked against a running daemon."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.fakes.appliance_proc import REPO, Appliance, fake_engine_config, run_appliance

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Appliance, Path, str]]:
    tmp = tmp_path_factory.mktemp("security")
    cfg = fake_engine_config(
        tmp, 2, gateway={"keys_file": str(tmp / "state" / "keys.json"), "max_body_bytes": 4096}
    )
    with run_appliance(tmp, cfg) as app:
        app.wait_all_ready()  # the tests look at both engines
        key = (tmp / "state" / "admin.key").read_text().strip()
        yield app, tmp, key


def call(
    url: str,
    method: str = "GET",
    key: str | None = None,
    body: bytes | None = None,
    timeout: float = 5,
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


ROUTES = [
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("GET", "/metrics"),
    ("GET", "/admin/status"),
    ("POST", "/admin/engines/0/restart"),
    ("POST", "/admin/engines/0/drain"),
    ("POST", "/admin/engines/0/resume"),
    ("GET", "/admin/keys"),
    ("POST", "/admin/keys"),
    ("DELETE", "/admin/keys/abcdef01"),
]


def test_every_route_but_health_needs_a_key(daemon: tuple[Appliance, Path, str]) -> None:
    app, _, _ = daemon
    for method, path in ROUTES:
        status, headers, body = call(
            app.url + path, method, body=b"{}" if method == "POST" else None
        )
        assert status == 401, (method, path, status)
        assert headers.get("WWW-Authenticate", "").startswith("Bearer")
        assert json.loads(body)["error"]["type"] == "authentication_error"
    for path in ("/healthz", "/readyz"):
        assert call(app.url + path)[0] == 200


def test_scopes_are_enforced_per_route(daemon: tuple[Appliance, Path, str]) -> None:
    app, tmp, _ = daemon
    keys: dict[str, str] = {}
    for scope in ("user", "metrics"):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "appliance.cli",
                "keys",
                "create",
                "--name",
                scope,
                "--scope",
                scope,
                "--config",
                str(tmp / "config.toml"),
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            check=True,
        )
        keys[scope] = out.stdout.splitlines()[0].strip()
    # The daemon sees key changes within 2 s (test_gateway_keys times that): here, wait
    # until both keys are known to it.
    app.wait_for(
        lambda: all(call(app.url + "/v1/models", "GET", k)[0] != 401 for k in keys.values()),
        10,
        "the new keys in force",
    )
    for method, path in ROUTES:
        for scope, key in keys.items():
            status, _, body = call(
                app.url + path, method, key, body=b"{}" if method == "POST" else None
            )
            needed = (
                "user" if path.startswith("/v1") else "metrics" if path == "/metrics" else "admin"
            )
            if scope == needed:
                assert status not in (401, 403), (scope, method, path, status)
            else:
                assert status == 403, (scope, method, path, status)
                assert json.loads(body)["error"]["type"] == "permission_error"


def test_engines_listen_only_on_private_unix_sockets_and_want_their_key(
    daemon: tuple[Appliance, Path, str],
) -> None:
    app, tmp, key = daemon
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    run_dir = os.stat(tmp / "run")
    assert stat.S_IMODE(run_dir.st_mode) == 0o700 and run_dir.st_uid == os.geteuid()
    for i in range(2):
        path = app.engine_socket(i)
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert app.engine_request(i, "POST", "/v1/completions", body)[0] == 401
        # The gateway's keys mean nothing to an engine.
        auth = {"Authorization": f"Bearer {key}"}
        assert app.engine_request(i, "POST", "/v1/completions", body, auth)[0] == 401
        stats = app.engine_stats(i)
        assert stats is not None
        # No TCP listener anywhere in the engine's tree.
        tree = psutil.Process(stats["pid"])
        for proc in [tree, *tree.children(recursive=True)]:
            listening = [c for c in proc.net_connections("inet") if c.status == "LISTEN"]
            assert listening == [], (proc.pid, listening)


OTHER_USER_PROBE = """
import json, socket, sys
out = {}
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        s.sendall(b"POST /invocations HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 2\\r\\n\\r\\n{}")
        out[path] = "connected: " + s.recv(200).decode(errors="replace")
    except OSError as exc:
        out[path] = type(exc).__name__
    finally:
        s.close()
print(json.dumps(out))
"""


# The probe runs as another account, which cannot enter root's home where the venv lives.
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a probe as another user")
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 for the probe")
def test_another_local_user_reaches_nothing_of_an_engine(
    daemon: tuple[Appliance, Path, str],
) -> None:
    """vLLM's own key leaves /invocations, /tokenize and more open; the private socket
    directory keeps every other account away from all of it."""
    app, _, _ = daemon
    paths = [app.engine_socket(i) for i in range(2)]
    probe = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", OTHER_USER_PROBE, *paths],
        user=65534,
        group=65534,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
    )
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout) == {p: "PermissionError" for p in paths}


def test_default_bind_is_loopback() -> None:
    from appliance.config import Config

    assert Config().gateway.host == "127.0.0.1" and not Config().gateway.allow_lan


def test_no_secret_in_logs_metrics_status_or_keys_file(daemon: tuple[Appliance, Path, str]) -> None:
    app, tmp, key = daemon
    secret = key.rsplit("-", 1)[-1]
    engine_keys = []
    for i in range(2):
        stats = app.engine_stats(i)
        assert stats is not None
        proc = psutil.Process(stats["pid"])
        engine_keys.append(proc.environ()["VLLM_API_KEY"])
        assert not any(engine_keys[-1] in a for a in proc.cmdline())
    call(
        app.url + "/v1/completions",
        "POST",
        key,
        json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode(),
    )
    texts = {
        "log": app.log(),
        "metrics": call(app.url + "/metrics", key=key)[2].decode(),
        "status": call(app.url + "/admin/status", key=key)[2].decode(),
        "keys file": (tmp / "state" / "keys.json").read_text(),
        "keys list": subprocess.run(
            [
                sys.executable,
                "-m",
                "appliance.cli",
                "keys",
                "list",
                "--config",
                str(tmp / "config.toml"),
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
        ).stdout,
        "status cli": subprocess.run(
            [
                sys.executable,
                "-m",
                "appliance.cli",
                "status",
                "--json",
                "--config",
                str(tmp / "config.toml"),
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
        ).stdout,
    }
    assert '"engines"' in texts["status cli"]
    for where, text in texts.items():
        assert secret not in text, where
        for ek in engine_keys:
            assert ek not in text, where


def test_keys_file_and_state_dir_permissions(daemon: tuple[Appliance, Path, str]) -> None:
    _, tmp, _ = daemon
    state = tmp / "state"
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    for name in ("keys.json", "admin.key"):
        assert stat.S_IMODE(os.stat(state / name).st_mode) == 0o600, name


def test_bodies_and_headers_at_and_beyond_limits(daemon: tuple[Appliance, Path, str]) -> None:
    app, _, key = daemon
    base = {"model": MODEL, "max_tokens": 1, "prompt": ""}
    room = 4096 - len(json.dumps(base))
    at_limit = json.dumps({**base, "prompt": "x" * room}).encode()
    assert len(at_limit) == 4096
    assert call(app.url + "/v1/completions", "POST", key, at_limit)[0] == 200
    over = json.dumps({**base, "prompt": "x" * (room + 1)}).encode()
    status, _, body = call(app.url + "/v1/completions", "POST", key, over)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    # A header line longer than the server's limit is refused, and nothing breaks.
    with socket.create_connection(("127.0.0.1", int(app.url.rsplit(":", 1)[1])), 5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        assert s.recv(100).split(b" ")[1] == b"400"
    assert call(app.url + "/healthz")[0] == 200


def test_slow_clients_do_not_block_others(daemon: tuple[Appliance, Path, str]) -> None:
    app, _, key = daemon
    port = int(app.url.rsplit(":", 1)[1])
    daemon_proc = psutil.Process(app.proc.pid)
    rss_before = daemon_proc.memory_info().rss
    # Slowloris: 100 connections that send half a request line and stall.
    stalled = []
    for _ in range(100):
        s = socket.create_connection(("127.0.0.1", port), 5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
        stalled.append(s)
    # A reader that never reads: a long stream nobody consumes.
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3000, "stream": True}).encode()
    lazy = socket.create_connection(("127.0.0.1", port), 5)
    lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lazy.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + key.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    try:
        started = time.monotonic()
        results: list[int] = []

        def ask() -> None:
            results.append(
                call(
                    app.url + "/v1/completions",
                    "POST",
                    key,
                    json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4}).encode(),
                )[0]
            )

        threads = [threading.Thread(target=ask) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert results == [200] * 10
        assert time.monotonic() - started < 10
        time.sleep(1.0)
        grown = daemon_proc.memory_info().rss - rss_before
        assert grown < 50 * 2**20, f"daemon RSS grew {grown / 2**20:.1f} MiB"
    finally:
        for s in stalled:
            s.close()
        lazy.close()
    assert call(app.url + "/healthz")[0] == 200


def test_every_spawn_gets_a_new_engine_key_and_the_old_one_dies_with_it(tmp_path: Path) -> None:
    cfg = fake_engine_config(tmp_path, 1)
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        first = app.engine_stats(0)
        assert first is not None
        old_key = psutil.Process(first["pid"]).environ()["VLLM_API_KEY"]
        app.engine_control(0, crash=True)
        app.wait_for(
            lambda: (s := app.engine_stats(0)) is not None and s["pid"] != first["pid"],
            20,
            "engine0 restarted",
        )
        app.wait_ready()
        second = app.engine_stats(0)
        assert second is not None
        new_key = psutil.Process(second["pid"]).environ()["VLLM_API_KEY"]
        assert new_key != old_key
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        old = {"Authorization": f"Bearer {old_key}", "Content-Type": "application/json"}
        assert app.engine_request(0, "POST", "/v1/completions", body, old)[0] == 401


class Squatter:
    """A local process's HTTP server on an engine's port: answers 200 to anything and
    records every request, so a test sees whether the supervisor sent it a key."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.requests: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(1)
                try:
                    self.requests.append(conn.recv(65536))
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(5)


def test_a_squatter_on_a_tcp_engine_port_is_named_and_never_sent_a_key(tmp_path: Path) -> None:
    """engine.listen = "tcp": another process binds the engine's port while the engine is
    still loading (vLLM binds only after its imports). It must get nothing from us."""
    cfg = fake_engine_config(
        tmp_path,
        1,
        "--startup-delay",
        "3",
        engine={"listen": "tcp"},
        restart={"max_restarts_per_hour": 1, "backoff_initial_s": 0.1},
    )
    port = cfg["engine"]["port_base"]
    with run_appliance(tmp_path, cfg) as app:
        app.wait_for(lambda: "engine0: starting on" in app.log(), 20, "engine0 spawned")
        squatter = Squatter(port)  # after our port check, before the engine binds
        try:
            assert app.wait_exit(60) == 3  # the engine never ran; nothing else was used
            log = app.log()
        finally:
            squatter.close()
    assert f"port {port} is held by" in log and f"(pid {os.getpid()})" in log
    assert squatter.requests == []  # not even /health, let alone the key
    assert "-> READY" not in log


def test_a_command_asking_for_the_key_gets_it_but_the_log_never_shows_it(tmp_path: Path) -> None:
    """{api_key} in engine.command still works (check-config warns), and the start log
    redacts the key inside any argument, not only an argument equal to it."""
    cfg = fake_engine_config(tmp_path, 1)
    cfg["engine"]["command"] = [*cfg["engine"]["command"], "--api-key={api_key}"]
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        stats = app.engine_stats(0)
        assert stats is not None
        proc = psutil.Process(stats["pid"])
        key = proc.environ()["VLLM_API_KEY"]
        assert f"--api-key={key}" in proc.cmdline()
        log = app.log()
    assert "--api-key=***" in log
    assert key not in log
