"""`llm-appliance status` finds the admin key where an install put it, and when refused
says which key it sent or every place it looked (issue 16, item 7).

A small in-process gateway answers ``/admin/status`` to one admin key only (401 for no
key or another, 403 for a key without the admin scope), and records what it was sent.
The command runs in a thread through its own parser, as a user runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from appliance import status

ADMIN = "sk-la-0123abcd-" + "A" * 43
USER = "sk-la-4567cdef-" + "U" * 43
STATUS_DOC = {
    "version": "test",
    "device": "cpu",
    "uptime_s": 1.0,
    "accepting": True,
    "ready": True,
    "queue_depth": 0,
    "engines": [],
    "gpus": [],
}


@dataclass
class Gateway:
    url: str = ""
    sent: list[str | None] = field(default_factory=list)


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    gw = Gateway()

    async def admin_status(request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization")
        gw.sent.append(auth)
        if auth == f"Bearer {ADMIN}":
            return web.json_response(STATUS_DOC)
        if auth == f"Bearer {USER}":
            return web.json_response({"error": {"code": "insufficient_scope"}}, status=403)
        return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)

    app = web.Application()
    app.router.add_get("/admin/status", admin_status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    gw.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield gw
    await runner.cleanup()


@dataclass(frozen=True)
class Box:
    config: Path
    first_start_key: Path  # admin.key beside the keys file
    role_key: Path  # where the Ansible role puts the first admin key


@pytest.fixture
def box(tmp_path: Path, gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> Box:
    state = tmp_path / "state"
    state.mkdir()
    config = tmp_path / "config.toml"
    port = gateway.url.rsplit(":", 1)[1]
    config.write_text(f'[gateway]\nport = {port}\nkeys_file = "{state / "keys.json"}"\n')
    role_key = tmp_path / "root" / "llm-appliance-admin.key"
    role_key.parent.mkdir()
    monkeypatch.setattr(status, "ROLE_ADMIN_KEY_FILE", role_key)
    monkeypatch.delenv("LLM_APPLIANCE_KEY", raising=False)
    return Box(config, state / "admin.key", role_key)


async def run_status(
    capsys: pytest.CaptureFixture[str], box: Box, *argv: str
) -> tuple[int, str, str]:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=None)
    parser = argparse.ArgumentParser(prog="llm-appliance", parents=[common])
    status.add_parser(parser.add_subparsers(dest="command", required=True), common)
    args = parser.parse_args(["status", "--config", str(box.config), *argv, "--json"])
    capsys.readouterr()
    code = await asyncio.to_thread(args.func, args)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


async def test_the_key_the_ansible_role_made_is_found_without_flags(
    box: Box, gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    """After the role, `sudo llm-appliance status` just works: no admin.key beside the
    keys file, the role's root-only file holds the key."""
    box.role_key.write_text(ADMIN + "\n")
    os.chmod(box.role_key, 0o600)
    code, out, err = await run_status(capsys, box)
    assert code == 0, err
    assert gateway.sent == [f"Bearer {ADMIN}"]
    assert '"engines": []' in out


async def test_first_starts_admin_key_comes_before_the_roles(
    box: Box, gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    box.first_start_key.write_text(ADMIN + "\n")
    box.role_key.write_text(USER + "\n")
    code, _, err = await run_status(capsys, box)
    assert code == 0, err
    assert gateway.sent == [f"Bearer {ADMIN}"]


async def test_a_symlink_at_the_roles_path_is_not_followed(
    box: Box, gateway: Gateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "elsewhere.key"
    secret.write_text(ADMIN + "\n")
    box.role_key.symlink_to(secret)
    code, _, err = await run_status(capsys, box)
    assert gateway.sent == [None]  # asked without a key: nothing of the link's target
    assert code == 1
    assert f"ignoring {box.role_key}: it is a symbolic link" in err


async def test_no_key_anywhere_names_every_place_looked_and_what_to_do(
    box: Box, gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await run_status(capsys, box)
    assert code == 1 and out == ""
    assert err.count("\n") == 1, err  # one line
    assert f"{gateway.url} answered 401: no admin key: none in --key or $LLM_APPLIANCE_KEY" in err
    assert f"{box.first_start_key} (no such file or directory)" in err
    assert f"{box.role_key} (no such file or directory)" in err
    assert "pass an admin key in LLM_APPLIANCE_KEY (or --key)" in err
    assert "sudo" not in err  # nothing is there for root to read either


async def test_an_unreadable_key_file_suggests_sudo(
    box: Box, gateway: Gateway, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a member of the service group sees: both files exist, neither is hers to read
    (simulated: the test may run as root, which reads anything)."""
    real_open = os.open

    def refuse_key_files(path: os.PathLike[str] | str, flags: int, *a: int, **k: int) -> int:
        if Path(path) in (box.first_start_key, box.role_key):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(status.os, "open", refuse_key_files)
    code, _, err = await run_status(capsys, box)
    assert code == 1 and err.count("\n") == 1, err
    assert f"{box.first_start_key} (permission denied)" in err
    assert f"{box.role_key} (permission denied)" in err
    assert "run it with sudo, or pass an admin key in LLM_APPLIANCE_KEY" in err


async def test_a_refused_key_is_named_by_where_it_came_from(
    box: Box, gateway: Gateway, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    revoked = "sk-la-89abcdef-" + "R" * 43
    box.role_key.write_text(revoked + "\n")
    code, _, err = await run_status(capsys, box)
    assert code == 1
    assert f"answered 401: the admin key from {box.role_key} was refused" in err
    monkeypatch.setenv("LLM_APPLIANCE_KEY", USER)
    code, _, err = await run_status(capsys, box)
    assert code == 1
    assert "answered 403: the key from $LLM_APPLIANCE_KEY has no admin scope" in err
    code, _, err = await run_status(capsys, box, "--key", revoked)
    assert code == 1 and "the admin key from --key was refused" in err
