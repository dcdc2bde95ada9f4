"""Which event loop `serve` runs on, and how an admin overrides it."""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

import pytest

from appliance.cli import EVENT_LOOP_ENV, event_loop_factory
from appliance.errors import ConfigError


def test_uvloop_by_default_when_installed() -> None:
    name, factory = event_loop_factory({})
    assert name == "uvloop" and factory is not None
    loop = factory()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def test_asyncio_when_asked() -> None:
    assert event_loop_factory({EVENT_LOOP_ENV: "asyncio"}) == ("asyncio", None)
    assert event_loop_factory({EVENT_LOOP_ENV: " AsyncIO "}) == ("asyncio", None)


def test_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert event_loop_factory({}) == ("asyncio", None)
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        event_loop_factory({EVENT_LOOP_ENV: "uvloop"})


def test_unknown_value_names_the_variable_and_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        event_loop_factory({EVENT_LOOP_ENV: "trio"})
    assert err.value.problems == [
        f"{EVENT_LOOP_ENV} = 'trio': allowed values are auto, uvloop, asyncio"
    ]


def test_uvloop_runs_subprocesses_and_threads() -> None:
    """The uvloop loop runs coroutines, subprocesses and threads like asyncio's."""
    _, factory = event_loop_factory({})

    async def work() -> tuple[bytes, int]:
        proc = await asyncio.create_subprocess_exec(
            "echo", "hi", stdout=asyncio.subprocess.PIPE, start_new_session=True
        )
        out, _ = await proc.communicate()
        return out, await asyncio.to_thread(lambda: 7)

    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(work()) == (b"hi\n", 7)
