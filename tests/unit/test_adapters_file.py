"""adapters.json, the admin's LoRA adapters kept across restarts, read as safely as the
keys file: never through a link, never blocking on a FIFO, each problem one sentence
naming the file and the fix (issue 23 review)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from appliance.config import ServedModel, parse_config
from appliance.supervisor.adapters import read_kept
from appliance.supervisor.adapters_file import Kept, read_file, write_file
from tests.fakes.lora_files import fake_adapter


def _served(tmp: Path) -> tuple[ServedModel, ...]:
    fake_adapter(tmp / "sql")
    table = {"name": "chat", "adapters": [{"name": "sql", "path": str(tmp / "sql")}]}
    return parse_config({"engine": {"device": "cpu"}, "models": [table]}).served


def test_what_is_written_is_read_back_0600(tmp_path: Path) -> None:
    path = tmp_path / "adapters.json"
    write_file(path, [Kept("sql2", "chat", "/srv/lora/sql2")])
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert read_file(path) == ([Kept("sql2", "chat", "/srv/lora/sql2")], None)
    assert read_file(tmp_path / "none.json") == ([], None)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("{not json", "not JSON"),
        ('{"format": 2, "adapters": []}', 'not {"format": 1'),
        ('{"format": 1, "adapters": {}}', "'adapters' is not a list"),
        ('{"format": 1, "adapters": ["sql"]}', "adapters[0] is not an object"),
        ('{"format": 1, "adapters": [{"name": "a", "model": 1, "path": "/x"}]}', "adapters[0]"),
    ],
)
def test_a_file_that_is_no_adapters_file_is_named_with_the_fix(
    tmp_path: Path, content: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "adapters.json"
    path.write_text(content)
    with caplog.at_level(logging.ERROR):
        kept, unreadable = read_kept(path, _served(tmp_path))
    assert kept == []
    assert unreadable is not None
    assert f"{path} is not an adapters file" in unreadable and said in unreadable
    assert "move it away" in unreadable
    assert unreadable in caplog.text


def test_a_symlink_is_refused_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    write_file(elsewhere, [Kept("sql2", "chat", "/srv/lora/sql2")])
    (tmp_path / "adapters.json").symlink_to(elsewhere)
    kept, unreadable = read_kept(tmp_path / "adapters.json", _served(tmp_path))
    assert kept == [] and unreadable is not None
    assert "is a symbolic link" in unreadable and "remove the link" in unreadable


def test_a_fifo_does_not_hang_the_daemon(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "adapters.json")
    kept, unreadable = read_kept(tmp_path / "adapters.json", _served(tmp_path))
    assert kept == [] and unreadable is not None and "not a regular file" in unreadable


def test_a_mode_open_to_others_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "adapters.json"
    write_file(path, [Kept("sql2", "chat", "/srv/lora/sql2")])
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING):
        kept, unreadable = read_kept(path, _served(tmp_path))
    assert ([k.name for k in kept], unreadable) == (["sql2"], None)
    assert f"{path} has mode 0644; it should be 0600" in caplog.text


def test_entries_that_no_longer_fit_the_config_are_left_out(tmp_path: Path) -> None:
    path = tmp_path / "adapters.json"
    entries = [
        Kept("sql", "chat", "/a"),  # now the config's adapter
        Kept("gone", "old-model", "/b"),
        Kept("..", "chat", "/c"),
        Kept("sql2", "chat", "/d"),
    ]
    write_file(path, entries)
    kept, _ = read_kept(path, _served(tmp_path))
    assert [k.name for k in kept] == ["sql2"]
    assert json.loads(path.read_text())["format"] == 1
