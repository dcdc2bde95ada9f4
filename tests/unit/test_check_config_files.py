"""`check-config` looks at the files the daemon reads at start, by the daemon's rules: the
keys file (readable, a keys document, 0600, not a symlink; missing is fine) and a
`file:` sensors source (there, readable, `{"gpus": [...]}`). A problem is exit 2 naming
the config key and the file; something the daemon lives with is a warning (exit 0).
Also how the daemon opens its telemetry: a `file:` source that cannot be opened stops
it with exit 2, and `nvml` without NVIDIA is the normal CPU case."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest

from appliance.cli import main
from appliance.config import parse_config
from appliance.errors import EXIT_CONFIG, ConfigError
from appliance.gateway.keys import KeysFileError, KeyStore
from appliance.supervisor import boot
from appliance.telemetry import NoneSource, TelemetryError

GOOD_SENSORS = {"gpus": [{"index": 0, "temperature_c": 64}]}


def write_config(tmp_path: Path, telemetry: str = "none") -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'[gateway]\nkeys_file = "{tmp_path / "keys.json"}"\n[telemetry]\nsource = "{telemetry}"\n'
    )
    return path


def check(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["check-config", "--config", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def good_keys(path: Path) -> None:
    KeyStore(path).create(name="alice")  # written 0600, as the daemon writes it


# --- the keys file --------------------------------------------------------------------------


def test_a_corrupt_keys_file_is_exit_2_naming_the_key_and_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text('{"version": 1, "keys": [')
    keys.chmod(0o600)
    code, out, err = check(write_config(tmp_path), capsys)
    assert code == EXIT_CONFIG
    assert out == ""  # no "config ok" summary for a config the daemon cannot use
    assert f"gateway.keys_file = '{keys}'" in err
    assert f"keys file {keys} is not valid JSON" in err
    assert keys.read_text() == '{"version": 1, "keys": ['  # looked at, never touched


def test_a_keys_document_with_a_bad_record_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"version": 1, "keys": [{"id": "nothex!!"}]}))
    keys.chmod(0o600)
    code, _, err = check(write_config(tmp_path), capsys)
    assert code == EXIT_CONFIG
    assert f"keys file {keys} is malformed: keys[0]" in err


def test_a_symlinked_keys_file_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = tmp_path / "real.json"
    good_keys(real)
    (tmp_path / "keys.json").symlink_to(real)
    code, _, err = check(write_config(tmp_path), capsys)
    assert code == EXIT_CONFIG
    assert "gateway.keys_file" in err and "symbolic link" in err


def test_a_keys_file_open_to_others_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.json"
    good_keys(keys)
    keys.chmod(0o644)
    code, out, err = check(write_config(tmp_path), capsys)
    assert code == 0 and out.startswith("config ok")
    warning = f"gateway.keys_file = '{keys}': keys file {keys} has mode 0644"
    assert f"llm-appliance: warning: {warning}" in err


def test_a_good_keys_file_or_none_at_all_is_fine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path)
    code, out, err = check(config, capsys)  # missing: serve makes it
    assert (code, err) == (0, "") and out.startswith("config ok")
    good_keys(tmp_path / "keys.json")
    code, out, err = check(config, capsys)
    assert (code, err) == (0, "") and out.startswith("config ok")


def test_a_keys_file_this_user_may_not_read_is_a_warning_not_a_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user who is neither root nor the service user cannot read the 0700 state
    directory: the daemon (the service user) can, so check-config cannot judge it."""

    def denied(self: KeyStore) -> None:
        error = KeysFileError(f"keys file {self.path} cannot be read (Permission denied)")
        error.errno = errno.EACCES
        raise error

    monkeypatch.setattr(KeyStore, "read_file", denied)
    code, out, err = check(write_config(tmp_path), capsys)
    assert code == 0 and out.startswith("config ok")
    assert "gateway.keys_file" in err and "not checked, this user may not read it" in err


# --- a file: sensors source -----------------------------------------------------------------


