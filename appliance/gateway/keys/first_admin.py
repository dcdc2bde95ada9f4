"""The first admin key: how a fresh box gets its first way in.

On a first start (no keys file, or no keys in it) ``serve`` makes one admin key named
"admin" and writes its full key to ``admin.key`` beside the keys file (0600), where the
operator (and ``llm-appliance status``) finds it. The secret is never logged.

admin.key is written before the keys file, so a crash in between only means a fresh key
on the next start, never an admin locked out. It is written like the keys file (new file,
renamed over the old), so a symlink planted at ``admin.key`` is replaced, never written
through. Blocking I/O: from the event loop, run it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from appliance.audit import AuditLog
from appliance.gateway.keys.errors import KeysFileError
from appliance.gateway.keys.store import KeyStore, atomic_write

# One logger for the whole package: log lines keep the name they had as one module.
log = logging.getLogger("appliance.gateway.keys")

ADMIN_KEY_FILE = "admin.key"


def ensure_admin_key(
    store: KeyStore, logger: logging.Logger | None = None, audit: AuditLog | None = None
) -> Path | None:
    """On a first start (no keys file, or no keys in it) make one admin key named "admin",
    write it to ``admin.key`` beside the keys file (0600) and return that path; else None.

    The secret is never logged. admin.key is written before the keys file, so a crash in
    between only means a fresh key on the next start, never an admin locked out.
    Raises KeysFileError for a corrupt or unwritable keys file. ``audit`` records the
    key made (actor "system"), or the attempt that failed.
    """
    logger = logger or log
    audit = audit or AuditLog(None)
    with store.locked():
        store.load()
        if store.records:
            return None
        record, key = store.new_key("admin", ["admin"])
        admin_path = store.path.with_name(ADMIN_KEY_FILE)
        target = f"key:{record.id}"
        try:
            atomic_write(admin_path, (key + "\n").encode("utf-8"))
            store.add(record)
            store.save()
        except KeysFileError:
            audit.record("key.first_admin", target, "system", "error", name="admin")
            raise
    audit.record(
        "key.first_admin",
        target,
        "system",
        "ok",
        name="admin",
        scopes=["admin"],
        secret_file=str(admin_path),
    )
    logger.warning(
        "no API keys yet: created admin key %s; its secret is in %s (mode 0600). "
        "Use it to create keys (`llm-appliance keys create`), then keep it safe or "
        "delete the file",
        record.id,
        admin_path,
    )
    return admin_path
