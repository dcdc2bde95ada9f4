"""API keys: the keys file, authentication, hot reload and the first admin key.

A key reads ``sk-la-<id>-<secret>``: ``id`` is 8 lower-case hex characters, public (what
``keys list`` shows and ``keys revoke ID`` takes); ``secret`` is
``secrets.token_urlsafe(32)`` (256 random bits). Only ``sha256(full key)`` is stored, so
the keys file never holds a usable secret; docs/security.md says why a fast hash is the
right one here.

The keys file is ``{"version": 1, "keys": [record, ...]}``, mode 0600, always replaced
atomically (temp file in the same directory, fsync, rename, fsync the directory), so a
reader sees the old file or the new one, never half of one. The CLI and the daemon's
admin endpoints may both change it: every read-modify-write holds an exclusive
``flock`` on ``<keys file>.lock`` and re-reads the file under that lock. The directory
belongs to the service account while root may run the CLI in it, so nothing there is
opened through a symlink, and the lock file is checked (regular, one link, expected
owner) before root locks or chowns it.

Every field a user gives (name, scopes, rpm, tpm, priority, expires_days, key id) has
one validator here, with fixed maxima, shared by the CLI, the admin API and the file
parser; a refusal is a :class:`KeySpecError` naming the field.

The daemon holds a :class:`KeyStore` and a :class:`KeyWatcher`; the watcher polls the
file and swaps the keys in force when it changes (and on SIGHUP, ``reload_now``). A
corrupt file never replaces good keys: the last good ones stay in force and the problem
is logged once per distinct content. A keys file that is *removed* means no keys (fail
closed); ``serve`` makes a fresh admin key on its next start.

File I/O here is blocking (small files, but an fsync and a lock): from the event loop,
run ``create``/``revoke``/``ensure_admin_key`` through ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from appliance.errors import ApplianceError

log = logging.getLogger("appliance.gateway.keys")  # the package's name, as before

KEY_PREFIX = "sk-la-"
SCOPES = frozenset({"user", "metrics", "admin"})
DEFAULT_SCOPES = ("user",)
Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[str, ...] = get_args(Priority)
LookupReason = Literal["ok", "unknown", "expired", "malformed"]
Signature = tuple[int, int, int]  # (st_mtime_ns, st_size, st_ino)

FILE_VERSION = 1
MAX_NAME_LEN = 64
ADMIN_KEY_FILE = "admin.key"
LOCK_TIMEOUT_S = 10.0
_MAX_PRESENTED_LEN = 200
_KEY_RE = re.compile(r"sk-la-([0-9a-f]{8})-([A-Za-z0-9_-]{16,128})")
_ID_RE = re.compile(r"[0-9a-f]{8}")
_ID_INPUT_RE = re.compile(r"[0-9A-Fa-f]{8}")  # explicit ranges: never Unicode digits
_HASH_RE = re.compile(r"[0-9a-f]{64}")
# Compared against when the id is unknown, so both paths do the same work.
_DUMMY_HASH = hashlib.sha256(b"sk-la-00000000-unknown").hexdigest()


class KeysFileError(ApplianceError):
    """The keys file cannot be read, parsed, locked or written; names the file and why."""

    exit_code = 1


class KeySpecError(ApplianceError, ValueError):
    """Bad arguments for a new key; ``field`` names the argument (``param`` in an API error)."""

    exit_code = 2

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.reason = message
        super().__init__(f"{field}: {message}")


def hash_key(presented: str) -> str:
    """The stored form of a key: sha256 of the full key, hex."""
    return hashlib.sha256(presented.encode("utf-8")).hexdigest()


def parse_key_id(presented: str) -> str | None:
    """The public id inside a well-formed key, else None."""
    if len(presented) > _MAX_PRESENTED_LEN:
        return None
    m = _KEY_RE.fullmatch(presented)
    return m.group(1) if m else None


def required_scope(path: str) -> str | None:
    """The scope an HTTP path needs: /v1 -> user, /metrics -> metrics, /admin -> admin."""
    if path == "/v1" or path.startswith("/v1/"):
        return "user"
    if path == "/metrics":
        return "metrics"
    if path == "/admin" or path.startswith("/admin/"):
        return "admin"
    return None


@dataclass(frozen=True)
class KeyRecord:
    id: str
    name: str
    scopes: frozenset[str]  # a subset of SCOPES
    rpm: int | None
    tpm: int | None
    priority: Priority
    created_at: float  # Unix time
    expires_at: float | None  # Unix time; None: never
    key_hash: str = field(repr=False)

    def is_expired(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return self.expires_at is not None and now >= self.expires_at

    def allows(self, scope: str) -> bool:
        """admin allows everything; otherwise the scope must be granted itself."""
        return "admin" in self.scopes or scope in self.scopes

    def public_dict(self) -> dict[str, Any]:
        """Everything but the hash (for `keys list --json` and GET /admin/keys)."""
        return {
            "id": self.id,
            "name": self.name,
            "scopes": sorted(self.scopes),
            "rpm": self.rpm,
            "tpm": self.tpm,
            "priority": self.priority,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
        }

    def stored_dict(self) -> dict[str, Any]:
        return {**self.public_dict(), "key_hash": self.key_hash}


# --- validation ------------------------------------------------------------------------
#
# One validator per field, used by `keys create`, POST /admin/keys, DELETE /admin/keys/{id},
# `keys revoke` and the keys file parser alike, so a field is refused in one place with one
# message. The maxima keep every stored value a finite JSON number that the rate limiter
# and the expiry arithmetic can hold (10**400 rpm or 1e304 days would not be).

MAX_RPM = 1_000_000  # requests per minute: far beyond what one box serves
MAX_TPM = 1_000_000_000  # tokens per minute: likewise
MAX_EXPIRES_DAYS = 36_500  # 100 years: a key that should outlive that needs no expiry
_LIMIT_MAXIMA = {"rpm": MAX_RPM, "tpm": MAX_TPM}
_SHOWN_MAX = 40


def _show(value: object) -> str:
    """A bad value for a message, cut short: a refusal stays one short line."""
    try:
        text = repr(value)
    except ValueError:  # an int with more digits than Python will print
        return "a number with thousands of digits"
    return text if len(text) <= _SHOWN_MAX else text[: _SHOWN_MAX - 3] + "..."


def validate_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise KeySpecError("name", "must be a non-empty string")
    name = name.strip()
    if len(name) > MAX_NAME_LEN:
        raise KeySpecError("name", f"must be at most {MAX_NAME_LEN} characters, got {len(name)}")
    if any(not ch.isprintable() for ch in name):
        raise KeySpecError("name", "must not contain control characters")
    return name


def validate_scopes(scopes: object) -> frozenset[str]:
    """A list of scopes (a lone string counts as one); None: the default."""
    allowed = ", ".join(sorted(SCOPES))
    if scopes is None:
        return frozenset(DEFAULT_SCOPES)
    if isinstance(scopes, str):
        scopes = [scopes]
    if not isinstance(scopes, (list, tuple)):
        raise KeySpecError(
            "scopes", f"must be a list of scopes ({allowed}), got {type(scopes).__name__}"
        )
    bad = [s for s in scopes if not isinstance(s, str) or s not in SCOPES]
    if bad:
        shown = ", ".join(_show(s) for s in bad[:3]) + (", ..." if len(bad) > 3 else "")
        raise KeySpecError("scopes", f"unknown scope(s) {shown}; allowed: {allowed}")
    if not scopes:
        raise KeySpecError("scopes", f"at least one scope is needed: {allowed}")
    return frozenset(scopes)


def validate_limit(field_name: str, value: object) -> int | None:
    """rpm or tpm: a whole number from 1 to its maximum, or None (no limit)."""
    maximum = _LIMIT_MAXIMA[field_name]
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= maximum:
        return value
    raise KeySpecError(
        field_name,
        f"must be a whole number from 1 to {maximum}, or unset for no limit; got {_show(value)}",
    )


def validate_priority(value: object) -> Priority:
    if value is None or value == "interactive":
        return "interactive"
    if value == "batch":
        return "batch"
    raise KeySpecError("priority", f"must be one of {', '.join(PRIORITIES)}, got {_show(value)}")


def validate_expires_days(value: object) -> float | None:
    """Days until the key expires: above 0, at most MAX_EXPIRES_DAYS; None: never."""
    if value is None:
        return None
    # Compared before any float(): a huge int would overflow it; NaN fails both bounds.
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= MAX_EXPIRES_DAYS
    ):
        raise KeySpecError(
            "expires_days",
            f"must be a number of days above 0 and at most {MAX_EXPIRES_DAYS}, or unset "
            f"for never; got {_show(value)}",
        )
    return float(value)


def validate_key_id(value: object) -> str:
    """A key's public id as `keys list` shows it (8 hex characters; ASCII only, case and
    surrounding spaces forgiven), in its stored lower-case form."""
    text = value.strip() if isinstance(value, str) else None
    if text is None or not _ID_INPUT_RE.fullmatch(text):
        raise KeySpecError(
            "id", f"must be a key id: 8 hex characters as `keys list` shows; got {_show(value)}"
        )
    return text.lower()


# --- the file format -------------------------------------------------------------------


def _parse_record(item: object, where: str) -> KeyRecord:
    if not isinstance(item, dict):
        raise ValueError(f"{where}: must be an object, got {type(item).__name__}")

    def need(key: str) -> Any:
        if key not in item:
            raise ValueError(f"{where}: missing {key!r}")
        return item[key]

    key_id, name, scopes = need("id"), need("name"), need("scopes")
    rpm, tpm, priority = need("rpm"), need("tpm"), need("priority")
    created_at, expires_at, key_hash = need("created_at"), need("expires_at"), need("key_hash")
    # The fields a user gives go through the same validators as `keys create` and the
    # admin API: a hand-edited file is held to the same bounds, with the same words.
    try:
        if not isinstance(key_id, str) or not _ID_RE.fullmatch(key_id):
            raise KeySpecError("id", f"must be 8 lower-case hex characters, got {_show(key_id)}")
        record = KeyRecord(
            id=key_id,
            name=validate_name(name),
            scopes=validate_scopes(scopes),
            rpm=validate_limit("rpm", rpm),
            tpm=validate_limit("tpm", tpm),
            priority=validate_priority(priority),
            created_at=_stored_time("created_at", created_at),
            expires_at=None if expires_at is None else _stored_time("expires_at", expires_at),
            key_hash=key_hash if isinstance(key_hash, str) else "",
        )
        if not _HASH_RE.fullmatch(record.key_hash):
            raise KeySpecError("key_hash", "must be 64 lower-case hex characters (sha256)")
    except KeySpecError as exc:
        raise ValueError(f"{where}.{exc.field}: {exc.reason}") from None
    return record


def _stored_time(field_name: str, value: object) -> float:
    """A Unix time from the file: a finite number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int too large for a float
            number = float(value)
            if math.isfinite(number):
                return number
    raise KeySpecError(field_name, f"must be a number (Unix time), got {_show(value)}")


