"""API keys while the daemon runs: the CLI edits the keys file, the daemon follows.

One daemon (one fake engine) for the module. The CLI is run as an admin would run it,
``llm-appliance keys ... --config <the daemon's config>``, in a separate process.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
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

HOT_RELOAD_S = 2.0  # the contract: a running daemon picks changes up within 2 s
KEY_RE = re.compile(r"sk-la-[0-9a-f]{8}-[A-Za-z0-9_-]+")


@dataclass
class Daemon:
    app: Appliance
    tmp: Path
    admin: str

    @property
    def config_path(self) -> Path:
        return self.tmp / "config.toml"

    @property
    def keys_path(self) -> Path:
        return self.tmp / "keys.json"

    def call(
        self, method: str, path: str, key: str | None = None, body: Any = None
    ) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = "application/json"
        conn = http.client.HTTPConnection(
            "127.0.0.1", self.app.config["gateway"]["port"], timeout=5
        )
        try:
            conn.request(method, path, body=data, headers=headers)
            r = conn.getresponse()
            raw = r.read()
        finally:
            conn.close()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw.decode(errors="replace")

    def status_of(self, key: str) -> int:
        return self.call("GET", "/v1/models", key)[0]

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("LLM_APPLIANCE_KEY", "LLM_APPLIANCE_CONFIG", "NOTIFY_SOCKET")
        }
        env["PYTHONPATH"] = str(REPO)
        env["LLM_APPLIANCE_HOME"] = str(self.tmp / "home")
        out = subprocess.run(
            [sys.executable, "-m", "appliance.cli", *args, "--config", str(self.config_path)],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=30,
        )
        if check:
            assert out.returncode == 0, (args, out.returncode, out.stdout, out.stderr)
        return out

    def create(self, *args: str) -> tuple[str, str]:
        """(full key, id) of a key made with `keys create`."""
        out = self.cli("keys", "create", *args)
        first = out.stdout.splitlines()[0]
        assert KEY_RE.fullmatch(first), out.stdout  # the key alone on its line
        return first, first.split("-")[2]

    def wait_status(self, key: str, want: int, within: float = HOT_RELOAD_S) -> float:
        """Seconds until ``key`` gets ``want`` on /v1/models; fails after ``within``."""
        started = time.monotonic()
        while True:
            got = self.status_of(key)
            waited = time.monotonic() - started
            if got == want:
                return waited
            if waited > within:
                raise AssertionError(f"still {got}, not {want}, after {waited:.2f} s")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("gw_keys")
    cfg = fake_engine_config(tmp, 1, health=STEADY_HEALTH)
    with run_appliance(tmp, cfg) as app:
        app.wait_ready()
        yield Daemon(app, tmp, (tmp / "admin.key").read_text().strip())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def secret_parts(key: str) -> list[str]:
    """What must never be shown: the key, its secret part, its stored hash."""
    return [key, key.split("-", 3)[3], hash_key(key)]


# ---- files ---------------------------------------------------------------------------


def test_first_start_made_an_admin_key_and_files_are_0600(d: Daemon) -> None:
    assert KEY_RE.fullmatch(d.admin)
    assert mode(d.keys_path) == 0o600
    assert mode(d.tmp / "admin.key") == 0o600
    text = d.keys_path.read_text()
    doc = json.loads(text)
    assert [r["name"] for r in doc["keys"]][:1] == ["admin"]
    assert doc["keys"][0]["key_hash"] == hash_key(d.admin)
    assert d.admin not in text and d.admin.split("-", 3)[3] not in text
    log = d.app.log()
    assert str(d.tmp / "admin.key") in log and d.admin not in log
    assert d.status_of(d.admin) == 200


# ---- the CLI while the daemon runs ---------------------------------------------------


def test_cli_create_is_in_force_within_2s_and_file_stays_0600(d: Daemon) -> None:
    key, key_id = d.create("--name", "dev laptop", "--rpm", "100", "--priority", "batch")
    waited = d.wait_status(key, 200)
    assert waited < HOT_RELOAD_S
    assert mode(d.keys_path) == 0o600
    text = d.keys_path.read_text()
    for s in secret_parts(key)[:2]:
        assert s not in text
    record = next(r for r in json.loads(text)["keys"] if r["id"] == key_id)
    assert record["rpm"] == 100 and record["priority"] == "batch"
    assert record["scopes"] == ["user"]
    assert record["key_hash"] == hash_key(key)
    # A user key is a user key: no admin, no metrics.
    assert d.call("GET", "/admin/status", key)[0] == 403
    assert d.call("GET", "/metrics", key)[0] == 403


def test_cli_create_metrics_scope(d: Daemon) -> None:
    key, _ = d.create("--name", "prometheus", "--scope", "metrics")
    d.wait_status(key, 403)  # in force (known key), but /v1 is not its scope
    assert d.call("GET", "/metrics", key)[0] == 200


def test_cli_revoke_is_refused_within_2s(d: Daemon) -> None:
    key, key_id = d.create("--name", "temp")
    d.wait_status(key, 200)
    out = d.cli("keys", "revoke", key_id)
    assert key_id in out.stdout
    waited = d.wait_status(key, 401)
    assert waited < HOT_RELOAD_S
    assert key_id not in d.keys_path.read_text()
    assert d.status_of(d.admin) == 200  # others untouched
    again = d.cli("keys", "revoke", key_id, check=False)
    assert again.returncode != 0 and key_id in again.stderr
    assert d.cli("keys", "revoke", "nonsense", check=False).returncode != 0


def test_cli_list_never_shows_a_secret(d: Daemon) -> None:
    key, key_id = d.create("--name", "listed", "--tpm", "5000")
    table = d.cli("keys", "list").stdout
    as_json = d.cli("keys", "list", "--json").stdout
    for out in (table, as_json):
        for k in (key, d.admin):
            for s in secret_parts(k):
                assert s not in out
        assert "key_hash" not in out
    rows = table.splitlines()[1:]
    assert any(row.startswith(key_id + " ") for row in rows), table
    assert all(re.match(r"[0-9a-f]{8} ", row) for row in rows), table  # id first
    listed = {r["id"]: r for r in json.loads(as_json)}
    assert listed[key_id]["tpm"] == 5000 and listed[key_id]["status"] == "active"
    assert "key" not in listed[key_id]


# ---- hot reload edge cases -----------------------------------------------------------


def test_corrupt_keys_file_keeps_the_last_good_keys(d: Daemon) -> None:
    user, _ = d.create("--name", "before corruption")
    d.wait_status(user, 200)
    good = d.keys_path.read_bytes()
    try:
        d.keys_path.write_text('{"version": 1, "keys": [ {"id": "oops"')
        os.chmod(d.keys_path, 0o600)
        d.app.wait_for(lambda: "is invalid" in d.app.log(), 3, "the bad file logged")
        time.sleep(0.3)
        assert d.status_of(user) == 200
        assert d.status_of(d.admin) == 200
        # Changing keys while the file is bad is refused, by the CLI and by the API.
        bad = d.cli("keys", "create", "--name", "x", check=False)
        assert bad.returncode != 0 and str(d.keys_path) in bad.stderr
        assert not KEY_RE.search(bad.stdout)
        code, body = d.call("POST", "/admin/keys", d.admin, {"name": "x"})
        assert code == 503 and body["error"]["code"] == "keys_file_error", body
        # SIGHUP with the bad file: same, and the daemon keeps running. The reload runs
        # in one step of the daemon's loop: once it is logged, the next answer is after it.
        hups = d.app.log().count("SIGHUP: reloading")
        d.app.signal(signal.SIGHUP)
        d.app.wait_for(
            lambda: d.app.log().count("SIGHUP: reloading") > hups, 5, "the SIGHUP handled"
        )
        assert d.status_of(user) == 200
        assert d.app.proc.poll() is None
    finally:
        d.keys_path.write_bytes(good)
    fresh, _ = d.create("--name", "after repair")
    d.wait_status(fresh, 200)
    assert d.status_of(user) == 200
    assert d.app.proc.poll() is None


def test_sighup_reloads_at_once(d: Daemon) -> None:
    """An edit the file watcher cannot see (same size, inode and mtime) is only picked up
    by SIGHUP: so when the key stops working right after the signal, SIGHUP did it."""
    code, body = d.call("POST", "/admin/keys", d.admin, {"name": "hup"})
    assert code == 201, body
    key, key_id = body["key"], body["id"]
    assert d.status_of(key) == 200
    # The watcher's baseline must be the file as it is now (the API just rewrote it): a
    # SIGHUP re-reads it and takes its stat, with no race against the 1 s poll.
    reloads = d.app.log().count(" reloaded: ")
    d.app.signal(signal.SIGHUP)
    d.app.wait_for(lambda: d.app.log().count(" reloaded: ") > reloads, 5, "keys re-read")
    st = d.keys_path.stat()
    data = d.keys_path.read_bytes()
    old_hash = hash_key(key).encode()
    assert data.count(old_hash) == 1
    # The daemon is stopped meanwhile: a watcher poll between the write and the utime
    # would see the new mtime, which is not the edit this test is about.
    d.app.signal(signal.SIGSTOP)
    try:
        with open(d.keys_path, "r+b") as f:  # in place: same inode, same size
            f.write(data.replace(old_hash, hash_key(key + "-revoked").encode()))
        os.utime(d.keys_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        d.app.signal(signal.SIGCONT)
    after = d.keys_path.stat()
    assert (after.st_mtime_ns, after.st_size, after.st_ino) == (
        st.st_mtime_ns,
        st.st_size,
        st.st_ino,
    )
    time.sleep(1.2)  # over one watcher poll
    assert d.status_of(key) == 200, "the watcher saw an edit it should not see"
    # Awaited on the reload the signal logs, not against a clock: the watcher cannot see
    # this edit (its stat is the same), so the keys the daemon reloaded are SIGHUP's.
    reloads = d.app.log().count(" reloaded: ")
    d.app.signal(signal.SIGHUP)
    d.app.wait_for(lambda: d.app.log().count(" reloaded: ") > reloads, 10, "keys re-read")
    assert d.status_of(key) == 401
    d.call("DELETE", f"/admin/keys/{key_id}", d.admin)


# ---- admin endpoints -----------------------------------------------------------------


def test_admin_keys_endpoints(d: Daemon) -> None:
    code, body = d.call(
        "POST",
        "/admin/keys",
        d.admin,
        {"name": "ci", "scopes": ["user", "metrics"], "rpm": 10, "expires_days": 30},
    )
    assert code == 201, body
    key, key_id = body["key"], body["id"]
    assert KEY_RE.fullmatch(key) and key.split("-")[2] == key_id
    assert body["scopes"] == ["metrics", "user"] and body["rpm"] == 10
    assert body["expires_at"] == pytest.approx(time.time() + 30 * 86400, abs=60)
    assert "key_hash" not in body
    # In force at once (the daemon made it), for both scopes.
    assert d.status_of(key) == 200
    assert d.call("GET", "/metrics", key)[0] == 200
    code, listing = d.call("GET", "/admin/keys", d.admin)
    assert code == 200
    text = json.dumps(listing)
    for k in (key, d.admin):
        for s in secret_parts(k):
            assert s not in text
    assert all("key" not in r and "key_hash" not in r for r in listing["keys"])
    assert key_id in {r["id"] for r in listing["keys"]}
    assert mode(d.keys_path) == 0o600
    # The CLI sees what the API made.
    assert key_id in d.cli("keys", "list").stdout
    code, body = d.call("DELETE", f"/admin/keys/{key_id}", d.admin)
    assert (code, body) == (200, {"id": key_id, "revoked": True})
    assert d.status_of(key) == 401
    code, body = d.call("DELETE", f"/admin/keys/{key_id}", d.admin)
    assert code == 404 and body["error"]["code"] == "unknown_key"
    assert key_id not in {r["id"] for r in d.call("GET", "/admin/keys", d.admin)[1]["keys"]}


def test_admin_delete_takes_the_id_in_any_case_as_the_cli_does(d: Daemon) -> None:
    """`keys revoke ABCDEF12` and DELETE /admin/keys/ABCDEF12 both revoke abcdef12."""

    def lettered() -> tuple[str, str]:
        # An id of digits only reads the same in capitals: 1 in 40 ids, so try again.
        for _ in range(10):
            code, body = d.call("POST", "/admin/keys", d.admin, {"name": "shouty"})
            assert code == 201, body
            if body["id"] != body["id"].upper():
                return body["key"], body["id"]
        raise AssertionError("ten ids of digits only")

    key, key_id = lettered()
    code, body = d.call("DELETE", f"/admin/keys/{key_id.upper()}", d.admin)
    assert (code, body) == (200, {"id": key_id, "revoked": True})
    assert d.status_of(key) == 401
    other, other_id = lettered()
    d.cli("keys", "revoke", other_id.upper())
    d.wait_status(other, 401)


# ---- llm-appliance status ------------------------------------------------------------


def test_status_command_table_and_json(d: Daemon) -> None:
    table = d.cli("status").stdout
    assert "ENGINE" in table and "READY" in table
    doc = json.loads(d.cli("status", "--json").stdout)
    assert [e["id"] for e in doc["engines"]] == [0]
    engine = doc["engines"][0]
    assert engine["state"] == "READY"
    # On its private Unix socket: no port.
    assert engine["port"] is None and engine["listen"] == f"unix:{d.app.engine_socket(0)}"
    for field in ("gpu", "inflight", "restarts", "last_restart_reason", "throttle_level"):
        assert field in engine
    assert "gpus" in doc
    # A key without the admin scope is told why, not shown a stack trace.
    user, _ = d.create("--name", "not admin")
    d.wait_status(user, 200)
    out = d.cli("status", "--key", user, check=False)
    assert out.returncode != 0 and "403" in out.stderr and "Traceback" not in out.stderr
