"""The canonical unit (systemd/llm-appliance.service) under a real systemd (PID 1).

Fake engines first (seconds each), sharing the one installed appliance of the session
(each test also passes alone): start waits for READY=1, status shows STATUS=, reload
(SIGHUP) reloads keys without dropping a request, a missed watchdog ping gets the
service killed and restarted, stop leaves no engine process, the journal carries the
engines' lines but no secret. The last test runs the real CPU vLLM engine under the
unit (about a minute to load; skipped without the set-up's engine venv and model).

The only changes to the unit are drop-ins that each test names: ``WatchdogSec=3s`` for
the watchdog test, and for the real engine ``ProtectHome=tmpfs`` plus
``BindReadOnlyPaths=`` of the developer set-up under /root (a deployment has its engine
venv under /var/lib/llm-appliance instead, which ``ProtectHome=yes`` leaves visible).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from appliance import paths
from tests.fakes.systemd_container import (
    CLI,
    ENGINE_PORT_BASE,
    FAKE_ENGINE,
    GATEWAY_PORT,
    STARTUP_DELAY_S,
    STATE,
    SYSTEM_PYTHON,
    UNIT_NAME,
    InstalledAppliance,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SECRETS: dict[str, str] = {}  # name -> secret seen by earlier tests, checked in the journal
ENGINE_KEY = re.compile(r"--api-key[= ](\S+)")


def processes(app: InstalledAppliance) -> list[str]:
    """Every process in the container: "PID ARGS" lines."""
    return app.box.run(["ps", "-eo", "pid=,args="], check=True).stdout.splitlines()


def wait_for(cond: Any, timeout: float, what: str, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(step)


def start_and_probe(app: InstalledAppliance, timeout: float) -> tuple[int, float, int]:
    """`systemctl start`, then at once one GET /readyz: (start rc, start seconds, readyz status).

    Both run in one process inside the container, so nothing lies between the return of
    `systemctl start` and the probe.
    """
    script = (
        "import subprocess, sys, time, urllib.request, urllib.error\n"
        "t = time.monotonic()\n"
        f"rc = subprocess.run(['systemctl', 'start', '{UNIT_NAME}']).returncode\n"
        "took = time.monotonic() - t\n"
        "try:\n"
        f"    code = urllib.request.urlopen('http://127.0.0.1:{GATEWAY_PORT}/readyz',"
        " timeout=5).status\n"
        "except urllib.error.HTTPError as e:\n"
        "    code = e.code\n"
        "except OSError:\n"
        "    code = 0\n"
        "print(rc, took, code)\n"
    )
    r = app.box.run([SYSTEM_PYTHON, "-c", script], timeout=timeout)
    rc, took, code = r.stdout.split()
    return int(rc), float(took), int(code)


def ensure_running(app: InstalledAppliance) -> None:
    if app.state()["ActiveState"] != "active":
        app.box.run(["systemctl", "start", UNIT_NAME], check=True, timeout=60)


def remember_engine_keys(app: InstalledAppliance) -> None:
    """The engines' API keys, from their command lines (the supervisor makes them)."""
    for line in processes(app):
        for key in ENGINE_KEY.findall(line):
            if key not in SECRETS.values():
                SECRETS[f"engine API key #{len(SECRETS)}"] = key


# --------------------------------------------------------------------------- fake engines


def test_start_returns_only_after_ready(fake_appliance: InstalledAppliance) -> None:
    app = fake_appliance
    app.box.run(["systemctl", "stop", UNIT_NAME], timeout=60)

    rc, took, readyz = start_and_probe(app, timeout=90)

    assert rc == 0, app.box.journal("-u", UNIT_NAME, "-n", "60")
    assert readyz == 200, (
        f"/readyz answered {readyz} right after `systemctl start` returned:\n"
        + app.box.journal("-u", UNIT_NAME, "-n", "60")
    )
    assert took >= STARTUP_DELAY_S, f"start returned after {took:.2f} s, before engines loaded"
    state = app.state()
    assert (state["ActiveState"], state["SubState"]) == ("active", "running"), state
    app.facts["start_s"] = took
    print(f"\n[systemd] `systemctl start` returned after {took:.2f} s, /readyz 200 at once")
    remember_engine_keys(app)
    SECRETS["admin key"] = app.admin_key()


