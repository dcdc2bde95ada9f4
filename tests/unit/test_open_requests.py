"""Each key's open requests, ended when the key stops being valid (issue 33 item 2)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from appliance.gateway.admission.open_requests import KEY_REVOKED, OpenRequest, OpenRequests
from appliance.gateway.keys import KeyRecord

KEY = KeyRecord(
    id="0123abcd",
    name="x",
    scopes=frozenset({"user"}),
    rpm=None,
    tpm=None,
    priority="interactive",
    created_at=100.0,
    expires_at=None,
    key_hash="0" * 64,
)


async def _open(book: OpenRequests) -> tuple[web.Request, OpenRequest, asyncio.Task[None]]:
    """A handler's task that opened a request of KEY and waits."""
    request = make_mocked_request("POST", "/v1/chat/completions")
    request["key"] = KEY
    opened: asyncio.Future[OpenRequest] = asyncio.get_running_loop().create_future()

    async def handler() -> None:
        opened.set_result(book.add(request))
        await asyncio.Event().wait()

    task = asyncio.create_task(handler())
    return request, await opened, task


async def _ended(task: asyncio.Task[None]) -> bool:
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 1)
    return task.cancelled()


async def test_a_revoked_keys_request_is_marked_as_well_as_cancelled() -> None:
    """The mark is what the relay checks before it sends anything to an engine: a cancel
    that arrives as the request's queue wait ends is swallowed by asyncio.wait_for (the
    slot it was handed wins), and the request would otherwise run on for its key."""
    book = OpenRequests()
    request, entry, task = await _open(book)
    assert book.end_invalid((KEY,), now=150.0) == 0  # still valid: nothing happens
    assert KEY_REVOKED not in request and not task.cancelling()
    assert book.end_invalid((), now=150.0) == 1  # revoked
    assert request[KEY_REVOKED] is True and entry.ended
    assert book.end_invalid((), now=150.0) == 0  # ended once
    assert await _ended(task)
    book.remove(entry)
    assert book.count(KEY.id) == 0


async def test_a_replaced_or_expired_key_ends_its_requests_too() -> None:
    book = OpenRequests()
    for current in (
        dataclasses.replace(KEY, key_hash="1" * 64),  # same id, another secret
        dataclasses.replace(KEY, expires_at=120.0),  # expired by now
    ):
        request, entry, task = await _open(book)
        assert book.end_invalid((current,), now=150.0) == 1
        assert request[KEY_REVOKED] is True
        assert await _ended(task)
        book.remove(entry)
