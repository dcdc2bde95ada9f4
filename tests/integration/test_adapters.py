"""LoRA adapters served as models (issue 23), through the daemon with fake engines.

One daemon: "chat" (engine 0) runs with LoRA (rank up to 16) and has the adapter "sql" in
its config; "plain" (engine 1) runs without LoRA; "od" loads on demand and has the
adapter "od-sql". What is asserted is what a user and an admin see: answers under the
adapter's name, /v1/models, metrics, the admin's add and remove with their refusals,
what the engine itself serves, the kept file, the audit trail; and, with a daemon of its
own, an adapter added at run time served again after the daemon restarts.
"""

from __future__ import annotations

import json
import re
import signal
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import STEADY_HEALTH, Appliance, fake_engine_config, run_appliance
from tests.fakes.http_json import call_json
from tests.fakes.lora_files import fake_adapter

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]
LORA = ["--enable-lora", "--max-lora-rank", "16"]


class Box:
    def __init__(self, app: Appliance, key: str, tmp: Path) -> None:
        self.app, self.key, self.tmp = app, key, tmp

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        return call_json(self.app.url, self.key, method, path, body)

    def chat(self, model: str) -> tuple[int, Any]:
        body = {"model": model, "messages": MSGS, "max_tokens": 2}
        return self.call("POST", "/v1/chat/completions", body)

    def add(self, model: str, name: str, path: Path | str) -> tuple[int, Any]:
        return self.call(
            "POST", f"/admin/models/{model}/adapters", {"name": name, "path": str(path)}
        )

    def listed(self) -> dict[str, Any]:
        code, body = self.call("GET", "/v1/models")
        assert code == 200, body
        return {m["id"]: m.get("parent") for m in body["data"]}

    def engine_adapters(self, engine: int) -> dict[str, str]:
        stats = self.app.engine_stats(engine)
        assert stats is not None
        return dict(stats["adapters"])

    def requests_in_flight(self, engine: int) -> int:
        code, status = self.call("GET", "/admin/status")
        assert code == 200, status
        return int(status["engines"][engine]["inflight"])

    def queued(self) -> float:
        code, text = self.call("GET", "/metrics")
        assert code == 200
        lines = [x for x in str(text).splitlines() if x.startswith("appliance_queue_depth ")]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    def requests_for(self, model: str) -> float:
        code, text = self.call("GET", "/metrics")
        assert code == 200
        total = 0.0
        for line in str(text).splitlines():
            if line.startswith("appliance_requests_total{") and f'model="{model}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total