def test_status_shows_the_status_text(fake_appliance: InstalledAppliance) -> None:
    app = fake_appliance
    ensure_running(app)
    wait_for(
        lambda: app.state()["StatusText"].startswith("2/2 engines ready"),
        10,
        "StatusText 2/2 engines ready",
    )
    text = app.state()["StatusText"]
    status = app.box.run(["systemctl", "status", "--no-pager", "--lines=0", UNIT_NAME]).stdout
    assert re.search(r'Status: "2/2 engines ready; \d+ in flight"', status), status
    assert "active (running)" in status, status
    print(f"\n[systemd] STATUS: {text}")


CLIENT_LOOP = r"""
import json, sys, threading, time, urllib.request, urllib.error
url, key, seconds, workers = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
body = json.dumps({"model": "smollm2-135m-instruct", "max_tokens": 40,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()
codes, errors, lock = {}, [], threading.Lock()
end = time.monotonic() + seconds
def work():
    while time.monotonic() < end:
        req = urllib.request.Request(url, data=body, headers={
            "Authorization": "Bearer " + key, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read(); code = r.status
        except urllib.error.HTTPError as e:
            code = e.code
        except OSError as e:
            code = 0
            with lock: errors.append(repr(e))
        with lock: codes[code] = codes.get(code, 0) + 1
threads = [threading.Thread(target=work) for _ in range(workers)]
print("started", flush=True)
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"codes": codes, "errors": errors[:5]}), flush=True)
"""


def test_reload_reloads_keys_without_dropping_a_request(
    fake_appliance: InstalledAppliance,
) -> None:
    app = fake_appliance
    ensure_running(app)
    before = app.state()
    admin = app.admin_key()
    cursor = app.box.journal_cursor()
    url = f"http://127.0.0.1:{GATEWAY_PORT}/v1/chat/completions"
    client = app.box.spawn([SYSTEM_PYTHON, "-c", CLIENT_LOOP, url, admin, "5", "4"])
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "started"
        time.sleep(1.0)  # requests in flight (40 tokens x 5 ms each) when the reload comes
        # The admin's way (docs/keys.md): as root; the file keeps its owner.
        created = app.box.run([CLI, "keys", "create", "--name", "reload-test"], check=True)
        new_key = created.stdout.splitlines()[0].strip()
        SECRETS["created key"] = new_key
        reload = app.box.run(["systemctl", "reload", UNIT_NAME], timeout=30)
        assert reload.returncode == 0, reload.stderr
        # With Type=notify, `systemctl reload` returns once kill -HUP was sent; the
        # daemon has reloaded soon after (well before its 2 s keys-file poll).
        wait_for(lambda: app.http("/v1/models", new_key)[0] == 200, 2.0, "new key accepted")
        out, err = client.communicate(timeout=30)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert client.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    codes = {int(k): v for k, v in result["codes"].items()}
    assert set(codes) == {200}, f"requests during the reload: {codes}, errors {result['errors']}"
    assert codes[200] >= 20, codes
    after = app.state()
    assert after["MainPID"] == before["MainPID"], "reload restarted the daemon"
    assert after["NRestarts"] == before["NRestarts"]
    assert (after["ActiveState"], after["SubState"]) == ("active", "running"), after
    journal = app.box.journal("-u", UNIT_NAME, "-o", "cat", after=cursor)
    assert "SIGHUP: reloading" in journal, journal[-3000:]
    after_hup = journal[journal.index("SIGHUP: reloading") :]
    assert re.search(r"keys file \S+ reloaded", after_hup), after_hup[-3000:]
    owner = app.box.run(["stat", "-c", "%U %a", f"{STATE}/keys.json"], check=True).stdout
    assert owner.split() == ["llm-appliance", "600"], owner
    print(f"\n[systemd] {codes[200]} requests during the reload, all 200")


