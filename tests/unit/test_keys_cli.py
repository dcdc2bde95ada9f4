"""`llm-appliance keys create|list|revoke` against a keys file in tmp_path."""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance import keys_cli
from appliance.gateway.keys import (
    MAX_EXPIRES_DAYS,
    MAX_RPM,
    MAX_TPM,
    KeySpecError,
    KeyStore,
)

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
    ("extra", "field"),
    [
        (["--scope", "root"], "scopes"),
        (["--rpm", "0"], "rpm"),
        (["--tpm", "x"], "tpm"),
        (["--priority", "urgent"], "priority"),
        (["--expires-days", "-1"], "expires_days"),
        # Bounds (issue 10, item 8): these were stored and broke the key or the file.
        (["--rpm", "1" + "0" * 400], "rpm"),
        (["--rpm", str(MAX_RPM + 1)], "rpm"),
        (["--rpm", "1.5"], "rpm"),
        (["--tpm", str(MAX_TPM + 1)], "tpm"),
        (["--expires-days", str(MAX_EXPIRES_DAYS + 1)], "expires_days"),
        (["--expires-days", "1e304"], "expires_days"),
        (["--expires-days", "0"], "expires_days"),
        # Only ASCII digits: int() would read these as 12, 1 and 7.
        (["--rpm", "\u0661\u0662"], "rpm"),
        (["--tpm", "\uff11"], "tpm"),
        (["--expires-days", "\u07c7"], "expires_days"),
        (["--rpm", "1_000"], "rpm"),
        (["--rpm", " 7"], "rpm"),
    ],
)
def test_create_rejects_bad_options_with_one_line_naming_the_field(
    run: Run, keys_path: Path, extra: list[str], field: str
) -> None:
    code, out, err = run("keys", "create", "--name", "x", *extra)
    assert code == 2 and out == ""
    assert err.startswith(f"llm-appliance: {field}: "), err
    assert err.count("\n") == 1 and len(err) < 200, err
    assert not keys_path.exists()


def test_cli_and_api_give_the_same_message(run: Run, keys_path: Path) -> None:
    """One validator per field: `keys create` says exactly what POST /admin/keys says."""
    _, _, err = run("keys", "create", "--name", "x", "--rpm", "0")
    with pytest.raises(KeySpecError) as api:
        KeyStore(keys_path).create(name="x", rpm=0)  # what the admin handler calls
    assert err.strip() == f"llm-appliance: {api.value}"


def test_create_accepts_the_maxima(run: Run, keys_path: Path) -> None:
    code, out, _ = run(
        "keys",
        "create",
        "--name",
        "x",
        "--rpm",
        str(MAX_RPM),
        "--tpm",
        str(MAX_TPM),
        "--expires-days",
        str(MAX_EXPIRES_DAYS),
    )
    assert code == 0
    store = KeyStore(keys_path)
    store.load()
    record = store.authenticate(out.splitlines()[0])
    assert record is not None and (record.rpm, record.tpm) == (MAX_RPM, MAX_TPM)


def test_create_rejects_a_bad_name(run: Run, keys_path: Path) -> None:
    code, out, err = run("keys", "create", "--name", "x" * 65)
    assert code == 2 and out == ""
    assert "name" in err and "64" in err
    assert not keys_path.exists()


def test_list_rows_start_with_the_id_and_never_show_a_secret(run: Run) -> None:
    _, out1, _ = run("keys", "create", "--name", "alice")
    _, out2, _ = run(
        "keys",
        "create",
        "--name",
        "ops",
        "--scope",
        "admin",
        "--rpm",
        "10",
        "--expires-days",
        "3",
        "--no-fallback",
        "--max-inflight",
        "4",
        "--model",
        "chat",
        "--model",
        "embed",
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
        "FALLBACK",
        "INFLIGHT",
        "MODELS",
        "EXPIRES",
        "CREATED",
        "STATUS",
    ):
        assert column in header
    assert len(rows) == 2
    assert [row.split()[0] for row in rows] == ids
    assert "alice" in rows[0] and "active" in rows[0] and "never" in rows[0]
    assert "ops" in rows[1] and "admin" in rows[1] and "10" in rows[1]
    fallback = header.index("FALLBACK")
    assert [row[fallback : fallback + 3].strip() for row in rows] == ["yes", "no"]
    inflight = header.index("INFLIGHT")
    assert [row[inflight : inflight + 8].split()[0] for row in rows] == ["-", "4"]
    models = header.index("MODELS")
    assert [row[models:].split()[0] for row in rows] == ["all", "chat,embed"]
    for key in keys:
        assert key not in out
        assert key.split("-", 3)[3] not in out

    code, out, _ = run("keys", "list", "--json")
    assert code == 0
    data = json.loads(out)
    assert [d["id"] for d in data] == ids
    assert [d["max_inflight"] for d in data] == [0, 4]
    assert [d["models"] for d in data] == [None, ["chat", "embed"]]
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


