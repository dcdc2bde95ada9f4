"""A full state disk loses nothing that was acknowledged (issue #21, item 2).

The state directory (keys.json, usage.json, audit.log, admin.key) is a small tmpfs of its
own, filled to the last byte while a real daemon (one fake engine) runs. Checked, as an
operator and a client see it: requests are still served; usage.json and audit.log
failures are one journal line each (not one per try), counted in
``appliance_state_write_errors_total{file}``, named with their reason in
``/admin/status`` and by ``llm-appliance doctor``; the files stay byte for byte what they
were; a key created through the admin API is refused with 507 and the keys file is
untouched; once space is back, the usage counted meanwhile and the audit lines that
waited are written, and the journal says so. ``keys create`` from the CLI on the full
disk exits 1 with one line naming the file and why.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import (
    REPO,
    Appliance,
    fake_engine_config,
    run_appliance,
    write_config,
)

pytestmark = pytest.mark.slow

NO_SPACE = "No space left on device"


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs of its own: the state directory, which the test can fill."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for the state directory needs root")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(state)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield state
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def fill(directory: Path) -> Path:
    """Fill ``directory``'s file system to the last byte; the file that does it."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 16, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as full:
        (directory / "probe").write_bytes(b"x")
    assert full.value.errno == errno.ENOSPC
    (directory / "probe").unlink(missing_ok=True)
    return filler


def call(app: Appliance, method: str, path: str, key: str, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", app.config["gateway"]["port"], timeout=20)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if path != "/metrics" else raw.decode()
    finally:
        conn.close()


def chat(app: Appliance, key: str) -> int:
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
    }
    status, _ = call(app, "POST", "/v1/chat/completions", key, body)
    return status


def errors_total(app: Appliance, admin: str, file: str) -> float:
    _, text = call(app, "GET", "/metrics", admin)
    for line in text.splitlines():
        if line.startswith(f'appliance_state_write_errors_total{{file="{file}"}}'):
            return float(line.split()[-1])
    return -1.0


def failing(app: Appliance, admin: str) -> dict[str, dict[str, Any]]:
    _, status = call(app, "GET", "/admin/status", admin)
    return {f["file"]: f for f in status["state_write_failures"]}