def parse_keys_document(data: bytes, source: str) -> dict[str, KeyRecord]:
    """Records by id from the bytes of a keys file; KeysFileError naming the problem."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise KeysFileError(f"keys file {source} is not UTF-8 ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise KeysFileError(f"keys file {source} is not valid JSON ({exc})") from None
    try:
        if not isinstance(doc, dict):
            raise ValueError(f'must be an object {{"version": {FILE_VERSION}, "keys": [...]}}')
        if doc.get("version") != FILE_VERSION:
            raise ValueError(f"version = {doc.get('version')!r}: must be {FILE_VERSION}")
        items = doc.get("keys")
        if not isinstance(items, list):
            raise ValueError(f"keys = {items!r}: must be a list")
        records: dict[str, KeyRecord] = {}
        for i, item in enumerate(items):
            record = _parse_record(item, f"keys[{i}]")
            if record.id in records:
                raise ValueError(f"keys[{i}].id = {record.id!r}: duplicate id")
            records[record.id] = record
    except ValueError as exc:
        raise KeysFileError(f"keys file {source} is malformed: {exc}") from None
    return records


def render_keys_document(records: Iterable[KeyRecord]) -> bytes:
    doc = {"version": FILE_VERSION, "keys": [r.stored_dict() for r in records]}
    try:
        # allow_nan=False: json.dumps would write Infinity/NaN, which is not JSON and
        # would leave a file that every later read refuses. The validators keep such
        # values out; this is the last line should one slip past them.
        text = json.dumps(doc, indent=2, allow_nan=False)
    except ValueError as exc:
        raise KeysFileError(
            f"refusing to write a keys file with a non-finite number ({exc})"
        ) from None
    return (text + "\n").encode("utf-8")


# --- files -----------------------------------------------------------------------------


def _ensure_dir(directory: Path) -> None:
    """Create the directory 0700 if missing (its parents with the usual mode)."""
    if directory.is_dir():
        return
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=0o700)
        os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
    except FileExistsError:
        if not directory.is_dir():
            raise KeysFileError(f"{directory} exists and is not a directory") from None
    except OSError as exc:
        raise KeysFileError(
            f"cannot create directory {directory} ({exc.strerror or exc})"
        ) from None


# Files are opened without following a symbolic link in their last component, and never
# block on a FIFO: the directory belongs to the service account, so when root runs
# `sudo llm-appliance keys ...` anything in it may have been planted there.
_SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _owner_reference(path: Path) -> tuple[int, int] | None:
    """Whose file this should stay: the file's owner when it is a plain file of its own
    (lstat: a symlink planted in its place must not choose), else the directory's."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            return st.st_uid, st.st_gid
    with contextlib.suppress(OSError):
        st = os.stat(path.parent)
        return st.st_uid, st.st_gid
    return None


