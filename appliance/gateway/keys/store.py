"""The keys in force, and the one keys file they are loaded from and saved to.

:class:`KeyStore` reads the file (never through a symlink, never blocking on a FIFO: see
:mod:`appliance.fsutil` for why), parses it (:mod:`~appliance.gateway.keys.document`),
authenticates presented keys against it (:mod:`~appliance.gateway.keys.format`), and
changes it: every ``create``/``revoke`` holds the lock
(:mod:`~appliance.gateway.keys.lock`), re-reads the file under it and writes it back
atomically, mode 0600 (:func:`appliance.fsutil.atomic_write`), so a reader sees the old
file or the new one, never half of one, and two writers never lose each other's keys.
When root edits the daemon's file it keeps its owner.

A corrupt file is never overwritten and never replaces good keys: ``apply`` changes
nothing when parsing fails. A missing file means no keys (fail closed). A file that
cannot be used while no key is in force (at start, or after the file was removed) leaves
the store *refusing* (:attr:`KeyStore.problem`): the gateway then answers every key with
503 ``keys_file_error`` rather than 401, since no key could be checked at all.

A change that cannot be written (a full disk: ENOSPC) leaves everything as it was: the
file byte for byte (:func:`appliance.fsutil.atomic_write` never replaces it with a half
one), and the keys in force (the new record is taken back out, a revoked one put back),
so the daemon never honours a key the file does not hold. :attr:`KeyStore.writes` counts
and shows such failures (``appliance_state_write_errors_total{file="keys.json"}``).

File I/O here is blocking (small files, but an fsync and a lock): from the event loop,
run ``create``/``revoke`` through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from appliance import fsutil
from appliance.gateway.keys.document import KeyRecord, parse_keys_document, render_keys_document
from appliance.gateway.keys.errors import KeysFileError
from appliance.gateway.keys.fields import (
    validate_expires_days,
    validate_fallback,
    validate_limit,
    validate_max_inflight,
    validate_models,
    validate_name,
    validate_priority,
    validate_scopes,
)
from appliance.gateway.keys.format import hash_key, hash_matches, new_key, new_key_id, parse_key_id
from appliance.gateway.keys.lock import LOCK_TIMEOUT_S, exclusive_lock, refuse_link
from appliance.state_writes import WriteHealth

# One logger for the whole package: log lines keep the name they had as one module.
log = logging.getLogger("appliance.gateway.keys")

LookupReason = Literal["ok", "unknown", "expired", "malformed"]
Signature = tuple[int, int, int]  # (st_mtime_ns, st_size, st_ino)


def mode_warning(path: Path, mode: int) -> str:
    """What to say about a keys file whose mode lets others in (``mode & 0o077``)."""
    return (
        f"keys file {path} has mode {stat.S_IMODE(mode):04o}; "
        "it should be 0600 (it will be on the next change)"
    )


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """:func:`appliance.fsutil.atomic_write`, failing with a KeysFileError (same message),
    the error every caller of the keys store handles."""
    try:
        fsutil.atomic_write(path, data, mode)
    except fsutil.FileWriteError as exc:
        raise KeysFileError.from_write(exc) from None


class KeyStore:
    """The keys in force, loaded from (and saved to) one keys file.

    Thread-safe for the daemon (the watcher swaps records on the loop while an admin
    endpoint may ``create`` in a worker thread) and process-safe against the CLI (flock).
    """

    def __init__(self, path: Path, logger: logging.Logger | None = None) -> None:
        """``logger``: where a failed write is said, once per episode (the daemon's
        journal); None for the CLI, which prints its own one-line error."""
        self.path = Path(path)
        self.writes = WriteHealth(
            "keys.json", self.path, logger, "keys cannot be created or revoked until it can"
        )
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._records: dict[str, KeyRecord] = {}
        self._signature: Signature | None = None
        self._digest: str | None = None
        self._problem: str | None = None
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

    @property
    def problem(self) -> str | None:
        """Why no key can be checked: the file cannot be read or parsed and no key is in
        force (see :meth:`refuse_all`); None once a file (or no file) is put in force."""
        return self._problem

    def get(self, key_id: str) -> KeyRecord | None:
        return self._records.get(key_id)

    def read(self) -> tuple[bytes | None, Signature | None]:
        """The file's bytes and signature, (None, None) when it does not exist. A mode
        open to others is logged (the next change writes it 0600)."""
        data, st = self.read_file()
        if st is None:
            return None, None
        if st.st_mode & 0o077:
            log.warning("%s", mode_warning(self.path, st.st_mode))
        return data, (st.st_mtime_ns, st.st_size, st.st_ino)

    def read_file(self) -> tuple[bytes | None, os.stat_result | None]:
        """The file's bytes and its stat, (None, None) when it does not exist; nothing
        logged (``check-config`` reports the mode itself). KeysFileError, with ``errno``
        set, when it cannot be read."""
        try:
            # Never through a symlink: the appliance always writes a plain file (by
            # rename), and root must not be made to read some other file as keys.
            fd = os.open(self.path, os.O_RDONLY | fsutil.SAFE_OPEN)
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise refuse_link(self.path, "keys file") from None
            raise self._unreadable(exc) from None
        try:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise KeysFileError(
                        f"keys file {self.path} cannot be read (not a regular file)"
                    )
                data = f.read()
        except OSError as exc:
            raise self._unreadable(exc) from None
        return data, st

    def _unreadable(self, exc: OSError) -> KeysFileError:
        error = KeysFileError(f"keys file {self.path} cannot be read ({exc.strerror or exc})")
        error.errno = exc.errno
        return error

    def apply(self, data: bytes | None, signature: Signature | None) -> None:
        """Put the keys in ``data`` in force (None: no keys). On KeysFileError nothing
        changes: the keys in force stay."""
        records = {} if data is None else parse_keys_document(data, str(self.path))
        with self._mutex:
            self._records = records
            self._signature = signature
            self._digest = None if data is None else hashlib.sha256(data).hexdigest()
            self._problem = None

    def refuse_all(self, problem: str) -> None:
        """No key is in force and the file cannot be used (``problem`` says why): every
        key is refused as unverifiable until a file (or no file) is put in force. Only
        for a store with no key in force: good keys are never dropped for a bad file."""
        with self._mutex:
            if not self._records:
                self._problem = problem

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
        # Compared even when the id is unknown, so both cases take the same time.
        matched = hash_matches(hash_key(presented), None if record is None else record.key_hash)
        if record is None or not matched:
            return None, "unknown"
        if record.is_expired(time.time() if now is None else now):
            return None, "expired"
        return record, "ok"

    def authenticate(self, presented: str, now: float | None = None) -> KeyRecord | None:
        return self.lookup(presented, now)[0]

    # -- changing

    def locked(self, timeout_s: float = LOCK_TIMEOUT_S) -> contextlib.AbstractContextManager[None]:
        """Exclusive flock on the sibling lock file, for a read-modify-write. Not
        re-entrant."""
        return exclusive_lock(self.lock_path, self.path, timeout_s)

    def save(self) -> None:
        """Write the records in force to the file (atomically, 0600)."""
        with self._mutex:
            records = self.records
        data = render_keys_document(records)
        try:
            fsutil.atomic_write(self.path, data)
        except fsutil.FileWriteError as exc:
            self.writes.failed(exc)
            raise KeysFileError.from_write(exc) from None
        self.writes.succeeded()
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
        fallback: object = None,
        max_inflight: object = None,
        models: object = None,
    ) -> tuple[KeyRecord, str]:
        """A validated new record and its full key, not yet added or saved."""
        rec_name = validate_name(name)
        rec_scopes = validate_scopes(scopes)
        rec_rpm, rec_tpm = validate_limit("rpm", rpm), validate_limit("tpm", tpm)
        rec_priority = validate_priority(priority)
        days = validate_expires_days(expires_days)
        rec_fallback = validate_fallback(fallback)
        rec_max_inflight = validate_max_inflight(max_inflight)
        rec_models = validate_models(models)
        now = time.time() if now is None else now
        key_id = new_key_id(self._records)
        key = new_key(key_id)
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
            fallback=rec_fallback,
            max_inflight=rec_max_inflight,
            models=rec_models,
        )
        return record, key

    def add(self, record: KeyRecord) -> None:
        """Put ``record`` in force, not saved: for a caller holding :meth:`locked` that
        saves next (``create``, the first admin key)."""
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
        fallback: object = None,
        max_inflight: object = None,
        models: object = None,
    ) -> tuple[KeyRecord, str]:
        """Add a key and save; returns (record, full key ``sk-la-<id>-<secret>``). The full
        key exists only in this return value. KeySpecError for bad arguments (nothing is
        written), KeysFileError when the file cannot be read or written."""
        # validate before locking
        args = (name, scopes, rpm, tpm, priority, expires_days)
        extra = (fallback, max_inflight, models)
        self.new_key(*args, None, *extra)
        with self.locked():
            self.load()  # another process may have changed it; a corrupt file stops here
            record, key = self.new_key(*args, None, *extra)  # None: now
            with self._undo_on_failure():
                self.add(record)
                self.save()
        return record, key

    def revoke(self, key_id: str) -> bool:
        """Remove a key and save; False when no key has that id."""
        with self.locked():
            self.load()
            if key_id not in self._records:
                return False
            with self._undo_on_failure():
                with self._mutex:
                    self._records = {k: r for k, r in self._records.items() if k != key_id}
                self.save()
        return True

    @contextlib.contextmanager
    def _undo_on_failure(self) -> Iterator[None]:
        """Put the records in force back as they were when the change cannot be saved: the
        keys in force stay those of the file (which atomic_write left untouched)."""
        with self._mutex:
            before = self._records
        try:
            yield
        except KeysFileError:
            with self._mutex:
                self._records = before
            raise
