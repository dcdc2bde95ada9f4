"""The composition root: the only module that knows both the supervisor and the gateway.

``llm-appliance serve`` builds the supervisor; once the engines are planned, the
supervisor asks for the gateway, which is built over the supervisor's side of the door
(:class:`appliance.control.Appliance`) and hands back its own side (the
:class:`~appliance.control.GatewayLink`) and how to close it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from appliance.audit import AuditLog, audit_path
from appliance.config import Config, config_warnings
from appliance.control import Listening
from appliance.errors import ApplianceError
from appliance.gateway.app import GATEWAY, start_gateway
from appliance.supervisor import Supervisor

log = logging.getLogger("appliance.supervisor")


async def serve(config: Config, config_arg: str | None = None) -> int:
    """Run the appliance until it stops; its exit status."""
    for warning in config_warnings(config):
        log.warning("config: %s", warning)
    # One audit log for both sides, beside the keys file (the state directory).
    audit = AuditLog(audit_path(Path(config.gateway.keys_file)))
    supervisor = Supervisor(config, config_arg=config_arg, audit=audit)

    async def start_http() -> Listening:
        runner = await start_gateway(supervisor, audit)
        return Listening(link=runner.app[GATEWAY], close=runner.cleanup)

    try:
        return await supervisor.run(start_http=start_http)
    except ApplianceError as exc:
        log.error("%s", exc)
        return exc.exit_code
