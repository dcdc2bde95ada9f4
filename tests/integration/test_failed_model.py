"""A model whose engine refuses to start (as vLLM refuses a bad --speculative-config)
ends FAILED with the engine's own reason in /admin/status, `status` and the journal,
while the other model keeps serving."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from appliance.cli import main
from tests.fakes.appliance_proc import STEADY_HEALTH, Appliance, fake_engine_config, run_appliance

REASON = "ValueError: speculative method 'ngramm' is not one of vLLM's methods"


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Appliance, str]]:
    tmp = tmp_path_factory.mktemp("failed-model")
    cfg: dict[str, Any] = fake_engine_config(
        tmp,
        2,
        restart={"backoff_initial_s": 0.1, "backoff_max_s": 0.2, "max_restarts_per_hour": 2},
        health=STEADY_HEALTH,
    )
    # What vLLM does with a speculative config it refuses: a line naming the error on
    # its output, then exit 1, before it ever listens.
    refuses = ["sh", "-c", f'echo "INFO starting"; echo "{REASON}" >&2; exit 1', "sh", "{uds}"]
    cfg["models"] = [
        {"name": "chat", "cpu_engines": 1},
        {"name": "spec", "cpu_engines": 1, "command": refuses},
    ]
    with run_appliance(tmp, cfg) as app:
        app.wait_ready(30)
        yield app, (tmp / "admin.key").read_text().strip()


def _status(app: Appliance, key: str) -> dict[str, Any]:
    req = urllib.request.Request(
        app.url + "/admin/status", headers={"Authorization": f"Bearer {key}"}
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def _engine(app: Appliance, key: str, model: str) -> dict[str, Any]:
    return next(e for e in _status(app, key)["engines"] if e["model"] == model)


def test_the_refused_engine_is_failed_with_its_reason(
    box: tuple[Appliance, str], capsys: pytest.CaptureFixture[str]
) -> None:
    app, key = box
    app.wait_for(lambda: _engine(app, key, "spec")["state"] == "FAILED", 30, "spec FAILED")
    failed = _engine(app, key, "spec")
    assert REASON in failed["last_exit"]
    assert "exited with status 1" in failed["last_exit"]
    assert REASON in app.log()  # the journal has it too
    assert main(["status", "--url", app.url, "--key", key]) == 0
    out = capsys.readouterr().out
    assert REASON in out


def test_the_other_model_keeps_serving(box: tuple[Appliance, str]) -> None:
    app, key = box
    assert _engine(app, key, "chat")["state"] == "READY"
    body = json.dumps({"model": "chat", "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(
        app.url + "/v1/completions",
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        answer = json.loads(resp.read())
    assert answer["model"] == "chat"
    assert answer["choices"]
