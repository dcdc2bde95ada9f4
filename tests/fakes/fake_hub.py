"""A Hugging Face hub on 127.0.0.1 in the hub's own layout, for `models pull` tests with
the real ``huggingface_hub`` client (pointed at it by ``HF_ENDPOINT``): nothing leaves
the machine.

It answers what the client asks: ``GET /api/models/{repo}/revision/{rev}`` (the files,
their sizes, LFS sha256 and git blob ids), ``HEAD`` and ``GET
/{repo}/resolve/{rev}/{file}`` (commit, ETag, size; ``Range`` for resume). Scripted
faults: a gated repository (401 ``X-Error-Code: GatedRepo`` without the token), a file
whose connection drops part-way the first time, a file served with other bytes than its
checksum says.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    gated_token: str | None = None  # gated: only this token may read it
    drop_once: dict[str, int] = field(default_factory=dict)  # file -> bytes sent, then cut
    corrupt: set[str] = field(default_factory=set)  # served with one byte changed

    def siblings(self) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for name, data in self.files.items():
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False)
            entry: dict[str, object] = {"rfilename": name, "size": len(data)}
            entry["blobId"] = blob.hexdigest()
            if name.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                entry["lfs"] = {"size": len(data), "sha256": sha, "pointerSize": 134}
            out.append(entry)
        return out

    def etag(self, name: str) -> str:
        data = self.files[name]
        if name.endswith(LFS_SUFFIXES):
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    downloads: list[tuple[str, str, str]] = field(default_factory=list)  # (repo, file, range)
    url: str = ""

    def add(self, repo: FakeRepo) -> FakeRepo:
        self.repos[repo.repo_id] = repo
        return repo


_INFO = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/?]+))?")
_FILE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _allowed(self, repo: FakeRepo) -> bool:
            if repo.gated_token is None:
                return True
            return self.headers.get("Authorization") == f"Bearer {repo.gated_token}"

        def _error(self, code: int, error_code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(code)
            self.send_header("X-Error-Code", error_code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _repo(self, repo_id: str) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if not self._allowed(repo):
                self._error(401, "GatedRepo", "Access to this gated repository is restricted")
                return None
            return repo

        def do_GET(self) -> None:
            path = unquote(self.path.split("?", 1)[0])
            if m := _INFO.fullmatch(path):
                repo = self._repo(m["repo"])
                if repo is not None:
                    doc = {"id": repo.repo_id, "sha": COMMIT, "siblings": repo.siblings()}
                    body = json.dumps(doc).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                return
            self._file(path, head=False)

        def do_HEAD(self) -> None:
            self._file(unquote(self.path.split("?", 1)[0]), head=True)

        def _file(self, path: str, head: bool) -> None:
            m = _FILE.fullmatch(path)
            repo = self._repo(m["repo"]) if m else None
            if m is None or repo is None:
                if m is None:
                    self._error(404, "EntryNotFound", "not found")
                return
            name = m["file"]
            if name not in repo.files:
                self._error(404, "EntryNotFound", "Entry not found")
                return
            data = repo.files[name]
            if name in repo.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            start = 0
            ranged = self.headers.get("Range", "")
            if r := re.fullmatch(r"bytes=(\d+)-", ranged):
                start = int(r.group(1))
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{repo.etag(name)}"')
            if name.endswith(LFS_SUFFIXES):
                self.send_header("X-Linked-Etag", f'"{repo.etag(name)}"')
                self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if head:
                return
            hub.downloads.append((repo.repo_id, name, ranged))
            cut = repo.drop_once.pop(name, None)
            if cut is not None:
                self.wfile.write(data[start:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

    return Handler


@contextmanager
def serve_hub(hub: FakeHub) -> Iterator[FakeHub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def smollm_repo(repo_id: str, model_folder: Path, weights: bytes | None = None) -> FakeRepo:
    """A repository of the packaged SmolLM2's files (its config and tokenizer), with
    ``weights`` as its safetensors (default: the real file)."""
    files: dict[str, bytes] = {}
    for p in sorted(model_folder.iterdir()):
        if p.is_file() and not p.name.startswith("."):
            files[p.name] = (
                p.read_bytes() if weights is None or p.suffix != ".safetensors" else weights
            )
    files["pytorch_model.bin"] = b"a pickle"
    files["modeling_custom.py"] = b"print('remote code')\n"
    return FakeRepo(repo_id, files)