@pytest.mark.parametrize("bad", ["xyz", "deadbeef0", "\uff44eadbeef", "\u0660" * 8])
def test_revoke_refuses_a_malformed_id(run: Run, bad: str) -> None:
    run("keys", "create", "--name", "alice")
    code, out, err = run("keys", "revoke", bad)
    assert code == 2 and out == ""
    assert err.startswith("llm-appliance: id: ") and err.count("\n") == 1, err


def test_revoke_takes_the_id_in_upper_case(run: Run, keys_path: Path) -> None:
    run("keys", "create", "--name", "alice")
    store = KeyStore(keys_path)
    store.load()
    key_id = store.records[0].id
    code, out, _ = run("keys", "revoke", key_id.upper())
    assert code == 0 and key_id in out


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


def test_a_symlinked_lock_is_refused_with_one_line_and_exit_1(
    tmp_path: Path, config: Path, keys_path: Path
) -> None:
    """Issue 10, item 7, end to end: `sudo llm-appliance keys create` with the lock file
    planted as a symlink to a root file: one line naming the lock file, exit 1, no
    traceback, and the target keeps its content, owner and mode."""
    keys_path.parent.mkdir(mode=0o700)
    victim = tmp_path / "shadow"
    victim.write_bytes(b"root:$6$not-yours:19000:0:99999:7:::\n")
    os.chmod(victim, 0o640)
    if os.geteuid() == 0:
        os.chown(keys_path.parent, 65534, 65534)  # the service account's directory
    lock = keys_path.with_name("keys.json.lock")
    lock.symlink_to(victim)
    before = (victim.read_bytes(), os.stat(victim))
    argv = ["keys", "create", "--config", str(config), "--name", "x"]
    proc = subprocess.run(
        [sys.executable, "-m", "appliance.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(lock) in proc.stderr and "symbolic link" in proc.stderr
    after = os.stat(victim)
    assert victim.read_bytes() == before[0]
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before[1].st_uid,
        before[1].st_gid,
        before[1].st_mode,
    )


def test_max_inflight_is_a_whole_number_from_0(run: Run) -> None:
    for bad in ("-1", "1.5", "x", "100001"):
        code, out, err = run("keys", "create", "--name", "a", "--max-inflight", bad)
        assert code == 2 and out == "", (bad, err)
        assert "max_inflight: must be a whole number from 0 (no cap) to 100000" in err


def test_models_are_printable_names(run: Run) -> None:
    for bad in ("", " ", "a\tb", "x" * 257):
        code, out, err = run("keys", "create", "--name", "a", "--model", bad)
        assert code == 2 and out == "", (bad, err)
        assert "models: each model must be a non-empty printable name" in err


def test_usage_shows_each_keys_energy_and_a_dash_where_none_is_known(
    run: Run, keys_path: Path
) -> None:
    """energy_wh is the key's estimated share of its GPUs' energy (accounting/energy.py);
    a key never charged any (no energy telemetry) shows "-" and null: unknown, not 0."""
    keys_path.parent.mkdir(parents=True)
    (keys_path.parent / "usage.json").write_text(
        json.dumps(
            {
                "format": 1,
                "keys": {
                    "k1": {
                        "prompt_tokens": 10,
                        "completion_tokens": 90,
                        "hours": {},
                        "energy_j": 9000.0,
                        "energy_hours": {},
                    },
                    "k2": {"prompt_tokens": 5, "completion_tokens": 5, "hours": {}},
                },
            }
        )
    )
    code, out, _ = run("keys", "usage")
    assert code == 0
    assert [line.split() for line in out.splitlines()] == [
        ["ID", "NAME", "PROMPT", "COMPLETION", "TOTAL", "ENERGY_WH"],
        ["k1", "(revoked)", "10", "90", "100", "2.500"],
        ["k2", "(revoked)", "5", "5", "10", "-"],
    ]
    code, out, _ = run("keys", "usage", "--json")
    assert [(r["id"], r["energy_wh"]) for r in json.loads(out)["keys"]] == [
        ("k1", 2.5),
        ("k2", None),
    ]
