"""Finding an engine's model on disk and reading it as the service account would.

Models are never downloaded at run time: a model id is looked up in the local Hugging
Face hub caches only. Sizes count each blob once (the hub cache links snapshots to
blobs) and only the weights when there are any.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from appliance import paths
from appliance.config import Config
from appliance.doctor.result import Account, octal_mode

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def hf_cache_dirs(env: Mapping[str, str]) -> list[Path]:
    """Where a model id may already be cached (never downloaded: HF_HUB_OFFLINE=1)."""
    dirs = []
    if env.get("HF_HUB_CACHE"):
        dirs.append(Path(env["HF_HUB_CACHE"]))
    if env.get("HF_HOME"):
        dirs.append(Path(env["HF_HOME"]) / "hub")
    if env.get("XDG_CACHE_HOME"):
        dirs.append(Path(env["XDG_CACHE_HOME"]) / "huggingface" / "hub")
    # The unit's XDG_CACHE_HOME, and the usual default.
    dirs.append(Path("/var/cache/llm-appliance/huggingface/hub"))
    dirs.append(Path(env.get("HOME", "/")) / ".cache" / "huggingface" / "hub")
    return list(dict.fromkeys(dirs))


def find_cached_model(model_id: str, caches: Sequence[Path]) -> Path | None:
    """The snapshot folder of ``model_id`` in a Hugging Face hub cache, if any."""
    folder = "models--" + model_id.replace("/", "--")
    for cache in caches:
        snapshots = cache / folder / "snapshots"
        ref = cache / folder / "refs" / "main"
        try:
            if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
                return snapshots / ref.read_text().strip()
            found = sorted(p for p in snapshots.iterdir() if p.is_dir())
        except OSError:
            continue
        if found:
            return found[-1]
    return None


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


def locate_model(config: Config, home: Path, env: Mapping[str, str]) -> tuple[Path | None, str]:
    """(where the model is, how it was named) or (None, why it is not found)."""
    m = config.engine.model
    if not m:
        return paths.packaged_model(home), "the packaged model"
    if m.startswith(("/", "./", "../", "~")):
        return Path(m).expanduser(), f"engine.model = {m!r}"
    cached = find_cached_model(m, hf_cache_dirs(env))
    if cached is None:
        where = ", ".join(str(c) for c in hf_cache_dirs(env))
        return None, f"engine.model = {m!r} is not in the local Hugging Face cache ({where})"
    return cached, f"engine.model = {m!r} (cached)"
