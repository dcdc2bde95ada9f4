"""Runs every check in order and prints the report: a table for people, JSON for machines.

Everything that touches the machine comes in through :class:`Probes`, so a test swaps a
fake pynvml, a fake ``systemctl``, a port holder or an opener in one place.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import __version__, paths
from appliance.config import Config, config_warnings, load_config
from appliance.doctor.engine import (
    VenvProbe,
    check_caches,
    check_engine_venv,
    check_models,
    check_ports,
    check_socket_dir,
    probe_venv,
    runtime_dir,
)
from appliance.doctor.gpu import (
    DRIVER_PROC,
    NvidiaProbe,
    check_nvidia,
    gpu_memory_totals,
    probe_nvidia,
    selected_gpus,
)
from appliance.doctor.host import (
    check_disk,
    check_gateway,
    check_keys_file,
    check_state_dir,
    check_systemd,
    describe_pid,
    is_appliance_process,
    read_unit,
)
from appliance.doctor.result import Account, Result, fail, na, ok, service_account
from appliance.doctor.state_files import NAME as STATE_NAME
from appliance.doctor.state_files import check_state_writes
from appliance.errors import EXIT_CONFIG, ConfigError
from appliance.proctree import port_holder


@dataclass
class Probes:
    """The doctor's view of the machine; each field is replaced in tests."""

    nvml: Any = None  # the pynvml module; None imports the real one
    driver_loaded: Callable[[], bool] = DRIVER_PROC.exists
    unit: Callable[[], dict[str, str] | str] = read_unit
    venv: Callable[[str, Mapping[str, str], Account], VenvProbe] = field(
        default=lambda python, env, account: probe_venv(python, env=env, account=account)
    )
    port_holder: Callable[[int], tuple[int | None, str] | None] = port_holder
    is_ours: Callable[[int], bool] = is_appliance_process
    describe_pid: Callable[[int], tuple[str, bool]] = describe_pid
    disk_usage: Callable[[str], Any] = shutil.disk_usage
    opener: Callable[..., Any] = urllib.request.urlopen
    statvfs: Callable[[str], Any] = os.statvfs
    account: Account | None = None  # None: the unit's User=, else llm-appliance, else us


@dataclass(frozen=True)
class Report:
    results: tuple[Result, ...]
    config_source: str | None  # None: the config could not be loaded
    account: str
    home: str

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status == "fail"]

    @property
    def exit_code(self) -> int:
        """0: nothing is ✗; 2: the config itself is bad (as for every command); 1: else."""
        if not self.failed:
            return 0
        return EXIT_CONFIG if any(r.name == "config" for r in self.failed) else 1


def _check_config(path: str | None, env: Mapping[str, str]) -> tuple[Result, Config | None]:
    try:
        config = load_config(path, env)
    except ConfigError as exc:
        return fail(
            "config", str(exc), "fix each key named above (`llm-appliance check-config`)"
        ), None
    # Allowed but unwise settings (a clear-text LAN gateway, ...): noted, not a failure.
    warnings = config_warnings(config)
    detail = config.summary() + "".join(f"\nwarning: {w}" for w in warnings)
    return ok("config", detail, source=config.source or None, warnings=warnings), config


def _engine_count(config: Config, device: str, gpu_count: int) -> int:
    if device == "cpu":
        return config.engine.cpu_engines
    return len(selected_gpus(config.engine.gpus, gpu_count))


def _engine_checks(
    config: Config,
    *,
    home: Path,
    device: str,
    gpus: Sequence[int],
    gpu_totals: Sequence[int],
    account: Account,
    env: Mapping[str, str],
    under_unit: bool,
    probes: Probes,
    gpu_memory: Mapping[int, int] | None = None,
) -> list[Result]:
    engine_env = {**env, **config.engine.env}
    results = [
        check_engine_venv(
            config,
            home,
            device=device,
            probe=lambda py: probes.venv(py, engine_env, account),
            under_unit=under_unit,
        ),
        *check_models(
            config,
            home,
            device=device,
            account=account,
            env=env,
            gpu_totals=gpu_totals,
            under_unit=under_unit,
            gpu_memory=gpu_memory,
        ),
        check_caches(config, env),
    ]
    if config.engine.listen == "unix":
        results.append(check_socket_dir(runtime_dir(env), account))
    else:
        n = _engine_count(config, device, len(gpus))
        ports = [config.engine.port_base + i for i in range(n)]
        results.append(check_ports(ports, holder=probes.port_holder, is_ours=probes.is_ours))
    return results


