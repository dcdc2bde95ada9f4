"""A stream nobody reads, on real vLLM (issue 33 item 2): ended after
``gateway.stall_timeout_s``, and the request queued behind it is served.

One CPU engine that takes one request at a time. A ``/v1/completions`` stream of 16
prompts is sent on a socket with a 4 KiB receive buffer that never reads; once the
gateway's buffer for that client passes its high water, the engine connection is paused,
and 3 s later (the stall timeout here) both connections are cut. Before, the stream held
the engine's slot for as long as the client kept its socket open, and the other request
got 503 ``queue_timeout``.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from appliance import paths
from tests.e2e.conftest import RealAppliance, missing_setup, serving
from tests.fakes.appliance_proc import real_engine_config
from tests.fakes.http_json import call_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
MODEL = paths.PACKAGED_MODEL_NAME
STALL_S = 3.0


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealAppliance]:
    reason = missing_setup()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("e2e-unread")
    cfg = real_engine_config(
        tmp,
        1,
        engine={"max_inflight": 1},
        gateway={"stall_timeout_s": STALL_S, "queue_timeout_s": 300},
    )
    with serving(tmp, cfg, engines=1) as real:
        yield real


def inflight(real: RealAppliance) -> int:
    return sum(e["inflight"] for e in real.status()["engines"])


def test_an_unread_stream_is_ended_and_the_next_request_served(one_slot: RealAppliance) -> None:
    real = one_slot
    port = int(real.app.config["gateway"]["port"])
    # What the gateway holds for the client is only paused above its high water once the
    # kernel's send buffer for that socket is full too (loopback: up to 4 MiB): 256
    # sequences of 30 tokens with 20 top log-probabilities each are about 5 MB of events,
    # a few tens of seconds of a small model on CPU.
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": ["Count from one to a thousand:"] * 64,
            "n": 4,
            "max_tokens": 30,
            "logprobs": 20,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    try:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {real.admin_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        real.app.wait_for(lambda: inflight(real) == 1, 60, "the unread stream admitted")
        began = time.monotonic()
        status, answer = call_json(
            real.url,
            real.admin_key,
            "POST",
            "/v1/completions",
            {"model": MODEL, "prompt": "Hello", "max_tokens": 1},
            timeout=300,
        )
        waited = time.monotonic() - began
        assert status == 200, answer
        real.app.wait_for(lambda: inflight(real) == 0, 30, "nothing in flight")
        assert f"the client read nothing for {STALL_S:g} s" in real.app.log()
        print(f"\n[e2e] the request behind the unread stream was answered after {waited:.1f} s")
    finally:
        sock.close()
