"""The status page (issue #25) in a real headless browser against the real daemon.

One daemon (two fake engines, ``file:`` telemetry) and one Chromium tab for every case,
in order, so the whole costs one start of each: the page's headers; a user key refused
in words; a metrics key sees the engines ``/admin/status`` has, without actions; an
admin key sees the usage per key, where a key named like an HTML tag shows as text;
heat in the sensors file shows as the GPU's new throttle level within 2 s; drain and
resume from the page, with their audit lines; a drain of the last engine serving asks
for the force. Throughout: no dialog, no script error, no CSP violation.

Screenshots of the overview under heat go to ``$LLM_APPLIANCE_UI_SHOTS`` when it is set
(``docs/img`` refreshes the ones in docs/status.md), else to the test's tmp folder.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fakes.appliance_proc import STEADY_HEALTH, fake_engine_config, get_json, run_appliance
from tests.fakes.browser import Page, find_chromium, open_page
from tests.integration.test_heat_and_degradation import write_sensors

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
XSS = "<img src=x onerror=alert(1)>"
CHROMIUM = find_chromium()
# Heard by the page before its own script runs: every CSP violation, counted.
WATCH_CSP = (
    "window.__csp = [];"
    "document.addEventListener('securitypolicyviolation',"
    " e => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));"
)


def call(app: Any, method: str, path: str, key: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(app.url + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {key}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def check_headers(app: Any) -> None:
    with urllib.request.urlopen(app.url + "/ui", timeout=10) as r:
        h = r.headers
        html = r.read().decode()
    csp = h["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert (h["X-Frame-Options"], h["X-Content-Type-Options"]) == ("DENY", "nosniff")
    assert h["Referrer-Policy"] == "no-referrer"
    assert 'name="key"' in html and "<script>" not in html  # no inline script
    conn = http.client.HTTPConnection("127.0.0.1", app.config["gateway"]["port"], timeout=10)
    conn.request("GET", "/")
    resp = conn.getresponse()
    assert (resp.status, resp.getheader("Location")) == (302, "ui")
    conn.close()


async def sign_in(page: Page, key: str) -> None:
    await page.eval("sessionStorage.clear()")
    await page.goto(page.url)
    await page.type_into("input[name=key]", key)
    await page.click("#signin-form button[type=submit]")


ROWS = (
    "[...document.querySelectorAll('#models tr[data-engine]')].map(r =>"
    " [Number(r.dataset.engine), r.dataset.model, r.querySelector('.state').textContent])"
)


def audit_lines(tmp: Path, action: str) -> list[dict[str, Any]]:
    path = tmp / "audit.log"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [x for x in lines if x["action"] == action]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: scripts/test-deps installs it (root)")
async def test_status_page_in_a_real_browser(tmp_path: Path) -> None:
    assert CHROMIUM is not None
    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, [60, 60])
    cfg = fake_engine_config(
        tmp_path,
        2,
        telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
        thermal={"soft_limit_c": 80, "hard_limit_c": 87, "hysteresis_c": 5},
        health=STEADY_HEALTH,
    )
    shots = Path(os.environ.get("LLM_APPLIANCE_UI_SHOTS") or tmp_path)
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        check_headers(app)
        admin = (tmp_path / "admin.key").read_text().strip()
        keys = {}
        for name, scope in (("ops-metrics", "metrics"), ("dev", "user"), (XSS, "user")):
            code, made = call(app, "POST", "/admin/keys", admin, {"name": name, "scopes": [scope]})
            assert code == 201, made
            keys[name] = made["key"]
        # The key named like a tag uses the API, so it has a row in the usage table.
        client = openai.OpenAI(base_url=app.url + "/v1", api_key=keys[XSS], max_retries=0)
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )

        async with open_page(CHROMIUM) as page:
            await page.send("Page.addScriptToEvaluateOnNewDocument", source=WATCH_CSP)
            page.url = app.url + "/ui"
            await page.goto(page.url)

            # A user key: refused, in words, on the page.
            await sign_in(page, keys["dev"])
            refusal = await page.wait(
                "document.querySelector('#signin-message').textContent", 15, "the refusal"
            )
            assert "cannot see this page" in refusal and "metrics or admin" in refusal
            assert await page.eval("document.querySelector('#dash').hidden") is True

            # A metrics key: the engines /admin/status has, no actions.
            await sign_in(page, keys["ops-metrics"])
            rows = await page.wait(f"{ROWS}.length === 2 && {ROWS}", 15, "two engine rows")
            status = get_json(
                app.url + "/admin/status", headers={"Authorization": f"Bearer {admin}"}
            )
            assert rows == [[e["id"], e["model"], e["state"]] for e in status[1]["engines"]]
            assert "metrics" in await page.eval("document.querySelector('#who').textContent")
            assert await page.eval("document.querySelectorAll('button[data-action]').length") == 0
            assert await page.eval("document.querySelector('#usage-section').hidden") is True

            # An admin key: actions, and the usage per key with the tag-like name as text.
            await sign_in(page, keys_admin := admin)
            names = await page.wait(
                "[...document.querySelectorAll('#usage .key-name')].map(e => e.textContent)",
                15,
                "the usage table",
            )
            assert XSS in names
            assert await page.eval("document.querySelectorAll('img').length") == 0
            events = await page.wait(
                "document.querySelector('#events').textContent.includes('key.create')"
                " && document.querySelector('#events').textContent",
                15,
                "key changes in the time line",
            )
            assert f"(name {XSS})" in events

            # Heat: the page shows the new throttle level within 2 s of the daemon's.
            write_sensors(sensors, [95, 60])
            app.wait_for(
                lambda: (
                    get_json(
                        app.url + "/admin/status", headers={"Authorization": f"Bearer {keys_admin}"}
                    )[1]["gpus"][0]["throttle_level"]
                    == 4
                ),
                15,
                "GPU 0 at throttle level 4",
            )
            shown = time.monotonic()
            level = "document.querySelector('[data-gpu=\"0\"] .throttle').textContent"
            await page.wait(f"{level} === 'level 4 of 4'", 2.0, "level 4 on the page")
            assert time.monotonic() - shown <= 2.0
            why = await page.eval(
                "document.querySelector('[data-gpu=\"0\"] .throttle-reason').textContent"
            )
            assert "hard limit" in why
            await page.wait(
                "document.querySelector('#events').textContent.includes('throttle up')",
                10,
                "the heat step in the time line",
            )
            await page.screenshot(shots / "status-page.png", 1280, 1400)
            await page.screenshot(shots / "status-page-phone.png", 390, 1600)
            await page.send("Emulation.clearDeviceMetricsOverride")

            # Drain engine 1 from the page, then resume it; each lands in the audit trail.
            await page.click('tr[data-engine="1"] button[data-action=drain]')
            text = await page.wait(
                "!document.querySelector('#confirm').hidden &&"
                " document.querySelector('#confirm-text').textContent",
                5,
                "the drain's confirmation",
            )
            assert text.startswith("Drain engine 1")
            await page.click("#confirm-yes")
            state = f"{ROWS}.find(r => r[0] === 1)[2]"
            await page.wait(f"{state} === 'DRAINING'", 10, "engine 1 DRAINING on the page")
            admin_id = keys_admin.split("-")[2]
            drains = audit_lines(tmp_path, "engine.drain")
            assert [(d["target"], d["actor"], d["outcome"]) for d in drains] == [
                ("engine:1", f"key:{admin_id}", "ok")
            ]

            # Engine 0 is now the last one serving: its drain says so and needs the force.
            await page.click('tr[data-engine="0"] button[data-action=drain]')
            text = await page.wait(
                "!document.querySelector('#confirm').hidden &&"
                " document.querySelector('#confirm-text').textContent",
                5,
                "the last engine's confirmation",
            )
            assert "last engine serving" in text
            assert "force" in await page.eval("document.querySelector('#confirm-yes').textContent")
            await page.click("#confirm-no")

            await page.click('tr[data-engine="1"] button[data-action=resume]')
            await page.wait("!document.querySelector('#confirm').hidden", 5, "the confirmation")
            await page.click("#confirm-yes")
            await page.wait(f"{state} === 'READY'", 10, "engine 1 READY again on the page")
            assert [r["outcome"] for r in audit_lines(tmp_path, "engine.resume")] == ["ok"]

            # Nothing fired or was blocked all along.
            assert page.seen("Page.javascriptDialogOpening") == []
            assert page.seen("Runtime.exceptionThrown") == []
            assert await page.eval("window.__csp") == []
            logged = [e["entry"]["text"] for e in page.seen("Log.entryAdded")]
            assert not [t for t in logged if "Content Security Policy" in t], logged
