"""A SIGHUP's reload: read the config file again, keep what may change live, say the rest.

A file with problems is refused and the running config stays in force. Of a good one,
the live keys apply at once (:func:`appliance.reload.merge_live`); keys that shape an
engine's command line or a socket are named in the log as needing a restart. The
gateway then reloads its keys file. One audit line records the outcome: changed keys
and a count of problems, never a value (``engine.env`` may hold a token).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from appliance.audit import AuditLog, Outcome
from appliance.config import Config, load_config
from appliance.control import GatewayLink
from appliance.errors import ConfigError
from appliance.reload import merge_live

log = logging.getLogger("appliance.supervisor")


@dataclass
class Reload:
    """What one reload did: the config now in force, and what the audit line says."""

    config: Config
    outcome: Outcome = "ok"
    detail: dict[str, object] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)  # live keys now in force


def reread_config(current: Config, config_arg: str | None, env: Mapping[str, str]) -> Reload:
    """Load the config again; the merged config, or ``current`` when the file is refused."""
    try:
        new = load_config(config_arg, env, require_file=bool(current.source))
    except ConfigError as exc:
        log.error(
            "reload refused; the running config stays in force:\n  %s",
            "\n  ".join(exc.problems),
        )
        return Reload(current, "refused", {"problems": len(exc.problems)})
    merged, live, restart = merge_live(current, new)
    if live:
        log.info("reload applied: %s", ", ".join(live))
    if restart:
        log.warning(
            "reload: these keys changed but need a restart (systemctl restart llm-appliance): %s",
            ", ".join(restart),
        )
    return Reload(merged, detail={"applied": live, "need_restart": restart}, applied=live)


def reload_keys(link: GatewayLink, done: Reload) -> None:
    """The gateway's keys file, read again; a failure is logged, never fatal."""
    try:
        link.reload()
    except Exception:  # a failing key reload must not take the daemon down
        log.exception("reloading keys failed")
        done.outcome, done.detail["keys"] = "error", "reload failed (see the journal)"


def audit_reload(audit: AuditLog, done: Reload) -> None:
    source = done.config.source or "built-in defaults"
    audit.record("config.reload", f"config:{source}", "signal:SIGHUP", done.outcome, **done.detail)
