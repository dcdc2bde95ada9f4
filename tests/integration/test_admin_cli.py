"""`llm-appliance engines drain|resume|restart` and `models load|unload` against a running
daemon with fake engines: the gateway and admin key found from the config as `status`
finds them, one line for what happened, exit 1 with a clear line when it did not."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from appliance.cli import main
from tests.fakes.appliance_proc import (
    STEADY_HEALTH,
    Appliance,
    fake_engine_config,
    get_json,
    run_appliance,
    write_config,
)
from tests.fakes.engine_proc import free_port

pytestmark = pytest.mark.slow


@dataclass
class Box:
    app: Appliance
    config: Path
    key: str

    def status(self) -> dict[str, Any]:
        code, body = get_json(
            self.app.url + "/admin/status", headers={"Authorization": f"Bearer {self.key}"}
        )
        assert code == 200, body
        assert isinstance(body, dict)
        return body

    def engine_state(self, i: int) -> str:
        return str(self.status()["engines"][i]["state"])

    def model_state(self, name: str) -> str:
        return next(str(m["state"]) for m in self.status()["models"] if m["name"] == name)


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("admin_cli")
    cfg: dict[str, Any] = fake_engine_config(tmp, 3, health=STEADY_HEALTH)
    cfg["models"] = [
        {"name": "chat", "cpu_engines": 2},
        {"name": "lazy", "cpu_engines": 1, "load": "on_demand", "load_timeout_s": 30},
    ]
    with run_appliance(tmp, cfg) as app:
        app.wait_for(
            lambda: (get_json(app.url + "/readyz")[1] or {}).get("engines_ready") == [0, 1],
            30,
            "both chat engines READY",
        )
        yield Box(app, tmp / "config.toml", (tmp / "admin.key").read_text().strip())


def cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str
) -> tuple[int, str, str]:
    """The command as an operator types it (no key in the environment)."""
    monkeypatch.delenv("LLM_APPLIANCE_KEY", raising=False)
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_drain_and_resume_an_engine(
    box: Box, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = cli(capsys, monkeypatch, "engines", "drain", "1", "--config", str(box.config))
    assert (code, err) == (0, "")
    assert out.startswith("engine 1: DRAINING: takes no new requests") and out.count("\n") == 1
    assert box.engine_state(1) == "DRAINING"
    # The other chat engine is now the last serving chat: a drain stops the service.
    code, out, err = cli(capsys, monkeypatch, "engines", "drain", "0", "--config", str(box.config))
    assert code == 1 and out == ""
    assert "engine 0: drain refused: engine 0 is the last engine serving" in err
    assert "add --force" in err and "?force" not in err
    assert box.engine_state(0) == "READY"
    code, out, _ = cli(capsys, monkeypatch, "engines", "resume", "1", "--config", str(box.config))
    assert code == 0 and out == "engine 1: READY: takes requests again\n"
    assert box.engine_state(1) == "READY"
    code, out, err = cli(capsys, monkeypatch, "engines", "resume", "1", "--config", str(box.config))
    assert code == 1 and "only a drained engine resumes" in err


def test_a_forced_drain_of_the_last_engine_serving(
    box: Box, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["--config", str(box.config)]
    assert cli(capsys, monkeypatch, "engines", "drain", "0", *args)[0] == 0
    code, out, _ = cli(capsys, monkeypatch, "engines", "drain", "1", "--force", *args)
    assert code == 0 and out.startswith("engine 1: DRAINING")
    for i in (0, 1):
        assert cli(capsys, monkeypatch, "engines", "resume", str(i), *args)[0] == 0
    box.app.wait_for(lambda: get_json(box.app.url + "/readyz")[0] == 200, 10, "ready again")


def test_restart_drains_then_restarts_and_spares_the_last_engine_unless_forced(
    box: Box, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["--config", str(box.config)]
    before = box.status()["engines"][0]["restarts"]
    code, out, err = cli(capsys, monkeypatch, "engines", "restart", "0", *args)
    assert (code, err) == (0, "")
    assert out.startswith("engine 0: restart asked for; it drains, then restarts")
    box.app.wait_for(
        lambda: (
            box.status()["engines"][0]["restarts"] == before + 1 and box.engine_state(0) == "READY"
        ),
        30,
        "engine 0 restarted and READY",
    )
    # With engine 1 drained, engine 0 is the last serving chat: refused here, unless forced.
    assert cli(capsys, monkeypatch, "engines", "drain", "1", *args)[0] == 0
    try:
        code, out, err = cli(capsys, monkeypatch, "engines", "restart", "0", *args)
        assert code == 1 and out == ""
        assert "engine 0 is the last engine serving chat" in err and "add --force" in err
        assert box.status()["engines"][0]["restarts"] == before + 1
    finally:
        assert cli(capsys, monkeypatch, "engines", "resume", "1", *args)[0] == 0


def test_unknown_engine_and_bad_id(
    box: Box, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = cli(capsys, monkeypatch, "engines", "drain", "9", "--config", str(box.config))
    assert code == 1 and out == ""
    assert "no engine 9" in err and "llm-appliance status" in err
    with pytest.raises(SystemExit) as exc:
        cli(capsys, monkeypatch, "engines", "resume", "x", "--config", str(box.config))
    assert exc.value.code == 2
    assert "engine ids are whole numbers" in capsys.readouterr().err


def test_load_and_unload_a_model(
    box: Box, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["--config", str(box.config)]
    code, out, err = cli(capsys, monkeypatch, "models", "load", "lazy", *args)
    assert (code, err) == (0, "")
    assert out == (
        "model lazy: loading, was unloaded; `llm-appliance status` shows when it is loaded\n"
    )
    box.app.wait_for(lambda: box.model_state("lazy") == "loaded", 30, "lazy loaded")
    code, out, _ = cli(capsys, monkeypatch, "models", "unload", "lazy", *args)
    assert code == 0 and out.startswith("model lazy: unloading (drained first), was loaded;")
    box.app.wait_for(lambda: box.model_state("lazy") == "unloaded", 30, "lazy unloaded")
    code, out, _ = cli(capsys, monkeypatch, "models", "unload", "lazy", *args)
    assert (code, out) == (0, "model lazy: already unloaded\n")
    code, out, err = cli(capsys, monkeypatch, "models", "unload", "chat", *args)
    assert code == 1 and out == "" and "model chat: unload refused:" in err
    assert "always loaded" in err
    code, out, err = cli(capsys, monkeypatch, "models", "load", "nope", *args)
    assert code == 1 and "model nope: no model has that name" in err


def test_no_key_a_user_key_and_no_daemon(
    box: Box,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same gateway, but a config whose keys file has no admin.key beside it.
    gw = {**box.app.config["gateway"], "keys_file": str(tmp_path / "keys.json")}
    elsewhere = write_config(tmp_path / "config.toml", {"gateway": gw})
    code, out, err = cli(capsys, monkeypatch, "engines", "drain", "0", "--config", str(elsewhere))
    assert code == 1 and out == ""
    assert "answered 401: no admin key" in err and "LLM_APPLIANCE_KEY" in err
    assert box.engine_state(0) == "READY"

    code, out, _ = cli(
        capsys, monkeypatch, "keys", "create", "--name", "dev", "--config", str(box.config)
    )
    user_key = re.search(r"sk-la-\S+", out)
    assert code == 0 and user_key is not None
    args = ["--config", str(box.config), "--key", user_key.group(0)]
    # The daemon picks a new key up within 2 s: until then the key is unknown (401).
    box.app.wait_for(
        lambda: "answered 403" in cli(capsys, monkeypatch, "models", "load", "lazy", *args)[2],
        10,
        "the user key refused with 403",
    )
    code, out, err = cli(capsys, monkeypatch, "models", "load", "lazy", *args)
    assert code == 1 and out == "" and "has no admin scope" in err

    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = cli(capsys, monkeypatch, "engines", "restart", "0", "--url", url)
    assert code == 1 and out == ""
    assert f"cannot reach {url}" in err and "is the daemon running?" in err
