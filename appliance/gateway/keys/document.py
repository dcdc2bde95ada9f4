"""A key's record and the keys file's content: ``{"version": 1, "keys": [record, ...]}``.

Parsing and rendering only, no I/O: the store reads and writes the bytes, the doctor
parses them too. Every field of a record goes through its validator in
:mod:`~appliance.gateway.keys.fields`, so a hand-edited file is held to the same bounds,
with the same words, as ``keys create`` and the admin API; a problem is a
:class:`KeysFileError` naming the file, the record and the field.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from appliance.gateway.keys.errors import KeysFileError, KeySpecError
from appliance.gateway.keys.fields import (
    Priority,
    validate_fallback,
    validate_key_hash,
    validate_limit,
    validate_max_inflight,
    validate_models,
    validate_name,
    validate_priority,
    validate_scopes,
    validate_stored_id,
    validate_stored_time,
)

FILE_VERSION = 1


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
    fallback: bool = True  # its requests may go to their model's fallback model
    max_inflight: int = 0  # its requests in flight at once, beyond: they wait; 0 = no cap
    models: tuple[str, ...] | None = None  # the models it may use; None: every model

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
            "fallback": self.fallback,
            "max_inflight": self.max_inflight,
            "models": None if self.models is None else list(self.models),
        }

    def stored_dict(self) -> dict[str, Any]:
        return {**self.public_dict(), "key_hash": self.key_hash}


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
    # Arguments are evaluated in order, so the first bad field is the one reported.
    try:
        return KeyRecord(
            id=validate_stored_id(key_id),
            name=validate_name(name),
            scopes=validate_scopes(scopes),
            rpm=validate_limit("rpm", rpm),
            tpm=validate_limit("tpm", tpm),
            priority=validate_priority(priority),
            created_at=validate_stored_time("created_at", created_at),
            expires_at=(
                None if expires_at is None else validate_stored_time("expires_at", expires_at)
            ),
            key_hash=validate_key_hash(key_hash),
            # absent in files written before the field existed: allowed, as before
            fallback=validate_fallback(item.get("fallback")),
            max_inflight=validate_max_inflight(item.get("max_inflight")),
            models=validate_models(item.get("models")),
        )
    except KeySpecError as exc:
        raise ValueError(f"{where}.{exc.field}: {exc.reason}") from None


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
