"""The pure parts of `engines` and `models load|unload` (appliance/admin_cli.py): the
lines they print, the gateway's words said the command line's way, and which engine is
the last one serving its model (tested against a daemon in
tests/integration/test_admin_cli.py)."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.admin_cli import engine_line, error_message, last_serving, model_line


def _doc(*engines: tuple[int, str, str]) -> dict[str, Any]:
    return {"engines": [{"id": i, "model": m, "state": s} for i, m, s in engines]}


@pytest.mark.parametrize(
    ("engines", "engine_id", "last"),
    [
        ([(0, "chat", "READY"), (1, "chat", "READY")], 0, None),
        ([(0, "chat", "READY"), (1, "chat", "DRAINING")], 0, "chat"),
        ([(0, "chat", "READY")], 0, "chat"),  # one engine: always the last
        ([(0, "chat", "READY"), (1, "embed", "READY")], 0, "chat"),  # another model's
        ([(0, "chat", "FAILED"), (1, "chat", "DRAINING")], 0, None),  # serves nothing now
        ([(0, "chat", "READY")], 7, None),  # no such engine: the gateway says so
    ],
)
def test_last_serving(
    engines: list[tuple[int, str, str]], engine_id: int, last: str | None
) -> None:
    assert last_serving(_doc(*engines), engine_id) == last


def test_error_messages_speak_the_command_line() -> None:
    body = {"error": {"message": "engine 1 is the last engine serving: ...; add ?force=true to"}}
    assert error_message(body) == "engine 1 is the last engine serving: ...; add --force to"
    assert error_message({"error": "plain"}) == ""
    assert error_message({}) == ""


def test_lines() -> None:
    assert engine_line("resume", 2, {"state": "READY"}) == "engine 2: READY: takes requests again"
    assert engine_line("drain", 0, {"state": "DRAINING"}).startswith(
        "engine 0: DRAINING: takes no new requests, those in flight finish"
    )
    assert model_line("load", "a", {"state": "loaded"}) == "model a: already loaded"
    assert model_line("unload", "a", {"state": "loading"}).startswith(
        "model a: unloading (drained first), was loading;"
    )
