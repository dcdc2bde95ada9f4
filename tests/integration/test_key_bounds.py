"""Bounds on key fields and admin path ids through the admin API (issue 10, item 8).

Before: ``expires_days = 1e304`` wrote ``Infinity`` into the keys file (every later change
refused, the next start exited 1), ``rpm``/``tpm = 10**400`` made every request with that
key a 500, ``scopes`` of the wrong type was a 500, and engine ids such as ``²`` were a
500 while ``٠`` and ``１`` passed as engine 0 and 1. Now each is a 400 naming the field,
with the message `keys create` gives, and the keys file stays valid JSON.

One daemon with one fake engine for the module.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from appliance.gateway.keys import MAX_EXPIRES_DAYS, MAX_RPM, MAX_TPM, KeySpecError, KeyStore
from tests.fakes.appliance_proc import Appliance, fake_engine_config, run_appliance

pytestmark = pytest.mark.slow


@dataclass
class Api:
    app: Appliance
    keys_path: Path
    admin: str
    model: str

    def call(self, method: str, path: str, body: Any = None, key: str | None = None) -> Any:
        """(status, parsed JSON body) of one request; ``path`` may hold any Unicode."""
        headers = {"Authorization": f"Bearer {key or self.admin}"}
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = "application/json"
        conn = http.client.HTTPConnection(
            "127.0.0.1", int(self.app.config["gateway"]["port"]), timeout=10
        )
        try:
            conn.request(method, urllib.parse.quote(path), body=data, headers=headers)
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    tmp = tmp_path_factory.mktemp("key_bounds")
    # No health check during the module: engine 0's state is what admin calls made it
    # (one failed check on a loaded machine would show it SUSPECT for a while).
    cfg = fake_engine_config(tmp, 1, health={"interval_s": 600})
    with run_appliance(tmp, cfg) as app:
        app.wait_ready()
        a = Api(app, tmp / "keys.json", (tmp / "admin.key").read_text().strip(), "")
        a.model = a.call("GET", "/v1/models")[1]["data"][0]["id"]
        yield a


def assert_400_naming(status: int, body: Any, field: str) -> str:
    assert status == 400, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["param"] == field, err
    message: str = err["message"]
    assert message.startswith(f"{field}: ") and "\n" not in message and len(message) < 200
    return message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("expires_days", 1e304),
        ("expires_days", MAX_EXPIRES_DAYS + 1),
        ("expires_days", 0),
        ("rpm", 10**400),
        ("rpm", MAX_RPM + 1),
        ("rpm", 1.5),
        ("tpm", 10**400),
        ("tpm", MAX_TPM + 1),
        ("scopes", 5),
        ("scopes", {"user": True}),
        ("scopes", [["user"]]),
        ("scopes", "root"),
        ("priority", ["batch"]),
        ("name", {"a": 1}),
    ],
    ids=lambda v: v if isinstance(v, str) else repr(v)[:12],
)
def test_a_key_field_out_of_bounds_is_a_400_naming_it(api: Api, field: str, value: Any) -> None:
    before = api.keys_path.read_bytes()
    status, body = api.call("POST", "/admin/keys", {"name": "t", field: value})
    message = assert_400_naming(status, body, field)
    assert api.keys_path.read_bytes() == before  # nothing written
    # The very message `keys create` and the keys file parser give for it.
    with pytest.raises(KeySpecError) as cli:
        KeyStore(api.keys_path).new_key(**{"name": "t", field: value})
    assert message == str(cli.value)


def test_keys_at_the_maxima_work_and_the_file_stays_valid(api: Api) -> None:
    status, body = api.call(
        "POST",
        "/admin/keys",
        {"name": "top", "rpm": MAX_RPM, "tpm": MAX_TPM, "expires_days": MAX_EXPIRES_DAYS},
    )
    assert status == 201, body
    chat = {"model": api.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, answer = api.call("POST", "/v1/chat/completions", chat, key=body["key"])
    assert status == 200, answer
    # Strict JSON (no Infinity/NaN), and a later change still goes through.
    json.loads(api.keys_path.read_text(), parse_constant=pytest.fail)
    status, body = api.call("POST", "/admin/keys", {"name": "after"})
    assert status == 201, body


@pytest.mark.parametrize("raw", ["xyz", "deadbeef0", "\uff44eadbeef", "\u0660" * 8, "\x00"])
def test_deleting_a_malformed_key_id_is_a_400_naming_id(api: Api, raw: str) -> None:
    status, body = api.call("DELETE", f"/admin/keys/{raw}")
    assert_400_naming(status, body, "id")


def test_deleting_by_an_upper_case_id_works_and_an_unknown_one_is_404(api: Api) -> None:
    status, body = api.call("POST", "/admin/keys", {"name": "gone"})
    assert status == 201
    status, gone = api.call("DELETE", f"/admin/keys/{body['id'].upper()}")
    assert (status, gone) == (200, {"id": body["id"], "revoked": True})
    status, body = api.call("DELETE", "/admin/keys/00000000")
    assert status == 404 and body["error"]["code"] == "unknown_key"


@pytest.mark.parametrize("raw", ["\u00b2", "\u0660", "\uff11", "-1", "0x0", " 0", "1" * 40])
@pytest.mark.parametrize("action", ["drain", "resume", "restart"])
def test_engine_ids_are_ascii_digits_only(api: Api, raw: str, action: str) -> None:
    status, body = api.call("POST", f"/admin/engines/{raw}/{action}")
    if raw == "1" * 40:  # well-formed, but no such engine
        assert status == 404 and body["error"]["code"] == "unknown_engine", body
    else:
        assert_400_naming(status, body, "id")
    # "٠" did not drain or restart engine 0.
    engine = api.call("GET", "/admin/status")[1]["engines"][0]
    assert engine["state"] == "READY" and engine["restarts"] == 0, engine
