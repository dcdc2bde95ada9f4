"""Checks across keys and sections (what one field's type and bounds cannot say): the
gateway's address and TLS, the GPU list, engine ports, engine commands and variables,
the sensor source and limits that must be ordered. The warnings about settings that are
allowed but unwise are :mod:`appliance.config.checks.advice`."""

from __future__ import annotations

import ipaddress
import re
import string

from appliance.config.schema import (
    COMMAND_PLACEHOLDERS,
    MAX_GPUS,
    RESERVED_ENGINE_ENV,
    Config,
    EngineConfig,
)
from appliance.config.words import show


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (so a plain-HTTP gateway is not on a network)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_command_listens(e: EngineConfig, path: str, problems: list[str]) -> None:
    """A custom command must tell its engine where to listen, or nothing can reach it."""
    need = "uds" if e.listen == "unix" else "port"
    if e.command and not any("{" + need + "}" in arg for arg in e.command):
        problems.append(
            f"{path}.command: has no {{{need}}} placeholder, so the engine cannot know "
            f'where to listen with engine.listen = "{e.listen}" (add "--{need}", '
            f'"{{{need}}}"'
            + (', or set engine.listen = "tcp" and use {port})' if need == "uds" else ")")
        )


def engine_count_bound(cfg: Config) -> int:
    """The most engines this config can start (what the engine ports must make room for)."""
    e, total = cfg.engine, 0
    for m in cfg.served:
        gpu_engines = MAX_GPUS if m.gpus is None else len(m.gpus) // m.tensor_parallel_size
        # With device = "auto" the machine decides: GPUs if it has them, else CPU engines.
        total += {"cpu": m.cpu_engines, "cuda": gpu_engines}.get(
            e.device, max(gpu_engines, m.cpu_engines)
        )
    return total


def check(cfg: Config, problems: list[str]) -> None:
    """Rules that span fields of the sections, in the order their problems are listed."""
    _check_gateway(cfg, problems)
    _check_gpus(cfg.engine, problems)
    _check_ports(cfg, problems)
    check_engine_keys(cfg.engine, "engine", problems)
    _check_telemetry_and_limits(cfg, problems)


def _check_gateway(cfg: Config, problems: list[str]) -> None:
    g = cfg.gateway
    if not is_loopback(g.host) and not g.allow_lan:
        problems.append(
            f"gateway.host = {show(g.host)}: a non-loopback address needs "
            "gateway.allow_lan = true (and should use tls_cert/tls_key)"
        )
    if bool(g.tls_cert) != bool(g.tls_key):
        problems.append("gateway.tls_cert / gateway.tls_key: set both for HTTPS, or neither")
    if g.keys_file == "":
        problems.append('gateway.keys_file = "": must be a file path')


def _check_gpus(e: EngineConfig, problems: list[str]) -> None:
    if isinstance(e.gpus, list):
        if not e.gpus:
            problems.append('engine.gpus = []: must be "auto" or a non-empty list of GPU indices')
        elif len(set(e.gpus)) != len(e.gpus) or any(i < 0 or i >= 64 for i in e.gpus):
            problems.append(f"engine.gpus = {e.gpus!r}: indices must be distinct and 0..63")
        elif len(e.gpus) > MAX_GPUS:
            problems.append(f"engine.gpus = {e.gpus!r}: at most {MAX_GPUS} GPUs")
        if e.device == "cpu":
            problems.append(
                'engine.gpus: a GPU list needs engine.device = "cuda" or "auto" '
                '(with device = "cpu" use engine.cpu_engines)'
            )


def _check_ports(cfg: Config, problems: list[str]) -> None:
    """Engine ports inside 1..65535 and clear of the gateway's port."""
    g, e = cfg.gateway, cfg.engine
    count = engine_count_bound(cfg)
    if e.port_base + count - 1 > 65535:
        problems.append(f"engine.port_base = {e.port_base}: engine ports would pass 65535")
    elif e.listen == "tcp" and e.port_base <= g.port < e.port_base + count:
        problems.append(
            f"gateway.port = {g.port}: collides with engine ports "
            f"{e.port_base}..{e.port_base + count - 1} (engine.port_base)"
        )


def _check_telemetry_and_limits(cfg: Config, problems: list[str]) -> None:
    """The sensor source, and limits that must be ordered (hard above soft, and so on)."""
    t, th, r = cfg.telemetry, cfg.thermal, cfg.restart
    if not (t.source in ("nvml", "none") or (t.source.startswith("file:") and len(t.source) > 5)):
        problems.append(
            f'telemetry.source = {show(t.source)}: must be one of "nvml", '
            '"none", "file:/path/sensors.json"'
        )
    if th.hard_limit_c <= th.soft_limit_c:
        problems.append(
            f"thermal.hard_limit_c = {th.hard_limit_c:g}: must be above "
            f"thermal.soft_limit_c ({th.soft_limit_c:g})"
        )
    d = cfg.degradation
    for name in ("hang_s", "leak_hold_s"):
        if getattr(d, name) > d.window_s:
            problems.append(
                f"degradation.{name} = {getattr(d, name):g}: must be <= "
                f"degradation.window_s ({d.window_s:g})"
            )
    if r.backoff_max_s < r.backoff_initial_s:
        problems.append(
            f"restart.backoff_max_s = {r.backoff_max_s:g}: must be >= "
            f"restart.backoff_initial_s ({r.backoff_initial_s:g})"
        )


def check_engine_keys(e: EngineConfig, path: str, problems: list[str]) -> None:
    """engine.command and engine.env (or a model's own, under ``path``): placeholders,
    where the engine listens, variable names and the supervisor's reserved variables."""
    _check_command_listens(e, path, problems)
    for i, arg in enumerate(e.command):
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(arg) if f is not None]
        except ValueError as exc:
            problems.append(
                f"{path}.command[{i}] = {show(arg)}: {exc} (write a literal brace as {{{{ or }}}})"
            )
            continue
        for name in names:
            if name not in COMMAND_PLACEHOLDERS:
                problems.append(
                    f"{path}.command[{i}] = {show(arg)}: unknown placeholder "
                    f"{{{name}}}; allowed: "
                    + " ".join(f"{{{p}}}" for p in sorted(COMMAND_PLACEHOLDERS))
                )
    for key in e.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            problems.append(f"{path}.env.{key}: not a valid environment variable name")
        elif key in RESERVED_ENGINE_ENV or key.startswith("WATCHDOG_"):
            problems.append(
                f"{path}.env.{key}: set by the supervisor and not overridable "
                f"(reserved: {', '.join(sorted(RESERVED_ENGINE_ENV))}, WATCHDOG_*)"
            )
