"""``adapters.json``: the admin's LoRA adapters, kept beside the keys file across restarts.

``{"format": 1, "saved": <unix time>, "adapters": [{"name", "model", "path"}, ...]}``,
written 0600 and atomically (:func:`appliance.fsutil.atomic_write`: never through a
link). It is read as the keys file is read: never through a symbolic link, a regular
file only, never blocking on a FIFO, bounded in size; a mode open to others is said
(the next change writes it 0600). A file that cannot be read as one is a
:class:`KeptFileError` naming the file, what is wrong and what to do; the daemon then
serves none of it and refuses the admin's changes until it is fixed, so that a change
never writes over the adapters it could not read.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.fsutil import SAFE_OPEN, atomic_write

ADAPTERS_FILE = "adapters.json"
FORMAT = 1
MAX_FILE_BYTES = 4 * 1024 * 1024
FIX = "fix it, or move it away (its adapters are then forgotten: add them again)"


class KeptFileError(ValueError):
    """adapters.json cannot be used; the message names it, why, and the fix."""


@dataclass(frozen=True)
class Kept:
    """An adapter the admin added: its base model (canonical name) and folder."""

    name: str
    model: str
    path: str


def adapters_path(keys_file: str) -> Path:
    return Path(keys_file).with_name(ADAPTERS_FILE)


def read_file(path: Path) -> tuple[list[Kept], str | None]:
    """The entries of ``path`` ([] when there is none) and a warning about its mode (None:
    fine); KeptFileError when it cannot be read as an adapters file."""
    try:
        fd = os.open(path, os.O_RDONLY | SAFE_OPEN)
    except FileNotFoundError:
        return [], None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise KeptFileError(
                f"{path} is a symbolic link; the appliance writes a plain file: remove the link"
            ) from None
        raise KeptFileError(f"{path} cannot be read ({exc.strerror or exc}); {FIX}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise KeptFileError(f"{path} is not a regular file; {FIX}")
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise KeptFileError(f"{path} is larger than {MAX_FILE_BYTES} bytes; {FIX}")
    try:
        kept = parse(raw)
    except KeptFileError as exc:
        raise KeptFileError(f"{path} is not an adapters file ({exc}); {FIX}") from None
    warning = None
    if st.st_mode & 0o077:
        mode = stat.S_IMODE(st.st_mode)
        warning = f"{path} has mode {mode:04o}; it should be 0600 (it will be on the next change)"
    return kept, warning


def parse(raw: bytes) -> list[Kept]:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise KeptFileError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise KeptFileError(f'not {{"format": {FORMAT}, "adapters": [...]}}')
    entries = doc.get("adapters")
    if not isinstance(entries, list):
        raise KeptFileError("'adapters' is not a list")
    return [_entry(i, e) for i, e in enumerate(entries)]


def _entry(i: int, e: Any) -> Kept:
    fields = ("name", "model", "path")
    if not isinstance(e, dict) or not all(isinstance(e.get(f), str) for f in fields):
        raise KeptFileError(f"adapters[{i}] is not an object of strings name, model, path")
    return Kept(e["name"], e["model"], e["path"])


def write_file(path: Path, kept: list[Kept]) -> None:
    """``path`` replaced by these entries (FileWriteError or OSError when it cannot be)."""
    entries = [{"name": k.name, "model": k.model, "path": k.path} for k in kept]
    data = json.dumps({"format": FORMAT, "saved": time.time(), "adapters": entries}, indent=1)
    atomic_write(path, data.encode() + b"\n")
