"""Models on demand taking turns under load (issue 23): two models wanted at once on one
slot are both served, with and without a minimum residency, and nothing fails.

The daemon sees two fake GPUs (the GPU check's fake pynvml). "a" and "b" take turns on
GPU 0 with ``min_residency_s = 0``; "c" and "d" on GPU 1 with 1 s. Engines are stopped
when put away (``swap = "stop"``) and hold 40 % of their GPU while up, so an engine
that was just stopped waits for its GPU's memory to be free, which the other model of
its slot, started meanwhile, holds until it is put away in turn.

Each test runs two closed-loop clients, one per model of a slot, each sending its next
request as soon as the last is answered: the load under which ``bench.on_demand`` saw
one model starve (its engine's unloads were counted as crash restarts until the engine
was FAILED, and its requests waited out ``load_timeout_s``).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import (
    REPO,
    STEADY_HEALTH,
    Appliance,
    fake_engine_config,
    get_json,
    run_appliance,
)
from tests.gpu_check.fake_nvml import FAKE_DIR_ENV, default_gpu, write_shim, write_state

pytestmark = pytest.mark.slow

ANSWERS = 10  # per model: about 20 swaps per slot, far more than the crash budget below
LOAD_TIMEOUT_S = 20
ROUND_S = 120  # a bound for the whole round, never reached when both are served
QUEUE_TIMEOUT_S = 3  # gateway.queue_timeout_s: far below LOAD_TIMEOUT_S
RESTART_BUDGET = 3  # restart.max_restarts_per_hour: small, so a miscounted unload shows


class Box:
    def __init__(self, app: Appliance, key: str) -> None:
        self.app, self.key = app, key

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.app.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=LOAD_TIMEOUT_S + 30) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def status(self) -> dict[str, Any]:
        code, body = self.call("GET", "/admin/status")
        assert code == 200, body
        return dict(body)

    def both_wanted(self, models: tuple[str, str]) -> dict[str, list[Any]]:
        """Two closed-loop clients until each model has ANSWERS answers, one request
        fails, or ROUND_S passes: per model, what each request got (200 or the error)."""
        got: dict[str, list[Any]] = {m: [] for m in models}
        deadline = time.monotonic() + ROUND_S
        failed = threading.Event()

        def client(model: str) -> None:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            body["max_tokens"] = 2
            while len(got[model]) < ANSWERS and time.monotonic() < deadline:
                if failed.is_set():
                    return
                code, answer = self.call("POST", "/v1/chat/completions", body)
                got[model].append(200 if code == 200 else (code, answer))
                if code != 200:
                    failed.set()

        threads = [threading.Thread(target=client, args=(m,)) for m in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("on_demand_turns")
    nvml = tmp / "nvml"
    write_state(nvml, [default_gpu(0), default_gpu(1), default_gpu(2)])
    write_shim(nvml)
    cfg: dict[str, Any] = fake_engine_config(
        tmp,
        6,
        gateway={"queue_timeout_s": QUEUE_TIMEOUT_S},
        health=STEADY_HEALTH,
        telemetry={"source": "nvml", "interval_s": 1.0},  # the default
        restart={"max_restarts_per_hour": RESTART_BUDGET},
    )
    cfg["engine"]["device"] = "cuda"
    fake_gpu = [*cfg["engine"]["command"], "--gpu-share", "0.4"]
    on_demand = {"load": "on_demand", "swap": "stop", "load_timeout_s": LOAD_TIMEOUT_S}
    on_demand |= {"idle_unload_s": 0, "command": fake_gpu}
    cfg["models"] = [
        {"name": name, **on_demand, "gpus": [gpu], "min_residency_s": residency}
        for name, gpu, residency in (("a", 0, 0), ("b", 0, 0), ("c", 1, 1), ("d", 1, 1))
    ]
    cfg["models"] += [
        {**m, "name": name, "gpus": [2], "min_residency_s": 0, "max_inflight": 1}
        for m in (on_demand | {"command": [*fake_gpu, "--token-delay-ms", "150"]},)
        for name in ("e", "f")
    ]
    env = {FAKE_DIR_ENV: str(nvml), "PYTHONPATH": f"{nvml}:{REPO}"}
    with run_appliance(tmp, cfg, env) as app:
        app.wait_for(lambda: (tmp / "admin.key").exists(), 120, "the first admin key")
        b = Box(app, (Path(tmp) / "admin.key").read_text().strip())
        # /readyz, not /healthz: until the start sweep is over a request gets 503 starting.
        b.app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 200, 60, "the daemon started")
        yield b


def _served_in_turn(box: Box, models: tuple[str, str]) -> None:
    seen = len(box.app.log())  # the journal of this round starts here
    got = box.both_wanted(models)
    for m in models:
        failures = [g for g in got[m] if g != 200]
        assert not failures, (m, failures, box.app.log()[-3000:])
        assert len(got[m]) == ANSWERS, (m, got, box.app.log()[-3000:])
    engines = [e for e in box.status()["engines"] if e["model"] in models]
    # Being put away is no restart: nothing spent the crash budget, nothing FAILED.
    assert [(e["state"], e["restarts"]) for e in engines if e["restarts"]] == [], engines
    assert "FAILED" not in box.app.log()[seen:]


def test_two_models_wanted_at_once_without_residency_are_both_served(box: Box) -> None:
    _served_in_turn(box, ("a", "b"))


def test_two_models_wanted_at_once_with_a_residency_are_both_served(box: Box) -> None:
    _served_in_turn(box, ("c", "d"))


def test_requests_queued_for_a_model_put_away_meanwhile_are_served_after_the_swap(
    box: Box,
) -> None:
    # "e" takes one request at a time: of three sent at once, two queue while "e" is
    # loaded. A request for "f" has "e" drained (its request in flight finishes) and put
    # away; the two still queued want "e" back (nobody else asks for it), and wait for
    # that load as long as a request that found "e" unloaded would (load_timeout_s),
    # not gateway.queue_timeout_s.
    code, body = box.call("POST", "/v1/chat/completions", _chat("e"))
    assert code == 200, body  # "e" loaded
    got: dict[str, tuple[int, Any]] = {}

    def ask(tag: str, model: str) -> None:
        got[tag] = box.call("POST", "/v1/chat/completions", _chat(model))

    threads = [threading.Thread(target=ask, args=(f"e{i}", "e")) for i in range(3)]
    for t in threads:
        t.start()
    box.app.wait_for(lambda: _queue_depth(box) == 2, 30, "two requests for e queued")
    threads.append(threading.Thread(target=ask, args=("f", "f")))
    threads[-1].start()
    for t in threads:
        t.join()
    assert {tag: code for tag, (code, _) in got.items()} == dict.fromkeys(got, 200), got
    assert len(got) == 4


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _queue_depth(box: Box) -> int:
    return int(box.status()["queue_depth"])
