"""The gateway on the LAN (TLS, allow_lan) and its metrics as Prometheus reads them."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.fakes.appliance_proc import fake_engine_config, run_appliance

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
PROMTOOL = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
    "llm-appliance/tools/promtool"
)


def test_metrics_pass_promtool_and_name_the_contract_series(tmp_path: Path) -> None:
    promtool = str(PROMTOOL) if PROMTOOL.exists() else shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not available (scripts/test-deps fetches it as root)")
    sensors = tmp_path / "sensors.json"
    sensors.write_text(
        json.dumps(
            {
                "gpus": [
                    {
                        "index": 0,
                        "temperature_c": 81,
                        "power_w": 300,
                        "power_limit_w": 450,
                        "throttle_reasons": ["sw_thermal_slowdown"],
                    },
                    {"index": 1, "temperature_c": 60, "power_w": 200, "power_limit_w": 450},
                ]
            }
        )
    )
    cfg = fake_engine_config(
        tmp_path, 2, telemetry={"source": f"file:{sensors}", "interval_s": 0.1}
    )
    with run_appliance(tmp_path, cfg) as app:
        # /readyz turns 200 with the first READY engine; engine 0's state is checked below.
        app.wait_all_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        client = openai.OpenAI(base_url=app.url + "/v1", api_key=key, max_retries=0)
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        list(client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True))
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="hi")
        req = urllib.request.Request(
            app.url + "/metrics", headers={"Authorization": f"Bearer {key}"}
        )
        scrapes: list[str] = []

        def engine0_ready_in_scrape() -> bool:
            # A health check that fails under load takes engine 0 to SUSPECT until its
            # next good one: the series must show READY once the engine is READY again.
            scrapes.append(urllib.request.urlopen(req, timeout=5).read().decode())
            return 'appliance_engine_state{engine="0",state="READY"} 1.0' in scrapes[-1]

        app.wait_for(engine0_ready_in_scrape, 10, "engine 0 READY in the scrape")
        text = scrapes[-1]
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    for series in (
        f'appliance_requests_total{{model="{MODEL}",route="/v1/completions",status="200"}} 2.0',
        # an unknown model is no label value: "" until a served model is named
        'appliance_requests_total{model="",route="/v1/completions",status="404"} 1.0',
        "appliance_request_duration_seconds_bucket",
        "appliance_queue_depth 0.0",
        'appliance_engine_state{engine="0",state="READY"} 1.0',
        'appliance_engine_inflight{engine="1"} 0.0',
        'appliance_gpu_temperature_celsius{gpu="0"} 81.0',
        'appliance_gpu_power_watts{gpu="1"} 200.0',
        # 81 °C is level 1 (81 + 1 below 82.33), and under the default predictive
        # governor a slowdown reason adds no level (stepped would add one: 2).
        'appliance_throttle_level{gpu="0"} 1.0',
        'appliance_throttle_level{gpu="1"} 0.0',
    ):
        assert series in text, series
    assert "# TYPE appliance_admission_rejections_total counter" in text
    assert "# TYPE appliance_engine_restarts_total counter" in text
    assert key not in text and key.split("-")[-1] not in text


def test_https_when_tls_cert_and_key_are_set(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not available to make a test certificate")
    cert, pkey = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(pkey),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    cfg = fake_engine_config(tmp_path, 1, gateway={"tls_cert": str(cert), "tls_key": str(pkey)})
    with run_appliance(tmp_path, cfg) as app:
        https = app.url.replace("http://", "https://")
        ctx = ssl.create_default_context(cafile=str(cert))

        def ready() -> bool:
            try:
                return (
                    urllib.request.urlopen(https + "/readyz", context=ctx, timeout=2).status == 200
                )
            except OSError:
                return False

        app.wait_for(ready, 30, "HTTPS readyz")
        key = (tmp_path / "admin.key").read_text().strip()
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        req = urllib.request.Request(
            https + "/v1/completions",
            data=body,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            assert json.loads(resp.read())["choices"]
        # Plain HTTP on the TLS port is not served.
        with pytest.raises(OSError):
            urllib.request.urlopen(app.url + "/readyz", timeout=2)
        assert "gateway listening on https://" in app.log()


def test_lan_bind_without_allow_lan_refuses_to_start(tmp_path: Path) -> None:
    cfg = fake_engine_config(tmp_path, 1, gateway={"host": "0.0.0.0"})
    with run_appliance(tmp_path, cfg) as app:
        assert app.wait_exit(20) == 2
        assert "needs gateway.allow_lan = true" in app.log()
        assert "starting on" not in app.log()


def test_bad_tls_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "c.pem").write_text("not a certificate")
    cfg = fake_engine_config(
        tmp_path,
        1,
        gateway={"tls_cert": str(tmp_path / "c.pem"), "tls_key": str(tmp_path / "c.pem")},
    )
    with run_appliance(tmp_path, cfg) as app:
        assert app.wait_exit(20) == 1
        assert "gateway.tls_cert / gateway.tls_key cannot be loaded" in app.log()
