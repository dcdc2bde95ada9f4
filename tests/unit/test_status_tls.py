"""`llm-appliance status` over HTTPS checks whom it sends the admin key to (issue 10,
item 11), and never sends what a planted admin.key points at (item 7).

Each test runs a small aiohttp server in-process (HTTPS with a certificate openssl makes,
or plain HTTP) that answers ``/admin/status`` and records every Authorization header it
receives; the command runs in a thread, as a user would run it, through its parser.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from appliance import status

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
ADMIN = "sk-la-0123abcd-" + "A" * 43

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(autouse=True)
def no_role_admin_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Ansible role's admin key file, where status looks last: none here, whatever
    the machine running the tests holds at the real path."""
    monkeypatch.setattr(status, "ROLE_ADMIN_KEY_FILE", tmp_path / "no-role-admin.key")


@dataclass(frozen=True)
class Cert:
    cert: Path  # what the server presents (the leaf first, then any chain)
    key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _self_signed(where: Path, name: str, san: str) -> Cert:
    cert, key = where / f"{name}.pem", where / f"{name}.key"
    _openssl(
        *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
        *("-nodes", "-days", "1", "-subj", f"/CN={name}", "-addext", f"subjectAltName={san}"),
        *("-keyout", str(key), "-out", str(cert)),
    )
    return Cert(cert, key)


