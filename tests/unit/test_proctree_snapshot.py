"""proctree.tree_snapshot: the RSS sample of an engine's tree reads only the tree's own
/proc entries, and finds what psutil's scan of every process finds."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from appliance import proctree

# A parent whose children come from its main thread and from another thread (the kernel
# lists a child under the thread that forked it), one with a child of its own.
TREE = """
import subprocess, sys, threading, time
kids = [subprocess.Popen(["sleep", "60"])]
kids.append(subprocess.Popen(["sh", "-c", "sleep 60 & wait"]))
t = threading.Thread(target=lambda: kids.append(subprocess.Popen(["sleep", "60"])))
t.start(); t.join()
time.sleep(60)
"""


@contextlib.contextmanager
def process_tree() -> Iterator[psutil.Process]:
    proc = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        root = psutil.Process(proc.pid)
        deadline = time.monotonic() + 20
        while len(root.children(recursive=True)) < 4:  # 3 children and a grandchild
            if time.monotonic() > deadline:
                pytest.fail("the test's process tree did not form")
            time.sleep(0.02)
        yield root
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                p.kill()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("children_files", [True, False])
def test_snapshot_finds_every_descendant_as_a_full_scan_does(
    children_files: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(proctree, "_CHILDREN_FILES", children_files and proctree._CHILDREN_FILES)
    with process_tree() as root:
        rss, members = proctree.tree_snapshot(root.pid)
        expected = {root.pid, *(p.pid for p in root.children(recursive=True))}
        assert set(members) == expected
        assert rss is not None and rss > 0


def test_snapshot_of_a_process_that_is_gone() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert proctree.tree_snapshot(proc.pid) == (None, {})
