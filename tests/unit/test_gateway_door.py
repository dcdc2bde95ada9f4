"""The gateway, in-process, against a fake appliance that is the door and nothing more.

The gateway app (``create_app``) is built over :class:`FakeAppliance`, which has exactly
the members of ``appliance.control.ApplianceView`` and ``EngineCommands`` and
``__slots__``: should the gateway reach for anything else of the supervisor (its engine
records, its plan, its readings), the attribute does not exist and the request fails.
Two in-process fake engines (``tests/fakes/fake_engine.py`` on test servers) answer the
relayed requests. A client talks to the gateway over real HTTP; no subprocess.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from appliance.cli import main as cli_main
from appliance.config import parse_config
from appliance.control import (
    ApplianceView,
    CommandResult,
    EngineCommands,
    EngineStatus,
    GpuStatus,
)
from appliance.endpoint import EngineAddress
from appliance.engine import EngineState
from appliance.engine_cpu import CpuDtype
from appliance.gateway.admin import routes as admin
from appliance.gateway.app import GATEWAY, create_app
from appliance.telemetry import GpuReading
from tests.fakes.fake_appliance import FakeAppliance
from tests.fakes.fake_engine import FakeEngine, parse_args

# The middleware stores the caller's key record under a plain string, which aiohttp warns about.
pytestmark = pytest.mark.filterwarnings("ignore::aiohttp.web_exceptions.NotAppKeyWarning")

MODEL = "m"
ENGINE_KEY = "eng-test-key"
READY, DRAINING = EngineState.READY, EngineState.DRAINING


def public(cls: type) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")}


def test_the_fake_appliance_is_the_door_and_nothing_more() -> None:
    assert public(FakeAppliance) == public(ApplianceView) | public(EngineCommands)
    fake = FakeAppliance(parse_config({}), [])
    with pytest.raises(AttributeError):
        fake.plan = None  # type: ignore[attr-defined]


@dataclasses.dataclass
class Box:
    client: TestClient[Any, Any]
    appliance: FakeAppliance
    engines: list[FakeEngine]
    user: str
    admin: str
    metrics: str

    def auth(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def set_state(self, engine_id: int, state: EngineState) -> None:
        engines = self.appliance._engines
        engines[engine_id] = dataclasses.replace(engines[engine_id], state=state)

    async def complete(self, key: str | None = None) -> tuple[int, dict[str, Any]]:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        headers = self.auth(key or self.user)
        async with self.client.post("/v1/completions", json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    async def admin_post(self, path: str) -> tuple[int, dict[str, Any]]:
        async with self.client.post(path, headers=self.auth(self.admin)) as resp:
            return resp.status, await resp.json()


@contextlib.asynccontextmanager
async def fake_engine() -> AsyncIterator[tuple[FakeEngine, int]]:
    args, _ = parse_args(
        ["--api-key", ENGINE_KEY, "--served-model-name", MODEL, "--token-delay-ms", "0"]
    )
    args.disable_uvicorn_access_log = True
    engine = FakeEngine(args)
    async with TestServer(engine.make_app()) as server:
        assert server.port is not None
        yield engine, server.port


@pytest.fixture
async def box(tmp_path: Path) -> AsyncIterator[Box]:
    config = parse_config(
        {
            "gateway": {"keys_file": str(tmp_path / "keys.json")},
            "engine": {"served_model_name": MODEL},
        }
    )
    async with fake_engine() as (e0, port0), fake_engine() as (e1, port1):
        # The fake engines run in this process: their sockets are its own.
        statuses = [
            EngineStatus(
                i,
                None,
                EngineAddress(port=p),
                READY,
                ENGINE_KEY,
                MODEL,
                model=MODEL,
                pid=os.getpid(),
            )
            for i, p in enumerate((port0, port1))
        ]
        appliance = FakeAppliance(config, statuses)
        app = create_app(appliance)
        keys = app[GATEWAY].keys
        _, user = keys.create("user", ["user"])
        _, admin_key = keys.create("admin", ["admin"])
        _, metrics = keys.create("metrics", ["metrics"])
        async with TestClient(TestServer(app)) as client:
            yield Box(client, appliance, [e0, e1], user, admin_key, metrics)


# ---- auth ------------------------------------------------------------------------------
async def test_a_request_without_a_key_or_with_a_bad_one_is_401(box: Box) -> None:
    async with box.client.get("/v1/models") as resp:
        assert resp.status == 401
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        assert (await resp.json())["error"]["code"] == "missing_api_key"
    async with box.client.get("/v1/models", headers=box.auth("sk-la-nope")) as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "invalid_api_key"


async def test_scopes_decide_what_a_key_reaches(box: Box) -> None:
    async with box.client.get("/admin/status", headers=box.auth(box.user)) as resp:
        assert resp.status == 403
        assert (await resp.json())["error"]["code"] == "insufficient_scope"
    async with box.client.get("/metrics", headers=box.auth(box.metrics)) as resp:
        assert resp.status == 200
    async with box.client.get("/v1/models", headers=box.auth(box.user)) as resp:
        assert resp.status == 200
        assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]


# ---- admission and routing ---------------------------------------------------------------
async def test_requests_go_to_the_engine_that_takes_work(box: Box) -> None:
    box.set_state(0, DRAINING)
    for _ in range(3):
        assert (await box.complete())[0] == 200
    assert [e.requests for e in box.engines] == [0, 3]
    box.set_state(0, READY)
    box.set_state(1, DRAINING)
    assert (await box.complete())[0] == 200
    assert [e.requests for e in box.engines] == [1, 3]


async def test_an_unknown_model_is_404(box: Box) -> None:
    headers = box.auth(box.user)
    body = {"model": "gpt-9", "prompt": "hi"}
    async with box.client.post("/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"


async def test_a_stopping_appliance_refuses_new_work(box: Box) -> None:
    box.appliance._accepting = False
    status, body = await box.complete()
    assert (status, body["error"]["code"]) == (503, "shutting_down")
    async with box.client.get("/readyz") as resp:
        assert resp.status == 503
        assert (await resp.json())["status"] == "stopping"


async def test_a_starting_appliance_says_it_is_starting_not_stopping(box: Box) -> None:
    # A new daemon sweeps an earlier run's engines before it accepts: that is no shutdown.
    box.appliance._accepting, box.appliance._starting = False, True
    status, body = await box.complete()
    assert (status, body["error"]["code"]) == (503, "starting")
    assert "starting" in body["error"]["message"]
    async with box.client.get("/readyz") as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "5"
        assert (await resp.json())["status"] == "starting"


async def test_no_engine_able_to_take_work_is_503_and_readyz_says_why(box: Box) -> None:
    box.set_state(0, EngineState.FAILED)
    box.set_state(1, EngineState.FAILED)
    status, body = await box.complete()
    assert (status, body["error"]["code"]) == (503, "no_engine")
    box.set_state(1, DRAINING)
    async with box.client.get("/readyz") as resp:
        assert resp.status == 503
        assert (await resp.json())["reasons"] == {"0": "failed", "1": "draining"}


async def test_health_is_readyz_for_routers_in_front_without_a_key(box: Box) -> None:
    """vllm-router waits for GET /health (no key) before it routes to a box: it must
    say what /readyz says, 200 while engines admit work and 503 while they drain."""
    async with box.client.get("/health") as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "ready"
    box.set_state(0, DRAINING)
    box.set_state(1, DRAINING)
    async with box.client.get("/health") as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "5"
        assert (await resp.json())["reasons"] == {"0": "draining", "1": "draining"}


async def test_healthz_follows_the_supervisor_loop_s_tick(box: Box) -> None:
    async with box.client.get("/healthz") as resp:
        assert resp.status == 200
    box.appliance._last_tick = time.monotonic() - 60
    async with box.client.get("/healthz") as resp:
        assert resp.status == 503


# ---- admin commands: the runner's answer becomes the status code -----------------------
async def test_drain_is_asked_and_the_answer_is_200_or_409(box: Box) -> None:
    box.appliance._answers["drain"] = CommandResult(True, DRAINING)
    assert await box.admin_post("/admin/engines/1/drain") == (200, {"id": 1, "state": "DRAINING"})
    await box.admin_post("/admin/engines/0/drain?force=true")
    assert box.appliance._asked == [("drain", 1, {"force": False}), ("drain", 0, {"force": True})]
    why = "engine 1 is the last engine serving: ...; add ?force=true to drain it anyway"
    box.appliance._answers["drain"] = CommandResult(False, READY, why)
    status, body = await box.admin_post("/admin/engines/1/drain")
    assert (status, body["error"]["code"], body["error"]["message"]) == (409, "cannot_drain", why)


async def test_restart_is_202_when_asked_for_and_409_when_refused(box: Box) -> None:
    box.appliance._answers["restart"] = CommandResult(True, READY)
    assert await box.admin_post("/admin/engines/0/restart") == (
        202,
        {"id": 0, "action": "restart", "accepted": True},
    )
    why = "engine 0 is STOPPING and cannot be restarted now"
    box.appliance._answers["restart"] = CommandResult(False, EngineState.STOPPING, why)
    status, body = await box.admin_post("/admin/engines/0/restart")
    assert (status, body["error"]["code"], body["error"]["message"]) == (409, "engine_busy", why)


async def test_resume_answers_with_the_engine_s_state(box: Box) -> None:
    box.appliance._answers["resume"] = CommandResult(True, READY)
    assert await box.admin_post("/admin/engines/0/resume") == (200, {"id": 0, "state": "READY"})
    box.appliance._answers["resume"] = CommandResult(False, READY, "engine 0 is READY; ...")
    assert (await box.admin_post("/admin/engines/0/resume"))[0] == 409


async def test_engine_ids_are_checked_before_anything_is_asked(box: Box) -> None:
    assert (await box.admin_post("/admin/engines/7/drain"))[0] == 404
    assert (await box.admin_post("/admin/engines/x/drain"))[0] == 400
    assert box.appliance._asked == []


async def test_a_runner_that_does_not_answer_is_a_bounded_wait(
    box: Box, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admin, "COMMAND_WAIT_S", 0.05)
    status, body = await box.admin_post("/admin/engines/0/drain")
    assert (status, body["error"]["code"]) == (503, "engine_busy")


# ---- what the box shows: status document and metrics ------------------------------------
def with_figures(box: Box) -> None:
    box.appliance._engines[0] = dataclasses.replace(
        box.appliance._engines[0],
        restarts=2,
        restarts_by_reason={"crash": 2},
        last_restart_reason="crash",
        kv_cache_usage=0.5,
        running=3.0,
    )
    # Engine 0 of a CPU box is telemetry entry 0 (a sensors file can heat it).
    box.appliance._gpus = (GpuStatus(GpuReading(0, temperature_c=82.0, power_w=90.0), 1),)


async def test_the_status_document_is_the_appliance_s_status(box: Box) -> None:
    with_figures(box)
    async with box.client.get("/admin/status", headers=box.auth(box.admin)) as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert doc["device"] == "cpu"
    assert (doc["accepting"], doc["ready"], doc["queue_depth"]) == (True, True, 0)
    e0, e1 = doc["engines"]
    assert (e0["state"], e0["restarts"], e0["restarts_by_reason"]) == ("READY", 2, {"crash": 2})
    assert (e0["temperature_c"], e0["kv_cache_usage"], e0["requests_running"]) == (82.0, 0.5, 3.0)
    assert (e1["temperature_c"], e1["kv_cache_usage"], e1["port"]) == (None, None, e1["port"])
    assert [(g["index"], g["temperature_c"], g["throttle_level"]) for g in doc["gpus"]] == [
        (0, 82.0, 1)
    ]


async def test_metrics_show_engines_gpus_and_throttle(box: Box) -> None:
    with_figures(box)
    async with box.client.get("/metrics", headers=box.auth(box.metrics)) as resp:
        text = await resp.text()
    for series in (
        'appliance_engine_state{engine="0",state="READY"} 1.0',
        'appliance_engine_state{engine="1",state="DRAINING"} 0.0',
        'appliance_engine_restarts_total{engine="0",reason="crash"} 2.0',
        'appliance_engine_kv_cache_usage{engine="0"} 0.5',
        'appliance_engine_requests_running{engine="0"} 3.0',
        'appliance_gpu_temperature_celsius{gpu="0"} 82.0',
        'appliance_gpu_power_watts{gpu="0"} 90.0',
        'appliance_throttle_level{gpu="0"} 1.0',
        "appliance_queue_depth 0.0",
    ):
        assert series in text, series
    assert 'appliance_engine_kv_cache_usage{engine="1"}' not in text


async def test_the_status_document_names_the_cpu_engines_dtype(box: Box) -> None:
    box.appliance._cpu_dtype = CpuDtype("float32", "no bf16 here")
    async with box.client.get("/admin/status", headers=box.auth(box.admin)) as resp:
        assert (await resp.json())["cpu_dtype"] == {"dtype": "float32", "reason": "no bf16 here"}


async def test_gpu_energy_is_shared_among_keys_by_their_tokens_and_keys_usage_shows_it(
    box: Box, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Energy per key (issue 37, item 4), the gateway's half: both engines on GPU 0 (so
    routing does not matter), key a sends three requests and key b one of the same size;
    the GPU's energy between two telemetry ticks is theirs 3:1, in /metrics as read, and
    in ``keys usage --json`` as energy_wh once saved."""
    gw = box.client.server.app[GATEWAY]
    for i, e in enumerate(box.appliance._engines):
        box.appliance._engines[i] = dataclasses.replace(e, gpu=0, gpus=(0,))
    _, key_a = gw.keys.create("a", ["user"])
    _, key_b = gw.keys.create("b", ["user"])

    clock = [0.0]  # the energy split's clock: 4 Wh is no GPU's use in a moment
    gw.usage.monotonic = lambda: clock[0]

    def tick(energy_j: float) -> None:
        box.appliance._gpus = (GpuStatus(GpuReading(0, energy_j=energy_j)),)
        gw.telemetry_read(box.appliance._gpus)

    tick(1000.0)  # the first reading: where counting starts
    clock[0] = 1.0
    for key in (key_a, key_a, key_a, key_b):
        assert (await box.complete(key))[0] == 200
    clock[0] = 3600.0
    tick(1000.0 + 4 * 3600.0)  # 4 Wh since
    async with box.client.get("/metrics", headers=box.auth(box.metrics)) as resp:
        assert 'appliance_gpu_energy_joules_total{gpu="0"} 15400.0' in await resp.text()
    gw.usage.save()
    config = tmp_path / "config.toml"
    config.write_text(f'[gateway]\nkeys_file = "{tmp_path / "keys.json"}"\n')
    capsys.readouterr()
    assert cli_main(["keys", "usage", "--config", str(config), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["keys"]}
    assert rows["a"]["total_tokens"] == 3 * rows["b"]["total_tokens"] > 0
    assert rows["a"]["energy_wh"] == pytest.approx(3.0)
    assert rows["b"]["energy_wh"] == pytest.approx(1.0)
    assert cli_main(["keys", "usage", "--config", str(config)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["ID", "NAME", "PROMPT", "COMPLETION", "TOTAL", "ENERGY_WH"]
    assert [line.split()[-1] for line in table[1:]] == ["3.000", "1.000"]
