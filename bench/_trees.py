"""Other commits' code beside this tree's: throw-away ``git worktree``s and their labels.

A benchmark that compares trees starts each side's daemon from its own worktree (cwd and
``PYTHONPATH`` at it, see ``run_appliance(tree=...)``), with this tree's fake engine and
config on every side, and removes the worktrees when it ends, however it ends.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.fakes.appliance_proc import REPO


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


@contextlib.contextmanager
def worktree(ref: str, prefix: str = "bench-tree-") -> Iterator[Path]:
    """A detached worktree of ``ref`` in a temporary directory, always removed after."""
    parent = Path(tempfile.mkdtemp(prefix=prefix))
    path = parent / "tree"
    try:
        git("worktree", "add", "--detach", str(path), ref)
        yield path
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(path)], cwd=REPO, capture_output=True
        )
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)
        shutil.rmtree(parent, ignore_errors=True)


def commit_label(ref: str) -> str:
    """A revision's short hash."""
    return git("rev-parse", "--short", f"{ref}^{{commit}}")


def head_label() -> str:
    """This working tree: its HEAD's short hash, and whether appliance/ has changes on top."""
    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "appliance")
    return f"{head}{' (+ uncommitted)' if dirty else ''}"
