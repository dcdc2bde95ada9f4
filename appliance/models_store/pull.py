"""`models pull`: a Hugging Face repository into the model store, with Hugging Face's own
client (``huggingface_hub``: its progress bars, its resume of a file cut off, its
``HF_ENDPOINT`` mirrors), and the appliance's rules around it:

- only what vLLM needs: safetensors, the JSON and tokenizer files, chat templates;
  never pickled weights (``*.bin``, ``*.pt``, ...) unless ``--allow-pickle``, never code
  (``*.py``) unless ``--trust-remote-code``;
- the free disk checked before the first byte;
- every file checked against the hub's checksum (LFS files: sha256; others: their git
  blob id); a mismatch is refused and the folder of a new pull removed;
- a token only from a file (``--token-file``, else Hugging Face's own token file or
  ``$HF_TOKEN``), never from the command line; a gated repository without one refused
  in words.

Nothing here runs at serve time: the daemon never downloads.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.models_store.store import PULL_RECORD

WANTED = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.json",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
    "*.model",
)
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")
CODE = ("*.py",)
DISK_MARGIN = 512 * 1024**2  # left free beyond the files: the engine's caches, logs
FILE_TRIES = 3  # whole-file retries (the client resumes within a try itself)


class PullError(Exception):
    """The pull cannot go on; one line saying why and what to do."""


class ChecksumError(PullError):
    """A file is not what the hub says it is: nothing of a new pull is kept."""


@dataclass(frozen=True)
class RepoFile:
    name: str
    size: int
    sha256: str | None  # LFS files
    blob_id: str | None  # others: git's blob sha1


@dataclass(frozen=True)
class Pulled:
    folder: Path
    commit: str
    files: tuple[RepoFile, ...]
    bytes: int


def _hub() -> Any:
    try:
        return importlib.import_module("huggingface_hub")
    except ImportError as exc:
        raise PullError(
            f"huggingface_hub is not installed ({exc}): pip install huggingface_hub"
        ) from None


def select(names: Sequence[str], allow_pickle: bool, trust_remote_code: bool) -> list[str]:
    """The repository's files a pull takes (see the module's docstring)."""
    patterns = [*WANTED, *(PICKLES if allow_pickle else ()), *(CODE if trust_remote_code else ())]
    out = []
    for name in names:
        base = name.rsplit("/", 1)[-1]
        if name.startswith(".") or "/." in name:
            continue
        if any(fnmatch.fnmatch(base, p) for p in patterns):
            out.append(name)
    return out


def read_token(path: str | None) -> str | None:
    """The token in ``path`` (first line), or None: the client's own (its token file,
    $HF_TOKEN)."""
    if not path:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip().splitlines()
    except OSError as exc:
        raise PullError(f"--token-file {path}: cannot read it ({exc.strerror or exc})") from None
    if not token or not token[0].strip():
        raise PullError(f"--token-file {path}: it is empty")
    return token[0].strip()


def _endpoint() -> str | None:
    # Read now, not when huggingface_hub was imported: a mirror set for this command.
    return os.environ.get("HF_ENDPOINT") or None


def repo_files(repo_id: str, revision: str | None, token: str | None) -> tuple[str, list[RepoFile]]:
    """(the commit, every file with its size and checksum) of the repository."""
    hub = _hub()
    errors = importlib.import_module("huggingface_hub.errors")
    api = hub.HfApi(endpoint=_endpoint(), token=token)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except errors.GatedRepoError:
        raise PullError(
            f"{repo_id} is gated: it needs the token of an account that accepted its licence "
            "on huggingface.co; put the token in a file readable by root only and pass "
            "--token-file PATH (never the token itself on the command line)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise PullError(
            f"{repo_id}: no such repository (or a private one: --token-file PATH)"
        ) from None
    except errors.RevisionNotFoundError:
        raise PullError(f"{repo_id}: no revision {revision!r}") from None
    except (errors.HfHubHTTPError, OSError) as exc:
        raise PullError(f"{repo_id}: the hub did not answer: {_first_line(exc)}") from None
    files = [
        RepoFile(
            s.rfilename,
            int(s.lfs.size if s.lfs else (s.size or 0)),
            s.lfs.sha256 if s.lfs else None,
            None if s.lfs else s.blob_id,
        )
        for s in info.siblings or []
    ]
    return str(info.sha), files


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def checksum_ok(path: Path, f: RepoFile) -> bool:
    """Whether ``path`` holds what the hub says ``f`` is (sha256, or git's blob id)."""
    if f.sha256:
        digest = hashlib.sha256()
    elif f.blob_id:
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(b"blob %d\0" % path.stat().st_size)
    else:
        return True
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest() == (f.sha256 or f.blob_id)


def _present(folder: Path, f: RepoFile) -> bool:
    """Already here, whole and right (a pull again skips it)."""
    path = folder / f.name
    try:
        return path.stat().st_size == f.size and checksum_ok(path, f)
    except OSError:
        return False


def check_disk(folder: Path, need: int, usage: Callable[[str], Any] | None = None) -> None:
    """PullError unless the file system of ``folder`` has ``need`` bytes and a margin."""
    usage = usage or shutil.disk_usage
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = int(usage(str(probe)).free)
    if need + DISK_MARGIN > free:
        gib = 1024**3
        raise PullError(
            f"not enough disk for the pull: {need / gib:.1f} GiB to download and "
            f"{DISK_MARGIN / gib:.1f} GiB to spare, {free / gib:.1f} GiB free on {probe}; "
            "free some space (`llm-appliance models list`, `models remove NAME`)"
        )


def pull(
    repo_id: str,
    folder: Path,
    *,
    revision: str | None = None,
    token: str | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    usage: Callable[[str], Any] | None = None,
) -> Pulled:
    """Download ``repo_id`` into ``folder`` (see the module's docstring)."""
    commit, every = repo_files(repo_id, revision, token)
    names = set(select([f.name for f in every], allow_pickle, trust_remote_code))
    files = [f for f in every if f.name in names]
    if not any(f.name == "config.json" for f in files):
        raise PullError(f"{repo_id} has no config.json: not a model vLLM can load")
    skipped = sorted({f.name for f in every} - names)
    pickles = [n for n in skipped if any(fnmatch.fnmatch(n, p) for p in PICKLES)]
    if pickles and not any(f.name.endswith(".safetensors") for f in files):
        raise PullError(
            f"{repo_id} has its weights only as pickles ({', '.join(pickles[:3])}): they can "
            "run code when loaded; pass --allow-pickle if you trust the repository"
        )
    new = not folder.exists()
    todo = [f for f in files if not _present(folder, f)]
    check_disk(folder, sum(f.size for f in todo), usage)
    folder.mkdir(parents=True, exist_ok=True)
    total = sum(f.size for f in todo)
    done = 0
    try:
        for i, f in enumerate(todo, 1):
            # One line per file as well as the client's bars (those only show on a
            # terminal): what a journal or an Ansible log keeps.
            started = time.monotonic()
            _download(repo_id, commit, f, folder, token)
            done += f.size
            rate = f.size / max(time.monotonic() - started, 1e-3) / 1024**2
            print(
                f"[{i}/{len(todo)}] {f.name}: {_size(f.size)}, checksum ok, {rate:.1f} MiB/s "
                f"({_size(done)} of {_size(total)})",
                file=sys.stderr,
            )
    except ChecksumError:
        if new:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    record = {
        "repo_id": repo_id,
        "revision": revision or "main",
        "commit": commit,
        "pulled_at": int(time.time()),
        "trust_remote_code": trust_remote_code,
        "files": {
            f.name: {"size": f.size, "sha256": f.sha256, "blob_id": f.blob_id} for f in files
        },
    }
    tmp = folder / (PULL_RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, folder / PULL_RECORD)
    shutil.rmtree(folder / ".cache", ignore_errors=True)  # the client's resume state
    return Pulled(folder, commit, tuple(files), sum(f.size for f in files))


def _size(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"


def _download(repo_id: str, commit: str, f: RepoFile, folder: Path, token: str | None) -> None:
    """One file, by the client (progress bar, resume), then its checksum checked: a
    mismatch removes it and ends the pull."""
    hub = _hub()
    errors = importlib.import_module("huggingface_hub.errors")
    for attempt in range(1, FILE_TRIES + 1):
        try:
            hub.hf_hub_download(
                repo_id,
                f.name,
                revision=commit,
                local_dir=folder,
                token=token,
                endpoint=_endpoint(),
            )
            break
        except errors.GatedRepoError:
            raise PullError(f"{repo_id} is gated: pass --token-file PATH") from None
        except (errors.HfHubHTTPError, OSError) as exc:
            if attempt == FILE_TRIES:
                raise PullError(
                    f"{f.name}: {_first_line(exc)} (a pull again resumes where it stopped)"
                ) from None
    path = folder / f.name
    if not checksum_ok(path, f):
        path.unlink(missing_ok=True)
        expected = f.sha256 or f.blob_id
        raise ChecksumError(
            f"{f.name}: checksum mismatch (the hub says {expected}): refused and removed; "
            "the download was corrupted or the mirror serves other files"
        )
