"""The front host under a real systemd: ansible/front.yml converges, and vllm-router runs
from systemd/vllm-router.service as the role installs it.

It shares the session's container and its installed appliance (fake engines): that
gateway, on 127.0.0.1:8080, is the box the router fronts, so the front host is here one
of the boxes and the router listens on 8090. The role runs twice per converge need:
first its install tasks alone in the host's network (pip fetches vllm-router, the
version the role pins, from the package index), then the whole play in the container's
own network, where the router's wait for its /health must succeed.

What it proves: the play converges and a second run changes nothing; the router listens
on loopback only (a client on a LAN address is refused) unless ``allow_lan`` is said;
on this host only root and the named caller (the reverse proxy's account) reach it: another
local account can neither add a worker of its own nor serve the router's port while
the router is down, and turning ``restrict_local`` off is what lets it in again;
the unit's hardening applies to the running process; requests reach the box, which
checks the key, and the key stays out of the journal; a killed router is restarted by
systemd; and a box behind TLS with a private CA is reached through the role's
``llm_appliance_router_ca_file``. About 7 min on a 2-core machine, most of it pip and
the converges (nine of the front play).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.fakes import ansible_in_container as ai
from tests.fakes import systemd_container as sc
from tests.fakes.router_proc import ROUTER_VERSION, install_router

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

UNIT = "vllm-router.service"
ACCESS_UNIT = "vllm-router-access.service"
CALLER = "llm-proxy"  # the reverse proxy's account, named in local_callers
OTHER = "mallory"  # any other local account
PORT = 8090  # the box's gateway has 8080 on this host
INVENTORY = "/srv/front-inventory.ini"
INVENTORY_TEXT = f"""\
[llm_appliance]
box1 ansible_host=127.0.0.1 llm_appliance_gateway_port={sc.GATEWAY_PORT}

[llm_appliance_router]
localhost ansible_connection=local ansible_python_interpreter={sc.SYSTEM_PYTHON}
"""
DEFAULTS: dict[str, object] = {
    "llm_appliance_router_source_dir": ai.SRC,
    "llm_appliance_router_port": PORT,
    "llm_appliance_router_wait_ready_timeout": 60,
    "llm_appliance_router_local_callers": [CALLER],
}
LAN_BOX, LAN_CLIENT = "192.0.2.10", "192.0.2.20"  # TEST-NET-1: never a real network
CHAT = {
    "model": "smollm2-135m-instruct",
    "max_tokens": 5,
    "messages": [{"role": "user", "content": "hi"}],
}

# The key comes on standard input, never on the command line: runuser logs its session
# to the journal with its whole command line (_CMDLINE), and the journal must hold no key.
_HTTP = """
import sys, urllib.request, urllib.error
url, body, method, timeout = sys.argv[1:5]
key = sys.stdin.readline().strip()
h = {"Content-Type": "application/json"}
if key:
    h["Authorization"] = "Bearer " + key
req = urllib.request.Request(url, data=body.encode() if body else None, headers=h, method=method)
try:
    r = urllib.request.urlopen(req, timeout=float(timeout))
    code, out = r.status, r.read().decode(errors="replace")
except urllib.error.HTTPError as e:
    code, out = e.code, e.read().decode(errors="replace")
except OSError as e:
    code, out = 0, repr(e)
print(code)
print(out)
"""

# The TLS box: any GET answers 200 (the router's /health and /readyz checks), a POST
# answers a marker, over HTTPS with a certificate from a CA of the test's own.
_TLS_BOX = """
import http.server, json, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    def reply(self, body):
        b = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        self.reply({"status": "ok"})
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.reply({"answered_by": "tls-box"})
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[2], sys.argv[3])
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
"""

# Another account's server on the router's port while the router is down: it prints
# whatever reaches it (the journal of its unit) and answers 200.
_SQUATTER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(5)
    try:
        print("got", c.recv(65536), flush=True)
        c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\nConnection: close\\r\\n\\r\\n{}")
    except OSError as e:
        print("error", repr(e), flush=True)
    c.close()
"""


