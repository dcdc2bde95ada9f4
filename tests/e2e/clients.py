"""The real clients test_real_clients.py drives: installed once, reused, run as users do.

Each client lives in a folder of its own under ``~/.cache/llm-appliance/clients/``
(``$XDG_CACHE_HOME`` respected): a virtual environment per Python client (PyPI), a
``node_modules`` per npm CLI (registry.npmjs.org). A folder is made once per pinned
version and reused by every later run, so a warm run installs nothing; a half-made one
(no ``.complete`` stamp, e.g. an install that was interrupted) is made again. Versions
are pinned so a run tests what was verified; bumping one is a deliberate edit here.

When a registry does not have a client (no network, a mirror without it), or node is
missing, the test skips with the reason and the installer's last lines; any other
install failure is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PYTHON_CLIENTS = {
    "openai": ["openai==3.57.0"],
    "anthropic": ["anthropic==2.14.0"],
    "llm": ["llm==0.36"],
    "openai-agents": ["openai-agents==0.24.0"],
}
# Claude Code 2.1.197 is the newest whose package accepts node 20 (Debian's and
# NodeSource's LTS here); later ones ask for node >= 22 (the CLI itself is a native
# binary either way).
NPM_CLIENTS = {
    "codex": ("@openai/codex@0.169.0", "codex"),
    "claude": ("@anthropic-ai/claude-code@2.1.197", "claude"),
}
INSTALL_TIMEOUT_S = 600
# What pip and npm say when the package cannot be had from the registry (offline, a
# mirror without it, a version taken down): the one case that skips.
UNAVAILABLE = (
    "No matching distribution found",
    "Could not find a version that satisfies",
    "E404",
    "ETARGET",
    "ENOTFOUND",
    "EAI_AGAIN",
    "ECONNREFUSED",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm-appliance" / "clients"


@dataclass(frozen=True)
class Installed:
    """A client ready to run: its executable, and whether this run installed it."""

    path: Path
    fresh: bool


def _install(folder: Path, what: str, argv: list[str]) -> None:
    """Run an installer into ``folder``; skip when the registry lacks ``what``."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-1500:]
        shutil.rmtree(folder, ignore_errors=True)
        if any(marker in tail for marker in UNAVAILABLE):
            pytest.skip(f"{what} is not available from its registry: {tail}")
        pytest.fail(f"installing {what} failed ({done.returncode}): {tail}")
    (folder / ".complete").write_text(" ".join(argv) + "\n")


def python_client(name: str) -> Installed:
    """A venv holding ``name``'s pinned packages; its python."""
    spec = PYTHON_CLIENTS[name]
    folder = cache_root() / ("py-" + "-".join(s.replace("==", "-") for s in spec))
    python = folder / "bin" / "python"
    if (folder / ".complete").exists() and python.exists():
        return Installed(python, fresh=False)
    base = getattr(sys, "_base_executable", sys.executable)
    # One shell line: the venv is made into the folder _install has just emptied.
    _install(
        folder,
        " ".join(spec),
        [
            "sh",
            "-c",
            f'"{base}" -m venv "{folder}" && "{python}" -m pip install -q '
            "--disable-pip-version-check " + " ".join(spec),
        ],
    )
    return Installed(python, fresh=True)


def node_version() -> tuple[int, ...] | None:
    node = shutil.which("node")
    if node is None:
        return None
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    try:
        return tuple(int(p) for p in out.stdout.strip().lstrip("v").split("."))
    except ValueError:
        return None


def npm_client(name: str) -> Installed:
    """``node_modules`` holding ``name``'s pinned package; its command."""
    package, command = NPM_CLIENTS[name]
    if shutil.which("npm") is None or (node_version() or (0,)) < (18,):
        pytest.skip(f"{package} needs node >= 18 and npm (scripts/test-deps installs them)")
    folder = cache_root() / ("npm-" + package.lstrip("@").replace("/", "-"))
    binary = folder / "node_modules" / ".bin" / command
    if (folder / ".complete").exists() and binary.exists():
        return Installed(binary, fresh=False)
    npm = shutil.which("npm") or "npm"
    _install(
        folder,
        package,
        [npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund", package],
    )
    return Installed(binary, fresh=True)


SCRIPTS = Path(__file__).parent / "client_scripts"


def script(name: str) -> Path:
    """One of the SDK scripts that run inside a client's venv."""
    return SCRIPTS / name
