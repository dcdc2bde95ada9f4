"""Every error status of the contract, as a client sees it: status, OpenAI-shaped body
(``error.type``, ``error.code`` where the gateway sets one) and headers.

One daemon for the module, configured tight so each refusal is easy to provoke: two
fake engines admitting one request each, a queue of one with a 0.5 s timeout, a 2 KiB
body limit and ``max_tokens_cap = 100``. Health checks are lenient so an engine told to
fail requests stays READY (that is what the 502 test needs): with one check every ten
minutes none runs during the module, and a failed one would take the engine out of
routing (SUSPECT) at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from appliance.gateway.keys import KeyStore, atomic_write, render_keys_document
from tests.fakes.appliance_proc import Appliance, fake_engine_config, run_appliance, write_config

pytestmark = pytest.mark.slow

MAX_BODY = 2048
CAP = 100


@dataclass
class Resp:
    status: int
    headers: http.client.HTTPMessage
    raw: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.raw)

    @property
    def error(self) -> dict[str, Any]:
        body = self.json
        assert isinstance(body, dict) and isinstance(body.get("error"), dict), self.raw
        err: dict[str, Any] = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        assert "Traceback" not in err["message"]
        return err


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | str | dict[str, Any] | list[Any] | None = None,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> Resp:
    hdrs = dict(headers or {})
    if key is not None:
        hdrs["Authorization"] = f"Bearer {key}"
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
        hdrs.setdefault("Content-Type", "application/json")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=hdrs)
        r = conn.getresponse()
        return Resp(r.status, r.headers, r.read())
    finally:
        conn.close()


@dataclass
class Gw:
    app: Appliance
    tmp: Path
    admin: str
    user: str
    metrics: str
    model: str

    @property
    def port(self) -> int:
        return int(self.app.config["gateway"]["port"])

    def call(self, method: str, path: str, body: Any = None, **kw: Any) -> Resp:
        return request(self.port, method, path, body, **kw)

    def chat(self, key: str | None = None, **fields: Any) -> Resp:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], **fields}
        return self.call(
            "POST", "/v1/chat/completions", body, key=self.user if key is None else key
        )

    def new_key(self, **spec: Any) -> tuple[str, str]:
        r = self.call("POST", "/admin/keys", {"name": "t", **spec}, key=self.admin)
        assert r.status == 201, r.raw
        return r.json["key"], r.json["id"]

    def metric(self, sample: str) -> float:
        r = self.call("GET", "/metrics", key=self.admin)
        assert r.status == 200
        for line in r.raw.decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def engines(self) -> list[dict[str, Any]]:
        r = self.call("GET", "/admin/status", key=self.admin)
        assert r.status == 200, r.raw
        engines: list[dict[str, Any]] = r.json["engines"]
        return engines

    @contextlib.contextmanager
    def knobs(self, **knobs: Any) -> Iterator[None]:
        for i in range(2):
            self.app.engine_control(i, **knobs)
        try:
            yield
        finally:
            for i in range(2):
                self.app.engine_control(i, token_delay_ms=2.0, fail_requests=False)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gw]:
    tmp = tmp_path_factory.mktemp("gw_errors")
    cfg = fake_engine_config(
        tmp,
        2,
        gateway={
            "max_body_bytes": MAX_BODY,
            "max_tokens_cap": CAP,
            "max_queue": 1,
            "queue_timeout_s": 0.5,
            "metrics_public": False,
        },
        engine={"max_inflight": 1},
        health={"interval_s": 600, "failures_to_restart": 100},
    )
    with run_appliance(tmp, cfg) as app:
        app.wait_ready()
        admin = (tmp / "admin.key").read_text().strip()
        port = int(cfg["gateway"]["port"])
        keys = {}
        for scope in ("user", "metrics"):
            r = request(port, "POST", "/admin/keys", {"name": scope, "scopes": [scope]}, admin)
            assert r.status == 201, r.raw
            keys[scope] = r.json["key"]
        models = request(port, "GET", "/v1/models", key=admin).json
        g = Gw(app, tmp, admin, keys["user"], keys["metrics"], models["data"][0]["id"])
        app.wait_for(
            lambda: all(e["state"] == "READY" for e in g.engines()), 20, "both engines READY"
        )
        yield g


def assert_error(
    r: Resp, status: int, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    assert r.status == status, (r.status, r.raw)
    assert r.headers.get_content_type() == "application/json"
    err = r.error
    assert err["type"] == type_, err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_401(r: Resp, code: str) -> dict[str, Any]:
    err = assert_error(r, 401, "authentication_error", code)
    assert r.headers.get("WWW-Authenticate", "").startswith("Bearer"), dict(r.headers)
    return err


def retry_after(r: Resp) -> int:
    value = r.headers.get("Retry-After")
    assert value is not None and value.isdigit() and int(value) >= 1, dict(r.headers)
    return int(value)


# ---- no key needed -------------------------------------------------------------------


def test_healthz_and_readyz_need_no_key(gw: Gw) -> None:
    for path in ("/healthz", "/readyz"):
        r = gw.call("GET", path)
        assert r.status == 200, r.raw
        # A junk Authorization header is ignored there, not refused.
        assert gw.call("GET", path, headers={"Authorization": "Bearer junk"}).status == 200
    assert gw.call("GET", "/healthz").json == {"status": "ok"}
    assert gw.call("GET", "/readyz").json["engines_ready"] == [0, 1]


# ---- 400 -----------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def _bad_cases() -> list[Any]:
    m = "MODEL"  # replaced by the served model name
    return [
        pytest.param(CHAT, b"{not json", None, id="bad-json"),
        pytest.param(CHAT, b"\xff\xfe{}", None, id="not-utf8"),
        pytest.param(CHAT, b"", None, id="empty-body"),
        pytest.param(CHAT, [{"model": m, "messages": MSGS}], None, id="array-not-object"),
        pytest.param(CHAT, "a string", None, id="string-not-object"),
        pytest.param(CHAT, {"messages": MSGS}, "model", id="missing-model"),
        pytest.param(CHAT, {"model": 7, "messages": MSGS}, "model", id="model-not-string"),
        pytest.param(CHAT, {"model": ""}, "model", id="empty-model"),
        pytest.param(CHAT, {"model": m}, "messages", id="missing-messages"),
        pytest.param(CHAT, {"model": m, "messages": []}, "messages", id="empty-messages"),
        pytest.param(CHAT, {"model": m, "messages": "hi"}, "messages", id="messages-string"),
        pytest.param(
            CHAT, {"model": m, "messages": MSGS, "max_tokens": 0}, "max_tokens", id="max-tokens-0"
        ),
        pytest.param(
            CHAT, {"model": m, "messages": MSGS, "max_tokens": -5}, "max_tokens", id="negative"
        ),
        pytest.param(
            CHAT,
            {"model": m, "messages": MSGS, "max_tokens": CAP + 1},
            "max_tokens",
            id="max-tokens-over-cap",
        ),
        pytest.param(
            CHAT,
            {"model": m, "messages": MSGS, "max_completion_tokens": 10**30},
            "max_completion_tokens",
            id="max-completion-tokens-huge",
        ),
        pytest.param(
            CHAT, {"model": m, "messages": MSGS, "max_tokens": True}, "max_tokens", id="bool"
        ),
        pytest.param(
            CHAT, {"model": m, "messages": MSGS, "max_tokens": 2.5}, "max_tokens", id="float"
        ),
        pytest.param(
            CHAT, {"model": m, "messages": MSGS, "stream": "yes"}, "stream", id="stream-string"
        ),
        pytest.param("/v1/completions", {"model": m}, "prompt", id="completions-no-prompt"),
        pytest.param(
            "/v1/completions", {"model": m, "prompt": []}, "prompt", id="completions-empty-list"
        ),
        pytest.param("/v1/embeddings", {"model": m, "input": 5}, "input", id="embeddings-input"),
    ]


@pytest.mark.parametrize(("path", "body", "param"), _bad_cases())
def test_400_bad_request(gw: Gw, path: str, body: Any, param: str | None) -> None:
    if isinstance(body, dict):
        body = {k: (gw.model if v == "MODEL" else v) for k, v in body.items()}
    elif isinstance(body, list):
        body = [{k: (gw.model if v == "MODEL" else v) for k, v in body[0].items()}]
    elif isinstance(body, str):
        body = json.dumps(body)
    r = gw.call("POST", path, body, key=gw.user, headers={"Content-Type": "application/json"})
    assert_error(r, 400, "invalid_request_error", param=param)


def test_400_max_tokens_cap_is_refused_not_clamped(gw: Gw) -> None:
    err = assert_error(gw.chat(max_tokens=CAP + 1), 400, "invalid_request_error")
    assert str(CAP) in err["message"]
    r = gw.chat(max_tokens=CAP)
    assert r.status == 200, r.raw
    assert r.json["usage"]["completion_tokens"] == CAP


def test_400_admin_keys_bad_body(gw: Gw) -> None:
    r = gw.call("POST", "/admin/keys", b"{oops", key=gw.admin)
    assert_error(r, 400, "invalid_request_error")
    r = gw.call("POST", "/admin/keys", {"name": "x", "colour": "red"}, key=gw.admin)
    assert_error(r, 400, "invalid_request_error", param="colour")
    r = gw.call("POST", "/admin/keys", {"name": "x", "scopes": ["root"]}, key=gw.admin)
    assert_error(r, 400, "invalid_request_error", param="scopes")
    r = gw.call("POST", "/admin/keys", {"name": "x", "rpm": -1}, key=gw.admin)
    assert_error(r, 400, "invalid_request_error", param="rpm")


@pytest.mark.parametrize("path", [CHAT, "/admin/keys"])
def test_400_deeply_nested_json_is_bad_input_not_500(gw: Gw, path: str) -> None:
    r = gw.call("POST", path, b"[" * 1500, key=gw.admin)  # under max_body_bytes
    assert_error(r, 400, "invalid_request_error")


@pytest.mark.parametrize("valid_gzip", [False, True])
def test_415_compressed_body_is_refused_unread(gw: Gw, valid_gzip: bool) -> None:
    """Request bodies are never inflated (a gzip bomb froze the event loop): gzip, valid
    or not, is 415 in OpenAI's shape, before the key is even looked at."""
    import gzip

    body = json.dumps({"model": gw.model, "messages": MSGS, "max_tokens": 2}).encode()
    for key in (gw.user, None):
        r = gw.call(
            "POST",
            CHAT,
            gzip.compress(body) if valid_gzip else body,
            key=key,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        assert_error(r, 415, "invalid_request_error")
        assert r.error["code"] == "unsupported_content_encoding"


# ---- 401 -----------------------------------------------------------------------------


def test_401_no_or_malformed_header(gw: Gw) -> None:
    for path in ("/v1/models", "/admin/status", "/metrics"):
        assert_401(gw.call("GET", path), "missing_api_key")
    for header in ("Basic dXNlcjpwYXNz", "Token " + gw.user, "Bearer", gw.user):
        r = gw.call("GET", "/v1/models", headers={"Authorization": header})
        assert_401(r, "missing_api_key")


def test_401_bad_keys(gw: Gw) -> None:
    key_id = gw.user.split("-")[2]
    unknown_id = "0" * 8 if key_id != "0" * 8 else "1" * 8
    for bad in (
        "junk",
        "sk-la-",
        "sk-la-XYZ-abc",
        "sk-la-" + unknown_id + "-" + "A" * 43,  # well-formed, no such id
        gw.user[:-1] + ("A" if gw.user[-1] != "A" else "B"),  # right id, wrong secret
        gw.user + "x" * 300,  # absurdly long
        "sk-la-" + key_id + "-" + "\u00e9" * 20,
    ):
        hdr = f"Bearer {bad}".encode().decode("latin-1")
        r = gw.call("GET", "/v1/models", headers={"Authorization": hdr})
        err = assert_401(r, "invalid_api_key")
        assert bad not in err["message"]  # a presented secret is never echoed back
    # The scheme is case-insensitive, as RFC 7235 says.
    r = gw.call("GET", "/v1/models", headers={"Authorization": f"bearer {gw.user}"})
    assert r.status == 200


def test_401_revoked_key(gw: Gw) -> None:
    key, key_id = gw.new_key(scopes=["user"])
    assert gw.call("GET", "/v1/models", key=key).status == 200
    r = gw.call("DELETE", f"/admin/keys/{key_id}", key=gw.admin)
    assert r.status == 200 and r.json == {"id": key_id, "revoked": True}
    assert_401(gw.call("GET", "/v1/models", key=key), "invalid_api_key")
    assert_401(gw.chat(key=key), "invalid_api_key")


def test_401_expired_key(gw: Gw) -> None:
    # `keys create --expires-days` cannot make a key that is expired already: write one
    # whose expiry is in the past straight into the keys file, as the CLI would.
    store = KeyStore(gw.tmp / "keys.json")
    with store.locked():
        store.load()
        record, key = store.new_key(
            "expired", ["user"], expires_days=1, now=time.time() - 2 * 86400
        )
        atomic_write(store.path, render_keys_document([*store.records, record]))
    deadline = time.monotonic() + 2.5
    while True:
        r = gw.call("GET", "/v1/models", key=key)
        if (r.status == 401 and "expired" in r.error["message"]) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    err = assert_401(r, "invalid_api_key")
    assert "expired" in err["message"], err
    assert_401(gw.chat(key=key), "invalid_api_key")


# ---- 403 -----------------------------------------------------------------------------


def test_403_wrong_scope(gw: Gw) -> None:
    cases = [
        (gw.user, "GET", "/admin/status"),
        (gw.user, "GET", "/admin/keys"),
        (gw.user, "POST", "/admin/engines/0/drain"),
        (gw.user, "GET", "/metrics"),  # metrics_public = false
        (gw.metrics, "GET", "/v1/models"),
        (gw.metrics, "GET", "/admin/status"),
    ]
    for key, method, path in cases:
        r = gw.call(method, path, key=key)
        assert_error(r, 403, "permission_error", "insufficient_scope")
    r = gw.call("POST", CHAT, {"model": gw.model, "messages": MSGS}, key=gw.metrics)
    assert_error(r, 403, "permission_error", "insufficient_scope")
    # The right scopes get in.
    assert gw.call("GET", "/metrics", key=gw.metrics).status == 200
    assert gw.call("GET", "/metrics", key=gw.admin).status == 200
    assert gw.call("GET", "/v1/models", key=gw.user).status == 200
    assert gw.call("GET", "/admin/status", key=gw.admin).status == 200


def test_metrics_public_opens_metrics_only(gw: Gw) -> None:
    cfg_path = gw.tmp / "config.toml"
    cfg = json.loads(json.dumps(gw.app.config))
    cfg["gateway"]["metrics_public"] = True
    try:
        write_config(cfg_path, cfg)
        gw.app.signal(signal.SIGHUP)
        gw.app.wait_for(lambda: gw.call("GET", "/metrics").status == 200, 5, "metrics open")
        r = gw.call("GET", "/metrics")
        assert r.headers.get_content_type() == "text/plain"
        assert "appliance_requests_total" in r.raw.decode()
        # Only /metrics: the rest still needs its key.
        assert_401(gw.call("GET", "/admin/status"), "missing_api_key")
        assert_401(gw.call("GET", "/v1/models"), "missing_api_key")
    finally:
        write_config(cfg_path, gw.app.config)
        gw.app.signal(signal.SIGHUP)
    gw.app.wait_for(lambda: gw.call("GET", "/metrics").status == 401, 5, "metrics closed")
    assert "gateway.metrics_public" in gw.app.log()


# ---- 404 / 405 / 413 -------------------------------------------------------------------


def test_404_unknown_route(gw: Gw) -> None:
    for method, path, key in (
        ("GET", "/nope", None),
        ("GET", "/v1/nope", gw.user),
        ("POST", "/v1/chat/completion", gw.user),
        ("GET", "/admin/nope", gw.admin),
        ("GET", "/v2/models", gw.user),
    ):
        r = gw.call(method, path, key=key)
        err = assert_error(r, 404, "not_found_error", "unknown_route")
        assert path in err["message"]
    r = gw.call("POST", "/admin/engines/7/drain", key=gw.admin)
    assert_error(r, 404, "not_found_error", "unknown_engine")
    r = gw.call("DELETE", "/admin/keys/00000000", key=gw.admin)
    assert_error(r, 404, "not_found_error", "unknown_key")


def test_404_unknown_model(gw: Gw) -> None:
    for path, extra in (
        (CHAT, {"messages": MSGS}),
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/embeddings", {"input": "x"}),
    ):
        r = gw.call("POST", path, {"model": "gpt-9", **extra}, key=gw.user)
        err = assert_error(r, 404, "not_found_error", "model_not_found", param="model")
        assert "gpt-9" in err["message"]


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", CHAT), ("PUT", "/v1/models"), ("DELETE", "/v1/embeddings"), ("POST", "/healthz")],
)
def test_405_wrong_method(gw: Gw, method: str, path: str) -> None:
    r = gw.call(method, path, key=gw.user)
    assert_error(r, 405, "invalid_request_error", "method_not_allowed")
    assert r.headers.get("Allow"), dict(r.headers)