def cli(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_APPLIANCE")}
    env |= {"PYTHONPATH": str(REPO), "LLM_APPLIANCE_HOME": str(tmp / "home")}
    return subprocess.run(
        [sys.executable, "-m", "appliance.cli", *args, "--config", str(tmp / "config.toml")],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
        check=False,
    )


def test_a_full_state_disk_keeps_serving_says_so_once_and_loses_nothing(
    tmp_path: Path, state_dir: Path
) -> None:
    cfg = fake_engine_config(
        tmp_path,
        1,
        gateway={"keys_file": str(state_dir / "keys.json")},
        health={"interval_s": 2.0, "failures_to_restart": 100},
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        admin = (state_dir / "admin.key").read_text().strip()
        status, made = call(app, "POST", "/admin/keys", admin, {"name": "dev"})
        assert status == 201
        user, user_id = made["key"], made["id"]
        keys_before = (state_dir / "keys.json").read_bytes()
        audit_before = (state_dir / "audit.log").read_bytes()

        filler = fill(state_dir)

        # Served while full: the hot path never waits on a state file.
        assert [chat(app, user) for _ in range(3)] == [200, 200, 200]

        # A key created through the admin API: 507, the file untouched, no key in force.
        status, body = call(app, "POST", "/admin/keys", admin, {"name": "later"})
        assert status == 507, body
        err = body["error"]
        assert err["code"] == "insufficient_storage"
        assert str(state_dir / "keys.json") in err["message"] and NO_SPACE in err["message"]
        assert (state_dir / "keys.json").read_bytes() == keys_before
        _, listed = call(app, "GET", "/admin/keys", admin)
        assert "later" not in [k["name"] for k in listed["keys"]]

        # audit.log's last page still had room (tmpfs counts pages): refused admin
        # actions (400, no key written) add whole lines until it has none, then wait.
        for _ in range(60):
            if errors_total(app, admin, "audit.log") >= 1:
                break
            assert call(app, "POST", "/admin/keys", admin, {"name": ""})[0] == 400
        audit_full = (state_dir / "audit.log").read_bytes()
        assert audit_full.startswith(audit_before) and audit_full.endswith(b"\n")
        for _ in range(3):  # more lines wait; still one journal line for the episode
            assert call(app, "POST", "/admin/keys", admin, {"name": ""})[0] == 400

        # usage.json: one journal line for the episode, however many saves fail.
        app.wait_for(
            lambda: errors_total(app, admin, "usage.json") >= 2, 40, "two failed usage saves"
        )
        log = app.log()
        for file in ("usage.json", "audit.log"):
            said = [
                line
                for line in log.splitlines()
                if f"state file {state_dir / file} cannot be written ({NO_SPACE})" in line
            ]
            assert len(said) == 1, (file, said)
        assert errors_total(app, admin, "keys.json") == 1

        # /admin/status and doctor name each file and why.
        now_failing = failing(app, admin)
        assert set(now_failing) == {"usage.json", "audit.log", "keys.json"}
        assert all(f["error"] == NO_SPACE and f["since"] for f in now_failing.values())
        doctor = cli(tmp_path, "doctor", "--json")
        checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
        state = checks["state writes"]
        assert state["status"] == "fail", state
        assert "usage.json: No space left on device" in state["detail"]

        # The last good files, byte for byte.
        assert (state_dir / "keys.json").read_bytes() == keys_before
        assert (state_dir / "audit.log").read_bytes() == audit_full
        assert all(json.loads(line) for line in audit_full.splitlines())
        assert not [p.name for p in state_dir.iterdir() if p.name.endswith(".tmp")]

        filler.unlink()  # space again

        # The usage counted while full, and the audit lines that waited, are written.
        def usage_saved() -> bool:
            with contextlib.suppress(OSError, ValueError, KeyError):
                doc = json.loads((state_dir / "usage.json").read_text())
                return doc["keys"][user_id]["completion_tokens"] > 0
            return False

        app.wait_for(usage_saved, 40, "usage.json written after space came back")
        app.wait_for(
            lambda: not {"usage.json", "audit.log"} & set(failing(app, admin)),
            40,
            "usage.json and audit.log written again",
        )
        entries = [json.loads(x) for x in (state_dir / "audit.log").read_text().splitlines()]
        waited = entries[len(audit_full.splitlines()) :]
        assert len(waited) >= 4  # the line that found no room and the three after it
        assert {e["detail"].get("status") for e in waited} == {400}
        assert any(e["detail"].get("code") == "insufficient_storage" for e in entries)
        log = app.log()
        assert f"state file {state_dir / 'usage.json'} is written again" in log
        assert f"state file {state_dir / 'audit.log'} is written again" in log

        # keys.json: the next key change works and ends its episode.
        status, _ = call(app, "POST", "/admin/keys", admin, {"name": "later"})
        assert status == 201
        assert failing(app, admin) == {}
        json.loads((state_dir / "keys.json").read_bytes())


def test_keys_create_from_the_cli_on_a_full_disk_is_one_line_and_changes_nothing(
    tmp_path: Path, state_dir: Path
) -> None:
    cfg = fake_engine_config(tmp_path, 1, gateway={"keys_file": str(state_dir / "keys.json")})
    write_config(tmp_path / "config.toml", cfg)
    assert cli(tmp_path, "keys", "create", "--name", "first").returncode == 0
    before = (state_dir / "keys.json").read_bytes()
    fill(state_dir)

    proc = cli(tmp_path, "keys", "create", "--name", "second")
    assert proc.returncode == 1
    assert proc.stdout == ""  # no key printed: none was made
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"llm-appliance: cannot write {state_dir / 'keys.json'} ({NO_SPACE})"), (
        proc.stderr
    )
    assert (state_dir / "keys.json").read_bytes() == before
    assert json.loads(before)  # still the good file, valid JSON
    assert sorted(p.name for p in state_dir.iterdir() if p.name.endswith(".tmp")) == []
