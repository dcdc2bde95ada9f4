"""Heat and degradation, end to end through the daemon with fake engines.

`file:` telemetry stands in for NVML (the contract's way to run thermal behaviour
without hardware); the fake engine reports a preemption storm on demand.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fakes.appliance_proc import STEADY_HEALTH, fake_engine_config, get_json, run_appliance

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"


def write_sensors(path: Path, temps: list[float], reasons: list[list[str]] | None = None) -> None:
    gpus = [
        {
            "index": i,
            "temperature_c": t,
            "power_w": 300,
            "power_limit_w": 450,
            "memory_used_bytes": 0,
            "memory_total_bytes": 25757220864,
            "utilization": 0.5,
            "throttle_reasons": (reasons or [[]] * len(temps))[i],
        }
        for i, t in enumerate(temps)
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.replace(path)


def status(app: Any, key: str) -> dict[str, Any]:
    code, body = get_json(app.url + "/admin/status", headers={"Authorization": f"Bearer {key}"})
    assert code == 200, body
    return body  # type: ignore[no-any-return]


def metric(app: Any, key: str, line_start: str) -> float | None:
    import urllib.request

    req = urllib.request.Request(app.url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    text = urllib.request.urlopen(req, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(line_start + " ") or line.startswith(line_start + "{}"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_hot_gpu_gets_no_new_work_and_recovers_when_cool(tmp_path: Path) -> None:
    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, [60, 60])
    cfg = fake_engine_config(
        tmp_path,
        2,
        "--token-delay-ms",
        "5",
        telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
        thermal={"soft_limit_c": 80, "hard_limit_c": 87, "hysteresis_c": 5},
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        client = openai.OpenAI(base_url=app.url + "/v1", api_key=key, max_retries=0)

        # Client work is chat; health probes are completions: counting chats per engine
        # counts what the router sent it, however many probes a slow run lets in.
        def ask(n: int = 1, max_tokens: int = 4) -> None:
            for _ in range(n):
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens
                )

        def chats() -> list[int]:
            return [
                app.engine_stats(i)["requests_by_route"].get("/v1/chat/completions", 0)  # type: ignore[index]
                for i in range(2)
            ]

        # A long request in flight on GPU 0 when it overheats must still finish.
        long_done: list[str] = []
        app.engine_control(1, token_delay_ms=5)
        app.engine_control(0, token_delay_ms=30)
        t = threading.Thread(
            target=lambda: long_done.append(
                client.completions.create(model=MODEL, prompt="long", max_tokens=60).choices[0].text
            )
        )
        t.start()
        app.wait_for(
            lambda: (
                status(app, key)["engines"][0]["inflight"] == 1
                or status(app, key)["engines"][1]["inflight"] == 1
            ),
            5,
            "long request",
        )
        hot_engine = 0 if status(app, key)["engines"][0]["inflight"] == 1 else 1
        temps = [60.0, 60.0]
        temps[hot_engine] = 90.0
        write_sensors(sensors, temps)
        app.wait_for(
            lambda: status(app, key)["engines"][hot_engine]["throttle_level"] == 4,
            5,
            "hard throttle",
        )
        assert metric(app, key, f'appliance_throttle_level{{gpu="{hot_engine}"}}') == 4
        before = chats()
        ask(20)
        after = chats()
        # Client requests only to the cool one.
        assert after[1 - hot_engine] - before[1 - hot_engine] == 20
        assert after[hot_engine] == before[hot_engine]
        t.join(10)
        assert long_done and long_done[0]  # in-flight work on the hot GPU completed
        # Cool below soft - hysteresis: it serves again.
        write_sensors(sensors, [60, 60])
        app.wait_for(
            lambda: all(e["throttle_level"] == 0 for e in status(app, key)["engines"]),
            10,
            "cooled down",
        )
        before = chats()
        threads = [threading.Thread(target=ask, args=(5, 30)) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        after = chats()
        assert all(a - b >= 3 for a, b in zip(after, before, strict=True)), (before, after)


def test_soft_heat_lowers_the_budget_and_slowdown_reason_raises_it(tmp_path: Path) -> None:
    """The stepped governor (still selectable): its thresholds and its slowdown step."""
    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, [82])
    cfg = fake_engine_config(
        tmp_path,
        1,
        telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
        thermal={"governor": "stepped"},
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        app.wait_for(
            lambda: status(app, key)["engines"][0]["throttle_level"] == 1, 5, "level 1 at 82C"
        )
        write_sensors(sensors, [82], [["hw_thermal_slowdown"]])
        app.wait_for(
            lambda: status(app, key)["gpus"][0]["throttle_level"] == 2,
            5,
            "slowdown reason adds a level",
        )
        assert status(app, key)["gpus"][0]["throttle_reasons"] == ["hw_thermal_slowdown"]
        assert "gpu0" in app.log() and "throttle level" in app.log()


def test_predictive_governor_acts_early_and_a_cool_gpu_gets_its_budget_back(
    tmp_path: Path,
) -> None:
    """The default governor: 1 °C before each stepped threshold; a slowdown reason adds
    no level on top of the temperature's; once clearly cool (below soft - hysteresis -
    1) it steps down one level per reading, without the hold it keeps near the band."""
    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, [79])
    cfg = fake_engine_config(
        tmp_path, 1, telemetry={"source": f"file:{sensors}", "interval_s": 0.1}
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        app.wait_for(
            lambda: status(app, key)["gpus"][0]["throttle_level"] == 1, 5, "level 1 at 79C"
        )
        write_sensors(sensors, [83], [["hw_thermal_slowdown"]])
        app.wait_for(
            lambda: status(app, key)["gpus"][0]["throttle_reasons"] == ["hw_thermal_slowdown"],
            5,
            "the slowdown reading",
        )
        # 83 + 1 is in level 2's band; the reason adds nothing (stepped: 2 + 1 = 3).
        app.wait_for(
            lambda: status(app, key)["gpus"][0]["throttle_level"] == 2, 5, "level 2 at 83C"
        )
        assert metric(app, key, 'appliance_throttle_level{gpu="0"}') == 2
        write_sensors(sensors, [60])
        app.wait_for(lambda: status(app, key)["gpus"][0]["throttle_level"] == 0, 5, "cool: level 0")


def test_preemption_storm_is_drained_and_restarted_with_zero_client_failures(
    tmp_path: Path,
) -> None:
    cfg = fake_engine_config(
        tmp_path,
        2,
        "--token-delay-ms",
        "3",
        degradation={
            "window_s": 4,
            "max_preemptions_per_min": 30,
            "hang_s": 3,
            "leak_hold_s": 3,
            "baseline_warmup_s": 0,
        },
        health={"interval_s": 0.3, "probe_timeout_s": 2.0, "failures_to_restart": 3},
        restart={"drain_timeout_s": 10, "backoff_initial_s": 0.2},
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        client = openai.OpenAI(base_url=app.url + "/v1", api_key=key, max_retries=0)
        storm_pid = app.engine_stats(0)["pid"]  # type: ignore[index]
        app.engine_control(0, preemptions_per_request=20)
        failures: list[str] = []
        done = 0
        stop = threading.Event()

        def loop() -> None:
            nonlocal done
            while not stop.is_set():
                stream = done % 2 == 0
                try:
                    s = client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=8,
                        stream=stream,
                    )
                    if stream:
                        assert any(c.choices and c.choices[0].delta.content for c in s)
                    else:
                        assert s.choices[0].message.content
                    done += 1
                except Exception as exc:  # every failure is a finding
                    failures.append(repr(exc))
                    done += 1

        threads = [threading.Thread(target=loop) for _ in range(3)]
        for th in threads:
            th.start()
        try:
            app.wait_for(
                lambda: (s := app.engine_stats(0)) is not None and s["pid"] != storm_pid,
                40,
                "storming engine replaced",
            )
            app.wait_for(
                lambda: status(app, key)["engines"][0]["state"] == "READY", 20, "replacement ready"
            )
            app.wait_for(lambda: done >= 150, 60, "at least 150 requests")
        finally:
            stop.set()
            for th in threads:
                th.join(30)
        assert failures == [], failures[:5]
        assert done >= 150
        e0 = status(app, key)["engines"][0]
        assert e0["restarts"] == 1 and e0["last_restart_reason"] == "degraded"
        log = app.log()
        assert "degraded (preemption_storm" in log
        assert "engine0: READY -> DRAINING" in log
        assert (
            metric(app, key, 'appliance_engine_restarts_total{engine="0",reason="degraded"}') == 1
        )


def test_admin_drain_resume_and_restart(tmp_path: Path) -> None:
    cfg = fake_engine_config(tmp_path, 2, health=STEADY_HEALTH)
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()  # engine 0 can be drained only while engine 1 serves
        key = (tmp_path / "admin.key").read_text().strip()
        auth = {"Authorization": f"Bearer {key}"}
        import urllib.request

        def post(path: str) -> tuple[int, Any]:
            req = urllib.request.Request(app.url + path, data=b"", headers=auth, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        assert post("/admin/engines/0/drain") == (200, {"id": 0, "state": "DRAINING"})
        # The last engine serving is never taken out by a planned restart: it waits.
        code, _ = post("/admin/engines/1/restart")
        assert code == 202
        app.wait_for(
            lambda: "restart waits: it is the last engine serving" in app.log(), 10, "the wait"
        )
        engine1 = status(app, key)["engines"][1]
        assert engine1["state"] == "READY" and engine1["restarts"] == 0, engine1
        assert post("/admin/engines/0/resume") == (200, {"id": 0, "state": "READY"})
        app.wait_for(
            lambda: status(app, key)["engines"][1]["restarts"] == 1,
            15,
            "engine 1 restarted after engine 0 came back",
        )
        app.wait_for(lambda: status(app, key)["engines"][1]["state"] == "READY", 15, "ready")
        assert status(app, key)["engines"][1]["last_restart_reason"] == "admin"
        assert post("/admin/engines/7/restart")[0] == 404
        assert post("/admin/engines/0/resume")[0] == 409


def test_work_left_when_draining_times_out_moves_to_the_other_engine(tmp_path: Path) -> None:
    """A planned restart whose drain runs out gives up what is left before stopping.

    The non-streamed request still waiting on engine 0 is retried on engine 1 and is
    answered in full; the client never learns engine 0 went away.
    """
    # 150 tokens × 40 ms = 6 s: longer than the 1 s drain.
    cfg = fake_engine_config(tmp_path, 2, "--token-delay-ms", "40", restart={"drain_timeout_s": 1})
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        client = openai.OpenAI(base_url=app.url + "/v1", api_key=key, max_retries=0, timeout=30)
        answers: list[Any] = []

        def ask() -> None:
            answers.append(
                client.completions.create(model=MODEL, prompt="x", max_tokens=150).choices[0]
            )

        # Two at once: the router spreads them, so one is on engine 0.
        threads = [threading.Thread(target=ask) for _ in range(2)]
        for th in threads:
            th.start()
        # The gateway's count, not the engine's: the supervisor's health probe would
        # count there too, and restarting an engine with no request on it proves nothing.
        app.wait_for(lambda: status(app, key)["engines"][0]["inflight"] >= 1, 10, "a request on e0")
        import urllib.request

        req = urllib.request.Request(
            app.url + "/admin/engines/0/restart",
            data=b"",
            headers={"Authorization": f"Bearer {key}"},
            method="POST",
        )
        assert urllib.request.urlopen(req, timeout=5).status == 202
        for th in threads:
            th.join(30)
        assert [a.finish_reason for a in answers] == ["length", "length"]
        assert all(len(a.text.split()) == 150 for a in answers), answers
        log = app.log()
        assert "still running after 1 s of draining; restarting anyway" in log
        assert "(the engine was restarted after draining); retrying on another engine" in log


def test_sustained_heat_restarts_with_half_the_batched_tokens_then_restores(
    tmp_path: Path,
) -> None:
    import psutil

    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, [60, 60])
    cfg = fake_engine_config(
        tmp_path,
        2,
        "--max-num-batched-tokens",
        "8192",
        telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
        thermal={"heat_restart_after_s": 1, "heat_restore_after_s": 1.5},
    )

    def batched(i: int) -> str | None:
        stats = app.engine_stats(i)
        if stats is None:
            return None
        argv = psutil.Process(stats["pid"]).cmdline()
        return argv[argv.index("--max-num-batched-tokens") + 1]

    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        assert batched(0) == "8192"
        write_sensors(sensors, [95, 60])
        app.wait_for(lambda: batched(0) == "4096", 20, "engine 0 restarted with half batch")
        assert batched(1) == "8192"
        # The journal's start line shows the command line really spawned (issue 16, item 8).
        starts = [ln for ln in app.log().splitlines() if "engine0: starting on" in ln]
        assert "--max-num-batched-tokens 8192" in starts[0], starts
        assert "--max-num-batched-tokens 4096" in starts[-1], starts
        write_sensors(sensors, [50, 60])
        app.wait_for(lambda: batched(0) == "8192", 30, "full batch restored once cool")
        app.wait_for(lambda: status(app, key)["engines"][0]["state"] == "READY", 10, "ready")
        engine0 = status(app, key)["engines"][0]
        assert engine0["restarts_by_reason"] == {"heat": 2}
        assert "at the hard limit for" in app.log() and "restoring" in app.log()


def test_kv_pressure_breaker_sheds_then_reopens_without_waiting_for_a_health_check(
    tmp_path: Path,
) -> None:
    """An engine above 92 % KV gets nothing new; once below 85 % it is back in service
    from a quick KV read, not at the next full health check (``health.interval_s``)."""
    cfg = fake_engine_config(
        tmp_path,
        2,
        "--kv-cache-usage",
        "0.97",
        health={"interval_s": 8, "probe_timeout_s": 2, "failures_to_restart": 2},
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()  # engine 1 must be up to take its knob
        app.engine_control(1, kv_cache_usage=0.3)
        key = (tmp_path / "admin.key").read_text().strip()
        client = openai.OpenAI(base_url=app.url + "/v1", api_key=key, max_retries=0)

        def breaker(i: int) -> bool:
            return bool(status(app, key)["engines"][i]["kv_breaker_open"])

        app.wait_for(lambda: breaker(0), 20, "engine 0's KV breaker open at a health check")
        assert not breaker(1)
        assert metric(app, key, 'appliance_engine_kv_breaker_open{engine="0"}') == 1

        def chats() -> list[int]:
            return [
                app.engine_stats(i)["requests_by_route"].get("/v1/chat/completions", 0)  # type: ignore[index]
                for i in range(2)
            ]

        before = chats()
        for _ in range(8):
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert r.choices[0].message.content
        after = chats()
        assert after[0] == before[0]  # nothing new for the engine under KV pressure
        assert after[1] - before[1] == 8

        # Pressure falls (below 0.85): back in service with no full health check between.
        checks = app.engine_stats(0)["health_checks"]  # type: ignore[index]
        app.engine_control(0, kv_cache_usage=0.5)
        app.wait_for(lambda: not breaker(0), 20, "engine 0's KV breaker closed")
        assert app.engine_stats(0)["health_checks"] == checks  # type: ignore[index]
        before = chats()
        for _ in range(12):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert chats()[0] > before[0]  # it serves again


def test_a_request_refused_because_every_gpu_is_too_hot_says_so(tmp_path: Path) -> None:
    """Issue 33 item 12: the 503 names the heat, not only the queue's timeout."""
    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, [60])
    cfg = fake_engine_config(
        tmp_path,
        1,
        health=STEADY_HEALTH,
        gateway={"queue_timeout_s": 1},
        telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
        thermal={"soft_limit_c": 80, "hard_limit_c": 87, "hysteresis_c": 5},
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        client = openai.OpenAI(base_url=app.url + "/v1", api_key=key, max_retries=0)
        write_sensors(sensors, [91])
        app.wait_for(
            lambda: status(app, key)["engines"][0]["throttle_level"] == 4, 10, "hard throttle"
        )
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        error = refused.value.response.json()["error"]
        assert refused.value.status_code == 503
        assert error["code"] == "queue_timeout", error  # the code clients know
        assert "hard thermal limit" in error["message"], error
        assert "GPU 0 at 91 °C" in error["message"] and "87 °C" in error["message"], error
        assert int(refused.value.response.headers["Retry-After"]) >= 1
        write_sensors(sensors, [60])
        app.wait_for(
            lambda: status(app, key)["engines"][0]["throttle_level"] == 0, 10, "cooled down"
        )
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
