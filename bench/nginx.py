"""nginx as the floor: a plain streaming reverse proxy in front of a fake engine's socket.

Any relay that reads and writes every chunk costs at least what nginx does, so the
gateway's figures are put beside it (bench.vs_nginx, issue #24). nginx comes from the
distribution's package: :func:`ensure_nginx` installs ``nginx-light`` (else ``nginx``)
with apt-get when it is missing and we are root, or says in one line why there is none.
Installing the package may start the distribution's own service (port 80); it is not
used here: each bench runs its own nginx, ``daemon off`` and one worker, from a
configuration in a temporary directory (``-p``), logs and temporary files there too.

The configuration is what a careful operator would write for streamed answers:
``proxy_buffering off`` (each chunk goes out as it comes), HTTP/1.1 upstream with
``Connection ""`` and ``keepalive 64`` (connections to the engine kept, as the gateway's
pool keeps them), the engine's Unix socket as the one upstream server.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

PACKAGES = ("nginx-light", "nginx")

CONFIG = """\
{user}worker_processes 1;
daemon off;
master_process on;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
  keepalive_requests 1000000;
  upstream engine {{
    server unix:{socket};
    keepalive 64;
    keepalive_requests 1000000;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 300s;
    }}
  }}
}}
"""


def nginx_binary() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None


def ensure_nginx() -> tuple[str | None, str]:
    """nginx's path, installing Debian's package when missing; else None and why not."""
    exe = nginx_binary()
    if exe is not None:
        return exe, "already installed"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None, "nginx is not installed, and apt-get as root is not available here"
    for pkg in PACKAGES:
        print(f"  installing {pkg} with apt-get (nginx is missing)", flush=True)
        done = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", pkg],
            capture_output=True,
            text=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            check=False,
        )
        exe = nginx_binary()
        if done.returncode == 0 and exe is not None:
            return exe, f"installed now ({pkg})"
    return None, f"apt-get could not install {' or '.join(PACKAGES)}"


def version(exe: str) -> str:
    out = subprocess.run([exe, "-v"], capture_output=True, text=True, check=False)
    return (out.stderr or out.stdout).strip().removeprefix("nginx version: ")


@dataclass
class Nginx:
    proc: subprocess.Popen[bytes]
    port: int
    tmp: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def processes(self) -> list[psutil.Process]:
        """The master and its worker: whose CPU is the proxy's."""
        master = psutil.Process(self.proc.pid)
        return [master, *master.children()]

    def log(self) -> str:
        path = self.tmp / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(n: Nginx, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if n.proc.poll() is not None:
            raise RuntimeError(f"nginx exited ({n.proc.returncode}):\n{n.log()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", n.port), 0.2):
            if len(n.processes()) > 1:  # the worker is up, not only the master
                return
        time.sleep(0.05)
    raise RuntimeError(f"nginx did not listen in time:\n{n.log()[-2000:]}")


@contextlib.contextmanager
def run_nginx(exe: str, upstream_socket: str) -> Iterator[Nginx]:
    """nginx on a free loopback port, relaying to ``upstream_socket``; stopped after."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
    # As root, the worker would drop to nobody, who cannot reach the daemon's socket.
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
    port = _free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(CONFIG.format(user=user, tmp=tmp, socket=upstream_socket, port=port))
    proc = subprocess.Popen(
        [exe, "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "error.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    n = Nginx(proc, port, tmp)
    try:
        _wait_listening(n)
        yield n
    finally:
        proc.terminate()  # SIGTERM: nginx's fast shutdown
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
