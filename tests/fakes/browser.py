"""A headless Chromium driven through the DevTools protocol, for the status page's tests.

Debian's ``chromium`` (``scripts/test-deps`` installs it) is started with
``--remote-debugging-port=0``; the port it picked is read from ``DevToolsActivePort`` in
its profile folder, a page target is opened over HTTP, and its WebSocket speaks CDP: a
command is ``{"id", "method", "params"}`` answered by the same id, everything else is an
event, kept in :attr:`Page.events`. aiohttp's WebSocket client is all it needs: no
Playwright, no new dependency. :func:`find_chromium` says why not when there is none.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    return next((p for name in CANDIDATES if (p := shutil.which(name))), None)


class CdpError(RuntimeError):
    pass


class Page:
    """One tab: commands, the events seen so far, and JavaScript evaluated in the page."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.url = ""  # the page's address, set by the test (sign-in reloads it)
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            fut = self._waiting.pop(data.get("id", -1), None)
            if fut is not None and not fut.done():
                fut.set_result(data)
            elif "method" in data:
                self.events.append((data["method"], data.get("params", {})))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[n] = fut
        await self.ws.send_json({"id": n, "method": method, "params": params})
        answer = await asyncio.wait_for(fut, 30)
        if "error" in answer:
            raise CdpError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    async def eval(self, expression: str) -> Any:
        """The value of ``expression`` in the page (promises awaited)."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise CdpError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait(self, expression: str, within_s: float, what: str) -> Any:
        """Await ``expression`` becoming truthy in the page; its value."""
        deadline = time.monotonic() + within_s
        last: Any = None
        while time.monotonic() < deadline:
            last = await self.eval(expression)
            if last:
                return last
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out ({within_s} s) waiting for {what}; last value {last!r}")

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait("document.readyState === 'complete'", 20, f"{url} to load")

    async def type_into(self, selector: str, text: str) -> None:
        await self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.send("Input.insertText", text=text)

    async def click(self, selector: str) -> None:
        """A real mouse click at the element's centre (as a person's, not element.click())."""
        box = await self.eval(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            await self.send(
                "Input.dispatchMouseEvent",
                type=kind,
                x=box[0],
                y=box[1],
                button="left",
                clickCount=1,
            )

    async def screenshot(self, path: Path, width: int, height: int) -> None:
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=width < 600,
        )
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=False)
        path.write_bytes(base64.b64decode(shot["data"]))  # noqa: ASYNC240  (once, small)

    def seen(self, method: str) -> list[dict[str, Any]]:
        return [p for m, p in self.events if m == method]

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self.ws.close()


async def _devtools_port(profile: Path, proc: subprocess.Popen[bytes]) -> int:
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CdpError(f"chromium exited ({proc.returncode}) before it listened")
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(marker.read_text().splitlines()[0])
        await asyncio.sleep(0.05)
    raise CdpError("chromium did not listen for DevTools within 30 s")


@contextlib.asynccontextmanager
async def open_page(chromium: str) -> AsyncIterator[Page]:
    """Chromium, headless, with one tab open on about:blank; gone afterwards."""
    # Chromium's helpers (crashpad, utilities) can still write into the profile for a
    # moment after the browser exits: its whole group is ended, and a file they leave
    # behind does not fail the test.
    with tempfile.TemporaryDirectory(prefix="cdp-", ignore_cleanup_errors=True) as tmp:
        profile = Path(tmp)
        argv = [
            chromium,
            "--headless=new",
            "--remote-debugging-port=0",
            "--remote-allow-origins=*",
            f"--user-data-dir={profile}",
            "--no-sandbox",  # tests run as root in a container, where the sandbox cannot
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "about:blank",
        ]
        # Popen returns at once (the wait for its port is awaited below).
        proc = subprocess.Popen(  # noqa: ASYNC220
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            port = await _devtools_port(profile, proc)
            async with aiohttp.ClientSession() as http:
                async with http.put(f"http://127.0.0.1:{port}/json/new?about:blank") as resp:
                    target = await resp.json()
                ws = await http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
                page = Page(ws)
                try:
                    for domain in ("Page", "Runtime", "Log"):
                        await page.send(f"{domain}.enable")
                    yield page
                finally:
                    await page.close()
        finally:
            _end_group(proc)


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the browser's whole process group, SIGKILL after 10 s, reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
