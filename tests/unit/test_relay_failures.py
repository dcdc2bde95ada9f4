"""504 or 502 when the engine fails before answering, decided by the failure's type.

The relay (appliance/gateway/relay/handlers.py) runs in-process against a small fake gateway
with one engine, and a client talks to it over real HTTP: a streamed request takes the
splice path, a non-streamed one aiohttp's client. A connect that times out is 504; a
refused connection, bad HTTP, an engine's own 5xx or an engine the supervisor gave up on
is 502, whatever words its reason holds (a reason that says "timeout" is no timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from appliance.config import Config, EngineConfig
from appliance.control import EngineStatus, NoModels
from appliance.endpoint import EngineAddress, EngineOwner
from appliance.engine import EngineState
from appliance.gateway.accounting.book import UsageBook
from appliance.gateway.admission.adapter_work import AdapterWork
from appliance.gateway.admission.fallback import FallbackRecorder
from appliance.gateway.admission.gate import Admission
from appliance.gateway.admission.ratelimit import RateLimiter
from appliance.gateway.errors import GatewayError
from appliance.gateway.observe.metrics import GatewayMetrics
from appliance.gateway.relay.engine_ways import EngineSessions, EngineWays
from appliance.gateway.relay.handlers import Relay
from appliance.gateway.wire import upstream_pool
from appliance.gateway.wire.http1 import UpstreamError
from appliance.gateway.wire.splice import UpstreamConnection
from appliance.gateway.wire.upstream_pool import UpstreamPool
from tests.fakes.fake_appliance import FakeAppliance
from tests.fakes.owners import in_process

# The handler stores the caller's key record under a plain string, as the gateway's
# middleware does (appliance/gateway/app.py), which aiohttp warns about.
pytestmark = pytest.mark.filterwarnings("ignore::aiohttp.web_exceptions.NotAppKeyWarning")

MODEL = "m"
WORDY_WHY = "no token came back within the health check's timeout"  # a verdict, not a timeout


class _OneEngine(Admission):
    """One engine, always free; an engine that gave no answer stays in routing (the retry
    finds it as dead, and the client gets 502)."""

    def check_cost(self, cost: int, model: str | None = None) -> None:
        pass

    async def acquire(self, cost: int, **_: object) -> int:  # type: ignore[override]
        return 0

    def release(self, engine_id: int, cost: int, *_: object) -> None:  # type: ignore[override]
        pass

    def unanswered(self, engine_id: int, pid: int | None) -> None:
        pass


class _Sessions(EngineSessions):
    """aiohttp sessions to the in-process engine, or the test's own session."""

    def __init__(self, session: aiohttp.ClientSession | None) -> None:
        super().__init__(in_process)
        self._given = session

    def session_for(self, address: EngineAddress) -> aiohttp.ClientSession:
        return self._given if self._given is not None else super().session_for(address)


@dataclasses.dataclass
class OneEngine:
    """The relay's parts for one engine at ``address``: real ones, but for admission."""

    address: EngineAddress
    session: Any = None

    def __post_init__(self) -> None:
        config = Config(engine=EngineConfig(served_model_name=MODEL))
        status = EngineStatus(0, None, self.address, EngineState.READY, "engine-key")
        self.box = FakeAppliance(config, [status])
        self.upstreams = UpstreamPool(in_process)
        self.sessions = _Sessions(self.session)
        self.metrics = GatewayMetrics()

    def relay(self, tmp: Path) -> Relay:
        ratelimiter = RateLimiter()
        ways = EngineWays(
            lambda: self.box.config, self.sessions, self.upstreams, self.metrics.first_byte
        )
        return Relay(
            self.box,
            NoModels(),  # no model loads on demand here
            _OneEngine(lambda: self.box.config, self.box.engines, lambda: True),
            ratelimiter,
            AdapterWork(),
            FallbackRecorder(self.metrics.fallbacks),
            UsageBook(tmp / "usage.json", self.metrics.registry, ratelimiter),
            self.metrics,
            ways,
        )


@contextlib.asynccontextmanager
async def relay_client(
    gw: OneEngine,
) -> AsyncIterator[tuple[TestClient[Any, Any], Relay]]:
    """A client of the relay's chat route; a refusal comes back as its error response,
    as the gateway's middleware would send it."""
    with tempfile.TemporaryDirectory() as tmp:
        relay = gw.relay(Path(tmp))

        async def chat(request: web.Request) -> web.StreamResponse:
            request["key"] = SimpleNamespace(
                id="k", rpm=None, tpm=None, priority="interactive", max_inflight=0, models=None
            )
            try:
                return await relay.chat(request)
            except GatewayError as err:
                return err.response()

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        async with TestClient(TestServer(app)) as client:
            try:
                yield client, relay
            finally:
                gw.upstreams.close()
                await gw.sessions.close()