def wait_for(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


@dataclass
class Front:
    """The front host converged in the session's container, with helpers."""

    app: sc.InstalledAppliance
    first: tuple[int, str, float]  # the first whole converge: rc, output, seconds
    install_s: float
    lan_pid: str = ""  # a process in a network namespace of its own: the LAN client

    @property
    def box(self) -> sc.SystemdContainer:
        return self.app.box

    def converge(self, log: str, **extra: object) -> tuple[int, str, float]:
        return ai.playbook(
            self.box, "front.yml", INVENTORY, {**DEFAULTS, **extra}, log=log, timeout=300
        )

    def state(self) -> dict[str, str]:
        return self.box.show(
            UNIT, "ActiveState", "SubState", "MainPID", "NRestarts", "UnitFileState", "Result"
        )

    def http(
        self,
        url: str,
        key: str = "",
        body: Any = None,
        from_lan: bool = False,
        user: str = "",
        method: str = "",
        timeout: float = 10.0,
    ) -> tuple[int, str]:
        """One request from inside the container (or from the LAN client): (status, body).

        ``user``: sent by that local account rather than root."""
        data = json.dumps(body) if body else ""
        argv = [
            sc.SYSTEM_PYTHON,
            "-c",
            _HTTP,
            url,
            data,
            method or ("POST" if data else "GET"),
        ]
        argv.append(str(timeout))
        if user:
            argv = ["runuser", "-u", user, "--", *argv]
        if from_lan:
            argv = ["nsenter", "-t", self.lan_pid, "-n", *argv]
        r = self.box.run(argv, timeout=60, input=key + "\n")
        code, _, out = r.stdout.partition("\n")
        return int(code or 0), out

    def listening(self) -> list[str]:
        """The local addresses the router's main process listens on for PORT."""
        pid = self.state()["MainPID"]
        out = self.box.run(["ss", "-Hltnp", f"sport = :{PORT}"], check=True).stdout
        return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


def lan_client(box: sc.SystemdContainer) -> str:
    """A LAN for the container: LAN_BOX on a veth here, LAN_CLIENT in its own namespace.

    Returns the client's pid ("" when veth is not available here)."""
    pid = box.run("unshare -n sleep 3600 >/dev/null 2>&1 & echo $!", check=True).stdout.strip()
    r = box.run(
        f"ip link add lan0 type veth peer name lan1 && ip link set lan1 netns {pid} && "
        f"ip addr add {LAN_BOX}/24 dev lan0 && ip link set lan0 up && "
        f"nsenter -t {pid} -n sh -c 'ip link set lo up && "
        f"ip addr add {LAN_CLIENT}/24 dev lan1 && ip link set lan1 up'"
    )
    if r.returncode != 0:
        box.run(["kill", pid])
        return ""
    return pid


@pytest.fixture(scope="module")
def front(installed_appliance: sc.InstalledAppliance) -> Iterator[Front]:
    """The role converged on the container (router in front of the appliance there)."""
    for reason in (ai.unavailable_reason(), install_router()):
        if isinstance(reason, str):
            pytest.skip(reason)
    app = installed_appliance.use_fake_engines()
    app.box.run(["systemctl", "start", sc.UNIT_NAME], check=True, timeout=120)
    ai.copy_checkout(app.box)
    app.box.write(INVENTORY, INVENTORY_TEXT)
    for user in (CALLER, OTHER):
        if app.box.run(["id", "-u", user]).returncode != 0:
            app.box.run(["useradd", "--no-create-home", "--shell", "/bin/sh", user], check=True)
    rc, out, install_s = ai.playbook(
        app.box,
        "front.yml",
        INVENTORY,
        {**DEFAULTS, "llm_appliance_router_manage_service": False},
        log="front-install.txt",
        timeout=600,
        args=("--tags", "llm_appliance_router_install"),
        host_network=True,
    )
    assert rc == 0, f"the router's install failed (rc {rc}):\n{ai.failed_tasks(out)}"
    print(f"\n[front] vllm-router {ROUTER_VERSION} installed by the role in {install_s:.1f} s")
    first = ai.playbook(
        app.box, "front.yml", INVENTORY, DEFAULTS, log="front-converge-1.txt", timeout=300
    )
    result = Front(app, first, install_s)
    result.lan_pid = lan_client(app.box)
    try:
        yield result
    finally:
        app.box.run(["systemctl", "stop", UNIT], timeout=60)
        if result.lan_pid:
            app.box.run(["kill", result.lan_pid])


def test_front_play_converges_then_changes_nothing(front: Front) -> None:
    rc, out, took = front.first
    assert rc == 0, f"the converge failed (rc {rc}):\n{ai.failed_tasks(out)}"
    assert ai.recap(out)["changed"] > 0
    state = front.state()
    assert (state["ActiveState"], state["SubState"]) == ("active", "running"), state
    assert state["UnitFileState"] == "enabled", state
    access = front.box.show(ACCESS_UNIT, "ActiveState", "UnitFileState")
    assert access == {"ActiveState": "active", "UnitFileState": "enabled"}, access
    unit = front.box.run(["cat", f"/etc/systemd/system/{UNIT}"], check=True).stdout
    assert unit == (sc.REPO / "systemd" / UNIT).read_text(), "the unit is not installed unchanged"

    rc, out, again = front.converge("front-converge-2.txt")
    assert rc == 0, f"the second converge failed (rc {rc}):\n{ai.failed_tasks(out)}"
    assert ai.recap(out)["changed"] == 0, "changed:\n" + "\n".join(ai.changed_tasks(out))
    after = front.state()
    assert after["MainPID"] == state["MainPID"], f"restarted: {state} -> {after}"
    print(f"\n[front] converge {took:.1f} s, again {again:.1f} s (nothing changed)")


def test_router_listens_on_loopback_only(front: Front) -> None:
    assert front.listening() == [f"127.0.0.1:{PORT}"], front.listening()
    assert front.http(f"http://127.0.0.1:{PORT}/health")[0] == 200
    if not front.lan_pid:
        pytest.skip("no veth here: the listening address above is all that was checked")
    code, out = front.http(f"http://{LAN_BOX}:{PORT}/health", from_lan=True)
    # Refused, not unreachable: the LAN reached the host, and nothing listens there.
    assert (code, "ConnectionRefusedError" in out) == (0, True), (code, out)


def test_router_on_the_lan_only_with_allow_lan(front: Front) -> None:
    if not front.lan_pid:
        pytest.skip("no veth here for a LAN client")
    try:
        rc, out, _ = front.converge(
            "front-converge-lan.txt",
            llm_appliance_router_host="0.0.0.0",
            llm_appliance_router_allow_lan=True,
        )
        assert rc == 0, f"the converge failed (rc {rc}):\n{ai.failed_tasks(out)}"
        assert front.listening() == [f"0.0.0.0:{PORT}"], front.listening()
        # Through the router to the box, which asks for a key: the whole path works.
        code, body = front.http(f"http://{LAN_BOX}:{PORT}/v1/models", from_lan=True)
        assert code == 401 and "missing_api_key" in body, (code, body)
    finally:
        rc, out, _ = front.converge("front-converge-back.txt")
        assert rc == 0, ai.failed_tasks(out)
    assert front.http(f"http://{LAN_BOX}:{PORT}/health", from_lan=True)[0] == 0


def test_router_runs_with_the_units_hardening(front: Front) -> None:
    r = front.box.run(["systemd-analyze", "security", "--no-pager", UNIT], check=True)
    m = re.search(rf"Overall exposure level for {UNIT}: (\d+\.\d+)", r.stdout)
    assert m and float(m.group(1)) <= 2.0, r.stdout[-2000:]

    pid = front.state()["MainPID"]
    status = dict(
        line.split(":", 1)
        for line in front.box.run(["cat", f"/proc/{pid}/status"]).stdout.splitlines()
    )
    uid = int(status["Uid"].split()[0])
    assert len(set(status["Uid"].split())) == 1, status["Uid"]
    # DynamicUser=yes takes the role's static system account of the unit's name (the
    # access table names its uid), with the same sandbox as a dynamic one.
    user = front.box.run(["getent", "passwd", str(uid)], check=True).stdout
    assert user.startswith("vllm-router:") and uid < 1000, user
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"  # SystemCallFilter= applies
    for caps in ("CapPrm", "CapEff", "CapBnd"):
        assert int(status[caps], 16) == 0, (caps, status[caps])

    # Its own view of the file system: read-only, no home directories.
    in_ns = ["nsenter", "-t", pid, "-m", "--"]
    touch = front.box.run([*in_ns, "touch", "/opt/vllm-router/probe"])
    assert touch.returncode != 0 and "Read-only file system" in touch.stderr, touch.stderr
    assert front.box.run([*in_ns, "ls", "-A", "/root"]).stdout.strip() == ""

    # LimitNOFILE=65536, or as near as the container's own limit lets systemd go.
    def nofile(p: str) -> list[str]:
        limits = front.box.run(["cat", f"/proc/{p}/limits"], check=True).stdout
        return next(x.split()[3:5] for x in limits.splitlines() if x.startswith("Max open files"))

    ceiling = int(nofile("1")[1])
    assert nofile(pid) == [str(min(65536, ceiling))] * 2, (nofile(pid), ceiling)
    print(f"\n[front] exposure {m.group(1)}, uid {uid}, NoNewPrivs, seccomp, no capabilities")


def test_router_routes_to_the_box_which_checks_the_key(front: Front) -> None:
    url = f"http://127.0.0.1:{PORT}/v1/chat/completions"
    code, body = front.http(url, body=CHAT)
    assert code == 401 and json.loads(body)["error"]["code"] == "missing_api_key", (code, body)
    key = front.app.admin_key()
    cursor = front.box.journal_cursor()
    code, body = front.http(url, key, CHAT)
    assert code == 200, (code, body)
    answer = json.loads(body)
    assert answer["model"] == CHAT["model"] and answer["choices"][0]["message"]["content"]
    journal = front.box.journal("-u", UNIT, "-o", "export", after=cursor)
    assert key not in journal and key[len("sk-la-") :] not in journal


def test_killed_router_is_restarted_by_systemd(front: Front) -> None:
    before = front.state()
    # `kill -9 0` would kill this test's own process group (nsenter keeps it).
    assert before["MainPID"] != "0", before
    cursor = front.box.journal_cursor()
    front.box.run(["kill", "-9", before["MainPID"]], check=True)

    def restarted() -> bool:
        s = front.state()
        return (
            int(s["NRestarts"]) == int(before["NRestarts"]) + 1
            and (s["ActiveState"], s["SubState"]) == ("active", "running")
            and s["MainPID"] not in ("0", before["MainPID"])
        )

    wait_for(restarted, 30, "systemd to restart the killed router")
    journal = front.box.journal("-u", UNIT, "-o", "cat", after=cursor)
    assert "Failed with result 'signal'" in journal, journal[-2000:]
    assert "Scheduled restart job" in journal, journal[-2000:]
    # It listens again once its box answers /health, and routes.
    wait_for(lambda: front.http(f"http://127.0.0.1:{PORT}/health")[0] == 200, 30, "/health")
    code, _ = front.http(
        f"http://127.0.0.1:{PORT}/v1/chat/completions", front.app.admin_key(), CHAT
    )
    assert code == 200


def test_box_behind_tls_with_a_private_ca(front: Front) -> None:
    box, pki, port = front.box, "/etc/ssl/llm-test", 8443
    box.run(
        f"mkdir -p {pki} && cd {pki} && "
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 "
        "-subj /CN=test-ca && "
        "openssl req -newkey rsa:2048 -nodes -keyout box.key -out box.csr -subj /CN=box && "
        "printf 'subjectAltName=IP:127.0.0.1\\n' > san.cnf && "
        "openssl x509 -req -in box.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
        "-extfile san.cnf -out box.pem && chmod 0644 ca.pem",
        check=True,
    )
    box.write("/srv/tls_box.py", _TLS_BOX)
    box.run(
        [
            "systemd-run",
            "--unit=fake-tls-box",
            sc.SYSTEM_PYTHON,
            "/srv/tls_box.py",
            str(port),
            f"{pki}/box.pem",
            f"{pki}/box.key",
        ],
        check=True,
    )
    tls_url = f"https://127.0.0.1:{port}"
    try:
        wait_for(lambda: "CERTIFICATE_VERIFY_FAILED" in front.http(tls_url)[1], 10, "the TLS box")
        rc, out, _ = front.converge(
            "front-converge-tls.txt",
            llm_appliance_router_workers=[tls_url],
            llm_appliance_router_ca_file=f"{pki}/ca.pem",
        )
        # The role waits for the router's /health: it answers once the box is trusted.
        assert rc == 0, f"the converge failed (rc {rc}):\n{ai.failed_tasks(out)}"
        code, body = front.http(f"http://127.0.0.1:{PORT}/v1/chat/completions", "k", CHAT)
        assert (code, json.loads(body)) == (200, {"answered_by": "tls-box"}), (code, body)
    finally:
        box.run(["systemctl", "stop", "fake-tls-box"], timeout=30)
        rc, out, _ = front.converge("front-converge-back.txt")
        assert rc == 0, ai.failed_tasks(out)


def test_only_root_and_the_named_caller_reach_the_router(front: Front) -> None:
    router = f"http://127.0.0.1:{PORT}"
    # The capture: another account adds a worker of its own through the admin route,
    # which takes no key, and then receives the team's requests with their keys.
    code, out = front.http(
        f"{router}/add_worker?url=http://127.0.0.1:8099", user=OTHER, method="POST"
    )
    assert (code, "ConnectionRefusedError" in out) == (0, True), (code, out)
    code, out = front.http(f"{router}/v1/models", user=OTHER)
    assert (code, "ConnectionRefusedError" in out) == (0, True), (code, out)
    # The reverse proxy's account routes through it to the box, which checks the key.
    key = front.app.admin_key()
    code, body = front.http(f"{router}/v1/chat/completions", key, CHAT, user=CALLER)
    assert code == 200 and json.loads(body)["choices"][0]["message"]["content"], (code, body)
    code, body = front.http(f"{router}/workers")  # root, as the role and the admin
    workers = [w["url"] for w in json.loads(body)["workers"]]
    assert (code, workers) == (200, [f"http://127.0.0.1:{sc.GATEWAY_PORT}"]), (code, body)


def test_no_other_account_serves_the_routers_port_while_it_is_down(front: Front) -> None:
    """At boot the router listens only once a box answers (minutes on a box that loads
    its models): until then, or after a crash, the port is free for anyone to bind."""
    box, key = front.box, front.app.admin_key()
    url = f"http://127.0.0.1:{PORT}/v1/chat/completions"
    box.write("/srv/squatter.py", _SQUATTER)
    box.run(["systemctl", "stop", UNIT], check=True, timeout=60)
    try:
        box.run(
            [
                "systemd-run",
                "--unit=squatter",
                f"--uid={OTHER}",
                sc.SYSTEM_PYTHON,
                "/srv/squatter.py",
                str(PORT),
            ],
            check=True,
        )
        wait_for(
            lambda: "listening" in box.journal("-u", "squatter", "-o", "cat"), 10, "the squatter"
        )
        code, out = front.http(url, key, CHAT, user=CALLER, timeout=3)
        heard = box.journal("-u", "squatter", "-o", "cat")
        assert key not in heard and "got" not in heard, heard
        assert (code, "timed out" in out) == (0, True), (code, out)
        assert front.box.show(ACCESS_UNIT, "ActiveState")["ActiveState"] == "active"
    finally:
        box.run(["systemctl", "stop", "squatter"], timeout=30)
        box.run(["systemctl", "start", UNIT], check=True, timeout=60)
    wait_for(lambda: front.http(f"http://127.0.0.1:{PORT}/health")[0] == 200, 30, "/health")
    code, _ = front.http(url, key, CHAT, user=CALLER)
    assert code == 200


def test_restrict_local_off_lets_every_account_in(front: Front) -> None:
    """The table is what keeps them out: turned off, the role removes it and its unit."""
    health = f"http://127.0.0.1:{PORT}/health"
    try:
        rc, out, _ = front.converge(
            "front-converge-open.txt", llm_appliance_router_restrict_local=False
        )
        assert rc == 0, f"the converge failed (rc {rc}):\n{ai.failed_tasks(out)}"
        assert front.http(health, user=OTHER)[0] == 200
        assert front.box.run(["nft", "list", "table", "inet", "vllm_router_access"]).returncode
        assert front.box.show(ACCESS_UNIT, "LoadState")["LoadState"] == "not-found"
    finally:
        rc, out, _ = front.converge("front-converge-back.txt")
        assert rc == 0, ai.failed_tasks(out)
    code, out = front.http(health, user=OTHER)
    assert (code, "ConnectionRefusedError" in out) == (0, True), (code, out)
    assert front.http(health, user=CALLER)[0] == 200