def lora_config(tmp: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = fake_engine_config(tmp, 3, health=STEADY_HEALTH)
    command = cfg["engine"]["command"]
    cfg["models"] = [
        {
            "name": "chat",
            "cpu_engines": 1,
            "command": [*command, *LORA],
            "adapters": [{"name": "sql", "path": str(fake_adapter(tmp / "lora" / "sql"))}],
        },
        {"name": "plain", "cpu_engines": 1},
        {
            "name": "od",
            "cpu_engines": 1,
            "load": "on_demand",
            "load_timeout_s": 30,
            "command": [*command, *LORA],
            "adapters": [{"name": "od-sql", "path": str(fake_adapter(tmp / "lora" / "od"))}],
        },
    ]
    return cfg


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("adapters")
    with run_appliance(tmp, lora_config(tmp)) as app:
        app.wait_ready()
        yield Box(app, (tmp / "admin.key").read_text().strip(), tmp)


def test_every_adapter_is_listed_with_its_base_model_as_parent(box: Box) -> None:
    assert box.listed() == {"chat": None, "plain": None, "od": None, "sql": "chat", "od-sql": "od"}


def test_a_request_for_an_adapter_goes_to_its_base_models_engine_under_its_name(
    box: Box,
) -> None:
    before = box.requests_for("sql")
    code, body = box.chat("sql")
    assert code == 200, body
    assert body["model"] == "sql"
    stats = box.app.engine_stats(0)
    assert stats is not None and stats["last_request"]["body"]["model"] == "sql"
    assert box.requests_for("sql") == before + 1  # the model label is the adapter's name
    assert box.engine_adapters(0) == {"sql": str(box.tmp / "lora" / "sql")}


def test_an_unknown_name_is_404_naming_the_adapters_too(box: Box) -> None:
    code, body = box.chat("sql-nope")
    assert code == 404, body
    assert body["error"]["code"] == "model_not_found"
    assert "sql" in body["error"]["message"]


def test_a_request_for_an_on_demand_models_adapter_loads_the_model(box: Box) -> None:
    code, body = box.chat("od-sql")
    assert code == 200, body
    assert body["model"] == "od-sql"
    code, status = box.call("GET", "/admin/status")
    assert {m["name"]: m["state"] for m in status["models"]}["od"] == "loaded"


def test_the_gateway_never_relays_the_engines_lora_routes(box: Box) -> None:
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/adapters"):
        body = {"lora_name": "x", "lora_path": str(box.tmp), "name": "x", "src": str(box.tmp)}
        code, answer = box.call("POST", path, body)
        assert code == 404, (path, answer)
    code, _ = box.call("DELETE", "/adapters/sql")
    assert code in (404, 405)
    assert box.engine_adapters(0) == {"sql": str(box.tmp / "lora" / "sql")}


@pytest.mark.parametrize(
    ("model", "name", "folder", "status", "code"),
    [
        ("chat", "bad", "/no/such/folder", 400, "adapter_invalid"),
        ("chat", "bad", "{tmp}", 400, "adapter_invalid"),  # no adapter_config.json
        ("chat", "big", "{tmp}/lora/big", 409, "rank_too_large"),  # r 64 > 16
        ("chat", "plain", "{tmp}/lora/sql", 409, "name_taken"),  # a model's name
        ("chat", "od-sql", "{tmp}/lora/sql", 409, "name_taken"),  # another's adapter
        ("plain", "p-sql", "{tmp}/lora/sql", 409, "lora_off"),
        ("nope", "n-sql", "{tmp}/lora/sql", 404, "model_not_found"),
        ("chat", "Bad Name", "{tmp}/lora/sql", 400, "invalid_request"),
        ("chat", "..", "{tmp}/lora/sql", 400, "invalid_request"),  # no URL can name it
        ("chat", "sql/x", "{tmp}/lora/sql", 400, "invalid_request"),
        ("chat", "x", "/tmp/a\u0000b", 400, "adapter_invalid"),
    ],
)
def test_an_adapter_that_cannot_be_served_is_refused_clearly(
    box: Box, model: str, name: str, folder: str, status: int, code: str
) -> None:
    fake_adapter(box.tmp / "lora" / "big", r=64)
    listed = box.listed()
    code_, body = box.add(model, name, folder.format(tmp=box.tmp))
    assert (code_, body["error"]["code"]) == (status, code), body
    assert body["error"]["message"]
    assert box.listed() == listed
    assert box.engine_adapters(0) == {"sql": str(box.tmp / "lora" / "sql")}


def test_a_folder_another_account_could_change_is_refused_and_not_loaded(box: Box) -> None:
    folder = fake_adapter(box.tmp / "lora" / "open")
    folder.chmod(0o777)  # any account could swap the weights before vLLM reads them
    code, body = box.add("chat", "open", folder)
    assert (code, body["error"]["code"]) == (400, "adapter_unsafe"), body
    assert f"{folder} is writable by every account" in body["error"]["message"]
    assert f"chmod go-w {folder}" in body["error"]["message"]
    assert "open" not in box.listed()
    assert "open" not in box.engine_adapters(0)


def test_the_audit_line_of_an_add_is_bounded_and_never_quotes_the_refusal(box: Box) -> None:
    name, path = "n" * 5000, "/" + "p" * 5000
    code, body = box.add("chat", name, path)
    assert (code, body["error"]["code"]) == (400, "invalid_request"), body
    line = (box.tmp / "audit.log").read_text().splitlines()[-1]
    entry = json.loads(line)
    assert entry["action"] == "model.adapter.add" and entry["outcome"] == "refused"
    assert len(line) < 2000, line
    assert "message" not in json.dumps(entry)


def test_an_adapter_the_engine_cannot_load_is_refused_and_not_kept(box: Box) -> None:
    # Its config passes the appliance's checks; its weights are not safetensors.
    folder = fake_adapter(box.tmp / "lora" / "corrupt")
    (folder / "adapter_model.safetensors").write_bytes(b"garbage")
    code, body = box.add("chat", "corrupt", folder)
    assert (code, body["error"]["code"]) == (400, "adapter_invalid"), body
    assert "header too large" in body["error"]["message"]
    assert "corrupt" not in box.listed()
    assert "corrupt" not in box.engine_adapters(0)
    assert box.chat("sql")[0] == 200  # the engine serves on


def test_an_admin_adds_an_adapter_at_run_time_and_it_survives_an_engine_restart(
    box: Box,
) -> None:
    folder = fake_adapter(box.tmp / "lora" / "sql2")
    code, body = box.add("chat", "sql2", folder)
    assert code == 200, body
    assert box.engine_adapters(0)["sql2"] == str(folder)
    code, answer = box.chat("sql2")
    assert (code, answer["model"]) == (200, "sql2")
    assert box.listed()["sql2"] == "chat"
    kept = box.tmp / "adapters.json"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert [a["name"] for a in json.loads(kept.read_text())["adapters"]] == ["sql2"]
    audit = (box.tmp / "audit.log").read_text()
    assert re.search(r'"action": ?"model.adapter.add".*"outcome": ?"ok"', audit), audit

    pid = box.app.engine_stats(0)["pid"]  # type: ignore[index]
    assert box.call("POST", "/admin/engines/0/restart")[0] == 202
    box.app.wait_for(
        lambda: (
            (s := box.app.engine_stats(0)) is not None
            and s["pid"] != pid
            and "sql2" in s["adapters"]
        ),
        30,
        "engine 0 back with sql2",
    )
    box.app.wait_for(lambda: box.chat("sql2")[0] == 200, 30, "sql2 answers again")
    # A config reload (SIGHUP) keeps the admin's adapter as it keeps the config's.
    box.app.signal(signal.SIGHUP)
    box.app.wait_for(
        lambda: "config.reload" in (box.tmp / "audit.log").read_text(), 30, "the reload"
    )
    assert box.listed()["sql2"] == "chat"
    assert box.chat("sql2")[0] == 200


def test_an_admin_removes_an_adapter_everywhere(box: Box) -> None:
    folder = fake_adapter(box.tmp / "lora" / "gone")
    assert box.add("chat", "gone", folder)[0] == 200
    code, body = box.call("DELETE", "/admin/models/chat/adapters/gone")
    assert code == 200, body
    assert "gone" not in box.engine_adapters(0)
    assert "gone" not in box.listed()
    code, body = box.chat("gone")
    assert (code, body["error"]["code"]) == (404, "model_not_found")
    kept = json.loads((box.tmp / "adapters.json").read_text())["adapters"]
    assert "gone" not in [a["name"] for a in kept]
    # The config's adapter stays: it is removed in the config.
    code, body = box.call("DELETE", "/admin/models/chat/adapters/sql")
    assert (code, body["error"]["code"]) == (409, "adapter_in_config")
    code, body = box.call("DELETE", "/admin/models/chat/adapters/nothing")
    assert (code, body["error"]["code"]) == (404, "adapter_not_found")


def test_an_adapter_added_at_run_time_is_served_after_the_daemon_restarts(
    tmp_path: Path,
) -> None:
    cfg = lora_config(tmp_path)
    cfg["models"] = cfg["models"][:1]
    cfg["engine"]["cpu_engines"] = 1
    folder = fake_adapter(tmp_path / "lora" / "kept")
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        box = Box(app, (tmp_path / "admin.key").read_text().strip(), tmp_path)
        assert box.add("chat", "kept", folder)[0] == 200
        app.signal(signal.SIGTERM)
        assert app.wait_exit() == 0
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        box = Box(app, box.key, tmp_path)
        assert box.listed()["kept"] == "chat"
        code, body = box.chat("kept")
        assert (code, body["model"]) == (200, "kept"), body
        assert box.engine_adapters(0)["kept"] == str(folder)


def test_an_adapters_file_that_cannot_be_read_is_never_written_over(tmp_path: Path) -> None:
    cfg = lora_config(tmp_path)
    cfg["models"] = cfg["models"][:1]
    cfg["engine"]["cpu_engines"] = 1
    kept = tmp_path / "adapters.json"
    kept.write_text('{"format": 1, "adapters": [{"name": "mine", "model": "chat"}]}')
    kept.chmod(0o600)
    before = kept.read_bytes()
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        box = Box(app, (tmp_path / "admin.key").read_text().strip(), tmp_path)
        code, body = box.add("chat", "new", fake_adapter(tmp_path / "lora" / "new"))
        assert (code, body["error"]["code"]) == (503, "state_file"), body
        assert f"{kept} is not an adapters file" in body["error"]["message"]
        assert "restart the service" in body["error"]["message"]
        assert box.chat("sql")[0] == 200  # the config's adapters serve on
    assert kept.read_bytes() == before


def test_requests_for_an_adapter_the_admin_removes_finish_and_are_not_cut(
    tmp_path: Path,
) -> None:
    # One request at a time on a slow engine: one streams on the adapter, one waits in
    # the gateway's queue for it, and the admin removes the adapter meanwhile.
    cfg = lora_config(tmp_path)
    chat = cfg["models"][0]
    chat["command"] = [*chat["command"], "--token-delay-ms", "40"]
    chat["max_inflight"] = 1
    cfg["models"] = [chat]
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        box = Box(app, (tmp_path / "admin.key").read_text().strip(), tmp_path)
        assert box.add("chat", "busy", fake_adapter(tmp_path / "lora" / "busy"))[0] == 200
        answers: dict[str, Any] = {}

        def ask(what: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> None:
            answers[what] = box.call("POST", path, body)

        stream = {"model": "busy", "messages": MSGS, "max_tokens": 40, "stream": True}
        waiting = {"model": "busy", "messages": MSGS, "max_tokens": 2}
        threads = [threading.Thread(target=ask, args=("stream", stream))]
        threads[0].start()
        app.wait_for(lambda: box.requests_in_flight(0) == 1, 30, "the stream on the engine")
        threads.append(threading.Thread(target=ask, args=("waiting", waiting)))
        threads[1].start()
        app.wait_for(lambda: box.queued() == 1, 30, "the second request queued")
        remove = threading.Thread(
            target=lambda: answers.update(
                removed=box.call("DELETE", "/admin/models/chat/adapters/busy")
            )
        )
        remove.start()
        for t in (*threads, remove):
            t.join(60)
        code, text = answers["stream"]
        assert code == 200 and str(text).rstrip().endswith("data: [DONE]"), text
        assert str(text).count('"content"') >= 40
        code, body = answers["waiting"]
        assert (code, body["model"]) == (200, "busy"), body  # not vLLM's 404
        assert answers["removed"][0] == 200
        assert "busy" not in box.engine_adapters(0)
        code, body = box.chat("busy")
        assert (code, body["error"]["code"]) == (404, "model_not_found")