async def ask(client: TestClient[Any, Any], *, stream: bool) -> tuple[int, dict[str, Any]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    async with client.post("/v1/chat/completions", json=body) as resp:
        return resp.status, (await resp.json())["error"]


def refused_port() -> int:
    """A loopback port nobody listens on: connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SilentAddress(EngineAddress):
    """An engine address whose connect never completes (a SYN nobody answers)."""

    async def connect(
        self, factory: Callable[[], asyncio.Protocol], owner: EngineOwner | None
    ) -> tuple[asyncio.BaseTransport, asyncio.Protocol]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@contextlib.asynccontextmanager
async def engine(answer: bytes | None) -> AsyncIterator[tuple[EngineAddress, asyncio.Event]]:
    """An engine that reads one request, then writes ``answer`` and closes, or (None)
    never answers. The event is set once the request has arrived."""
    arrived = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            arrived.set()
            if answer is None:
                await reader.read()  # until the gateway closes its end
            else:
                writer.write(answer)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield EngineAddress(port=server.sockets[0].getsockname()[1]), arrived
    finally:
        server.close()


# ---- through the relay ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["splice", "aiohttp"])
async def test_a_refused_connection_is_502(stream: bool) -> None:
    async with relay_client(OneEngine(EngineAddress(port=refused_port()))) as (client, _):
        status, error = await ask(client, stream=stream)
    assert status == 502
    assert error["type"] == "api_error" and error["code"] == "engine_error"
    assert error["message"].startswith("the engine failed before answering (")


async def test_a_connect_timeout_is_504_on_the_splice_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream_pool, "CONNECT_TIMEOUT_S", 0.05)
    async with relay_client(OneEngine(SilentAddress(port=9))) as (client, _):
        status, error = await ask(client, stream=True)
    assert status == 504
    assert error["type"] == "timeout_error" and error["code"] == "engine_error"
    assert error["message"].endswith("(timeout connecting to the engine)")


async def test_a_connect_timeout_is_504_on_the_client_path() -> None:
    # What aiohttp raises when sock_connect runs out (the integration suite makes a real one).
    timeout = aiohttp.ConnectionTimeoutError("Connection timeout to host http://127.0.0.1:9")
    session = SimpleNamespace(post=mock.AsyncMock(side_effect=timeout))
    async with relay_client(OneEngine(EngineAddress(port=9), session)) as (client, _):
        status, error = await ask(client, stream=False)
    assert status == 504
    assert error["type"] == "timeout_error"
    assert error["message"] == "the engine failed before answering (ConnectionTimeoutError)"


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        # Bad HTTP whose bytes happen to say "timeout": the engine answered, and wrongly.
        (b"HTTP/1.1 timeout\r\n\r\n", "bad status line b'HTTP/1.1 timeout'"),
        # An engine's own 504 is an answer, not a timeout of ours.
        (b"HTTP/1.1 504 Gateway Timeout\r\nContent-Length: 0\r\n\r\n", "engine answered 504"),
    ],
    ids=["bad-http", "engine-504"],
)
async def test_an_engine_that_answers_badly_is_502_whatever_it_says(
    answer: bytes, reason: str
) -> None:
    async with (
        engine(answer) as (address, _),
        relay_client(OneEngine(address)) as (client, _),
    ):
        status, error = await ask(client, stream=True)
    assert status == 502, error
    assert error["message"] == f"the engine failed before answering ({reason})"


@pytest.mark.parametrize("stream", [True, False], ids=["splice", "aiohttp"])
async def test_an_abandoned_engine_is_502_even_when_the_why_says_timeout(stream: bool) -> None:
    async with (
        engine(None) as (address, arrived),
        relay_client(OneEngine(address)) as (client, relay),
    ):
        asked = asyncio.ensure_future(ask(client, stream=stream))
        await asyncio.wait_for(arrived.wait(), 5)
        assert relay.abandon(0, WORDY_WHY) == 1
        status, error = await asyncio.wait_for(asked, 5)
    assert status == 502, error
    assert error["message"] == f"the engine failed before answering ({WORDY_WHY})"


# ---- where splice.py raises ---------------------------------------------------------------


async def test_the_pool_says_a_connect_timeout_timed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream_pool, "CONNECT_TIMEOUT_S", 0.05)
    with pytest.raises(UpstreamError, match="timeout connecting to the engine") as timed:
        await UpstreamPool(in_process).acquire(SilentAddress(port=9))
    assert timed.value.timed_out
    with pytest.raises(UpstreamError, match="cannot connect to the engine") as refused:
        await UpstreamPool(in_process).acquire(EngineAddress(port=refused_port()))
    assert not refused.value.timed_out


@pytest.mark.parametrize(
    ("lost", "timed_out"),
    [(TimeoutError(110, "Connection timed out"), True), (ConnectionResetError(), False)],
)
async def test_a_connection_lost_mid_answer_says_whether_it_timed_out(
    lost: OSError, timed_out: bool
) -> None:
    async with engine(None) as (address, _):
        conn = await UpstreamPool(in_process).acquire(address)
        head = conn.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        conn.connection_lost(lost)  # what asyncio reports when the kernel gives up
        with pytest.raises(UpstreamError) as err:
            await head
        assert err.value.timed_out is timed_out
        assert isinstance(conn, UpstreamConnection) and conn.transport is not None
        conn.transport.close()
