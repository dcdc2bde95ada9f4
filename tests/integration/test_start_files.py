"""The daemon started on a bad file, as systemd would start it.

A corrupt keys file must not make it exit (exit 1 is restarted by systemd, into the same
file, in a loop): it starts, refuses every key with 503 keys_file_error, says so on
/readyz and in the journal, and picks the fixed file up without a restart. A `file:`
sensors source that does not exist is a config error (exit 2, which the unit does not
restart), never a quiet "telemetry off" that would throttle no GPU."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from appliance.gateway.keys import KeyStore
from tests.fakes.appliance_proc import Appliance, fake_engine_config, get_json, run_appliance

pytestmark = pytest.mark.slow

CORRUPT = '{"version": 1, "keys": [{"id": "3fa2c1d9", "name": '


def models(app: Appliance, key: str | None) -> tuple[int, dict[str, str], Any]:
    """GET /v1/models with ``key``: (status, headers, JSON body)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(app.url + "/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_a_corrupt_keys_file_at_start_refuses_keys_until_it_is_fixed(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(CORRUPT)
    keys.chmod(0o600)
    with run_appliance(tmp_path, fake_engine_config(tmp_path, 1)) as app:

        def engine_up_keys_refused() -> bool:
            code, body = get_json(app.url + "/readyz")
            return code == 503 and isinstance(body, dict) and body["engines_admitting"] == [0]

        app.wait_for(engine_up_keys_refused, 30, "the engine READY and /readyz 503")
        _, body = get_json(app.url + "/readyz")
        assert body["status"] == "keys file unusable"
        assert "keys file cannot be used" in body["keys"]
        assert str(keys) not in json.dumps(body)  # /readyz needs no key: no path, no content

        status, headers, answer = models(app, "sk-la-3fa2c1d9-whatever")
        assert status == 503, answer
        assert answer["error"]["code"] == "keys_file_error"
        assert answer["error"]["type"] == "service_unavailable"
        assert "keys file cannot be used" in answer["error"]["message"]
        assert headers["Retry-After"] == "5"
        assert models(app, None)[2]["error"]["code"] == "missing_api_key"

        log = app.log()
        assert f"keys file {keys} is invalid" in log and "not valid JSON" in log
        assert "every request with a key gets 503 keys_file_error" in log
        # Never overwritten, no admin key made over it.
        assert keys.read_text() == CORRUPT
        assert not (tmp_path / "admin.key").exists()

        fixed = tmp_path / "restored.json"
        _, key = KeyStore(fixed).create(name="alice")
        fixed.replace(keys)
        app.wait_all_ready(10)  # /readyz 200 again: picked up by the watcher
        status, _, answer = models(app, key)
        assert status == 200, answer
        assert app.proc.poll() is None
        assert app.log().count("gateway listening") == 1  # the same daemon, never restarted
        assert f"keys file {keys} reloaded: 1 key(s) in force" in app.log()


def test_a_missing_sensors_file_at_start_is_exit_2_naming_it(tmp_path: Path) -> None:
    sensors = tmp_path / "sensors.json"
    cfg = fake_engine_config(tmp_path, 1, telemetry={"source": f"file:{sensors}"})
    with run_appliance(tmp_path, cfg) as app:
        code = app.wait_exit(20)
        log = app.log()
    assert code == 2, log
    assert f"telemetry.source = 'file:{sensors}' cannot be used" in log
    assert f"telemetry file {sensors} cannot be read" in log
    assert 'telemetry.source = "none"' in log  # what to do instead, if that is what is meant
    assert "starting on" not in log and "GPU telemetry off" not in log
