"""The status page's routes: ``GET /ui`` and its two files, ``/`` sending there, and
``GET /admin/history`` (scope metrics; admin also gets per-key usage).

The page is three files shipped inside the package (``static/``), read once when the
app is made: no CDN, no build step, nothing fetched at run time. Fetching them needs no
key; everything they show comes from ``/admin/history`` with the key the person pasted,
sent as a Bearer header by the page's script (never in a URL or a cookie, so no other
site can make a browser send it). Actions go to the existing admin POST routes the same
way, and are audited there.

Every answer here carries the page's headers (:data:`PAGE_HEADERS`): a Content-Security-
Policy that allows the page's own files only (no inline script or style, no framing, no
form sent anywhere: a sign-in form submitted without the script would otherwise put the
key in a URL), ``X-Frame-Options``, ``nosniff`` and no Referer.
"""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from appliance.control import ApplianceView
from appliance.gateway.accounting.book import UsageBook
from appliance.gateway.admission.gate import Admission
from appliance.gateway.keys import KeyStore
from appliance.gateway.observe.metrics import GatewayMetrics
from appliance.gateway.observe.status_document import StatusDocument
from appliance.gateway.observe.ui.history import Figures, History
from appliance.gateway.observe.ui.sampler import Sampler

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
FILES = {  # what /ui serves: the name in the URL -> (file in static/, content type)
    "": ("index.html", "text/html; charset=utf-8"),
    "app.js": ("app.js", "text/javascript; charset=utf-8"),
    "app.css": ("app.css", "text/css; charset=utf-8"),
}
USAGE_WINDOW_S = 24 * 3600.0
USAGE_ROWS = 50  # the keys that used the most; the rest is in `keys list` and /metrics


def _read_static() -> dict[str, tuple[bytes, str]]:
    static = resources.files("appliance.gateway.observe.ui") / "static"
    return {url: ((static / name).read_bytes(), ctype) for url, (name, ctype) in FILES.items()}


def _totals(family_samples: Any, suffix: str) -> float:
    return float(sum(s.value for s in family_samples if s.name.endswith(suffix)))


def gateway_figures(admission: Admission, metrics: GatewayMetrics, usage: UsageBook) -> Figures:
    """The running totals a sample's rates come from (a few dict walks every 2 s)."""
    interactive, batch = admission.queued
    rejections = [s for fam in metrics.rejections.collect() for s in fam.samples]
    ttft = [s for fam in metrics.ttft.collect() for s in fam.samples]
    return Figures(
        queued_interactive=interactive,
        queued_batch=batch,
        rejections=_totals(rejections, "_total"),
        ttft_sum_s=_totals(ttft, "_sum"),
        ttft_count=_totals(ttft, "_count"),
        completion_tokens=sum(v[1] for v in usage.counts.totals.values()),
    )


class StatusPage:
    """The page's files, its history and the task that feeds it."""

    def __init__(
        self,
        appliance: ApplianceView,
        status: StatusDocument,
        admission: Admission,
        metrics: GatewayMetrics,
        keys: KeyStore,
        usage: UsageBook,
        audit_path: Path | None,
    ) -> None:
        self._appliance = appliance
        self._status = status
        self._keys = keys
        self._usage_book = usage
        self.files = _read_static()
        self.history = History()
        self.sampler = Sampler(
            self.history,
            appliance.status,
            lambda: gateway_figures(admission, metrics, usage),
            audit_path,
        )

    def install(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/", self.root)
        r.add_get("/ui", self.page)
        r.add_get("/ui/", self.to_page)  # typed or bookmarked with the slash
        r.add_get("/ui/{name}", self.page)
        r.add_get("/admin/history", self.history_json)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)

    async def _start(self, app: web.Application) -> None:
        self.sampler.start()

    async def _stop(self, app: web.Application) -> None:
        await self.sampler.stop()

    async def root(self, request: web.Request) -> web.Response:
        # Relative: right behind TLS or a proxy alike. Returned, not raised: the middleware
        # turns raised HTTP exceptions into OpenAI-shaped errors.
        return web.Response(status=302, headers={**PAGE_HEADERS, "Location": "ui"})

    async def to_page(self, request: web.Request) -> web.Response:
        # The page's files are relative to /ui ("ui/app.js"): served at /ui/ they would
        # resolve under /ui/ui/. "../ui" from /ui/ is /ui, behind a path prefix too.
        return web.Response(status=302, headers={**PAGE_HEADERS, "Location": "../ui"})

    async def page(self, request: web.Request) -> web.Response:
        found = self.files.get(request.match_info.get("name", ""))
        if found is None:
            raise web.HTTPNotFound()
        body, ctype = found
        return web.Response(body=body, headers={**PAGE_HEADERS, "Content-Type": ctype})

    async def history_json(self, request: web.Request) -> web.Response:
        """What the page draws: the status now, the history after ``?after=SEQ``, and for
        an admin key the usage per key over 24 h. The middleware checked the scope."""
        try:
            after = max(0, int(request.query.get("after", "0")))
        except ValueError:
            after = 0
        samples, events = self.history.after(after)
        th = self._appliance.config.thermal
        admin = request["key"].allows("admin")
        doc: dict[str, Any] = {
            "now": round(time.time(), 3),
            "scope": "admin" if admin else "metrics",
            "seq": self.history.seq,
            "interval_s": self.history.interval_s,
            "limits": {"soft_c": th.soft_limit_c, "hard_c": th.hard_limit_c},
            "status": self._status.build(),
            "samples": samples,
            "events": events,
            "usage": self._usage() if admin else None,
        }
        return web.json_response(doc, headers=PAGE_HEADERS)

    def _usage(self) -> list[dict[str, Any]]:
        names = {r.id: r.name for r in self._keys.records}
        used = self._usage_book.counts.since(time.time() - USAGE_WINDOW_S)
        rows = sorted(used.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:USAGE_ROWS]
        return [
            {"id": k, "name": names.get(k), "prompt_tokens": p, "completion_tokens": c}
            for k, (p, c) in rows
        ]
