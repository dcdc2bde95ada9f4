"""KeyStore, KeyRecord, KeyWatcher and ensure_admin_key against real files in tmp_path."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from appliance.gateway import keys as keys_mod
from appliance.gateway.keys import (
    KeyRecord,
    KeysFileError,
    KeySpecError,
    KeyStore,
    KeyWatcher,
    atomic_write,
    ensure_admin_key,
    hash_key,
    parse_key_id,
    required_scope,
)

LOGGER = "appliance.gateway.keys"
ADMIN_KEY = keys_mod.ADMIN_KEY_FILE


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def keys_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "keys.json"


@pytest.fixture
def store(keys_path: Path) -> KeyStore:
    return KeyStore(keys_path)


def _write_doc(path: Path, doc: Any) -> None:
    atomic_write(path, json.dumps(doc).encode())


# --- key format ------------------------------------------------------------------------


def test_created_key_has_the_documented_format(store: KeyStore) -> None:
    record, key = store.create(name="alice")
    assert key.startswith("sk-la-")
    prefix, la, key_id, secret = key.split("-", 3)
    assert (prefix, la) == ("sk", "la")
    assert key_id == record.id and len(key_id) == 8 and int(key_id, 16) >= 0
    assert key_id == key_id.lower()
    assert len(secret) >= 43  # token_urlsafe(32)
    assert record.key_hash == hashlib.sha256(key.encode()).hexdigest()
    assert parse_key_id(key) == record.id


@pytest.mark.parametrize(
    "presented",
    [
        "",
        "Bearer x",
        "sk-la-",
        "sk-la-1234567-" + "a" * 43,  # 7 hex chars
        "sk-la-ABCDEF12-" + "a" * 43,  # upper case id
        "sk-la-1234567g-" + "a" * 43,
        "sk-la-12345678-short",
        "sk-la-12345678-" + "a" * 43 + " ",
        "sk-la-12345678-" + "a" * 43 + "\n",
        "sk-la-12345678-" + "é" * 43,
        "sk-la-12345678-" + "a" * 5000,
        "sk-xx-12345678-" + "a" * 43,
    ],
)
def test_malformed_keys_are_rejected(store: KeyStore, presented: str) -> None:
    store.create(name="alice")
    assert parse_key_id(presented) is None
    assert store.lookup(presented) == (None, "malformed")
    assert store.authenticate(presented) is None


# --- authentication --------------------------------------------------------------------


def test_authenticate_ok_unknown_revoked_expired(store: KeyStore) -> None:
    record, key = store.create(name="alice", scopes=["user"], rpm=60, tpm=1000)
    assert store.authenticate(key) == record
    assert store.lookup(key) == (record, "ok")

    # Same id, wrong secret.
    wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    assert store.lookup(wrong) == (None, "unknown")
    # Well-formed, unknown id.
    other = "sk-la-00000000-" + key.split("-", 3)[3]
    assert store.lookup(other) == (None, "unknown")

    assert store.revoke(record.id) is True
    assert store.lookup(key) == (None, "unknown")
    assert store.revoke(record.id) is False

    rec2, key2 = store.create(name="temp", expires_days=1)
    assert rec2.expires_at is not None
    assert store.lookup(key2, now=rec2.expires_at - 1) == (rec2, "ok")
    assert store.lookup(key2, now=rec2.expires_at + 1) == (None, "expired")
    assert store.authenticate(key2, now=rec2.expires_at + 1) is None


def test_wrong_secret_of_an_expired_key_is_unknown_not_expired(store: KeyStore) -> None:
    rec, _ = store.create(name="temp", expires_days=1)
    assert rec.expires_at is not None
    wrong = f"sk-la-{rec.id}-" + "x" * 43
    assert store.lookup(wrong, now=rec.expires_at + 1) == (None, "unknown")


def test_hashes_are_compared_in_constant_time(
    store: KeyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    record, key = store.create(name="alice")
    calls: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def recording(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    assert store.authenticate(key) == record
    assert calls == [(hash_key(key), record.key_hash)]
    calls.clear()
    assert store.authenticate(f"sk-la-{record.id}-" + "y" * 43) is None
    assert len(calls) == 1
    calls.clear()
    assert store.authenticate("sk-la-ffffffff-" + "y" * 43) is None
    assert len(calls) == 1  # an unknown id does the same work


def test_a_second_store_sees_keys_created_by_the_first(keys_path: Path) -> None:
    record, key = KeyStore(keys_path).create(name="alice")
    other = KeyStore(keys_path)
    other.load()
    assert other.authenticate(key) == record


# --- records ---------------------------------------------------------------------------


def test_record_scopes_and_public_dict(store: KeyStore) -> None:
    user, _ = store.create(name="u")
    metrics, _ = store.create(name="m", scopes=["metrics"])
    admin, _ = store.create(name="a", scopes=["admin"])
    both, _ = store.create(name="b", scopes=["user", "metrics"], priority="batch")
    assert user.scopes == frozenset({"user"}) and user.priority == "interactive"
    assert user.allows("user") and not user.allows("metrics") and not user.allows("admin")
    assert metrics.allows("metrics") and not metrics.allows("user")
    assert all(admin.allows(s) for s in ("user", "metrics", "admin"))
    assert both.allows("user") and both.allows("metrics") and not both.allows("admin")
    assert both.priority == "batch"
    public = both.public_dict()
    assert "key_hash" not in public and both.key_hash not in json.dumps(public)
    assert public["scopes"] == ["metrics", "user"]
    assert set(public) == {
        "id",
        "name",
        "scopes",
        "rpm",
        "tpm",
        "priority",
        "created_at",
        "expires_at",
        "fallback",
        "max_inflight",
        "models",
    }
    assert both.key_hash not in repr(both)


def test_is_expired() -> None:
    rec = KeyRecord(
        id="0123abcd",
        name="x",
        scopes=frozenset({"user"}),
        rpm=None,
        tpm=None,
        priority="interactive",
        created_at=100.0,
        expires_at=200.0,
        key_hash="0" * 64,
    )
    assert not rec.is_expired(199.9)
    assert rec.is_expired(200.0)
    never = KeyRecord(
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
    assert not never.is_expired(1e12)
    assert not never.is_expired()


@pytest.mark.parametrize(
    ("path", "scope"),
    [
        ("/v1/chat/completions", "user"),
        ("/v1/models", "user"),
        ("/metrics", "metrics"),
        ("/admin/status", "admin"),
        ("/admin/keys", "admin"),
        ("/healthz", None),
        ("/readyz", None),
        ("/v10", None),
    ],
)
def test_required_scope(path: str, scope: str | None) -> None:
    assert required_scope(path) == scope


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": ""}, "name"),
        ({"name": "   "}, "name"),
        ({"name": "x" * 65}, "name"),
        ({"name": "a\nb"}, "name"),
        ({"name": "x", "scopes": ["root"]}, "scopes"),
        ({"name": "x", "scopes": []}, "scopes"),
        ({"name": "x", "rpm": 0}, "rpm"),
        ({"name": "x", "rpm": -5}, "rpm"),
        ({"name": "x", "rpm": 1.5}, "rpm"),
        ({"name": "x", "rpm": True}, "rpm"),
        ({"name": "x", "tpm": "100"}, "tpm"),
        ({"name": "x", "priority": "urgent"}, "priority"),
        ({"name": "x", "expires_days": 0}, "expires_days"),
        ({"name": "x", "expires_days": -1}, "expires_days"),
        ({"name": "x", "expires_days": float("inf")}, "expires_days"),
        # Bounds (issue 10, item 8): each of these used to be stored, and then either
        # bricked the file (Infinity) or made every request with the key a 500.
        ({"name": "x", "expires_days": 1e304}, "expires_days"),
        ({"name": "x", "expires_days": 10**400}, "expires_days"),
        ({"name": "x", "expires_days": keys_mod.MAX_EXPIRES_DAYS + 1}, "expires_days"),
        ({"name": "x", "expires_days": float("nan")}, "expires_days"),
        ({"name": "x", "expires_days": "7"}, "expires_days"),
        ({"name": "x", "rpm": 10**400}, "rpm"),
        ({"name": "x", "rpm": keys_mod.MAX_RPM + 1}, "rpm"),
        ({"name": "x", "tpm": 10**400}, "tpm"),
        ({"name": "x", "tpm": keys_mod.MAX_TPM + 1}, "tpm"),
        ({"name": "x", "tpm": float("inf")}, "tpm"),
        ({"name": "x", "scopes": 5}, "scopes"),
        ({"name": "x", "scopes": {"user": 1}}, "scopes"),
        ({"name": "x", "scopes": [["user"]]}, "scopes"),
        ({"name": "x", "scopes": [{"a": 1}]}, "scopes"),
        ({"name": "x", "priority": ["batch"]}, "priority"),
        ({"name": 5}, "name"),
        ({"name": "x", "models": []}, "models"),
        ({"name": "x", "models": 5}, "models"),
        ({"name": "x", "models": [5]}, "models"),
        ({"name": "x", "models": [""]}, "models"),
        ({"name": "x", "models": ["x" * 257]}, "models"),
        ({"name": "x", "models": ["m"] * 65}, "models"),
    ],
)
def test_create_validates_its_arguments(
    store: KeyStore, keys_path: Path, kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(KeySpecError) as info:
        store.create(**kwargs)
    assert info.value.field == field
    message = str(info.value)
    assert message.startswith(field + ":")
    assert "\n" not in message and len(message) < 200, message
    assert not keys_path.exists()


def test_create_accepts_the_edges(store: KeyStore) -> None:
    rec, _ = store.create(
        name="x" * 64,
        scopes=["user", "admin", "metrics"],
        rpm=1,
        tpm=1,
        priority="batch",
        expires_days=0.5,
    )
    assert rec.name == "x" * 64 and rec.rpm == 1 and rec.tpm == 1
    assert rec.expires_at is not None
    assert rec.expires_at - rec.created_at == pytest.approx(43200, abs=0.01)
    top, _ = store.create(
        name="top",
        rpm=keys_mod.MAX_RPM,
        tpm=keys_mod.MAX_TPM,
        expires_days=keys_mod.MAX_EXPIRES_DAYS,
    )
    again = KeyStore(store.path)
    again.load()  # what was written reads back: finite JSON numbers
    assert again.get(top.id) == top


@pytest.mark.parametrize(
    ("given", "stored"),
    [("deadbeef", "deadbeef"), ("DEADBEEF", "deadbeef"), (" 0a1b2c3d\n", "0a1b2c3d")],
)
def test_validate_key_id_accepts_ids_as_keys_list_shows_them(given: str, stored: str) -> None:
    assert keys_mod.validate_key_id(given) == stored


@pytest.mark.parametrize(
    "given",
    ["", "deadbee", "deadbeef0", "xyzxyzxy", "\uff10" * 8, "\u0660" * 8, "%00", None, 12345678],
)
def test_validate_key_id_refuses_anything_else(given: object) -> None:
    with pytest.raises(KeySpecError) as info:
        keys_mod.validate_key_id(given)
    assert info.value.field == "id" and str(info.value).startswith("id: ")


def test_the_file_is_held_to_the_same_bounds_with_the_same_words(
    store: KeyStore, keys_path: Path
) -> None:
    rec, _ = store.create(name="a")
    good = rec.stored_dict()
    for field, value in [
        ("rpm", 10**400),
        ("tpm", keys_mod.MAX_TPM + 1),
        ("scopes", 5),
        ("models", []),
        ("created_at", 10**400),  # used to escape as an OverflowError
        ("expires_at", 10**400),
    ]:
        _write_doc(keys_path, {"version": 1, "keys": [{**good, field: value}]})
        with pytest.raises(KeysFileError, match=rf"keys\[0\]\.{field}: ") as info:
            KeyStore(keys_path).load()
        if field in ("rpm", "tpm", "scopes", "models"):
            with pytest.raises(KeySpecError) as api:
                KeyStore(keys_path.with_name("other.json")).new_key("a", **{field: value})
            assert api.value.reason in str(info.value)


def test_non_finite_numbers_are_never_written(keys_path: Path) -> None:
    record = KeyRecord(
        id="0123abcd",
        name="a",
        scopes=frozenset({"user"}),
        rpm=None,
        tpm=None,
        priority="interactive",
        created_at=time.time(),
        expires_at=float("inf"),
        key_hash="0" * 64,
    )
    with pytest.raises(KeysFileError, match="non-finite"):
        keys_mod.render_keys_document([record])


# --- the file --------------------------------------------------------------------------


def test_file_and_directory_modes_and_no_secret_on_disk(store: KeyStore, keys_path: Path) -> None:
    old = os.umask(0o022)
    try:
        _, key1 = store.create(name="alice")
        _, key2 = store.create(name="bob", scopes=["admin"])
    finally:
        os.umask(old)
    assert _mode(keys_path) == 0o600
    assert _mode(keys_path.parent) == 0o700
    raw = keys_path.read_text()
    for key in (key1, key2):
        assert key not in raw
        assert key.split("-", 3)[3] not in raw
    doc = json.loads(raw)
    assert doc["version"] == 1
    assert [k["name"] for k in doc["keys"]] == ["alice", "bob"]
    assert set(doc["keys"][0]) == {
        "id",
        "name",
        "scopes",
        "rpm",
        "tpm",
        "priority",
        "created_at",
        "expires_at",
        "fallback",
        "max_inflight",
        "models",
        "key_hash",
    }


def test_existing_directory_mode_is_left_alone(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    KeyStore(tmp_path / "keys.json").create(name="a")
    assert _mode(tmp_path) == 0o755
    assert _mode(tmp_path / "keys.json") == 0o600


def test_save_fixes_a_loose_mode(
    store: KeyStore, keys_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store.create(name="a")
    os.chmod(keys_path, 0o644)
    with caplog.at_level(logging.WARNING, LOGGER):
        store.create(name="b")
    assert "0644" in caplog.text
    assert _mode(keys_path) == 0o600


def test_atomic_write_leaves_no_temp_files(store: KeyStore, keys_path: Path) -> None:
    for i in range(5):
        store.create(name=f"k{i}")
    store.revoke(store.records[0].id)
    names = sorted(p.name for p in keys_path.parent.iterdir())
    assert names == ["keys.json", "keys.json.lock"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(
    store: KeyStore, keys_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.create(name="a")
    before = keys_path.read_bytes()

    def boom(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("appliance.fsutil.os.replace", boom)
    with pytest.raises(KeysFileError, match="No space left"):
        store.create(name="b")
    assert keys_path.read_bytes() == before
    assert sorted(p.name for p in keys_path.parent.iterdir()) == ["keys.json", "keys.json.lock"]


def test_temp_file_is_created_0600_exclusively(
    store: KeyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, int, int]] = []
    real_open = os.open

    def spy(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        seen.append((str(path), flags, mode))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr("appliance.fsutil.os.open", spy)
    store.create(name="a")
    temps = [(f, m) for p, f, m in seen if p.endswith(".tmp")]
    assert temps
    for flags, mode in temps:
        assert flags & os.O_EXCL and flags & os.O_CREAT
        assert mode == 0o600


def test_missing_file_means_no_keys(store: KeyStore) -> None:
    store.load()
    assert store.records == ()
    assert store.signature is None


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[]", "must be an object"),
        (b'{"version": 2, "keys": []}', "version"),
        (b'{"version": 1, "keys": {}}', "keys"),
        (b'{"version": 1, "keys": [1]}', "keys[0]"),
        (b'{"version": 1, "keys": [{"id": "abc"}]}', "keys[0]"),
    ],
)
def test_corrupt_file_raises_keys_file_error(
    store: KeyStore, keys_path: Path, content: bytes, problem: str
) -> None:
    keys_path.parent.mkdir(parents=True)
    keys_path.write_bytes(content)
    with pytest.raises(KeysFileError) as info:
        store.load()
    assert str(keys_path) in str(info.value)
    assert problem in str(info.value)


def test_wrong_field_values_are_named(store: KeyStore, keys_path: Path) -> None:
    rec, _ = store.create(name="a")
    good = rec.stored_dict()
    for field, value in [
        ("scopes", ["root"]),
        ("rpm", 0),
        ("priority", "x"),
        ("key_hash", "abc"),
        ("created_at", "yesterday"),
        ("id", "XYZ"),
    ]:
        _write_doc(keys_path, {"version": 1, "keys": [{**good, field: value}]})
        with pytest.raises(KeysFileError, match=rf"keys\[0\]\.{field}"):
            KeyStore(keys_path).load()
    _write_doc(keys_path, {"version": 1, "keys": [good, good]})
    with pytest.raises(KeysFileError, match="duplicate"):
        KeyStore(keys_path).load()


def test_a_failed_load_keeps_the_keys_in_force(store: KeyStore, keys_path: Path) -> None:
    rec, key = store.create(name="a")
    keys_path.write_text("garbage")
    with pytest.raises(KeysFileError):
        store.load()
    assert store.authenticate(key) == rec


def test_create_refuses_to_overwrite_a_corrupt_file(store: KeyStore, keys_path: Path) -> None:
    store.create(name="a")
    keys_path.write_text("{broken")
    with pytest.raises(KeysFileError, match="not valid JSON"):
        store.create(name="b")
    assert keys_path.read_text() == "{broken"


def test_unreadable_file_is_a_keys_file_error(tmp_path: Path) -> None:
    (tmp_path / "keys.json").mkdir()  # a directory where the file should be
    with pytest.raises(KeysFileError, match="cannot be read"):
        KeyStore(tmp_path / "keys.json").load()


def test_unwritable_location_is_a_keys_file_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(KeysFileError) as info:
        KeyStore(blocker / "keys.json").create(name="a")
    assert str(blocker) in str(info.value)


def test_concurrent_creates_lose_nothing(keys_path: Path) -> None:
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(5):
                KeyStore(keys_path).create(name=f"w{n}-{i}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    final = KeyStore(keys_path)
    final.load()
    assert len(final.records) == 20


def test_create_sees_changes_made_by_another_writer(keys_path: Path) -> None:
    daemon = KeyStore(keys_path)
    daemon.create(name="a")
    cli = KeyStore(keys_path)
    cli.create(name="b")
    daemon.create(name="c")  # re-reads under the lock; b survives
    assert [r.name for r in daemon.records] == ["a", "b", "c"]


# --- ensure_admin_key ------------------------------------------------------------------


def test_ensure_admin_key_on_first_start(
    store: KeyStore, keys_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        path = ensure_admin_key(store, logging.getLogger("appliance.test"))
    assert path == keys_path.parent / "admin.key"
    assert _mode(path) == 0o600 and _mode(keys_path) == 0o600
    content = path.read_text()
    assert content.endswith("\n") and content.count("\n") == 1
    key = content.strip()
    record = store.authenticate(key)
    assert record is not None and record.name == "admin" and record.scopes == {"admin"}
    assert str(path) in caplog.text
    assert key not in caplog.text and key.split("-", 3)[3] not in caplog.text
    assert key not in keys_path.read_text()
    # A second start leaves everything alone.
    assert ensure_admin_key(KeyStore(keys_path), logging.getLogger("appliance.test")) is None
    assert path.read_text() == content


def test_ensure_admin_key_with_an_empty_key_list(keys_path: Path) -> None:
    _write_doc(keys_path, {"version": 1, "keys": []})
    store = KeyStore(keys_path)
    path = ensure_admin_key(store, logging.getLogger("appliance.test"))
    assert path is not None and path.exists()
    assert len(store.records) == 1


def test_ensure_admin_key_keeps_existing_keys(store: KeyStore, keys_path: Path) -> None:
    store.create(name="alice")
    assert ensure_admin_key(KeyStore(keys_path), logging.getLogger("x")) is None
    assert not (keys_path.parent / "admin.key").exists()


def test_ensure_admin_key_refuses_a_corrupt_file(keys_path: Path) -> None:
    keys_path.parent.mkdir(parents=True)
    keys_path.write_text("nope")
    with pytest.raises(KeysFileError):
        ensure_admin_key(KeyStore(keys_path), logging.getLogger("x"))
    assert keys_path.read_text() == "nope"


# --- KeyWatcher ------------------------------------------------------------------------


def test_watcher_poll_reload_and_corrupt_file(
    store: KeyStore, keys_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rec_a, key_a = store.create(name="a")
    watcher = KeyWatcher(store)
    assert watcher.poll() is True

    rec_b, key_b = KeyStore(keys_path).create(name="b")
    assert store.authenticate(key_b) is None
    assert watcher.poll() is True
    assert store.authenticate(key_b) == rec_b

    caplog.clear()
    with caplog.at_level(logging.INFO, LOGGER):
        keys_path.write_text("{corrupt")
        assert watcher.poll() is False
        assert watcher.poll() is False
        assert watcher.reload_now() is False
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1, "logged once per distinct content"
        assert str(keys_path) in errors[0].getMessage()
        assert "last good keys stay in force" in errors[0].getMessage()
        assert store.authenticate(key_a) == rec_a and store.authenticate(key_b) == rec_b

        keys_path.write_text("{corrupt, differently")
        assert watcher.poll() is False
        assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2

    atomic_write(keys_path, keys_mod.render_keys_document([rec_a]))
    assert watcher.poll() is True
    assert store.authenticate(key_a) == rec_a
    assert store.authenticate(key_b) is None


def test_watcher_removed_file_means_no_keys(store: KeyStore, keys_path: Path) -> None:
    _, key = store.create(name="a")
    watcher = KeyWatcher(store)
    keys_path.unlink()
    assert watcher.poll() is True
    assert store.authenticate(key) is None


def test_the_watcher_says_when_other_keys_are_in_force(store: KeyStore, keys_path: Path) -> None:
    """on_change is the gateway's cue to end a revoked key's open requests
    (gateway/open_requests.py): after each reload that changed the keys, and a removal."""
    rec, _ = store.create(name="a")
    changes: list[tuple[str, ...]] = []
    watcher = KeyWatcher(
        store, on_change=lambda: changes.append(tuple(r.id for r in store.records))
    )
    assert watcher.poll() is True and changes == []  # nothing changed
    other = KeyStore(keys_path)
    other.load()
    other.revoke(rec.id)  # `keys revoke` in another process
    assert watcher.reload_now() is True
    assert changes == [()]
    keys_path.unlink()
    assert watcher.poll() is True
    assert changes == [(), ()]


def test_reload_now_reads_even_when_stat_is_unchanged(store: KeyStore, keys_path: Path) -> None:
    rec, key = store.create(name="a")
    watcher = KeyWatcher(store)
    st = os.stat(keys_path)
    other = KeyStore(keys_path)
    other.load()
    other.revoke(rec.id)
    # Pretend the change is invisible to stat (same mtime and size; a new inode though).
    os.utime(keys_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert watcher.reload_now() is True
    assert store.authenticate(key) is None


async def test_watcher_puts_a_change_in_force_at_its_next_poll(
    store: KeyStore, keys_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Picked up "within 2 s" (the journal's promise): a poll every second, and the first
    poll that starts after a write puts it in force. Counted in polls, not in seconds, so
    a busy machine that runs the loop late cannot fail it."""
    store.create(name="a")
    watcher = KeyWatcher(store)
    assert watcher.interval_s == 1.0
    polls = 0
    poll = watcher.poll

    def counted(force: bool = False) -> bool:
        nonlocal polls
        polls += 1
        return poll(force)

    monkeypatch.setattr(watcher, "poll", counted)

    async def next_poll() -> None:
        # A poll runs on this loop, so none is half done while this task runs: the next
        # one to start comes after the write that came before this call.
        after = polls
        for _ in range(600):  # a hang, not a slow machine, outlasts 30 s
            if polls > after:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the watcher stopped polling")

    watcher.start()
    try:
        rec, key = await asyncio.to_thread(KeyStore(keys_path).create, name="b")
        await next_poll()
        assert store.authenticate(key) == rec, "watcher missed the change"

        await asyncio.to_thread(KeyStore(keys_path).revoke, rec.id)
        await next_poll()
        assert store.authenticate(key) is None, "watcher missed the revoke"
    finally:
        await watcher.stop()


