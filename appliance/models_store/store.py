"""The model store: the folders ``models pull`` makes under the appliance's home
(``<home>/models/NAME``, beside the packaged models set-up prepares), what ``models
list`` shows and ``models remove`` deletes.

A pulled folder is complete once it holds :data:`PULL_RECORD` (written last): the
repository, the commit, every file with its size and checksum. A folder without it is a
pull still under way or interrupted: the next pull of it resumes.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config import Config
from appliance.config.model_places import locate, named_models

PULL_RECORD = ".llm-appliance-pull.json"
NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def store_dir(home: Path) -> Path:
    return home / "models"


def default_name(repo_id: str) -> str:
    """A store name from a repository id: its last part, lower case, other characters
    as "-" ("Qwen/Qwen2.5-Coder-7B-Instruct" -> "qwen2.5-coder-7b-instruct")."""
    tail = repo_id.rsplit("/", 1)[-1].lower()
    return re.sub(r"[^a-z0-9._-]+", "-", tail).strip("-.")[:64] or "model"


def check_name(name: str) -> str | None:
    """Why ``name`` cannot name a folder of the store, or None."""
    if not NAME_RE.fullmatch(name) or set(name) <= {"."}:
        return f"--name {name!r}: 1-64 of a-z 0-9 . _ -, starting with a letter or digit"
    return None


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (each once; the download cache left out)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != ".cache"]
        for name in files:
            try:
                st = (Path(root) / name).stat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def read_record(folder: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((folder / PULL_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass(frozen=True)
class StoredModel:
    """One folder of the store, as ``models list`` shows it."""

    name: str
    path: Path
    bytes: int
    source: str  # "Qwen/Qwen2.5-Coder-7B-Instruct@<commit>", "packaged", "incomplete pull"
    revision: str
    used_by: tuple[str, ...]  # the config's models that load it

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "bytes": self.bytes,
            "source": self.source,
            "revision": self.revision,
            "used_by": list(self.used_by),
        }


def users(config: Config, home: Path, env: Mapping[str, str]) -> dict[Path, list[str]]:
    """Each model folder the config names, and the config's models that load it."""
    out: dict[Path, list[str]] = {}
    eenv = {**env, **config.engine.env}
    for named in named_models(config):
        try:
            located = locate(named.value, home, eenv)
        except OSError:
            continue
        if located.path is not None:
            out.setdefault(located.path.resolve(), []).append(named.served)
    return out


def stored_models(config: Config, home: Path, env: Mapping[str, str]) -> list[StoredModel]:
    """Every model folder of the store, by name."""
    store = store_dir(home)
    try:
        folders = sorted(p for p in store.iterdir() if p.is_dir())
    except OSError:
        return []
    used = users(config, home, env)
    packaged = {paths.packaged_model(home, n).resolve(): n for n in paths.PACKAGED_MODELS}
    out = []
    for folder in folders:
        record = read_record(folder)
        if record is not None:
            source = f"{record.get('repo_id')}@{str(record.get('commit', ''))[:12]}"
            revision = str(record.get("revision") or "")
        elif folder.resolve() in packaged:
            source, revision = f"packaged:{packaged[folder.resolve()]}", ""
        elif (folder / ".cache" / "huggingface").is_dir():
            source, revision = "incomplete pull (`models pull` again resumes it)", ""
        else:
            source, revision = "copied in", ""
        name = folder.name
        out.append(
            StoredModel(
                name,
                folder,
                folder_bytes(folder),
                source,
                revision,
                tuple(used.get(folder.resolve(), [])),
            )
        )
    return out