def test_413_body_too_large(gw: Gw) -> None:
    big = {"model": gw.model, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    r = gw.call("POST", CHAT, big, key=gw.user)
    err = assert_error(r, 413, "invalid_request_error", "request_too_large")
    assert str(MAX_BODY) in err["message"]
    r = gw.call("POST", "/admin/keys", b"{" + b" " * MAX_BODY + b"}", key=gw.admin)
    assert_error(r, 413, "invalid_request_error", "request_too_large")


# ---- 429 -----------------------------------------------------------------------------


def test_429_rpm_with_retry_after(gw: Gw) -> None:
    key, key_id = gw.new_key(scopes=["user"], rpm=2)
    assert gw.chat(key=key, max_tokens=1).status == 200
    assert gw.chat(key=key, max_tokens=1).status == 200
    r = gw.chat(key=key, max_tokens=1)
    err = assert_error(r, 429, "rate_limit_error", "rate_limit_rpm")
    assert 1 <= retry_after(r) <= 30
    assert "rpm" in err["message"]
    # Another key is not affected, and the refusal is counted by key id.
    assert gw.chat(max_tokens=1).status == 200
    assert gw.metric(f'appliance_rate_limited_total{{key_id="{key_id}",limit="rpm"}}') == 1


def test_429_tpm_with_retry_after(gw: Gw) -> None:
    key, _ = gw.new_key(scopes=["user"], tpm=120)
    assert gw.chat(key=key, max_tokens=60).status == 200
    r = gw.chat(key=key, max_tokens=60)
    assert_error(r, 429, "rate_limit_error", "rate_limit_tpm")
    retry_after(r)


# ---- 503 -----------------------------------------------------------------------------


def test_503_queue_full_and_queue_timeout(gw: Gw) -> None:
    # Two engines x max_inflight 1 busy for ~1 s; a queue of one that times out at 0.5 s.
    full = gw.metric('appliance_admission_rejections_total{reason="queue_full"}')
    timeout = gw.metric('appliance_admission_rejections_total{reason="queue_timeout"}')
    with gw.knobs(token_delay_ms=100), concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = []
        for _ in range(4):
            futures.append(pool.submit(gw.chat, max_tokens=10))
            time.sleep(0.05)
        results = [f.result() for f in futures]
    statuses = sorted(r.status for r in results)
    assert statuses == [200, 200, 503, 503], [(r.status, r.raw) for r in results]
    codes = set()
    for r in results:
        if r.status == 503:
            codes.add(assert_error(r, 503, "service_unavailable")["code"])
            retry_after(r)
    assert codes == {"queue_full", "queue_timeout"}
    assert gw.metric('appliance_admission_rejections_total{reason="queue_full"}') == full + 1
    assert gw.metric('appliance_admission_rejections_total{reason="queue_timeout"}') == timeout + 1
    assert all(e["inflight"] == 0 for e in gw.engines())


def test_503_when_no_engine_takes_work_and_readyz(gw: Gw) -> None:
    try:
        for i in range(2):
            # The last serving engine drains only when forced (it stops the service).
            force = "?force=true" if i == 1 else ""
            r = gw.call("POST", f"/admin/engines/{i}/drain{force}", key=gw.admin)
            assert r.status == 200 and r.json["state"] == "DRAINING", r.raw
        r = gw.call("GET", "/readyz")
        assert r.status == 503 and r.json["engines_ready"] == [], r.raw
        retry_after(r)
        started = time.monotonic()
        r = gw.chat(max_tokens=1)
        # Every engine drained by an admin: refused at once, saying so (issue 33 item 11).
        err = assert_error(r, 503, "service_unavailable", "no_engine")
        assert "drained by an admin" in err["message"], err
        retry_after(r)
        assert time.monotonic() - started < 3
        assert gw.call("GET", "/healthz").status == 200  # alive, just not ready
    finally:
        for i in range(2):
            gw.call("POST", f"/admin/engines/{i}/resume", key=gw.admin)
    assert gw.call("GET", "/readyz").status == 200
    assert gw.chat(max_tokens=1).status == 200


# ---- 502 -----------------------------------------------------------------------------


def test_502_when_every_engine_fails(gw: Gw) -> None:
    with gw.knobs(fail_requests=True):
        for stream in (False, True):
            r = gw.chat(max_tokens=2, stream=stream)
            err = assert_error(r, 502, "api_error", "engine_error")
            assert "500" in err["message"]
        r = gw.call("POST", "/v1/completions", {"model": gw.model, "prompt": "x"}, key=gw.user)
        assert_error(r, 502, "api_error", "engine_error")
    assert gw.chat(max_tokens=1).status == 200
    assert all(e["state"] == "READY" for e in gw.engines())


def test_engine_4xx_is_passed_through(gw: Gw) -> None:
    # What only the engine checks (here: a message that is not an object) comes back as
    # the engine said it, not turned into a 5xx and not retried elsewhere.
    r = gw.call("POST", CHAT, {"model": gw.model, "messages": [1]}, key=gw.user)
    assert r.status == 400
    assert r.error["param"] == "messages"


# ---- 504: a connection to the engine that times out ----------------------------------


def _fill_backlog(port: int, n: int = 400) -> list[socket.socket]:
    """Connections a stopped server never accepts: once its accept queue is full, the
    kernel drops further SYNs, so the next connect() times out."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        socks.append(s)
    return socks


def test_504_engine_connect_timeout(tmp_path: Path) -> None:
    # Over TCP, where a full accept queue makes connect() time out (a Unix socket would
    # refuse at once): what is tested is that a timeout is answered 504.
    cfg = fake_engine_config(
        tmp_path,
        1,
        engine={"listen": "tcp"},
        # No health check during the test: one failing on the stopped engine would make
        # it SUSPECT, and the request would queue for no engine instead of timing out.
        health={"interval_s": 600, "failures_to_restart": 100},
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        admin = (tmp_path / "admin.key").read_text().strip()
        port = int(cfg["gateway"]["port"])
        model = request(port, "GET", "/v1/models", key=admin).json["data"][0]["id"]
        pid = app.engine_stats(0)["pid"]  # type: ignore[index]
        os.kill(pid, signal.SIGSTOP)
        socks = _fill_backlog(app.engine_port(0))
        try:
            # The gateway has never talked to this engine: it must open a connection,
            # which times out (5 s) since the stopped engine's queue is full.
            r = request(port, "POST", CHAT, {"model": model, "messages": MSGS}, admin, timeout=20)
        finally:
            for s in socks:
                s.close()
            os.kill(pid, signal.SIGCONT)
    assert r.status in (502, 504), (r.status, r.raw)
    assert "Timeout" in r.error["message"]  # the failure really was a timeout
    assert_error(r, 504, "timeout_error", "engine_error")
