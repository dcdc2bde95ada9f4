"""What ``check-config`` says about the keys file, by the daemon's own rules.

The file is read as the daemon reads it (:meth:`KeyStore.read_file`: never through a
symlink, a regular file only) and parsed by the daemon's parser
(:func:`~appliance.gateway.keys.document.parse_keys_document`), so check-config and the
daemon never disagree about a file:

- missing: fine, ``serve`` creates it with one admin key;
- a symlink, not a regular file, unreadable, or not a valid keys document: a problem
  (the daemon would start, but refuse every key until the file is fixed);
- a mode open to group or others: a warning (the daemon works, and writes the file 0600
  on its next change);
- not readable *by this user* (check-config run by someone who is neither the service
  user nor root, the state directory being 0700): a warning that it was not checked,
  since the daemon reads it as the service user.
"""

from __future__ import annotations

import errno
from pathlib import Path

from appliance.gateway.keys.document import parse_keys_document
from appliance.gateway.keys.errors import KeysFileError
from appliance.gateway.keys.store import KeyStore, mode_warning

FIX = (
    "restore it from a backup, or move it away (the daemon then starts with a new admin "
    "key in admin.key beside it)"
)


def check_keys_file(path: Path) -> tuple[list[str], list[str]]:
    """(problems, warnings) about the keys file at ``path``, each naming
    ``gateway.keys_file`` and the file."""
    where = f"gateway.keys_file = {str(path)!r}"
    try:
        data, st = KeyStore(path).read_file()
        if data is None or st is None:
            return [], []
        parse_keys_document(data, str(path))
    except KeysFileError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return [], [
                f"{where}: not checked, this user may not read it ({exc}); run check-config "
                "as the service user or root"
            ]
        return [f"{where}: {exc}; {FIX}"], []
    if st.st_mode & 0o077:
        return [], [f"{where}: {mode_warning(path, st.st_mode)}"]
    return [], []
