"""The order of an admin's adapter changes against requests (issue 23 review): an added
adapter is routed only once every engine serves it, and a removed one is unloaded only
once the requests already routed to it have ended (bounded), so that no request for
it meets vLLM's own 404."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from appliance.config import parse_config
from appliance.supervisor import adapters
from appliance.supervisor.adapters import AdapterBook
from appliance.supervisor.commands import SyncAdapters
from appliance.supervisor.runner import EngineRunner
from tests.fakes.lora_files import fake_adapter


class Runner:
    """An engine's runner as the book sees one: it is told to sync, and answers later."""

    def __init__(self) -> None:
        self.spec = SimpleNamespace(model="chat", lora_rank=16)
        self.told: list[SyncAdapters] = []

    def tell(self, command: SyncAdapters) -> None:
        self.told.append(command)

    def answer(self, errors: dict[str, str] | None = None) -> None:
        for c in self.told:
            if c.done is not None and not c.done.done():
                c.done.set_result(errors or {})


def _book(tmp: Path, busy: Any = lambda name: 0) -> tuple[AdapterBook, Runner]:
    table = {"name": "chat", "extra_args": ["--enable-lora"]}
    cfg = parse_config(
        {
            "engine": {"device": "cpu"},
            "gateway": {"keys_file": str(tmp / "keys.json"), "queue_timeout_s": 1},
            "models": [table],
        }
    )
    book = AdapterBook(lambda: cfg, tmp / "adapters.json", busy)
    runner = Runner()
    book.attach([cast(EngineRunner, runner)])
    return book, runner


async def _until(condition: Any) -> None:
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110 (the book has no event to await)
            await asyncio.sleep(0.01)


def test_an_added_adapter_is_routed_only_once_its_engines_serve_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        book, runner = _book(tmp_path)
        adding = asyncio.create_task(book.add("chat", "sql", str(fake_adapter(tmp_path / "a"))))
        await _until(lambda: runner.told)
        assert "sql" not in book.names()  # loading: a request now would meet vLLM's 404
        assert "sql" in book.wanted("chat")  # what the engine is told to load
        runner.answer()
        assert (await adding).status == 200
        assert book.names()["sql"] == "chat"

    asyncio.run(scenario())


def test_a_removed_adapter_is_unloaded_once_its_requests_have_ended(tmp_path: Path) -> None:
    async def scenario() -> None:
        busy = {"sql": 1}
        book, runner = _book(tmp_path, lambda name: busy.get(name, 0))
        adding = asyncio.create_task(book.add("chat", "sql", str(fake_adapter(tmp_path / "a"))))
        await _until(lambda: runner.told)
        runner.answer()
        assert (await adding).status == 200
        runner.told.clear()
        removing = asyncio.create_task(book.remove("chat", "sql"))
        await _until(lambda: "sql" not in book.names())  # no new request is routed to it
        await asyncio.sleep(0.2)
        assert runner.told == []  # one request still on it: not unloaded yet
        busy["sql"] = 0
        await _until(lambda: runner.told)
        runner.answer()
        assert (await removing).status == 200

    asyncio.run(scenario())


def test_a_removal_waits_for_a_request_no_longer_than_the_queue_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapters, "SETTLE_MARGIN_S", 0.1)

    async def scenario() -> None:
        book, runner = _book(tmp_path, lambda name: 1)  # a stream that never ends
        adding = asyncio.create_task(book.add("chat", "sql", str(fake_adapter(tmp_path / "a"))))
        await _until(lambda: runner.told)
        runner.answer()
        await adding
        runner.told.clear()
        removing = asyncio.create_task(book.remove("chat", "sql"))
        await _until(lambda: runner.told)  # after queue_timeout_s (1 s): unloaded
        runner.answer()
        assert (await removing).status == 200

    asyncio.run(scenario())


def test_an_engine_that_does_not_answer_the_load_in_time_fails_the_add_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never routed to an engine not known to serve it (vLLM would answer 404), nothing
    kept, and the admin told to retry: it used to be a 200."""
    monkeypatch.setattr(adapters, "ANSWER_WAIT_S", 0.2)

    async def scenario() -> None:
        book, runner = _book(tmp_path)  # a runner that never answers
        result = await book.add("chat", "sql", str(fake_adapter(tmp_path / "a")))
        assert (result.status, result.code) == (503, "engine_busy")
        assert "did not answer within 0.2 s" in result.message and "retry" in result.message
        assert "sql" not in book.names() and "sql" not in book.wanted("chat")
        assert not (tmp_path / "adapters.json").exists()
        # Told twice: load it, then (nothing wanted any more) unload it where it loaded,
        # without waiting a second time for the engine that is late already.
        assert len(runner.told) == 2 and runner.told[1].done is None

    asyncio.run(scenario())
