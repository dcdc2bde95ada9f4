"""Finding an engine's model on disk and reading it as the service account would.

Models are never downloaded at run time: a model id is looked up in the local Hugging
Face hub caches only (:mod:`appliance.config.model_places`, shared with check-config and
the daemon's start). Sizes count each blob once (the hub cache links snapshots to
blobs) and only the weights when there are any.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

from appliance.config.model_places import (
    Located,
    NamedModel,
    find_cached_model,
    hf_cache_dirs,
    locate,
)
from appliance.doctor.result import Account, octal_mode

__all__ = [
    "WEIGHT_SUFFIXES",
    "find_cached_model",
    "hf_cache_dirs",
    "locate_model",
    "may",
    "model_size",
    "unreadable",
]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _walk(path: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """Every entry under ``path`` (itself first), stat'ed through symlinks (the hub cache
    links snapshots to blobs)."""
    try:
        yield path, path.stat()
    except OSError:
        return
    if not path.is_dir():
        return
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            p = Path(root) / name
            try:
                yield p, p.stat()
            except OSError:
                continue


def may(account: Account, st: os.stat_result, want: int) -> bool:
    """Whether ``account`` has the ``want`` bits (4 read, 1 enter) by the mode bits."""
    if account.uid == 0:
        return True
    if st.st_uid == account.uid:
        bits = st.st_mode >> 6
    elif st.st_gid in account.groups or st.st_gid == account.gid:
        bits = st.st_mode >> 3
    else:
        bits = st.st_mode
    return bits & want == want


def unreadable(path: Path, account: Account) -> list[str]:
    """What under ``path`` (and on the way to it) ``account`` cannot read or enter."""
    bad = []
    for parent in reversed(path.absolute().parents):
        try:
            if not may(account, parent.stat(), 1):
                bad.append(f"{parent} (cannot enter)")
        except OSError:
            continue
    for p, st in _walk(path):
        want = 5 if stat.S_ISDIR(st.st_mode) else 4
        if not may(account, st, want):
            bad.append(f"{p} ({octal_mode(st.st_mode)}, owner {account.owner_name(st.st_uid)})")
    return bad


def model_size(path: Path) -> int:
    """Bytes on disk of the model's files (each blob once); weights only when it has any,
    so a folder's README or its original GGUF copy is not counted as weights."""
    seen: set[tuple[int, int]] = set()
    total = weights = 0
    for p, st in _walk(path):
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        total += st.st_size
        if p.suffix in WEIGHT_SUFFIXES:
            weights += st.st_size
    return weights or total


def locate_model(named: NamedModel, home: Path, env: Mapping[str, str]) -> tuple[Located, str]:
    """Where one model the config names is (:func:`appliance.config.model_places.locate`)
    and how to name it to a person."""
    located = locate(named.value, home, env)
    label = f"{named.key} = {named.value!r}" if named.value else "the packaged model"
    if located.how == "cached":
        label += " (cached)"
    return located, label
