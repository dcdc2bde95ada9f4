"""The status page's parts without a browser: the events between two snapshots (a table),
audit lines as events, the history ring and its samples, the audit file's tail, and the
routes over the in-process gateway (files, headers, scopes of ``/admin/history``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from appliance.audit import audit_line
from appliance.control import ApplianceStatus, EngineStatus, GpuStatus
from appliance.endpoint import EngineAddress
from appliance.engine import EngineState
from appliance.gateway.keys import required_scope
from appliance.gateway.observe.ui.events import Event, audit_event, diff_events
from appliance.gateway.observe.ui.history import Figures, History, sample_of
from appliance.gateway.observe.ui.sampler import TAIL_BYTES, AuditTail
from appliance.telemetry import GpuReading
from tests.unit.test_gateway_door import Box, box  # noqa: F401  (the fixture)

pytestmark = pytest.mark.filterwarnings("ignore::aiohttp.web_exceptions.NotAppKeyWarning")
S = EngineState


def engine(eid: int = 0, state: S = S.READY, restarts: int = 0, **kw: Any) -> EngineStatus:
    return EngineStatus(
        eid, eid, EngineAddress(port=8100 + eid), state, "k", restarts=restarts, **kw
    )


def gpu(index: int = 0, level: int = 0, temp: float | None = 60.0) -> GpuStatus:
    return GpuStatus(GpuReading(index=index, temperature_c=temp), level)


def snap(engines: list[EngineStatus], gpus: list[GpuStatus] = ()) -> ApplianceStatus:  # type: ignore[assignment]
    return ApplianceStatus(0.0, "cuda", None, True, True, tuple(engines), tuple(gpus))


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (None, snap([engine()]), []),
        (snap([engine()]), snap([engine()]), []),
        (
            snap([engine()]),
            snap([engine(state=S.DRAINING)]),
            [("state", "engine 0 DRAINING (was READY)")],
        ),
        (
            snap([engine(state=S.READY)]),
            snap([engine(state=S.FAILED, last_exit="exit status 1: CUDA out of memory")]),
            [("state", "engine 0 FAILED (was READY): exit status 1: CUDA out of memory")],
        ),
        (
            snap([engine(state=S.STARTING)]),
            snap([engine(state=S.STARTING, restarts=1, last_restart_reason="sustained_heat")]),
            [("restart", "engine 0 restarted (sustained_heat)")],
        ),
        (
            snap([], [gpu(0, 0, 70)]),
            snap([], [gpu(0, 2, 84.4)]),
            [("heat", "GPU 0 throttle up: level 0 → 2 at 84 °C")],
        ),
        (
            snap([], [gpu(0, 4, 95)]),
            snap([], [gpu(0, 3, None)]),
            [("heat", "GPU 0 throttle down: level 4 → 3")],
        ),
        # An engine or GPU that appears (a reload) is no event: nothing to compare with.
        (snap([engine(0)]), snap([engine(0), engine(1, S.STARTING)], [gpu(1, 4)]), []),
    ],
)
def test_events_between_two_snapshots(
    old: ApplianceStatus | None, new: ApplianceStatus, expected: list[tuple[str, str]]
) -> None:
    assert [(e.kind, e.text) for e in diff_events(5.0, old, new)] == expected


def test_audit_lines_become_events_and_anything_else_is_skipped() -> None:
    line = audit_line("key.create", "key:3f9a1c2e", "key:00000001", "ok", {"name": "<b>x</b>"})
    event = audit_event(line)
    assert event is not None and event.kind == "audit"
    assert event.text == "key.create key:3f9a1c2e by key:00000001: ok (name <b>x</b>)"
    drain = audit_line("engine.drain", "engine:0", "key:1", "refused", {"message": "last one"})
    assert audit_event(drain).text.endswith("refused: last one")  # type: ignore[union-attr]
    forced = audit_line("engine.drain", "engine:0", "key:1", "ok", {"force": True})
    assert audit_event(forced).text.endswith("ok (forced)")  # type: ignore[union-attr]
    assert audit_event('{"action": "x"') is None  # cut by a crash
    assert audit_event('{"time": "yesterday"}') is None
    assert audit_event("[1, 2]") is None


def figures(rej: float = 0, ttft: tuple[float, float] = (0, 0), tokens: int = 0) -> Figures:
    return Figures(2, 1, rej, ttft[0], ttft[1], tokens)


def test_a_sample_is_the_gpus_now_and_the_rates_since_the_last() -> None:
    status = snap(
        [], [GpuStatus(GpuReading(0, temperature_c=81.26, power_w=300, sm_clock_mhz=1800), 2)]
    )
    first = sample_of(10.0, status, figures(), None, 0.0)
    assert first == {
        "t": 10.0,
        "gpus": [[0, 81.3, 300.0, 1800, 2]],
        "queue": [2, 1],
        "rejected": 0,
        "ttft_s": None,
        "tokens_per_s": 0.0,
    }
    later = sample_of(12.0, status, figures(5, (1.5, 10), 800), figures(2, (1.0, 5), 0), 2.0)
    assert (later["rejected"], later["ttft_s"], later["tokens_per_s"]) == (3, 0.1, 400.0)
    # A counter that went back (a reset) is no negative rate.
    reset = sample_of(14.0, status, figures(0, (0, 0), 0), figures(5, (1.5, 10), 800), 2.0)
    assert (reset["rejected"], reset["ttft_s"], reset["tokens_per_s"]) == (0, None, 0.0)


def test_the_ring_keeps_an_hour_and_a_poll_gets_only_what_is_newer() -> None:
    ring = History(interval_s=2.0, span_s=10.0)  # 5 samples
    for i in range(8):
        ring.add_sample({"t": i})
    ring.add_events([Event(7.5, "heat", "hot")])
    samples, events = ring.after(0)
    assert [s["t"] for s in samples] == [3, 4, 5, 6, 7]
    assert events == [{"t": 7.5, "kind": "heat", "text": "hot"}]
    assert ring.after(ring.seq) == ([], [])
    ring.add_sample({"t": 8})
    assert ring.after(ring.seq - 1) == ([{"t": 8}], [])


def test_the_audit_tail_reads_whole_new_lines_and_starts_over_after_a_rotation(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.log"
    tail = AuditTail(path)
    assert tail.read_new() == []  # no file yet
    path.write_text('{"a": 1}\n{"a": 2')
    assert tail.read_new() == ['{"a": 1}']  # the line being written waits
    with path.open("a") as f:
        f.write('}\n{"a": 3}\n')
    assert tail.read_new() == ['{"a": 2}', '{"a": 3}']
    assert tail.read_new() == []
    path.rename(tmp_path / "audit.log.1")  # rotated: a new file
    path.write_text('{"a": 4}\n')
    assert tail.read_new() == ['{"a": 4}']


def test_the_audit_tail_starts_at_the_end_of_a_long_file_on_a_line(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    lines = [json.dumps({"n": i, "pad": "x" * 90}) for i in range(2 * TAIL_BYTES // 100)]
    path.write_text("\n".join(lines) + "\n")
    got = AuditTail(path).read_new()
    assert 0 < len(got) < len(lines)
    assert got == lines[-len(got) :]  # whole lines only: no piece of one first
    (tmp_path / "link.log").symlink_to(path)
    assert AuditTail(tmp_path / "link.log").read_new() == []  # a symlink is not followed


# ---- the routes, over the in-process gateway ---------------------------------------------
def test_the_page_data_needs_the_metrics_scope_the_rest_of_admin_stays_admin() -> None:
    assert required_scope("/admin/history") == "metrics"
    assert required_scope("/admin/status") == "admin"
    assert required_scope("/admin/engines/0/drain") == "admin"
    assert required_scope("/ui") is None and required_scope("/") is None


async def test_the_page_is_served_without_a_key_with_its_headers(box: Box) -> None:  # noqa: F811
    async with box.client.get("/ui") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/html")
        csp = resp.headers["Content-Security-Policy"]
        assert "default-src 'self'" in csp and "script-src 'self';" in csp
        assert "form-action 'none'" in csp and "frame-ancestors 'none'" in csp
        assert resp.headers["X-Frame-Options"] == "DENY"
        assert '<input id="key" name="key"' in await resp.text()
    async with box.client.get("/ui/app.js") as resp:
        assert resp.headers["Content-Type"].startswith("text/javascript")
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
    async with box.client.get("/ui/secrets.txt") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "unknown_route"
    async with box.client.get("/", allow_redirects=False) as resp:
        assert (resp.status, resp.headers["Location"]) == (302, "ui")
    # /ui/ as typed or bookmarked with the slash: to the page (issue 33, item 16).
    async with box.client.get("/ui/", allow_redirects=False) as resp:
        assert (resp.status, resp.headers["Location"]) == (302, "../ui")
    async with box.client.get("/ui/") as resp:
        assert resp.status == 200 and str(resp.url).endswith("/ui")
        assert '<input id="key" name="key"' in await resp.text()


async def test_the_sign_in_text_says_what_each_scope_sees(box: Box) -> None:  # noqa: F811
    """A metrics key does not see the usage per key (admin only, /admin/history's
    ``usage``): the sign-in page must not promise it "everything"."""
    async with box.client.get("/ui") as resp:
        text = " ".join((await resp.text()).split())
    assert "sees everything" not in text
    assert "an <b>admin</b> key also sees the usage per key" in text


async def test_history_by_scope(box: Box) -> None:  # noqa: F811
    async with box.client.get("/admin/history") as resp:
        assert resp.status == 401
    async with box.client.get("/admin/history", headers=box.auth(box.user)) as resp:
        assert resp.status == 403
    async with box.client.get("/admin/history", headers=box.auth(box.metrics)) as resp:
        assert resp.status == 200
        doc = await resp.json()
        assert doc["scope"] == "metrics" and doc["usage"] is None  # usage is the admin's
        assert [e["id"] for e in doc["status"]["engines"]] == [0, 1]
        assert resp.headers["Cache-Control"] == "no-store"
    # Read-only: a metrics key still cannot act.
    async with box.client.post("/admin/engines/0/drain", headers=box.auth(box.metrics)) as resp:
        assert resp.status == 403
    await box.complete()
    async with box.client.get("/admin/history?after=x", headers=box.auth(box.admin)) as resp:
        doc = await resp.json()
        assert doc["scope"] == "admin"
        assert [u["name"] for u in doc["usage"]] == ["user"]


async def test_metrics_public_opens_metrics_only_not_the_page_data(box: Box) -> None:  # noqa: F811
    cfg = box.appliance._config
    box.appliance._config = dataclasses.replace(
        cfg, gateway=dataclasses.replace(cfg.gateway, metrics_public=True)
    )
    async with box.client.get("/metrics") as resp:
        assert resp.status == 200
    async with box.client.get("/admin/history") as resp:
        assert resp.status == 401
