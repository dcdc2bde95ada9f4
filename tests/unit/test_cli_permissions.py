"""A file the user may not read is one line naming it and what would let them, never a
traceback (issue 16, item 7).

The end-to-end tests run the real command line in a child process that has become
``nobody`` (uid 65534, no other group), as a user outside the service group on a
provisioned box; they need root to become someone else. The message's advice is
tested without root, by asking for another user's view of a tree of files.
"""

from __future__ import annotations

import grp
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance import cli
from appliance.permissions import Viewer, denied_line

NOBODY = 65534
STRANGER = Viewer(NOBODY, frozenset({NOBODY}))


def _other_group() -> grp.struct_group:
    """A group that exists here, is not root's or nobody's, and does not list nobody."""
    for g in grp.getgrall():
        if g.gr_gid not in (0, NOBODY) and "nobody" not in g.gr_mem:
            return g
    pytest.skip("no group to give the service's files to")


def _denied(path: Path) -> PermissionError:
    return PermissionError(13, "Permission denied", str(path))


# --- the advice, from another user's view of the modes ---------------------------------


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory anyone may enter, on a path anyone may walk (pytest's tmp_path lies
    under a 0700 directory, which would be the first thing in everyone's way)."""
    base = Path(tempfile.mkdtemp(prefix="llm-appliance-perm-"))
    try:
        os.chmod(base, 0o755)
        yield base
    finally:
        shutil.rmtree(base)


@pytest.fixture
def tree(open_dir: Path) -> Path:
    """OPEN/etc (0750) holding config.toml (0640), both in this process's group."""
    etc = open_dir / "etc"
    etc.mkdir()
    (etc / "config.toml").write_text("")
    os.chmod(etc / "config.toml", 0o640)
    os.chmod(etc, 0o750)
    return etc


def test_a_directory_only_the_group_may_enter_says_join_the_group(tree: Path) -> None:
    group = grp.getgrgid(os.stat(tree).st_gid).gr_name
    assert denied_line(_denied(tree / "config.toml"), STRANGER) == (
        f"cannot read {tree / 'config.toml'}: permission denied "
        f"(join the group {group} or use sudo)"
    )


def test_a_file_only_the_group_may_read_says_join_the_group(tree: Path) -> None:
    os.chmod(tree, 0o755)
    group = grp.getgrgid(os.stat(tree).st_gid).gr_name
    line = denied_line(_denied(tree / "config.toml"), STRANGER)
    assert line == (
        f"cannot read {tree / 'config.toml'}: permission denied "
        f"(join the group {group} or use sudo)"
    )


def test_the_group_is_not_offered_where_it_would_not_help(tree: Path) -> None:
    """The state directory (0700) is the service user's alone: sudo, not the group."""
    os.chmod(tree, 0o700)
    member = Viewer(NOBODY, frozenset({os.stat(tree).st_gid}))
    owner = tree.owner()
    assert denied_line(_denied(tree / "config.toml"), member) == (
        f"cannot read {tree / 'config.toml'}: permission denied "
        f"(only {owner} may enter {tree}: use sudo)"
    )
    os.chmod(tree, 0o755)
    os.chmod(tree / "config.toml", 0o600)
    assert denied_line(_denied(tree / "config.toml"), member) == (
        f"cannot read {tree / 'config.toml'}: permission denied "
        f"(only {owner} may read it: use sudo)"
    )


def test_a_file_that_cannot_be_made_names_the_directory(tree: Path) -> None:
    os.chmod(tree, 0o755)
    line = denied_line(_denied(tree / "keys.json"), STRANGER)
    assert line == (
        f"cannot create {tree / 'keys.json'}: permission denied "
        f"(only {tree.owner()} may write in {tree}: use sudo)"
    )


def test_what_the_modes_allow_is_not_explained_away(tree: Path) -> None:
    """Refused though the modes allow it (an ACL, a security module): the system's words."""
    root = Viewer(0, frozenset({0}))
    assert denied_line(_denied(tree / "config.toml"), root) == (
        f"cannot use {tree / 'config.toml'}: permission denied"
    )
    assert denied_line(PermissionError(1, "Operation not permitted")) is None


# --- end to end: the command line as a user outside the service group ------------------


@dataclass(frozen=True)
class Box:
    config: Path
    keys: Path
    group: str


@pytest.fixture
def box(open_dir: Path) -> Box:
    """/etc/llm-appliance and /var/lib/llm-appliance as the Ansible role leaves them: the
    config 0640 root:GROUP in a 0750 root:GROUP directory, the state directory 0700."""
    group = _other_group()
    etc, state = open_dir / "etc", open_dir / "state"
    etc.mkdir(mode=0o750)
    state.mkdir(mode=0o700)
    config = etc / "config.toml"
    config.write_text(f'[gateway]\nkeys_file = "{state / "keys.json"}"\n')
    os.chmod(config, 0o640)
    os.chown(etc, 0, group.gr_gid)
    os.chown(config, 0, group.gr_gid)
    return Box(config, state / "keys.json", group.gr_name)


def run_as_nobody(*argv: str) -> tuple[int, str, str]:
    """``llm-appliance ARGV`` in a child that became nobody: (exit status, stdout, stderr)."""
    cli.build_parser()  # imports every command now: nobody cannot read root's interpreter
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 99
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (the child exits)
                sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                code = cli.main(list(argv))
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")


@needs_root
@pytest.mark.parametrize("command", [["status"], ["keys", "list"], ["check-config"]])
def test_outside_the_group_every_command_says_which_file_and_which_group(
    box: Box, command: list[str]
) -> None:
    code, out, err = run_as_nobody(*command, "--config", str(box.config))
    assert (code, out) == (2, ""), err
    assert err == (
        f"llm-appliance: cannot read {box.config}: permission denied "
        f"(join the group {box.group} or use sudo)\n"
    )


@needs_root
def test_a_config_the_directory_shows_but_the_file_withholds_is_the_same_line(
    box: Box,
) -> None:
    os.chmod(box.config.parent, 0o755)
    code, _, err = run_as_nobody("check-config", "--config", str(box.config))
    assert code == 2
    assert err == (
        f"llm-appliance: cannot read {box.config}: permission denied "
        f"(join the group {box.group} or use sudo)\n"
    )


@needs_root
def test_the_keys_file_is_the_service_users_alone(box: Box) -> None:
    """With the config readable, `keys list` stops at the 0700 state directory: one
    line naming the keys file (the keys commands word their own file errors)."""
    os.chmod(box.config.parent, 0o755)
    os.chmod(box.config, 0o644)
    code, out, err = run_as_nobody("keys", "list", "--config", str(box.config))
    assert (code, out) == (1, ""), err
    assert err == f"llm-appliance: keys file {box.keys} cannot be read (Permission denied)\n"