async def test_watcher_loop_survives_a_corrupt_file_and_errors(
    store: KeyStore, keys_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec, key = store.create(name="a")
    watcher = KeyWatcher(store, interval_s=0.02)
    watcher.start()
    try:
        await asyncio.to_thread(keys_path.write_text, "{")
        await asyncio.sleep(0.1)
        assert store.authenticate(key) == rec

        def broken(*_: Any, **__: Any) -> None:
            raise RuntimeError("unexpected")

        monkeypatch.setattr(watcher, "poll", broken)
        await asyncio.sleep(0.1)
        task = watcher._task
        assert task is not None and not task.done()
    finally:
        await watcher.stop()
    assert task.done()
    await watcher.stop()  # idempotent


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give files away")
def test_root_editing_the_daemons_file_keeps_it_the_daemons(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 65534, 65534)
    store = KeyStore(state / "keys.json")
    store.create(name="a")  # new file: takes the directory's owner
    store.create(name="b")  # existing file: keeps its owner
    for name in ("keys.json", "keys.json.lock"):
        st = os.stat(state / name)
        assert (st.st_uid, st.st_gid) == (65534, 65534)
        assert stat.S_IMODE(st.st_mode) == 0o600


# --- files the service account may have planted (issue 10, item 7) ----------------------
#
# The keys directory belongs to the service account; root runs `sudo llm-appliance keys
# ...` in it. Whatever the account left there must not make root write, chown or read
# another file. Run as root (as CI does), the directory is nobody's, as in production.


def _snapshot(path: Path) -> tuple[bytes, int, int, int]:
    st = os.stat(path)
    return path.read_bytes(), st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


@pytest.fixture
def daemon_dir(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(state, 65534, 65534)
    return state


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file root owns that the service account must never get: /etc/shadow's stand-in."""
    path = tmp_path / "shadow"
    path.write_bytes(b"root:$6$not-yours:19000:0:99999:7:::\n")
    os.chmod(path, 0o640)
    return path


def _assert_one_line_naming(exc: KeysFileError, path: Path, words: str) -> None:
    message = str(exc)
    assert str(path) in message and words in message, message
    assert "\n" not in message


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(
    daemon_dir: Path, victim: Path
) -> None:
    keys_path = daemon_dir / "keys.json"
    KeyStore(keys_path).create(name="a")
    lock = daemon_dir / "keys.json.lock"
    lock.unlink()
    lock.symlink_to(victim)
    before, keys_before = _snapshot(victim), keys_path.read_bytes()
    with pytest.raises(KeysFileError) as info:
        KeyStore(keys_path).create(name="b")
    _assert_one_line_naming(info.value, lock, "symbolic link")
    assert _snapshot(victim) == before  # content, owner and mode
    assert keys_path.read_bytes() == keys_before
    with pytest.raises(KeysFileError, match="symbolic link"):
        KeyStore(keys_path).revoke("00000000")


def test_a_dangling_lock_symlink_creates_nothing(daemon_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "cron.d-job"  # O_CREAT through the link would make this file
    (daemon_dir / "keys.json.lock").symlink_to(target)
    with pytest.raises(KeysFileError, match="symbolic link"):
        KeyStore(daemon_dir / "keys.json").create(name="a")
    assert not target.exists() and not target.is_symlink()


def test_a_hard_linked_lock_file_is_refused_and_its_target_untouched(
    daemon_dir: Path, victim: Path
) -> None:
    os.link(victim, daemon_dir / "keys.json.lock")
    before = _snapshot(victim)
    with pytest.raises(KeysFileError) as info:
        KeyStore(daemon_dir / "keys.json").create(name="a")
    _assert_one_line_naming(info.value, daemon_dir / "keys.json.lock", "hard links")
    assert _snapshot(victim) == before


def test_a_lock_that_is_not_a_regular_file_is_refused(daemon_dir: Path) -> None:
    os.mkfifo(daemon_dir / "keys.json.lock", 0o600)
    with pytest.raises(KeysFileError, match="not a regular file"):
        KeyStore(daemon_dir / "keys.json").create(name="a")


def test_a_symlinked_keys_file_is_refused_not_read(daemon_dir: Path, victim: Path) -> None:
    keys_path = daemon_dir / "keys.json"
    keys_path.symlink_to(victim)
    before = _snapshot(victim)
    for action in (KeyStore(keys_path).load, lambda: KeyStore(keys_path).create(name="a")):
        with pytest.raises(KeysFileError) as info:
            action()
        _assert_one_line_naming(info.value, keys_path, "symbolic link")
    assert _snapshot(victim) == before
    assert keys_path.is_symlink()


def test_a_fifo_as_keys_file_is_refused_without_hanging(daemon_dir: Path) -> None:
    os.mkfifo(daemon_dir / "keys.json", 0o600)  # an open without O_NONBLOCK waits forever
    with pytest.raises(KeysFileError, match="not a regular file"):
        KeyStore(daemon_dir / "keys.json").load()


def test_a_symlinked_admin_key_is_replaced_not_followed(daemon_dir: Path, victim: Path) -> None:
    admin = daemon_dir / ADMIN_KEY
    admin.symlink_to(victim)
    before = _snapshot(victim)
    assert ensure_admin_key(KeyStore(daemon_dir / "keys.json")) == admin
    assert _snapshot(victim) == before
    assert not admin.is_symlink() and _mode(admin) == 0o600
    assert parse_key_id(admin.read_text().strip()) is not None


def test_models_are_kept_in_order_and_an_old_file_without_them_allows_every_model(
    store: KeyStore, keys_path: Path
) -> None:
    rec, _ = store.create(name="a", models=[" chat ", "embed", "chat"])
    assert rec.models == ("chat", "embed")
    assert rec.public_dict()["models"] == ["chat", "embed"]
    again = KeyStore(keys_path)
    again.load()
    assert again.get(rec.id) == rec
    old = {k: v for k, v in rec.stored_dict().items() if k != "models"}
    _write_doc(keys_path, {"version": 1, "keys": [old]})
    older = KeyStore(keys_path)
    older.load()
    loaded = older.get(rec.id)
    assert loaded is not None and loaded.models is None
