"""A keys file that cannot be used when the daemon starts: the store refuses every key
(the gateway answers 503 keys_file_error), the journal says what and where, the first
admin key is never written over it, and the watcher puts the fixed file in force."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from appliance.audit import AuditLog
from appliance.gateway.app import _load_keys
from appliance.gateway.keys import KeysFileError, KeyStore, KeyWatcher, ensure_admin_key

LOGGER = "appliance.gateway.keys"
CORRUPT = '{"version": 1, "keys": ['


@pytest.fixture
def keys_path(tmp_path: Path) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(CORRUPT)
    path.chmod(0o600)
    return path


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


def test_a_corrupt_file_at_start_refuses_every_key_and_says_where(
    keys_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = KeyStore(keys_path)
    watcher = KeyWatcher(store)
    with caplog.at_level(logging.INFO, LOGGER):
        assert watcher.first_load() is False
        assert watcher.poll() is False  # unchanged: not logged again
    assert store.problem is not None and str(keys_path) in store.problem
    [line] = errors(caplog)
    assert f"keys file {keys_path} is invalid" in line and "not valid JSON" in line
    assert "503 keys_file_error until the file is fixed" in line
    assert "last good keys" not in line  # there are none
    assert keys_path.read_text() == CORRUPT


def test_the_first_admin_key_is_never_written_over_a_corrupt_file(keys_path: Path) -> None:
    store = KeyStore(keys_path)
    KeyWatcher(store).first_load()
    with pytest.raises(KeysFileError):
        ensure_admin_key(store)
    assert keys_path.read_text() == CORRUPT
    assert not (keys_path.parent / "admin.key").exists()


def test_the_fixed_file_is_put_in_force_and_then_good_keys_are_kept(
    keys_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = KeyStore(keys_path)
    watcher = KeyWatcher(store)
    watcher.first_load()
    fixed = tmp_path / "fixed.json"
    record, key = KeyStore(fixed).create(name="alice")
    fixed.replace(keys_path)
    assert watcher.poll() is True
    assert store.problem is None and store.authenticate(key) == record
    # Corrupt again while running: the last good keys stay, nothing is refused.
    with caplog.at_level(logging.INFO, LOGGER):
        keys_path.write_text(CORRUPT + " ")
        assert watcher.poll() is False
    assert store.problem is None and store.authenticate(key) == record
    assert "the last good keys stay in force" in errors(caplog)[-1]


def test_removing_the_corrupt_file_means_no_keys_not_a_refusal(keys_path: Path) -> None:
    """Moved away: no key is in force (401, fail closed) until `keys create` makes one."""
    store = KeyStore(keys_path)
    watcher = KeyWatcher(store)
    watcher.first_load()
    keys_path.unlink()
    assert watcher.poll() is True
    assert store.problem is None and store.records == ()


def test_an_unreadable_file_at_start_refuses_every_key(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.mkdir()  # not a regular file: cannot be read as keys
    store = KeyStore(path)
    assert KeyWatcher(store).first_load() is False
    assert store.problem is not None and "cannot be read" in store.problem


def test_a_missing_file_at_start_is_no_keys_not_a_problem(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys.json")
    assert KeyWatcher(store).first_load() is True
    assert store.problem is None


async def test_a_first_admin_key_that_cannot_be_written_refuses_every_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No keys file and nowhere to write one (its directory cannot be made): the daemon
    still starts, refusing every key and saying why, instead of exiting into a loop."""
    store = KeyStore(Path("/proc/no-such-dir/keys.json"))
    gateway = SimpleNamespace(keys=store, watcher=KeyWatcher(store), audit=AuditLog(None))
    with caplog.at_level(logging.INFO, LOGGER):
        await _load_keys(gateway)  # type: ignore[arg-type]  # only keys, watcher, audit used
    assert store.problem is not None and "/proc/no-such-dir" in store.problem
    assert store.records == ()
    assert "503 keys_file_error" in errors(caplog)[0]