def _match_owner(fd: int, path: Path) -> None:
    """When root edits the daemon's files (`sudo llm-appliance keys ...`), keep them the
    daemon's: a 0600 file that root took over would lock the service user out. ``fd``
    must be a file this process made or checked (see :func:`_check_lock_file`)."""
    if os.geteuid() != 0:
        return
    ref = _owner_reference(path)
    if ref is not None and ref != (0, 0):
        with contextlib.suppress(OSError):
            os.fchown(fd, *ref)


def _refuse_link(path: Path, what: str) -> KeysFileError:
    return KeysFileError(
        f"refusing to use {what} {path}: it is a symbolic link, which the appliance never "
        "makes (remove it and try again)"
    )


def _check_lock_file(fd: int, lock_path: Path, keys_path: Path) -> None:
    """The lock file opened is one the appliance could have made: a regular file with one
    link, owned by us or by the keys file's owner. Anything else (a hard link to another
    file, a device, someone else's file) is refused before it is chowned or locked."""
    st = os.fstat(fd)
    ref = _owner_reference(keys_path)
    owners = {os.geteuid()} | ({ref[0]} if ref else set())
    if not stat.S_ISREG(st.st_mode):
        problem = "it is not a regular file"
    elif st.st_nlink != 1:
        problem = f"it has {st.st_nlink} hard links (another file's content)"
    elif st.st_uid not in owners:
        problem = f"it belongs to uid {st.st_uid}, not to the keys file's owner"
    else:
        return
    raise KeysFileError(f"refusing to use lock file {lock_path}: {problem} (remove it)")


