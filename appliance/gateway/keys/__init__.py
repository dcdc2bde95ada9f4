"""API keys: the keys file, authentication, hot reload and the first admin key.

The code lives in :mod:`appliance.gateway.keys.store` for now, to be split by concern;
this package re-exports the names the rest of the appliance imports.
"""

from appliance.gateway.keys.store import (
    ADMIN_KEY_FILE,
    MAX_EXPIRES_DAYS,
    MAX_RPM,
    MAX_TPM,
    PRIORITIES,
    SCOPES,
    KeyRecord,
    KeysFileError,
    KeySpecError,
    KeyStore,
    KeyWatcher,
    atomic_write,
    ensure_admin_key,
    hash_key,
    parse_key_id,
    parse_keys_document,
    render_keys_document,
    required_scope,
    validate_key_id,
)

__all__ = [
    "ADMIN_KEY_FILE",
    "MAX_EXPIRES_DAYS",
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
    "ensure_admin_key",
    "hash_key",
    "parse_key_id",
    "parse_keys_document",
    "render_keys_document",
    "required_scope",
    "validate_key_id",
]
