"""The Grafana dashboard and the alert rules, against a real Prometheus scraping a real daemon.

A daemon with two fake engines and `file:` telemetry serves some traffic (a stream, a
404, a key over its rpm), restarts an engine and heats a GPU to the hard limit, while a
real Prometheus (Debian's binary, which scripts/test-deps unpacks; loopback only, a
1 s scrape with a `metrics` key, the job of monitoring/prometheus/scrape.example.yml and
the rules of alerts.yml) scrapes it. Then every panel query and every alert expression
goes through Prometheus's HTTP API with Grafana's variables substituted: each must
parse, and each panel query must return at least one series over the run (a panel whose
data cannot exist yet would be listed in EXPECTED_EMPTY with the reason). A renamed
metric therefore fails here, naming the panel. Prometheus itself loads the rules: all
must evaluate cleanly, and the hard-limit alert must be pending for the hot GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fakes.appliance_proc import fake_engine_config, run_appliance
from tests.fakes.engine_proc import free_port

yaml = pytest.importorskip("yaml", reason="PyYAML (it comes with ansible-core) is missing")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "monitoring" / "grafana" / "llm-appliance.json"
RULES = REPO / "monitoring" / "prometheus" / "alerts.yml"
SCRAPE_EXAMPLE = REPO / "monitoring" / "prometheus" / "scrape.example.yml"
PROMETHEUS = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    / "llm-appliance/tools/prometheus"
)
MODEL = "smollm2-135m-instruct"
SCRAPE_S = 1
# What Grafana puts in place of its interval variables for a 1 s scrape: $__rate_interval
# is at least four scrape intervals, so a rate always has samples to work on.
GRAFANA_INTERVALS = {"__rate_interval": f"{4 * SCRAPE_S}s", "__interval": f"{SCRAPE_S}s"}
# Panel title -> why its data cannot exist in this run.
EXPECTED_EMPTY: dict[str, str] = {
    "Fallbacks/s by reason": "one model, no fallback: tests/integration/test_fallback.py "
    "checks appliance_fallbacks_total",
}


def _sensors(path: Path, temps: list[float], reasons: list[list[str]]) -> None:
    """`file:` telemetry for GPUs 0..n-1 (written atomically: the daemon re-reads it)."""
    gpus = [
        {
            "index": i,
            "temperature_c": t,
            "power_w": 300,
            "power_limit_w": 450,
            "memory_used_bytes": 6 << 30,
            "memory_total_bytes": 24 << 30,
            "utilization": 0.5,
            "sm_clock_mhz": 2520,
            "throttle_reasons": reasons[i],
            # Cumulative, as NVML's counter: 300 W since some start.
            "energy_j": 300.0 * time.monotonic(),
        }
        for i, t in enumerate(temps)
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.replace(path)


@dataclass
class Prometheus:
    url: str

    def get(self, path: str, **params: str) -> dict[str, Any]:
        """A query API answer, errors included (a bad query is a 400 with a JSON body)."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body: dict[str, Any] = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        return body

    def series(self, expr: str) -> list[dict[str, Any]]:
        body = self.get("/api/v1/query", query=expr)
        assert body.get("status") == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, expr: str, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.series(expr):
            assert time.monotonic() < deadline, f"Prometheus never saw {what} ({expr})"
            time.sleep(0.2)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def run_prometheus(tmp: Path, target: str, key_file: Path) -> Iterator[Prometheus]:
    """Prometheus on loopback with the shipped scrape job aimed at ``target``; stopped
    (and killed if need be) however the test ends."""
    config = yaml.safe_load(SCRAPE_EXAMPLE.read_text(encoding="utf-8"))
    config["global"] = {
        "scrape_interval": f"{SCRAPE_S}s",
        "evaluation_interval": f"{SCRAPE_S}s",
    }
    config["rule_files"] = [str(RULES)]
    (job,) = config["scrape_configs"]
    job["scrape_interval"] = f"{SCRAPE_S}s"
    job["authorization"]["credentials_file"] = str(key_file)
    job["static_configs"] = [{"targets": [target]}]
    config_file = tmp / "prometheus.yml"
    config_file.write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    with open(tmp / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 20
        while not _answers(prom.url + "/-/ready"):
            if proc.poll() is not None or time.monotonic() > deadline:
                log_text = (tmp / "prometheus.log").read_text(errors="replace")
                raise AssertionError(f"Prometheus did not start:\n{log_text[-3000:]}")
            time.sleep(0.1)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _substitute(expr: str, variables: dict[str, str]) -> str:
    """Grafana's $name and ${name} for the dashboard's variables and its intervals."""

    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in variables, f"unknown variable ${name} in {expr}"
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def _dashboard_variables(dashboard: dict[str, Any], prom: Prometheus) -> dict[str, str]:
    """The values Grafana would give the dashboard's variables on this Prometheus: import
    constants at their defaults, label_values() queries answered by Prometheus."""
    inputs = {i["name"]: i.get("value", "") for i in dashboard["__inputs"]}
    variables = dict(GRAFANA_INTERVALS)
    for var in dashboard["templating"]["list"]:
        if var["type"] == "constant":
            variables[var["name"]] = _substitute(var["query"], inputs)
        elif var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"]["query"])
            assert m, f"variable {var['name']}: unexpected query {var['query']}"
            values = sorted({s["metric"][m.group(2)] for s in prom.series(m.group(1))})
            assert values, f"variable {var['name']} has no values: {var['query']}"
            variables[var["name"]] = values[0]
        else:
            raise AssertionError(f"variable {var['name']}: type {var['type']} not handled here")
    return variables


def _panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, what to call the query in a failure, expr) for every panel query and
    every Prometheus annotation (whose title is its name)."""
    queries = [
        (p["title"], f"panel {p['title']!r} query {t['refId']}", t["expr"])
        for p in dashboard["panels"]
        if p["type"] != "row"
        for t in p["targets"]
    ]
    queries += [
        (a["name"], f"annotation {a['name']!r}", a["expr"])
        for a in dashboard["annotations"]["list"]
        if "expr" in a
    ]
    return queries


def _call(app_url: str, method: str, path: str, key: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        app_url + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _drive_traffic(url: str, admin: str, tight: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=admin, max_retries=0)
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        list(client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    limited = openai.OpenAI(base_url=url + "/v1", api_key=tight, max_retries=0)
    limited.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    with pytest.raises(openai.RateLimitError):
        limited.completions.create(model=MODEL, prompt="hi", max_tokens=3)


@pytest.mark.skipif(
    not PROMETHEUS.exists(),
    reason="the prometheus server is not available (scripts/test-deps unpacks it as root)",
)
def test_every_panel_and_alert_query_works_on_a_real_prometheus(tmp_path: Path) -> None:
    sensors = tmp_path / "sensors.json"
    _sensors(sensors, [60, 60], [[], []])
    cfg = fake_engine_config(
        tmp_path,
        2,
        # long enough a STARTING for a 1 s scrape to see the restart
        "--startup-delay",
        "1.5",
        # vLLM's speculative decoding counters, for the acceptance panel
        "--fake-spec-decode",
        telemetry={"source": f"file:{sensors}", "interval_s": 0.2},
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        admin = (tmp_path / "admin.key").read_text().strip()
        scraper = _call(
            app.url, "POST", "/admin/keys", admin, {"name": "prom", "scopes": ["metrics"]}
        )
        tight = _call(app.url, "POST", "/admin/keys", admin, {"name": "tight", "rpm": 1})
        key_file = tmp_path / "prometheus.key"
        key_file.write_text(scraper["key"] + "\n")
        target = f"127.0.0.1:{cfg['gateway']['port']}"
        with run_prometheus(tmp_path, target, key_file) as prom:
            start = time.time()
            prom.wait_for('up{job="llm-appliance"} == 1', "a good scrape")
            _drive_traffic(app.url, admin, tight["key"])
            _call(app.url, "POST", "/admin/engines/1/restart", admin)
            prom.wait_for(
                'appliance_engine_restarts_total{engine="1", reason="admin"}', "the restart"
            )
            app.wait_all_ready()
            # GPU 0 past the hard limit; GPU 1 cool but reporting a thermal slowdown.
            _sensors(sensors, [90, 60], [[], ["sw_thermal_slowdown"]])
            prom.wait_for(
                'ALERTS{alertname="LlmApplianceGpuAtHardLimit", gpu="0", alertstate="pending"}',
                "the hard-limit alert pending for GPU 0",
            )
            prom.wait_for('appliance_gpu_clock_event_active{gpu="1"}', "GPU 1's slowdown")
            _check_dashboard(prom, start)
            _check_rules(prom)


def _check_dashboard(prom: Prometheus, start: float) -> None:
    """Every query parses and evaluates, and returns series over the run unless its panel
    is in EXPECTED_EMPTY; all failures are reported at once, each naming its panel."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = _dashboard_variables(dashboard, prom)
    assert set(EXPECTED_EMPTY) <= {p["title"] for p in dashboard["panels"]}
    # One step past now: the last step of a range lands at or after the newest sample
    # (a series first scraped a moment ago is in it, as Grafana's "now" would show it).
    end = time.time() + SCRAPE_S
    failures: list[str] = []
    for title, what, expr in _panel_queries(dashboard):
        query = _substitute(expr, variables)
        instant = prom.get("/api/v1/query", query=query)
        if instant.get("status") != "success":
            failures.append(f"{what}: does not evaluate: {instant.get('error')} in {query}")
            continue
        # What Grafana draws: a range query over the run.
        ranged = prom.get(
            "/api/v1/query_range",
            query=query,
            start=f"{start:.3f}",
            end=f"{end:.3f}",
            step=f"{SCRAPE_S}s",
        )
        if ranged.get("status") != "success":
            failures.append(f"{what}: range query fails: {ranged.get('error')} in {query}")
        elif title in EXPECTED_EMPTY and ranged["data"]["result"]:
            failures.append(f"{what}: has data now, drop it from EXPECTED_EMPTY: {query}")
        elif title not in EXPECTED_EMPTY and not ranged["data"]["result"]:
            failures.append(f"{what}: no series over the run: {query}")
    assert not failures, "\n".join(failures)


def _check_rules(prom: Prometheus) -> None:
    """Every alert expression evaluates on the API, and Prometheus evaluates every rule it
    loaded without error."""
    rules = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    exprs = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    failures = [
        f"alert {name}: {body.get('error')}"
        for name, expr in exprs.items()
        if (body := prom.get("/api/v1/query", query=expr)).get("status") != "success"
    ]
    assert not failures, "\n".join(failures)
    loaded = prom.get("/api/v1/rules")["data"]["groups"]
    health = {r["name"]: (r["health"], r.get("lastError", "")) for g in loaded for r in g["rules"]}
    assert set(health) == set(exprs)
    assert {n: h for n, h in health.items() if h[0] != "ok"} == {}
