"""What a model refuses of a request body, before admission: the one call the relay makes.

Each rule is its module's (tools.py, logprobs.py, media.py) and reads what the route says
of its body (``Route.calls_tools``, ``prompt_logprobs``, ``media_fields``); the first
refusal wins. They run on the model the request is sent to, so a fallback model is asked
afresh (relay/handlers.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.config import ServedModel
from appliance.gateway.errors import GatewayError
from appliance.gateway.protocols.base import Route
from appliance.gateway.protocols.logprobs import prompt_logprobs_refusal
from appliance.gateway.protocols.media import media_refusal
from appliance.gateway.protocols.tools import tools_refusal


def model_refusal(
    route: Route, body: Mapping[str, Any], model: ServedModel, tables: bool
) -> GatewayError | None:
    """The 400 ``model`` answers ``body`` on ``route`` with, or None when it takes it.
    ``tables``: the config has [[models]] tables (which key a message names)."""
    return (
        tools_refusal(route.calls_tools, body, model, tables)
        or prompt_logprobs_refusal(route.prompt_logprobs, body, model, tables)
        or media_refusal(route.media_fields, body, model, tables)
    )
