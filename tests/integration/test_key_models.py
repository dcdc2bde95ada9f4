"""Keys limited to models (issue 35 item 4), on fake engines: a key made with ``models``
uses only those (their aliases too), sees only them in ``GET /v1/models``, and is refused
403 ``model_not_allowed`` on any other, in the shape of the route it called, before the
gateway does anything for the request: an on-demand model it may not use stays unloaded.

One daemon for the module: an always-loaded model ``chat`` (alias ``gpt-4o-mini``) and an
on-demand model ``lazy`` that nothing here is allowed to load.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.fakes.appliance_proc import STEADY_HEALTH, Appliance, fake_engine_config, run_appliance

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]


@dataclass
class Box:
    app: Appliance
    admin: str

    def call(self, method: str, path: str, key: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.app.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw or b"null")
        except ValueError:
            return status, raw.decode(errors="replace")

    def new_key(self, **fields: Any) -> tuple[str, dict[str, Any]]:
        code, body = self.call("POST", "/admin/keys", self.admin, {"name": "t", **fields})
        assert code == 201, body
        return str(body["key"]), body

    def state(self, model: str) -> str:
        code, body = self.call("GET", "/admin/status", self.admin)
        assert code == 200, body
        return str(next(m["state"] for m in body["models"] if m["name"] == model))

    def cold_loads(self, model: str) -> float:
        code, text = self.call("GET", "/metrics", self.admin)
        assert code == 200
        total = 0.0
        for line in str(text).splitlines():
            m = re.fullmatch(r"appliance_key_model_loads_total\{(.*)\} (\S+)", line)
            if m and f'model="{model}"' in m.group(1):
                total += float(m.group(2))
        return total


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("key_models")
    cfg: dict[str, Any] = fake_engine_config(tmp, 2, health=STEADY_HEALTH)
    cfg["models"] = [
        {"name": "chat", "aliases": ["gpt-4o-mini"], "cpu_engines": 1},
        {"name": "lazy", "load": "on_demand", "load_timeout_s": 30},
    ]
    with run_appliance(tmp, cfg) as app:
        app.wait_ready()
        yield Box(app, (tmp / "admin.key").read_text().strip())


def test_the_admin_api_stores_and_lists_a_keys_models(box: Box) -> None:
    _, made = box.new_key(models=["gpt-4o-mini"])
    assert made["models"] == ["gpt-4o-mini"]
    code, body = box.call("GET", "/admin/keys", box.admin)
    assert code == 200
    listed = {k["id"]: k["models"] for k in body["keys"]}
    assert listed[made["id"]] == ["gpt-4o-mini"]
    code, err = box.call("POST", "/admin/keys", box.admin, {"name": "t", "models": []})
    assert code == 400 and err["error"]["param"] == "models", err


def test_a_key_sees_and_uses_only_its_models(box: Box) -> None:
    key, _ = box.new_key(models=["chat"])
    code, body = box.call("GET", "/v1/models", key)
    assert code == 200 and [m["id"] for m in body["data"]] == ["chat", "gpt-4o-mini"]
    code, body = box.call("GET", "/v1/models", box.admin)  # no limit: every model
    assert [m["id"] for m in body["data"]] == ["chat", "gpt-4o-mini", "lazy"]
    for name in ("chat", "gpt-4o-mini"):  # the alias follows its model
        body_in = {"model": name, "messages": MSGS, "max_tokens": 2}
        code, body = box.call("POST", "/v1/chat/completions", key, body_in)
        assert code == 200, body


def test_another_model_is_refused_403_and_never_loaded(box: Box) -> None:
    key, _ = box.new_key(models=["chat"])
    assert box.state("lazy") == "unloaded"
    code, err = box.call(
        "POST", "/v1/chat/completions", key, {"model": "lazy", "messages": MSGS, "max_tokens": 2}
    )
    assert code == 403, err
    assert err["error"]["code"] == "model_not_allowed" and err["error"]["param"] == "model"
    assert err["error"]["type"] == "permission_error" and "'lazy'" in err["error"]["message"]
    # Anthropic's shape on /v1/messages and count_tokens
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {"model": "lazy", "messages": MSGS, "max_tokens": 2}
        code, err = box.call("POST", path, key, body)
        assert code == 403, (path, err)
        assert err["type"] == "error" and err["error"]["type"] == "permission_error", err
    # the model routes outside chat too
    for path, body in [
        ("/v1/completions", {"model": "lazy", "prompt": "hi", "max_tokens": 2}),
        ("/v1/responses", {"model": "lazy", "input": "hi"}),
        ("/tokenize", {"model": "lazy", "prompt": "hi"}),
    ]:
        code, err = box.call("POST", path, key, body)
        assert code == 403 and err["error"]["code"] == "model_not_allowed", (path, err)
    # An allowed request afterwards is served; the refused ones never made lazy load.
    ok = {"model": "chat", "messages": MSGS, "max_tokens": 2}
    assert box.call("POST", "/v1/chat/completions", key, ok)[0] == 200
    assert box.state("lazy") == "unloaded"
    assert box.cold_loads("lazy") == 0