def _nvidia_checks(nv: NvidiaProbe, config: Config | None, probes: Probes) -> list[Result]:
    """The driver and each GPU, judged against the engine settings (defaults if none)."""
    e = config.engine if config is not None else None
    return check_nvidia(
        nv,
        device=e.device if e is not None else "auto",
        gpus_setting=e.gpus if e is not None else "auto",
        gpu_memory_utilization=e.gpu_memory_utilization if e is not None else 0.9,
        driver_loaded=probes.driver_loaded(),
        describe_pid=probes.describe_pid,
        power_limit_w=config.thermal.power_limit_w if config is not None else 0,
    )


def _host_checks(
    config: Config | None,
    home: Path,
    account: Account,
    unit: dict[str, str] | str,
    probes: Probes,
) -> list[Result]:
    """State directory, keys file, disk, the systemd unit, the gateway and whether the
    state files can be written, in that order."""
    results = [check_state_dir(home, account)]
    if config is not None:
        results.append(check_keys_file(Path(config.gateway.keys_file), account))
    else:
        results.append(na("keys file", "the config is invalid"))
    results.append(
        check_disk(home, setup_done=(home / paths.SETUP_MARKER).exists(), usage=probes.disk_usage)
    )
    results.append(check_systemd(unit))
    if config is None:
        return [
            *results,
            na("gateway", "the config is invalid"),
            na(STATE_NAME, "the config is invalid"),
        ]
    gateway = check_gateway(config.gateway, opener=probes.opener)
    readyz = gateway.data.get("readyz")  # the daemon's own account of its state writes
    state = check_state_writes(
        Path(config.gateway.keys_file), readyz, account, statvfs=probes.statvfs
    )
    return [*results, gateway, state]


def run_checks(
    config_path: str | None, env: Mapping[str, str] | None = None, probes: Probes | None = None
) -> Report:
    env = os.environ if env is None else env
    probes = probes or Probes()
    config_result, config = _check_config(config_path, env)
    unit = probes.unit()
    account = probes.account or service_account(
        unit.get("User") if isinstance(unit, dict) else None
    )
    home = paths.appliance_home(env)
    nv = probe_nvidia(probes.nvml)
    e = config.engine if config is not None else None
    setting = e.device if e is not None else "auto"
    device = "cpu" if setting == "cpu" or (setting == "auto" and not nv.gpus) else "cuda"
    gpus = selected_gpus(e.gpus if e is not None else "auto", len(nv.gpus))
    results = [config_result, *_nvidia_checks(nv, config, probes)]
    under_unit = isinstance(unit, dict) and unit.get("LoadState") == "loaded"
    if config is not None:
        results += _engine_checks(
            config,
            home=home,
            device=device,
            gpus=gpus,
            gpu_totals=gpu_memory_totals(nv, gpus),
            gpu_memory={g.index: g.memory_total for g in nv.gpus if g.memory_total},
            account=account,
            env=env,
            under_unit=under_unit,
            probes=probes,
        )
    else:
        results += [na(n, "the config is invalid") for n in ("engine venv", "model", "caches")]
    results += _host_checks(config, home, account, unit, probes)
    source = (config.source or "built-in defaults") if config is not None else None
    return Report(tuple(results), source, account.name, str(home))


# --- output ----------------------------------------------------------------------------------


def render_table(report: Report) -> str:
    width = max(len(r.name) for r in report.results)
    pad = " " * (width + 4)
    lines = [
        f"llm-appliance doctor {__version__}: config {report.config_source or '(invalid)'}, "
        f"service account {report.account}, state dir {report.home}",
        "",
    ]
    for r in report.results:
        detail = r.detail.splitlines() or [""]
        lines.append(f"{r.symbol} {r.name.ljust(width)}  {detail[0]}")
        lines += [pad + d for d in detail[1:]]
        if r.fix:
            lines.append(f"{pad}→ {r.fix}")
    failed = report.failed
    lines.append("")
    if failed:
        lines.append(f"{len(failed)} problem(s): " + ", ".join(r.name for r in failed))
    else:
        lines.append("no problems found (– lines do not apply to this machine)")
    return "\n".join(lines)


def render_json(report: Report) -> str:
    return json.dumps(
        {
            "version": __version__,
            "config": report.config_source,
            "account": report.account,
            "state_dir": report.home,
            "ok": not report.failed,
            "failed": [r.name for r in report.failed],
            "checks": [r.to_json() for r in report.results],
        },
        indent=2,
        ensure_ascii=False,
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    report = run_checks(args.config)
    print(render_json(report) if args.json else render_table(report))
    return report.exit_code


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "doctor",
        parents=[common],
        help="check the box: config, GPUs, engine venv, model, files, unit, gateway",
        description="Check everything the appliance needs on this machine. Exit 0 when "
        "nothing failed, 1 when a check failed, 2 when the config is invalid.",
    )
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=cmd_doctor)
