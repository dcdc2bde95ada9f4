"""What a key looks like, how one is made, and how a presented one is checked.

A key reads ``sk-la-<id>-<secret>``: ``id`` is 8 lower-case hex characters, public (what
``keys list`` shows and ``keys revoke ID`` takes); ``secret`` is
``secrets.token_urlsafe(32)`` (256 random bits). Only ``sha256(full key)`` is stored, so
the keys file never holds a usable secret.

Why a fast hash: slow key-derivation functions (bcrypt, Argon2, ...) make each guess at a
*password* expensive; a 256-bit random secret cannot be enumerated at any speed of hash,
so a slow one would add no protection and cost every request tens of milliseconds of CPU.
docs/security.md ("Why a fast hash") says it at length.

Presented hashes are compared in constant time (``hmac.compare_digest``), and an unknown
id is compared against a dummy hash, so a wrong key takes the same time whether or not
its id exists.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Container

KEY_PREFIX = "sk-la-"
_MAX_PRESENTED_LEN = 200
_KEY_RE = re.compile(r"sk-la-([0-9a-f]{8})-([A-Za-z0-9_-]{16,128})")
# Compared against when the id is unknown, so both paths do the same work.
_DUMMY_HASH = hashlib.sha256(b"sk-la-00000000-unknown").hexdigest()


def hash_key(presented: str) -> str:
    """The stored form of a key: sha256 of the full key, hex."""
    return hashlib.sha256(presented.encode("utf-8")).hexdigest()


def parse_key_id(presented: str) -> str | None:
    """The public id inside a well-formed key, else None."""
    if len(presented) > _MAX_PRESENTED_LEN:
        return None
    m = _KEY_RE.fullmatch(presented)
    return m.group(1) if m else None


def hash_matches(presented_hash: str, stored_hash: str | None) -> bool:
    """Whether a presented key's hash is the stored one, in constant time. ``None`` (no
    key with that id) is compared against a dummy hash, so it costs the same and fails."""
    if stored_hash is None:
        hmac.compare_digest(presented_hash, _DUMMY_HASH)
        return False
    return hmac.compare_digest(presented_hash, stored_hash)


def new_key_id(taken: Container[str]) -> str:
    """A fresh public id (8 hex characters) that no key in ``taken`` has."""
    key_id = secrets.token_hex(4)
    while key_id in taken:
        key_id = secrets.token_hex(4)
    return key_id


def new_key(key_id: str) -> str:
    """A full key for ``key_id`` with a new 256-bit secret: ``sk-la-<id>-<secret>``."""
    return f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
