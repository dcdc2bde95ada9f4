"""The warnings about settings that are allowed but unwise, each with what to do instead.

``check-config`` prints them after its summary (still exit 0) and ``serve`` logs them at
WARNING when it starts: they are choices an admin may make on purpose, so they never
stop the service (the problems that do are the rest of :mod:`appliance.config.checks`).
"""

from __future__ import annotations

import string

from appliance.config.checks.sections import is_loopback
from appliance.config.schema import Config
from appliance.config.words import label, show


def _placeholders(arg: str) -> set[str]:
    try:
        return {f for _, f, _, _ in string.Formatter().parse(arg) if f is not None}
    except ValueError:
        return set()  # a config problem of its own, named by sections.check


def config_warnings(cfg: Config) -> list[str]:
    """Settings that are allowed but unwise, each with what to do instead (see the
    module's doc: never a reason to stop)."""
    warnings: list[str] = []
    g, e = cfg.gateway, cfg.engine
    if not is_loopback(g.host) and not g.tls_cert:
        warnings.append(
            f"gateway.host = {show(g.host)} (allow_lan = true) without tls_cert/tls_key: "
            "API keys, prompts and answers cross the network in clear text, readable "
            "and replayable by anyone on the path; set gateway.tls_cert and "
            "gateway.tls_key (docs/security.md)"
        )
    commands = [("engine", e.command)] + [
        (label(i, m.name), m.overrides["command"])
        for i, m in enumerate(cfg.models)
        if "command" in m.overrides
    ]
    for path, command in commands:
        warnings += _api_key_warnings(path, command)
        warnings += _heat_restart_warnings(cfg, path, command)
    return warnings


# What a heat restart halves (appliance/supervisor/planned.py): it finds the flag in the
# engine's argv as an argument of its own, the number after it.
BATCHED_TOKENS_FLAG = "--max-num-batched-tokens"


def _heat_restart_warnings(cfg: Config, path: str, command: list[str]) -> list[str]:
    """Heat restarts are on, but this command gives no ``--max-num-batched-tokens`` to
    halve: its engines are never restarted for heat (only the admission throttle acts)."""
    after = cfg.thermal.heat_restart_after_s
    if not command or after <= 0 or BATCHED_TOKENS_FLAG in command:
        return []
    return [
        f"{path}.command: has no {BATCHED_TOKENS_FLAG} argument, so thermal."
        f"heat_restart_after_s = {after:g} does nothing for its engines (a heat restart "
        "halves that number; the admission throttle still acts); add "
        f'"{BATCHED_TOKENS_FLAG}", "<tokens>" (two arguments) to the command, or set '
        "thermal.heat_restart_after_s = 0"
    ]


def _api_key_warnings(path: str, command: list[str]) -> list[str]:
    warnings: list[str] = []
    for i, arg in enumerate(command):
        if "api_key" in _placeholders(arg):
            warnings.append(
                f"{path}.command[{i}] = {show(arg)}: {{api_key}} puts the engine key on a "
                "command line, which every local user can read (ps, /proc/PID/cmdline); "
                "remove it: the engine gets its key in VLLM_API_KEY"
            )
    return warnings
