"""The audit trail of a real daemon: every admin action an operator can take (the first
admin key, keys created and revoked by the admin API and by the CLI, drain, resume,
restart, a refused drain, a reload by SIGHUP) is exactly one line in audit.log beside the
keys file, naming who did it, to what, and how it ended; no secret is ever in it."""

from __future__ import annotations

import http.client
import json
import os
import pwd
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from appliance.gateway.keys import hash_key
from tests.fakes.appliance_proc import (
    REPO,
    STEADY_HEALTH,
    Appliance,
    fake_engine_config,
    run_appliance,
)

pytestmark = pytest.mark.slow


def call(app: Appliance, method: str, path: str, key: str, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    data = None
    if body is not None:
        data = json.dumps(body)
        headers["Content-Type"] = "application/json"
    conn = http.client.HTTPConnection("127.0.0.1", app.config["gateway"]["port"], timeout=15)
    try:
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def cli(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LLM_APPLIANCE_KEY", "LLM_APPLIANCE_CONFIG", "NOTIFY_SOCKET", "SUDO_USER")
    }
    env["PYTHONPATH"] = str(REPO)
    env["LLM_APPLIANCE_HOME"] = str(tmp / "home")
    return subprocess.run(
        [sys.executable, "-m", "appliance.cli", *args, "--config", str(tmp / "config.toml")],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=30,
    )


def entries(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_admin_action_is_one_audit_line_and_no_secret_is_in_the_file(
    tmp_path: Path,
) -> None:
    audit = tmp_path / "audit.log"
    cfg = fake_engine_config(tmp_path, 2, health=STEADY_HEALTH)  # drain needs 1 READY
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        admin = (tmp_path / "admin.key").read_text().strip()
        admin_id = admin.split("-")[2]

        # Keys through the admin API.
        code, made = call(app, "POST", "/admin/keys", admin, {"name": "alice", "scopes": ["user"]})
        assert code == 201
        alice, alice_id = made["key"], made["id"]
        assert call(app, "DELETE", f"/admin/keys/{alice_id}", admin)[0] == 200
        # A secret pasted where an id belongs is refused and kept out of the trail.
        assert call(app, "DELETE", f"/admin/keys/{alice}", admin)[0] == 400

        # Keys through the CLI, as the local user.
        out = cli(tmp_path, "keys", "create", "--name", "bob")
        assert out.returncode == 0, out.stderr
        bob = out.stdout.splitlines()[0]
        bob_id = bob.split("-")[2]
        assert cli(tmp_path, "keys", "revoke", bob_id).returncode == 0

        # Engines: a drain, a refused drain of the last serving engine, resume, restart.
        assert call(app, "POST", "/admin/engines/0/drain", admin)[0] == 200
        assert call(app, "POST", "/admin/engines/1/drain", admin)[0] == 409
        assert call(app, "POST", "/admin/engines/0/resume", admin)[0] == 200
        assert call(app, "POST", "/admin/engines/1/restart", admin)[0] == 202

        app.signal(signal.SIGHUP)
        app.wait_for(lambda: '"config.reload"' in audit.read_text(), 10, "the reload audited")
        lines = entries(audit)
        text = audit.read_text()
        journal = app.log()

    def one(action: str, target: str) -> dict[str, Any]:
        found = [e for e in lines if (e["action"], e["target"]) == (action, target)]
        assert len(found) == 1, (action, target, lines)
        return found[0]

    first = one("key.first_admin", f"key:{admin_id}")
    assert (first["actor"], first["outcome"]) == ("system", "ok")

    made_line = one("key.create", f"key:{alice_id}")
    assert (made_line["actor"], made_line["outcome"]) == (f"key:{admin_id}", "ok")
    assert made_line["detail"]["name"] == "alice"
    assert one("key.revoke", f"key:{alice_id}")["outcome"] == "ok"
    pasted = one("key.revoke", "key:?")
    assert (pasted["outcome"], pasted["detail"]["status"]) == ("refused", 400)

    cli_made = one("key.create", f"key:{bob_id}")
    assert cli_made["actor"] == f"cli:{pwd.getpwuid(os.getuid()).pw_name}"
    assert cli_made["outcome"] == "ok"
    assert one("key.revoke", f"key:{bob_id}")["actor"] == cli_made["actor"]

    drains = [e for e in lines if e["action"] == "engine.drain"]
    assert [(e["target"], e["outcome"]) for e in drains] == [
        ("engine:0", "ok"),
        ("engine:1", "refused"),
    ]
    assert drains[1]["detail"]["status"] == 409 and drains[1]["detail"]["force"] is False
    assert drains[1]["actor"] == f"key:{admin_id}"
    assert one("engine.resume", "engine:0")["outcome"] == "ok"
    assert one("engine.restart", "engine:1")["outcome"] == "ok"

    reload = one("config.reload", f"config:{tmp_path / 'config.toml'}")
    assert (reload["actor"], reload["outcome"]) == ("signal:SIGHUP", "ok")

    # Exactly the actions taken, nothing more; the daemon's own lines are in its journal.
    assert len(lines) == 11, lines
    for line in text.splitlines():
        assert (line in journal) != ('"actor":"cli:' in line), line
    # No secret, no secret part, no stored hash.
    for key in (admin, alice, bob):
        for secret in (key, key.split("-", 3)[3], hash_key(key)):
            assert secret not in text
    assert stat.S_IMODE(audit.stat().st_mode) == 0o600
