"""`llm-appliance keys create|list|revoke` against a keys file in tmp_path."""

from __future__ import annotations

import argparse
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance.gateway import keys_cli
from appliance.gateway.keys import KeyStore

Run = Callable[..., tuple[int, str, str]]


def _parser() -> argparse.ArgumentParser:
    """The shape `appliance.cli.build_parser` gives `keys` (common --config, SUPPRESS)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS)
    parser = argparse.ArgumentParser(prog="llm-appliance", parents=[common])
    sub = parser.add_subparsers(dest="command", required=True)
    keys_cli.add_parser(sub, common)
    return parser


@pytest.fixture
def keys_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "keys.json"


@pytest.fixture
def config(tmp_path: Path, keys_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f'[gateway]\nkeys_file = "{keys_path}"\n')
    return path


@pytest.fixture
def run(config: Path, capsys: pytest.CaptureFixture[str]) -> Run:
    def run(*argv: str, with_config: bool = True) -> tuple[int, str, str]:
        capsys.readouterr()
        full = list(argv)
        if with_config:
            full = [*argv[:2], "--config", str(config), *argv[2:]]
        args = _parser().parse_args(full)
        if not hasattr(args, "config"):
            args.config = None
        code = args.func(args)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_create_prints_the_key_alone_on_the_first_line(run: Run, keys_path: Path) -> None:
    code, out, err = run("keys", "create", "--name", "alice")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 1
    key = lines[0]
    assert key.startswith("sk-la-") and key == key.strip()
    assert "not shown again" in err and key not in err
    store = KeyStore(keys_path)
    store.load()
    record = store.authenticate(key)
    assert record is not None and record.name == "alice" and record.scopes == {"user"}
    assert record.priority == "interactive" and record.expires_at is None
    assert stat.S_IMODE(os.stat(keys_path).st_mode) == 0o600


def test_create_with_every_option(run: Run, keys_path: Path) -> None:
    code, out, _ = run(
        "keys",
        "create",
        "--name",
        "batch job",
        "--scope",
        "user",
        "--scope",
        "metrics",
        "--rpm",
        "30",
        "--tpm",
        "5000",
        "--priority",
        "batch",
        "--expires-days",
        "7",
    )
    assert code == 0
    store = KeyStore(keys_path)
    store.load()
    record = store.authenticate(out.splitlines()[0])
    assert record is not None
    assert record.scopes == {"user", "metrics"}
    assert (record.rpm, record.tpm, record.priority) == (30, 5000, "batch")
    assert record.expires_at is not None
    assert record.expires_at - record.created_at == pytest.approx(7 * 86400, abs=0.01)


@pytest.mark.parametrize(
    "extra",
    [
        ["--scope", "root"],
        ["--rpm", "0"],
        ["--tpm", "x"],
        ["--priority", "urgent"],
        ["--expires-days", "-1"],
    ],
)
def test_create_rejects_bad_options(
    run: Run, extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        run("keys", "create", "--name", "x", *extra)
    assert info.value.code == 2


def test_create_rejects_a_bad_name(run: Run, keys_path: Path) -> None:
    code, out, err = run("keys", "create", "--name", "x" * 65)
    assert code == 2 and out == ""
    assert "name" in err and "64" in err
    assert not keys_path.exists()


def test_list_rows_start_with_the_id_and_never_show_a_secret(run: Run) -> None:
    _, out1, _ = run("keys", "create", "--name", "alice")
    _, out2, _ = run(
        "keys", "create", "--name", "ops", "--scope", "admin", "--rpm", "10", "--expires-days", "3"
    )
    keys = [out1.strip(), out2.strip()]
    ids = [k.split("-")[2] for k in keys]

    code, out, _ = run("keys", "list")
    assert code == 0
    lines = out.splitlines()
    header, rows = lines[0], lines[1:]
    for column in (
        "ID",
        "NAME",
        "SCOPES",
        "RPM",
        "TPM",
        "PRIORITY",
        "EXPIRES",
        "CREATED",
        "STATUS",
    ):
        assert column in header
    assert len(rows) == 2
    assert [row.split()[0] for row in rows] == ids
    assert "alice" in rows[0] and "active" in rows[0] and "never" in rows[0]
    assert "ops" in rows[1] and "admin" in rows[1] and "10" in rows[1]
    for key in keys:
        assert key not in out
        assert key.split("-", 3)[3] not in out

    code, out, _ = run("keys", "list", "--json")
    assert code == 0
    data = json.loads(out)
    assert [d["id"] for d in data] == ids
    assert all(d["status"] == "active" for d in data)
    assert all("key_hash" not in d for d in data)
    for key in keys:
        assert key.split("-", 3)[3] not in out


def test_list_marks_expired_keys(run: Run, keys_path: Path) -> None:
    run("keys", "create", "--name", "old", "--expires-days", "1")
    doc = json.loads(keys_path.read_text())
    doc["keys"][0]["expires_at"] = 1.0
    keys_path.write_text(json.dumps(doc))
    _, out, _ = run("keys", "list")
    assert out.splitlines()[1].rstrip().endswith("expired")
    _, out, _ = run("keys", "list", "--json")
    assert json.loads(out)[0]["status"] == "expired"


def test_list_with_no_keys_file(run: Run) -> None:
    code, out, err = run("keys", "list")
    assert code == 0
    assert out.splitlines()[0].startswith("ID")
    assert len(out.splitlines()) == 1
    assert "no keys" in err


def test_revoke(run: Run, keys_path: Path) -> None:
    _, out, _ = run("keys", "create", "--name", "alice")
    key = out.strip()
    key_id = key.split("-")[2]
    code, out, _ = run("keys", "revoke", key_id)
    assert code == 0 and key_id in out
    store = KeyStore(keys_path)
    store.load()
    assert store.lookup(key) == (None, "unknown")
    _, out, _ = run("keys", "list")
    assert key_id not in out


def test_revoke_unknown_id_fails(run: Run) -> None:
    run("keys", "create", "--name", "alice")
    code, out, err = run("keys", "revoke", "deadbeef")
    assert code != 0
    assert "deadbeef" in err and out == ""


def test_corrupt_keys_file_is_a_clear_error(run: Run, keys_path: Path) -> None:
    keys_path.parent.mkdir(parents=True)
    keys_path.write_text("{oops")
    for argv in (
        ("keys", "list"),
        ("keys", "create", "--name", "x"),
        ("keys", "revoke", "deadbeef"),
    ):
        code, out, err = run(*argv)
        assert code == 1 and out == ""
        assert str(keys_path) in err and "not valid JSON" in err
    assert keys_path.read_text() == "{oops"


def test_unwritable_keys_file_is_a_clear_error(tmp_path: Path, run: Run, config: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("")  # a file where the keys directory should be; fails even as root
    config.write_text(f'[gateway]\nkeys_file = "{blocker / "keys.json"}"\n')
    code, out, err = run("keys", "create", "--name", "x")
    assert code == 1 and out == ""
    assert str(blocker) in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_read_only_directory_is_a_clear_error(
    tmp_path: Path, run: Run, config: Path, keys_path: Path
) -> None:
    run("keys", "create", "--name", "a")
    os.chmod(keys_path.parent, 0o500)
    try:
        code, out, err = run("keys", "create", "--name", "b")
    finally:
        os.chmod(keys_path.parent, 0o700)
    assert code == 1 and out == ""
    assert "Permission denied" in err


def test_config_comes_from_the_environment_without_flag(
    run: Run, config: Path, keys_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLM_APPLIANCE_CONFIG", str(config))
    code, _, _ = run("keys", "create", "--name", "env", with_config=False)
    assert code == 0 and keys_path.exists()


def test_through_the_real_cli_when_wired(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from appliance import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if "keys" not in sub.choices:
        pytest.skip("keys_cli.add_parser is not wired into appliance.cli yet")
    assert cli.main(["keys", "create", "--config", str(config), "--name", "alice"]) == 0
    key = capsys.readouterr().out.splitlines()[0]
    assert cli.main(["--config", str(config), "keys", "list"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith(key.split("-")[2])
    assert cli.main(["keys", "revoke", "--config", str(config), "00000000"]) != 0