def test_missed_watchdog_gets_the_service_killed_and_restarted(
    fake_appliance: InstalledAppliance,
) -> None:
    app = fake_appliance
    app.set_drop_in("[Service]\nWatchdogSec=3s\nRestartSec=1s\n")
    try:
        app.box.run(["systemctl", "restart", UNIT_NAME], check=True, timeout=60)
        assert app.box.show(UNIT_NAME, "WatchdogUSec")["WatchdogUSec"] == "3s"
        before = app.state()
        old_engines = [line.split()[0] for line in processes(app) if FAKE_ENGINE in line]
        assert old_engines
        cursor = app.box.journal_cursor()
        stopped_at = time.monotonic()
        app.box.run(["kill", "-STOP", before["MainPID"]], check=True)

        def restarted() -> bool:
            s = app.state()
            return (
                int(s["NRestarts"]) == int(before["NRestarts"]) + 1
                and (s["ActiveState"], s["SubState"]) == ("active", "running")
                and s["MainPID"] not in ("0", before["MainPID"])
            )

        wait_for(restarted, 30, "a watchdog restart", step=0.2)
        took = time.monotonic() - stopped_at
        journal = app.box.journal("-u", UNIT_NAME, "-o", "cat", after=cursor)
        assert "Watchdog timeout (limit 3s)!" in journal, journal[-3000:]
        assert "with signal SIGABRT" in journal, journal[-3000:]
        assert "Failed with result 'watchdog'" in journal, journal[-3000:]
        live = {line.split()[0] for line in processes(app)}
        assert not live & set(old_engines), "engines of the killed daemon outlived it"
        assert app.http("/readyz")[0] == 200
        print(f"\n[systemd] SIGSTOP -> killed and active again after {took:.1f} s")
    finally:
        app.set_drop_in(None)


def test_stop_leaves_no_engine_process(fake_appliance: InstalledAppliance) -> None:
    app = fake_appliance
    ensure_running(app)
    remember_engine_keys(app)
    cgroup = app.box.show(UNIT_NAME, "ControlGroup")["ControlGroup"]
    assert cgroup, "a running service has a cgroup"
    engines = [line for line in processes(app) if FAKE_ENGINE in line]
    assert len(engines) == 4, engines  # 2 engines, each with its --spawn-child child
    cursor = app.box.journal_cursor()

    started = time.monotonic()
    app.box.run(["systemctl", "stop", UNIT_NAME], check=True, timeout=200)
    took = time.monotonic() - started

    state = app.state()
    assert (state["ActiveState"], state["Result"]) == ("inactive", "success"), state
    left = [line for line in processes(app) if FAKE_ENGINE in line]
    assert not left, f"engine processes left after stop: {left}"
    procs = app.box.run(
        f"cat /sys/fs/cgroup/unified{cgroup}/cgroup.procs /sys/fs/cgroup/systemd{cgroup}/"
        f"cgroup.procs /sys/fs/cgroup{cgroup}/cgroup.procs 2>/dev/null"
    ).stdout.split()
    assert not procs, f"the unit's cgroup {cgroup} still holds {procs}"
    journal = app.box.journal("-u", UNIT_NAME, "-o", "cat", after=cursor)
    # KillMode=mixed: the supervisor stops its engines itself; systemd's final SIGKILL
    # sweep found nothing left.
    assert "Killing process" not in journal, journal[-3000:]
    print(f"\n[systemd] `systemctl stop` took {took:.2f} s; nothing left in {cgroup}")


def test_journal_has_engine_lines_and_no_secret(fake_appliance: InstalledAppliance) -> None:
    app = fake_appliance
    if not any(name.startswith("engine") for name in SECRETS):  # this test runs alone
        ensure_running(app)
        remember_engine_keys(app)
        app.box.run(["systemctl", "stop", UNIT_NAME], check=True, timeout=200)
    SECRETS["admin key"] = app.admin_key()
    messages = app.box.journal("-u", UNIT_NAME, "-o", "cat")
    assert "[engine0]" in messages and "[engine1]" in messages, messages[-3000:]
    assert "[fake_engine.py]" in messages
    # Every field of every entry (MESSAGE, _CMDLINE, ...), not only the messages.
    everything = app.box.journal("-o", "json")
    assert len(SECRETS) >= 3, SECRETS.keys()  # the admin key and the engines' keys
    for name, secret in SECRETS.items():
        assert secret not in everything, f"the {name} is in the journal"
    assert "--api-key ***" in messages  # the supervisor logs engine commands redacted


# --------------------------------------------------------------------------- real vLLM


def real_setup() -> tuple[Path, Path, Path, Path] | str:
    """(home, engine python, model, interpreter prefix) of the host's set-up, or why not."""
    home = paths.appliance_home()
    python, model = paths.engine_python(home), paths.packaged_model(home)
    if not python.exists() or not (model / "config.json").exists():
        return f"no engine venv or model under {home}: run scripts/setup first"
    if home == paths.SYSTEM_HOME:
        return f"the set-up lives in {home}, the service's own StateDirectory"
    base = ""
    for line in (home / paths.ENGINE_VENV_DIR / "pyvenv.cfg").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home":
            base = value.strip()
    if not base:
        return "the engine venv's pyvenv.cfg names no base interpreter"
    return home, python, model, Path(base).parent


