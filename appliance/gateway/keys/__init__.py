"""API keys: the keys file, authentication, hot reload and the first admin key.

One module per concern; this package re-exports the names the rest of the appliance
imports, so ``from appliance.gateway.keys import X`` is the way in:

=================  ===================================================================
``format``         what a key looks like (``sk-la-<id>-<secret>``), making one, hashing
                   it (sha256, and why a fast hash), the constant-time check
``fields``         one validator per field (name, scopes, rpm, tpm, priority,
                   expires_days, key id, stored fields) with fixed maxima and one
                   message; the scopes and which one each HTTP path needs
``document``       a key's record and the file's content, ``{"version": 1, "keys": []}``
``lock``           one writer at a time: the checked, never-followed ``.lock`` file
``store``          :class:`KeyStore`: the keys in force, read and saved atomically
``watcher``        :class:`KeyWatcher`: the daemon's reload on change and on SIGHUP
``first_admin``    the first admin key and ``admin.key``
``check``          what ``check-config`` says about the keys file (the daemon's rules)
``errors``         :class:`KeySpecError` (a bad field) and :class:`KeysFileError`
=================  ===================================================================

Generic file helpers (atomic replace, no-follow opens, keeping the owner) are in
:mod:`appliance.fsutil`. File I/O here is blocking (small files, but an fsync and a
lock): from the event loop, run ``create``/``revoke``/``ensure_admin_key`` through
``asyncio.to_thread``. The CLI is :mod:`appliance.keys_cli`.
"""

from appliance.gateway.keys.check import check_keys_file
from appliance.gateway.keys.document import KeyRecord, parse_keys_document, render_keys_document
from appliance.gateway.keys.errors import KeysFileError, KeySpecError
from appliance.gateway.keys.fields import (
    MAX_EXPIRES_DAYS,
    MAX_INFLIGHT,
    MAX_RPM,
    MAX_TPM,
    PRIORITIES,
    SCOPES,
    required_scope,
    validate_key_id,
)
from appliance.gateway.keys.first_admin import ADMIN_KEY_FILE, ensure_admin_key
from appliance.gateway.keys.format import hash_key, parse_key_id
from appliance.gateway.keys.store import KeyStore, atomic_write
from appliance.gateway.keys.watcher import KeyWatcher

__all__ = [
    "ADMIN_KEY_FILE",
    "MAX_EXPIRES_DAYS",
    "MAX_INFLIGHT",
    "MAX_RPM",
    "MAX_TPM",
    "PRIORITIES",
    "SCOPES",
    "KeyRecord",
    "KeySpecError",
    "KeyStore",
    "KeyWatcher",
    "KeysFileError",
    "atomic_write",
    "check_keys_file",
    "ensure_admin_key",
    "hash_key",
    "parse_key_id",
    "parse_keys_document",
    "render_keys_document",
    "required_scope",
    "validate_key_id",
]