def test_a_missing_sensors_file_is_exit_2_naming_the_source_and_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sensors = tmp_path / "sensors.json"
    code, out, err = check(write_config(tmp_path, f"file:{sensors}"), capsys)
    assert code == EXIT_CONFIG and out == ""
    assert f"telemetry.source = 'file:{sensors}' cannot be used" in err
    assert f"telemetry file {sensors} cannot be read" in err


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ('{"gpus": [', "is not valid JSON"),
        ('[{"index": 0}]', 'is not of the form {"gpus": [...]}'),
        ("", "is not valid JSON"),
    ],
)
def test_a_corrupt_sensors_file_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, said: str
) -> None:
    sensors = tmp_path / "sensors.json"
    sensors.write_text(content)
    code, _, err = check(write_config(tmp_path, f"file:{sensors}"), capsys)
    assert code == EXIT_CONFIG
    assert f"telemetry.source = 'file:{sensors}' cannot be used" in err and said in err


def test_a_sensors_directory_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = check(write_config(tmp_path, f"file:{tmp_path}"), capsys)
    assert code == EXIT_CONFIG and "telemetry.source" in err


def test_a_good_sensors_file_is_fine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sensors = tmp_path / "sensors.json"
    sensors.write_text(json.dumps(GOOD_SENSORS))
    code, out, err = check(write_config(tmp_path, f"file:{sensors}"), capsys)
    assert (code, err) == (0, "") and out.startswith("config ok")


def test_every_file_problem_is_named_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "keys.json").write_text("nope")
    code, _, err = check(write_config(tmp_path, f"file:{tmp_path / 'nope.json'}"), capsys)
    assert code == EXIT_CONFIG
    assert "2 config problem(s)" in err
    assert "gateway.keys_file" in err and "telemetry.source" in err


# --- the daemon's telemetry at start --------------------------------------------------------


def test_the_daemon_refuses_a_file_source_it_cannot_open(tmp_path: Path) -> None:
    """Exit 2 (the unit's RestartPreventExitStatus), not a quiet "telemetry off": without
    readings no GPU would ever be throttled."""
    sensors = tmp_path / "sensors.json"
    config = parse_config({"telemetry": {"source": f"file:{sensors}"}}, "/etc/x.toml")
    with pytest.raises(ConfigError) as caught:
        boot.open_telemetry(config)
    assert caught.value.exit_code == EXIT_CONFIG
    [problem] = caught.value.problems
    assert problem.startswith(f"telemetry.source = 'file:{sensors}' cannot be used")
    assert str(sensors) in problem and "No such file" in problem


def test_the_daemon_starts_on_a_sensors_file_caught_half_written(tmp_path: Path) -> None:
    """Content is forgiven at start as while running (a writer may be mid-rewrite): only a
    file that cannot be opened at all stops the daemon."""
    sensors = tmp_path / "sensors.json"
    sensors.write_text('{"gpus": [')
    config = parse_config({"telemetry": {"source": f"file:{sensors}"}})
    assert boot.open_telemetry(config).read() == []


def test_nvml_without_nvidia_is_no_gpu_telemetry_not_an_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = boot.open_source

    def no_driver(spec: str) -> object:
        if spec == "nvml":
            raise TelemetryError("NVML Shared Library Not Found")
        return real_open(spec)

    monkeypatch.setattr(boot, "open_source", no_driver)
    with caplog.at_level(logging.INFO, "appliance.supervisor"):
        source = boot.open_telemetry(parse_config({"telemetry": {"source": "nvml"}}))
    assert isinstance(source, NoneSource)
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert "GPU telemetry off: NVML unavailable" in caplog.records[0].getMessage()


def test_a_sensors_file_this_user_may_not_read_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sensors = tmp_path / "sensors.json"

    def denied(path: str) -> None:
        raise TelemetryError(f"telemetry file {path} cannot be read") from PermissionError(
            errno.EACCES, "Permission denied"
        )

    monkeypatch.setattr(boot, "check_sensors_file", denied)
    code, _, err = check(write_config(tmp_path, f"file:{sensors}"), capsys)
    assert code == 0 and "telemetry.source" in err and "cannot check it as this user" in err