def _issued_by(where: Path, ca: Cert, name: str, san: str) -> Cert:
    """A leaf (not a CA) that ``ca`` signed; its PEM file holds the leaf, then the CA."""
    leaf, key, csr, ext = (where / f"{name}{s}" for s in (".crt", ".key", ".csr", ".ext"))
    ext.write_text(f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\n")
    _openssl(
        *("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
        *("-nodes", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr)),
    )
    _openssl(
        *("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key)),
        *("-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(leaf)),
    )
    chain = where / f"{name}.pem"
    chain.write_text(leaf.read_text() + ca.cert.read_text())
    return Cert(chain, key)


@dataclass(frozen=True)
class Certs:
    local: Cert  # self-signed, valid for 127.0.0.1
    elsewhere: Cert  # self-signed, valid only for elsewhere.example
    ca: Cert
    issued: Cert  # signed by ca, valid only for elsewhere.example
    sibling: Cert  # also signed by ca: another server's certificate


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    where = tmp_path_factory.mktemp("certs")
    ca = _self_signed(where, "ca", "DNS:ca.example")
    return Certs(
        local=_self_signed(where, "local", "IP:127.0.0.1"),
        elsewhere=_self_signed(where, "elsewhere", "DNS:elsewhere.example"),
        ca=ca,
        issued=_issued_by(where, ca, "issued", "DNS:elsewhere.example,IP:127.0.0.1"),
        sibling=_issued_by(where, ca, "sibling", "IP:127.0.0.1"),
    )


@dataclass
class Server:
    url: str
    port: int
    authorizations: list[str | None] = field(default_factory=list)


Serve = Callable[[Cert | None], Awaitable[Server]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(cert: Cert | None) -> Server:
        server = Server("", 0)

        async def admin_status(request: web.Request) -> web.Response:
            server.authorizations.append(request.headers.get("Authorization"))
            return web.json_response(STATUS_DOC)

        app = web.Application()
        app.router.add_get("/admin/status", admin_status)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        ctx = None
        if cert is not None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(cert.cert, cert.key)
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        server.port = runner.addresses[0][1]
        server.url = f"{'https' if cert else 'http'}://127.0.0.1:{server.port}"
        return server

    yield start
    for runner in runners:
        await runner.cleanup()


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=None)
    parser = argparse.ArgumentParser(prog="llm-appliance", parents=[common])
    status.add_parser(parser.add_subparsers(dest="command", required=True), common)
    return parser


async def run_status(
    capsys: pytest.CaptureFixture[str], *argv: str, env_key: str | None = ADMIN
) -> tuple[int, str, str]:
    """Run `llm-appliance status ARGV --json` in a thread (it blocks on urllib)."""
    args = _parser().parse_args(["status", *argv, "--json"])
    capsys.readouterr()
    old = os.environ.pop("LLM_APPLIANCE_KEY", None)
    if env_key is not None:
        os.environ["LLM_APPLIANCE_KEY"] = env_key
    try:
        code = await asyncio.to_thread(args.func, args)
    finally:
        os.environ.pop("LLM_APPLIANCE_KEY", None)
        if old is not None:
            os.environ["LLM_APPLIANCE_KEY"] = old
    out, err = capsys.readouterr()
    return code, out, err


def _config(tmp_path: Path, port: int, cert: Cert | None = None) -> Path:
    path = tmp_path / "config.toml"
    tls = f'tls_cert = "{cert.cert}"\ntls_key = "{cert.key}"\n' if cert else ""
    path.write_text(
        f'[gateway]\nport = {port}\nkeys_file = "{tmp_path / "state" / "keys.json"}"\n{tls}'
    )
    return path


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# --- item 11: the certificate is checked ------------------------------------------------


async def test_an_unverified_certificate_is_refused_and_gets_no_key(
    serve: Serve, certs: Certs, capsys: pytest.CaptureFixture[str]
) -> None:
    server = await serve(certs.local)
    code, out, err = await run_status(capsys, "--url", server.url)
    assert code == 1 and out == ""
    line = _one_line(err)
    assert "not trusted" in line and "--cacert" in line and "--insecure" in line
    assert server.authorizations == []  # the admin key never left


async def test_cacert_trusts_a_self_signed_certificate(
    serve: Serve, certs: Certs, capsys: pytest.CaptureFixture[str]
) -> None:
    server = await serve(certs.local)
    code, out, err = await run_status(
        capsys, "--url", server.url, "--cacert", str(certs.local.cert)
    )
    assert code == 0, err
    assert json.loads(out) == STATUS_DOC
    assert server.authorizations == [f"Bearer {ADMIN}"]


async def test_cacert_still_checks_the_host_name(
    serve: Serve, certs: Certs, capsys: pytest.CaptureFixture[str]
) -> None:
    server = await serve(certs.elsewhere)  # trusted, but made for another name
    code, _, err = await run_status(
        capsys, "--url", server.url, "--cacert", str(certs.elsewhere.cert)
    )
    assert code == 1
    assert "not trusted" in _one_line(err) and "127.0.0.1" in err
    assert server.authorizations == []


async def test_cacert_may_be_a_ca(
    serve: Serve, certs: Certs, capsys: pytest.CaptureFixture[str]
) -> None:
    server = await serve(certs.sibling)
    code, _, err = await run_status(capsys, "--url", server.url, "--cacert", str(certs.ca.cert))
    assert code == 0, err


async def test_insecure_is_explicit_and_warns(
    serve: Serve, certs: Certs, capsys: pytest.CaptureFixture[str]
) -> None:
    server = await serve(certs.elsewhere)
    code, out, err = await run_status(capsys, "--url", server.url, "--insecure")
    assert code == 0 and json.loads(out) == STATUS_DOC
    assert "--insecure" in _one_line(err) and "not checked" in err


async def test_a_missing_cacert_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = await run_status(
        capsys, "--url", "https://127.0.0.1:1", "--cacert", str(tmp_path / "nope.pem")
    )
    assert code == 2
    assert "--cacert" in _one_line(err) and "nope.pem" in err


def test_cacert_and_insecure_do_not_go_together() -> None:
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["status", "--cacert", "x", "--insecure"])
    assert info.value.code == 2


# --- without --url: the config's own gateway, its own certificate pinned ----------------


async def test_default_url_accepts_the_configured_certificate_whatever_its_name(
    serve: Serve, certs: Certs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = await serve(certs.elsewhere)  # self-signed for a LAN name, asked at 127.0.0.1
    config = _config(tmp_path, server.port, certs.elsewhere)
    code, out, err = await run_status(capsys, "--config", str(config))
    assert code == 0, err
    assert json.loads(out) == STATUS_DOC and server.authorizations == [f"Bearer {ADMIN}"]


async def test_default_url_pins_a_ca_issued_certificate_not_its_ca(
    serve: Serve, certs: Certs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tls_cert holds the leaf and its CA: only that leaf is pinned. Another server with a
    certificate from the same CA (and no name check, as pinning needs none) is refused."""
    own = await serve(certs.issued)
    config = _config(tmp_path, own.port, certs.issued)
    code, _, err = await run_status(capsys, "--config", str(config))
    assert code == 0, err
    impostor = await serve(certs.sibling)
    config = _config(tmp_path, impostor.port, certs.issued)
    code, _, err = await run_status(capsys, "--config", str(config))
    assert code == 1 and "not trusted" in _one_line(err)
    assert impostor.authorizations == []


async def test_default_url_refuses_a_server_with_another_certificate(
    serve: Serve, certs: Certs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = await serve(certs.local)  # valid for 127.0.0.1, but not the configured one
    config = _config(tmp_path, server.port, certs.elsewhere)
    code, _, err = await run_status(capsys, "--config", str(config))
    assert code == 1 and "not trusted" in _one_line(err)
    assert server.authorizations == []


# --- item 7: admin.key is read only as the appliance writes it -------------------------


async def test_a_symlinked_admin_key_is_not_sent(
    serve: Serve, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = await serve(None)
    config = _config(tmp_path, server.port)
    (tmp_path / "state").mkdir()
    secret = tmp_path / "root-only"
    secret.write_text("sk-la-deadbeef-" + "S" * 43 + "\n")  # any file root can read
    (tmp_path / "state" / "admin.key").symlink_to(secret)
    code, _, err = await run_status(capsys, "--config", str(config), env_key=None)
    assert server.authorizations == [None]  # asked without a key: nothing of the file
    assert code == 0  # this server answers anyone; the gateway would say 401
    assert "admin.key" in err and "symbolic link" in err


async def test_the_admin_key_file_is_used_when_it_is_a_plain_key_file(
    serve: Serve, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = await serve(None)
    config = _config(tmp_path, server.port)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "admin.key").write_text(ADMIN + "\n")
    code, _, err = await run_status(capsys, "--config", str(config), env_key=None)
    assert code == 0, err
    assert server.authorizations == [f"Bearer {ADMIN}"]
