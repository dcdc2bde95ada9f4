"""Where set-up's engine venv and model live: one rule for a checkout and the system."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance import paths


@pytest.fixture
def system_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Stand-in for /var/lib/llm-appliance, empty (no system set-up) unless a test marks it."""
    home = tmp_path / "var-lib-llm-appliance"
    home.mkdir()
    monkeypatch.setattr(paths, "SYSTEM_HOME", home)
    return home


@pytest.mark.parametrize(
    ("env", "system_setup", "expect"),
    [
        # 1. LLM_APPLIANCE_HOME wins over everything.
        (
            {"LLM_APPLIANCE_HOME": "/x", "STATE_DIRECTORY": "/s", "XDG_DATA_HOME": "/d"},
            True,
            "/x",
        ),
        # 2. systemd's StateDirectory=, the first of several colon-separated ones.
        (
            {"STATE_DIRECTORY": "/var/lib/llm-appliance", "HOME": "/h"},
            False,
            "/var/lib/llm-appliance",
        ),
        ({"STATE_DIRECTORY": "/var/lib/a:/var/lib/b", "HOME": "/h"}, False, "/var/lib/a"),
        ({"STATE_DIRECTORY": "/s", "XDG_DATA_HOME": "/d"}, True, "/s"),
        # 3. A system set-up already made (marker present).
        ({"XDG_DATA_HOME": "/d", "HOME": "/h"}, True, "SYSTEM"),
        # 4. XDG_DATA_HOME, else ~/.local/share.
        ({"XDG_DATA_HOME": "/d", "HOME": "/h"}, False, "/d/llm-appliance"),
        ({"HOME": "/home/dev"}, False, "/home/dev/.local/share/llm-appliance"),
        # Empty values count as unset.
        (
            {"LLM_APPLIANCE_HOME": "", "STATE_DIRECTORY": "", "XDG_DATA_HOME": "", "HOME": "/h"},
            False,
            "/h/.local/share/llm-appliance",
        ),
    ],
)
def test_appliance_home_resolution_order(
    env: dict[str, str], system_setup: bool, expect: str, system_home: Path
) -> None:
    if system_setup:
        (system_home / paths.SETUP_MARKER).write_text("{}")
    want = system_home if expect == "SYSTEM" else Path(expect)
    assert paths.appliance_home(env) == want


def test_system_home_without_marker_is_not_used(system_home: Path) -> None:
    (system_home / "engine-venv").mkdir()  # a half-made set-up is no set-up
    assert paths.appliance_home({"HOME": "/h"}) == Path("/h/.local/share/llm-appliance")


def test_appliance_home_reads_the_process_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, system_home: Path
) -> None:
    monkeypatch.setenv("LLM_APPLIANCE_HOME", str(tmp_path))
    assert paths.appliance_home() == tmp_path


def test_layout_under_home() -> None:
    home = Path("/srv/appliance")
    assert paths.engine_python(home) == home / "engine-venv" / "bin" / "python"
    assert paths.packaged_model(home) == home / "models" / "SmolLM2-135M-Instruct"


def test_packaged_models_by_name() -> None:
    home = Path("/srv/appliance")
    assert paths.packaged_model(home, "all-minilm-l6-v2") == home / "models" / "all-MiniLM-L6-v2"
    assert paths.PACKAGED_MODELS["all-minilm-l6-v2"].task == "embed"
    assert paths.PACKAGED_MODELS[paths.PACKAGED_MODEL_NAME].task == "generate"
    assert paths.packaged_name("packaged:all-minilm-l6-v2") == "all-minilm-l6-v2"
    assert paths.packaged_name("/srv/models/x") is None
    with pytest.raises(KeyError):
        paths.packaged_model(home, "no-such")