@pytest.mark.e2e
def test_real_vllm_engine_under_the_unit(installed_appliance: InstalledAppliance) -> None:
    setup = real_setup()
    if isinstance(setup, str):
        pytest.skip(setup)
    home, python, model, prefix = setup
    app = installed_appliance
    app.box.run(["systemctl", "stop", UNIT_NAME], timeout=200)
    app.facts["config"] = "real"
    protected = [Path("/root"), Path("/home"), Path("/run/user")]
    hidden = [p for p in (home, prefix) if any(p.is_relative_to(d) for d in protected)]
    # ProtectHome=yes hides /root, where a developer set-up (and its pyenv interpreter)
    # lives; expose just those two trees, read-only. Everything else is the unit as is.
    app.set_drop_in(
        "[Service]\nProtectHome=tmpfs\nBindReadOnlyPaths=" + " ".join(map(str, hidden)) + "\n"
        if hidden
        else None
    )
    app.write_config(
        {
            "gateway": {"port": GATEWAY_PORT, "keys_file": f"{STATE}/keys.json"},
            "engine": {
                "device": "cpu",
                "cpu_engines": 1,
                "port_base": ENGINE_PORT_BASE,
                "python": str(python),
                "model": str(model),
                "max_model_len": 1024,
                "startup_timeout_s": 300,
                "cpu_kvcache_space_gib": 1,
            },
            "telemetry": {"source": "none"},
            "health": {"interval_s": 2, "probe_timeout_s": 20, "failures_to_restart": 3},
        }
    )
    try:
        rc, took, readyz = start_and_probe(app, timeout=280)
        assert rc == 0, app.box.journal("-u", UNIT_NAME, "-n", "80", "-o", "cat")
        assert readyz == 200, (
            f"/readyz answered {readyz} right after `systemctl start` returned:\n"
            + app.box.journal("-u", UNIT_NAME, "-n", "60")
        )
        state = app.state()
        assert (state["ActiveState"], state["SubState"]) == ("active", "running"), state
        assert state["StatusText"].startswith("1/1 engines ready"), state

        body = json.dumps(
            {
                "model": paths.PACKAGED_MODEL_NAME,
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 8,
                "temperature": 0,
            }
        )
        code, out = app.http("/v1/chat/completions", app.admin_key(), body, timeout=60)
        assert code == 200, out
        reply = json.loads(out)
        assert reply["choices"][0]["message"]["content"], reply
        assert reply["usage"]["completion_tokens"] > 0, reply
        vllm = [p for p in processes(app) if "vllm" in p.lower() or str(python) in p]
        assert vllm, "no vLLM process while the engine serves"
        # On a Unix socket in the unit's RuntimeDirectory (0700), no TCP port.
        assert any("--uds /run/llm-appliance/engine0.sock" in p for p in vllm), vllm
        assert not any("--port" in p for p in vllm), vllm
        # The per-boot key is not on any command line (every local user can read those):
        # it is in the API server's environment.
        assert not [k for line in vllm for k in ENGINE_KEY.findall(line)], vllm
        engine_keys = set()
        for line in vllm:
            pid = line.split()[0]
            environ = app.box.run(["cat", f"/proc/{pid}/environ"]).stdout
            for var in environ.split("\0"):
                if var.startswith("VLLM_API_KEY="):
                    engine_keys.add(var.split("=", 1)[1])
        assert engine_keys, vllm

        stopped = time.monotonic()
        app.box.run(["systemctl", "stop", UNIT_NAME], check=True, timeout=200)
        stop_s = time.monotonic() - stopped
        state = app.state()
        assert (state["ActiveState"], state["Result"]) == ("inactive", "success"), state
        comms = app.box.run(["ps", "-eo", "pid=,comm=,args="], check=True).stdout.splitlines()
        left = [p for p in comms if "vllm" in p.lower() or str(python) in p]
        assert not left, f"vLLM processes left after stop: {left}"
        everything = app.box.journal("-o", "json")
        assert "[engine0]" in everything
        assert not [k for k in engine_keys if k in everything], "vLLM's API key is in the journal"
        print(
            f"\n[systemd] real vLLM: `systemctl start` returned after {took:.1f} s "
            f"(READY), chat completion ok, `systemctl stop` took {stop_s:.1f} s"
        )
    finally:
        app.box.run(["systemctl", "stop", UNIT_NAME], timeout=200)
        app.set_drop_in(None)