def _lock_error(keys_path: Path, lock_path: Path, exc: OSError) -> KeysFileError:
    return KeysFileError(
        f"cannot lock keys file {keys_path} (lock file {lock_path}: {exc.strerror or exc})"
    )


def _open_lock_file(lock_path: Path, keys_path: Path) -> int:
    """Open (creating it 0600 if missing) the lock file, never through a symlink; the fd
    is checked with :func:`_check_lock_file`. KeysFileError naming the file otherwise."""
    flags = os.O_RDWR | _SAFE_OPEN
    for _ in range(3):  # it may vanish or appear between the two opens
        try:
            return os.open(lock_path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # O_EXCL also fails on a symlink: the next open says which
        except OSError as exc:
            raise _lock_error(keys_path, lock_path, exc) from None
        try:
            fd = os.open(lock_path, flags)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refuse_link(lock_path, "lock file") from None
            raise _lock_error(keys_path, lock_path, exc) from None
        try:
            _check_lock_file(fd, lock_path, keys_path)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise KeysFileError(f"cannot lock keys file {keys_path}: {lock_path} keeps changing")


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` so readers see the old or the new file, never half.

    The temp file is created with ``mode`` from the start (O_EXCL), so the content is never
    readable by others, not even for a moment. Raises KeysFileError naming the file.
    """
    directory = path.parent
    _ensure_dir(directory)
    tmp = directory / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        # O_EXCL: a new file of ours, never an existing one or a symlink's target.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE_OPEN, mode)
    except OSError as exc:
        raise KeysFileError(
            f"cannot write {path} (creating a file in {directory}: {exc.strerror or exc})"
        ) from None
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have taken bits; never adds any here
            _match_owner(fd, path)
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise KeysFileError(f"cannot write {path} ({exc.strerror or exc})") from None
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return  # the rename happened; only its durability across a power cut is unsure
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


class KeyStore:
    """The keys in force, loaded from (and saved to) one keys file.

    Thread-safe for the daemon (the watcher swaps records on the loop while an admin
    endpoint may ``create`` in a worker thread) and process-safe against the CLI (flock).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._records: dict[str, KeyRecord] = {}
        self._signature: Signature | None = None
        self._digest: str | None = None
        self._mutex = threading.Lock()

    # -- reading

    @property
    def records(self) -> tuple[KeyRecord, ...]:
        """The keys in force, in file order (new keys are appended: oldest first)."""
        return tuple(self._records.values())

    @property
    def signature(self) -> Signature | None:
        """(st_mtime_ns, st_size, st_ino) of the file the records came from; None: no file."""
        return self._signature

    @property
    def digest(self) -> str | None:
        """sha256 of the bytes the records came from; None: no file."""
        return self._digest

    def get(self, key_id: str) -> KeyRecord | None:
        return self._records.get(key_id)

    def read(self) -> tuple[bytes | None, Signature | None]:
        """The file's bytes and signature, (None, None) when it does not exist."""
        try:
            # Never through a symlink: the appliance always writes a plain file (by
            # rename), and root must not be made to read some other file as keys.
            fd = os.open(self.path, os.O_RDONLY | _SAFE_OPEN)
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refuse_link(self.path, "keys file") from None
            raise KeysFileError(
                f"keys file {self.path} cannot be read ({exc.strerror or exc})"
            ) from None
        try:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise KeysFileError(
                        f"keys file {self.path} cannot be read (not a regular file)"
                    )
                data = f.read()
        except OSError as exc:
            raise KeysFileError(
                f"keys file {self.path} cannot be read ({exc.strerror or exc})"
            ) from None
        if st.st_mode & 0o077:
            log.warning(
                "keys file %s has mode %04o; it should be 0600 (it will be on the next change)",
                self.path,
                stat.S_IMODE(st.st_mode),
            )
        return data, (st.st_mtime_ns, st.st_size, st.st_ino)

    def apply(self, data: bytes | None, signature: Signature | None) -> None:
        """Put the keys in ``data`` in force (None: no keys). On KeysFileError nothing
        changes: the keys in force stay."""
        records = {} if data is None else parse_keys_document(data, str(self.path))
        with self._mutex:
            self._records = records
            self._signature = signature
            self._digest = None if data is None else hashlib.sha256(data).hexdigest()

    def load(self) -> None:
        """(Re)read the file; a missing file means no keys. KeysFileError keeps the old."""
        data, signature = self.read()
        self.apply(data, signature)

    # -- authentication

    def lookup(
        self, presented: str, now: float | None = None
    ) -> tuple[KeyRecord | None, LookupReason]:
        """(record, "ok") for a valid key; (None, "unknown" | "expired" | "malformed")
        otherwise. Revoked keys are gone from the file, so they are "unknown". The record
        is returned only with "ok", so ``if record:`` is a safe test."""
        key_id = parse_key_id(presented)
        if key_id is None:
            return None, "malformed"
        record = self._records.get(key_id)
        presented_hash = hash_key(presented)
        if record is None:
            hmac.compare_digest(presented_hash, _DUMMY_HASH)
            return None, "unknown"
        if not hmac.compare_digest(presented_hash, record.key_hash):
            return None, "unknown"
        if record.is_expired(time.time() if now is None else now):
            return None, "expired"
        return record, "ok"

    def authenticate(self, presented: str, now: float | None = None) -> KeyRecord | None:
        return self.lookup(presented, now)[0]

    # -- changing

    @contextlib.contextmanager
    def locked(self, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
        """Exclusive flock on the sibling lock file, for a read-modify-write. Not
        re-entrant."""
        _ensure_dir(self.path.parent)
        fd = _open_lock_file(self.lock_path, self.path)
        try:
            _match_owner(fd, self.path)  # the keys file's owner, else the directory's
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise KeysFileError(
                            f"keys file {self.path} stayed locked by another "
                            f"process for {timeout_s:g} s"
                        ) from None
                    time.sleep(0.05)
                except OSError as exc:
                    raise KeysFileError(
                        f"cannot lock keys file {self.path} ({exc.strerror or exc})"
                    ) from None
            yield
        finally:
            os.close(fd)  # releases the lock

    def save(self) -> None:
        """Write the records in force to the file (atomically, 0600)."""
        with self._mutex:
            records = self.records
        data = render_keys_document(records)
        atomic_write(self.path, data)
        try:
            st = os.stat(self.path)
            signature: Signature | None = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            signature = None
        with self._mutex:
            self._signature = signature
            self._digest = hashlib.sha256(data).hexdigest()

    def new_key(
        self,
        name: object,
        scopes: object = None,
        rpm: object = None,
        tpm: object = None,
        priority: object = "interactive",
        expires_days: object = None,
        now: float | None = None,
    ) -> tuple[KeyRecord, str]:
        """A validated new record and its full key, not yet added or saved."""
        rec_name = validate_name(name)
        rec_scopes = validate_scopes(scopes)
        rec_rpm, rec_tpm = validate_limit("rpm", rpm), validate_limit("tpm", tpm)
        rec_priority = validate_priority(priority)
        days = validate_expires_days(expires_days)
        now = time.time() if now is None else now
        key_id = secrets.token_hex(4)
        while key_id in self._records:
            key_id = secrets.token_hex(4)
        key = f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
        record = KeyRecord(
            id=key_id,
            name=rec_name,
            scopes=rec_scopes,
            rpm=rec_rpm,
            tpm=rec_tpm,
            priority=rec_priority,
            created_at=round(now, 3),
            expires_at=None if days is None else round(now + days * 86400, 3),
            key_hash=hash_key(key),
        )
        return record, key

    def _add(self, record: KeyRecord) -> None:
        with self._mutex:
            self._records = {**self._records, record.id: record}

    def create(
        self,
        name: object,
        scopes: object = None,
        rpm: object = None,
        tpm: object = None,
        priority: object = "interactive",
        expires_days: object = None,
    ) -> tuple[KeyRecord, str]:
        """Add a key and save; returns (record, full key ``sk-la-<id>-<secret>``). The full
        key exists only in this return value. KeySpecError for bad arguments (nothing is
        written), KeysFileError when the file cannot be read or written."""
        self.new_key(name, scopes, rpm, tpm, priority, expires_days)  # validate before locking
        with self.locked():
            self.load()  # another process may have changed it; a corrupt file stops here
            record, key = self.new_key(name, scopes, rpm, tpm, priority, expires_days)
            self._add(record)
            self.save()
        return record, key

    def revoke(self, key_id: str) -> bool:
        """Remove a key and save; False when no key has that id."""
        with self.locked():
            self.load()
            if key_id not in self._records:
                return False
            with self._mutex:
                self._records = {k: r for k, r in self._records.items() if k != key_id}
            self.save()
        return True


# --- the first admin key ---------------------------------------------------------------


def ensure_admin_key(store: KeyStore, logger: logging.Logger | None = None) -> Path | None:
    """On a first start (no keys file, or no keys in it) make one admin key named "admin",
    write it to ``admin.key`` beside the keys file (0600) and return that path; else None.

    The secret is never logged. admin.key is written before the keys file, so a crash in
    between only means a fresh key on the next start, never an admin locked out.
    Raises KeysFileError for a corrupt or unwritable keys file.
    """
    logger = logger or log
    with store.locked():
        store.load()
        if store.records:
            return None
        record, key = store.new_key("admin", ["admin"])
        admin_path = store.path.with_name(ADMIN_KEY_FILE)
        atomic_write(admin_path, (key + "\n").encode("utf-8"))
        store._add(record)
        store.save()
    logger.warning(
        "no API keys yet: created admin key %s; its secret is in %s (mode 0600). "
        "Use it to create keys (`llm-appliance keys create`), then keep it safe or "
        "delete the file",
        record.id,
        admin_path,
    )
    return admin_path


# --- hot reload ------------------------------------------------------------------------


class KeyWatcher:
    """Polls the keys file and puts its keys in force when it changes; ``reload_now`` for
    SIGHUP. A corrupt or unreadable file keeps the last good keys and is logged once per
    distinct content. Never raises out of its loop."""

    def __init__(
        self, store: KeyStore, interval_s: float = 1.0, logger: logging.Logger | None = None
    ) -> None:
        self.store = store
        self.interval_s = interval_s
        self.log = logger or log
        self._seen: Signature | None = store.signature
        self._reported: object = None  # the problem last logged, to log each one once
        self._task: asyncio.Task[None] | None = None

    def _stat(self) -> Signature | None:
        try:
            st = os.stat(self.store.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _report(self, problem: object, message: str) -> None:
        if problem != self._reported:
            self._reported = problem
            self.log.error("%s; the last good keys stay in force", message)

    def poll(self, force: bool = False) -> bool:
        """One check. True when the keys in force are the file's; False when the file is
        bad (the last good keys stay in force)."""
        try:
            current = self._stat()
        except OSError as exc:
            self._report(
                ("stat", str(exc)),
                f"keys file {self.store.path} is invalid (cannot stat: {exc.strerror or exc})",
            )
            return False
        if not force and current == self._seen and self._reported is None:
            return True
        if not force and current == self._seen:
            return False  # unchanged and still bad; already reported
        self._seen = current
        try:
            data, signature = self.store.read()
        except KeysFileError as exc:
            self._report(("read", str(exc)), f"keys file {self.store.path} is invalid ({exc})")
            return False
        if data is None:
            had = len(self.store.records)
            self.store.apply(None, None)
            if had or self._reported is not None:
                self.log.warning(
                    "keys file %s is gone: no key is accepted until it is back "
                    "(a restart creates a new admin key)",
                    self.store.path,
                )
            self._reported = None
            return True
        digest = hashlib.sha256(data).hexdigest()
        if digest == self.store.digest and not force:
            self._reported = None
            return True
        try:
            self.store.apply(data, signature)
        except KeysFileError as exc:
            self._report(digest, f"keys file {self.store.path} is invalid ({exc})")
            return False
        self._reported = None
        self.log.info(
            "keys file %s reloaded: %d key(s) in force", self.store.path, len(self.store.records)
        )
        return True

    def reload_now(self) -> bool:
        """Re-read the file now (SIGHUP). True when its keys are in force."""
        try:
            return self.poll(force=True)
        except Exception:  # pragma: no cover - a bug; a reload must not kill the caller
            self.log.exception("reloading keys file %s failed", self.store.path)
            return False

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.poll()
            except Exception:  # pragma: no cover - a bug; keep watching regardless
                self.log.exception("checking keys file %s failed", self.store.path)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._seen = self.store.signature
            self._task = asyncio.get_running_loop().create_task(self._run(), name="keys-watcher")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
