"""The admin's LoRA adapter routes' parts (issue 23): the body of an add (a JSON object of
known fields, read as every admin body is), the answer when the supervisor refused, how
an adapter shows in ``/admin/status``. The handlers are
:class:`appliance.gateway.admin.routes.Admin`'s (audited like every admin action)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from aiohttp import web

from appliance.control import AdapterResult
from appliance.gateway.errors import GatewayError

PATH_SHOWN = 512  # an adapter's folder in the audit trail (one line per action)


def shown(name: str, most: int = 64) -> str:
    """What a client sent, as the audit trail records it: bounded."""
    return name if len(name) <= most else name[: most - 3] + "..."


async def json_object(request: web.Request, allowed: Collection[str]) -> dict[str, Any]:
    """An admin request's body: a JSON object of ``allowed`` fields only, or a 400 naming
    what is wrong (the first unknown field as ``param``)."""
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        raise GatewayError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise GatewayError(
            400, f"unknown field(s) {unknown}; allowed: {sorted(allowed)}", param=unknown[0]
        )
    return body


async def adapter_body(request: web.Request) -> tuple[str, str]:
    """``{"name", "path"}`` of an adapter to add, or a 400 naming the field."""
    body = await json_object(request, ("name", "path"))
    for field_name in ("name", "path"):
        if not isinstance(body.get(field_name), str) or not body[field_name]:
            raise GatewayError(400, f"'{field_name}' is required: a string", param=field_name)
    return body["name"], body["path"]


def refuse_unless(result: AdapterResult) -> None:
    if not result.ok:
        # The audit records the code, never the message (_audited): it quotes the path.
        retry = 5 if result.status == 503 else None
        raise GatewayError(result.status, result.message, code=result.code, retry_after=retry)
