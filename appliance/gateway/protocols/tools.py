"""Whether a request lets the model call a tool, and the refusal when its model cannot.

vLLM 0.32 extracts tool calls from a model's text only with a tool-call parser
(``--tool-call-parser``, which the model's ``tool_call_parser`` key sets, with
``--enable-auto-tool-choice``). Without one, what a request with ``tools`` gets depends
on the route: chat is vLLM's 400 naming its own command-line flags (useless to a client
of this box) for ``tool_choice`` "auto" (the default when ``tools`` are sent), "required"
or a named function (``online_renderer.render_chat``); Messages is converted to chat and
gets the same; Responses answers 200 with the tool call left as text (``parser.
_extract_tool_calls`` returns it unparsed), which a client takes for a model that never
calls tools. So the gateway refuses all three alike, before admission, with a 400 that
names the key to set. ``tool_choice: "none"`` (Anthropic's ``{"type": "none"}``) needs no
parser on any route, and neither do ``response_format`` or ``structured_outputs``: they
pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from appliance.config import ServedModel
from appliance.gateway.errors import GatewayError

ToolsReader = Callable[[Mapping[str, Any]], bool]


def openai_calls_tools(body: Mapping[str, Any]) -> bool:
    """Chat and Responses: ``tools`` given and ``tool_choice`` anything but "none"
    (absent means "auto"; an explicit null is read as no tool choice, as vLLM's chat
    reads it, and left to the engine)."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return False
    choice = body.get("tool_choice", "auto")
    return choice is not None and choice != "none"


def anthropic_calls_tools(body: Mapping[str, Any]) -> bool:
    """Messages: ``tools`` given and ``tool_choice`` absent (vLLM makes it "auto") or of
    a type other than "none"."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return False
    choice = body.get("tool_choice")
    return not (isinstance(choice, dict) and choice.get("type") == "none")


def parser_key(model: ServedModel, tables: bool) -> str:
    """The config key that turns tool calls on for ``model``, as an admin writes it."""
    return f"models.{model.name}.tool_call_parser" if tables else "engine.tool_call_parser"


def tools_refusal(
    calls_tools: ToolsReader | None, body: Mapping[str, Any], model: ServedModel, tables: bool
) -> GatewayError | None:
    """The 400 for a request that lets ``model`` call tools (``calls_tools``: its route's
    reader; None: a route without tools) when the model has no parser; else None.
    ``tables``: the config has [[models]] tables (which key to name)."""
    if calls_tools is None or model.engine.tool_call_parser or not calls_tools(body):
        return None
    return GatewayError(
        400,
        f"the model '{model.name}' is not set up to call tools: 'tools' with tool_choice "
        f'"auto" (the default), "required" or a named tool need a tool-call parser; '
        f'the operator sets {parser_key(model, tables)} (e.g. "hermes"; `llm-appliance '
        'check-config` lists vLLM\'s names). Send tool_choice "none" to use the model '
        "without tools.",
        param="tool_choice",
        code="tools_not_enabled",
        reason="bad_request",
    )
