"""engine.listen = "tcp": a process that binds a dead engine's port gets nothing relayed.

Reproduces security issue #20 (item 2): the engine's HTTP server is SIGKILLed, another
account binds its port at once, and clients keep sending requests through the gateway.
Before, the relay sent that process the engine key and the users' prompts, and its own
text went back to the clients as a 200.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.fakes.appliance_proc import Appliance, fake_engine_config, run_appliance

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
MARK = "squatter-text"

# Binds the port the moment it is free (SO_REUSEADDR, as in the report: 14 ms after the
# kill), answers every request with its own text as a 200, and prints how many bytes
# each connection sent it before the answer, one line per connection.
SQUATTER = f"""
import socket, sys, time
port = int(sys.argv[1])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
print("waiting", flush=True)
while True:
    try:
        s.bind(("127.0.0.1", port))
        break
    except OSError:
        time.sleep(0.001)
s.listen(64)
print("bound", flush=True)
body = b'{{"choices": [{{"text": "{MARK}", "message": {{"content": "{MARK}"}}}}]}}'
while True:
    conn, _ = s.accept()
    conn.settimeout(1.0)
    got = b""
    try:
        while b"\\r\\n\\r\\n" not in got:
            chunk = conn.recv(65536)
            if not chunk:
                break
            got += chunk
        conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\n"
                     b"Content-Length: %d\\r\\n\\r\\n" % len(body) + body)
    except OSError:
        pass
    print("conn", len(got), flush=True)
    conn.close()
"""

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


def start_squatter(port: int) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    """The squatter as another account (uid 65534) when we are root, else as ourselves:
    either way a process outside the engine's tree."""
    as_root = os.geteuid() == 0 and SYSTEM_PYTHON is not None
    proc = subprocess.Popen(
        [SYSTEM_PYTHON if as_root else sys.executable, "-c", SQUATTER, str(port)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd="/",
        **({"user": 65534, "group": 65534, "extra_groups": []} if as_root else {}),
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.strip())

    threading.Thread(target=read, daemon=True).start()
    assert lines.get(timeout=20) == "waiting"
    return proc, lines


def ask(app: Appliance, key: str, stream: bool) -> tuple[int, str]:
    body = json.dumps(
        {"model": MODEL, "prompt": "my secret prompt", "max_tokens": 4, "stream": stream}
    ).encode()
    req = urllib.request.Request(
        app.url + "/v1/completions",
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wrapped_engine(command: list[str]) -> list[str]:
    """The fake engine's HTTP server as a child of the process the supervisor started
    (as with vLLM's API server processes under a parent): killing the server leaves the
    engine's root alive, so nothing but a check of the port itself can tell."""
    return ["/bin/sh", "-c", f"{shlex.join(command)}; sleep 600"]


@pytest.mark.parametrize("first_streamed", [False, True], ids=["aiohttp-client", "splice"])
def test_a_squatter_on_a_dead_engine_s_port_gets_nothing_relayed(
    tmp_path: Path, first_streamed: bool
) -> None:
    """The first request after the kill takes the relay's aiohttp path (a whole answer)
    or its splice pool (an HTTP/1.1 stream): both check their new connection."""
    cfg = fake_engine_config(
        tmp_path,
        2,
        engine={"listen": "tcp"},
        # Checks only when asked: the first (while starting) and the gateway's.
        health={"interval_s": 600, "probe_timeout_s": 5.0},
        restart={"max_restarts_per_hour": 1, "backoff_initial_s": 0.1},
    )
    cfg["engine"]["command"] = wrapped_engine(cfg["engine"]["command"])
    port = cfg["engine"]["port_base"]
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        stats = app.engine_stats(0)
        assert stats is not None
        squatter, lines = start_squatter(port)
        try:
            os.kill(stats["pid"], signal.SIGKILL)  # engine0's HTTP server
            assert lines.get(timeout=20) == "bound"
            answers = [ask(app, key, stream=(i % 2 == 0) == first_streamed) for i in range(6)]
            for status, text in answers:  # engine1's answers, or a clean error
                assert status in (200, 502, 503), (status, text)
                assert MARK not in text, "the squatter answered a client"
            assert [s for s, _ in answers].count(200) >= 5  # engine1 answered
            app.wait_for(lambda: f"port {port} is held by" in app.log(), 30, "supervisor check")
            log = app.log()
        finally:
            squatter.kill()
            squatter.wait()
        sent = []
        while not lines.empty():
            line = lines.get()
            if line.startswith("conn "):
                sent.append(int(line.split()[1]))
    # Not a byte of any request (the engine key, a prompt) reached the squatter.
    assert sent and set(sent) == {0}, sent
    refused = f"engine0: a new connection to 127.0.0.1:{port} did not reach the engine's own"
    assert log.count(refused) == 1, log  # said once, not per request
    assert "nothing was sent" not in log
    if os.geteuid() == 0 and SYSTEM_PYTHON is not None:
        assert "of uid 65534" in log
