"""Error responses in the shape of the protocol the client speaks, never a stack trace.

OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on every route but
Anthropic's (``/v1/messages``, ``/v1/messages/count_tokens``), where it is Anthropic's
``{"type": "error", "error": {"type", "message"}}`` with Anthropic's type names
(:data:`ANTHROPIC_TYPES`): each SDK maps the status and the type to its exception
classes. Every refusal the gateway makes goes through :func:`error_response`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Literal

from aiohttp import web

Shape = Literal["openai", "anthropic"]

ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",  # an engine's (FastAPI's) refusal of a field
    429: "rate_limit_error",
    502: "api_error",
    503: "service_unavailable",
    504: "timeout_error",
}


# Anthropic's error types by status (its API's errors page); 503: it says overloaded.
ANTHROPIC_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    kind = ANTHROPIC_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    type_: str | None = None,
) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": type_ or ERROR_TYPES.get(status, "api_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    type_: str | None = None,
    retry_after: float | None = None,
    headers: Mapping[str, str] | None = None,
    shape: Shape = "openai",
) -> web.Response:
    hdrs = dict(headers or {})
    if retry_after is not None:
        hdrs["Retry-After"] = str(max(1, int(retry_after + 0.999)))
    if status == 401:
        hdrs.setdefault("WWW-Authenticate", 'Bearer realm="llm-appliance"')
    if shape == "anthropic":
        body = anthropic_error_body(status, message)
    else:
        body = error_body(status, message, param=param, code=code, type_=type_)
    return web.Response(
        status=status,
        body=json.dumps(body),
        content_type="application/json",
        headers=hdrs,
    )


def sse_error_event(status: int, message: str, code: str) -> bytes:
    """The event that ends a stream cleanly when the engine fails after the first byte."""
    return b"data: " + json.dumps(error_body(status, message, code=code)).encode() + b"\n\n"


# What an engine's own 4xx is called in the gateway's shape (a string code, never vLLM's
# integer), by status; a prompt that does not fit the context has OpenAI's code of its own
# (context_length_exceeded).
ENGINE_CODES: Mapping[int, str] = {
    404: "not_found",
    413: "request_too_large",
    422: "invalid_request",
}
CONTEXT_WORDS = "maximum context length"  # in each of vLLM 0.32's messages for it
MAX_ENGINE_MESSAGE = 4096  # characters of the engine's words passed on


def engine_refusal(status: int, body: bytes, shape: Shape = "openai") -> web.Response:
    """An engine's 4xx answer in the gateway's shape, its words kept.

    vLLM 0.32 writes ``{"error": {"message", "type": "BadRequestError", "param", "code":
    400}}`` (an integer code, its exception's name as the type), Anthropic's envelope
    with those same types on /v1/messages, ``{"detail": ...}`` from FastAPI, and older
    servers ``{"object": "error", "message", ...}``. The client gets the gateway's
    ``{"error": {"message", "type", "param", "code"}}`` with a string code (Anthropic's
    shape and type names on its routes), as for every other refusal. Only the error
    path calls this: a successful answer passes untouched.
    """
    if status in (401, 403):
        # The engine refused the gateway's own per-start key (an engine restarted under
        # the request, or something else on its address): the client's key is fine, so
        # never a 401 telling it otherwise.
        return error_response(
            502,
            f"the engine refused the gateway (HTTP {status}); retry",
            code="engine_error",
            retry_after=1,
            shape=shape,
        )
    message, param = _engine_words(body)
    if not message:
        message = f"the engine refused the request (HTTP {status})"
    return error_response(
        status,
        message[:MAX_ENGINE_MESSAGE],
        param=param,
        code=(
            "context_length_exceeded"
            if CONTEXT_WORDS in message
            else ENGINE_CODES.get(status, "invalid_request")
        ),
        shape=shape,
    )


def _engine_words(body: bytes) -> tuple[str, str | None]:
    """(message, param) of an engine's error body, whatever its shape; ("", None) when
    it has none."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return body.decode("utf-8", "replace").strip(), None
    if not isinstance(doc, dict):
        return "", None
    inner = doc.get("error")
    where = inner if isinstance(inner, dict) else doc
    message = where.get("message")
    if not isinstance(message, str):
        detail = doc.get("detail")  # FastAPI: a text, or a list of {"loc", "msg", ...}
        if isinstance(detail, str):
            message = detail
        elif isinstance(detail, list):
            message = "; ".join(
                str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in detail
            )
        else:
            message = ""
    param = where.get("param")
    return message, param if isinstance(param, str) and param else None


class GatewayError(Exception):
    """Raised inside a handler to refuse a request; turned into an error_response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        reason: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.reason = reason or code or str(status)
        self.close = close  # the answer ends the connection (no keep-alive)

    def response(self, shape: Shape = "openai") -> web.Response:
        resp = error_response(
            self.status,
            self.message,
            param=self.param,
            code=self.code,
            retry_after=self.retry_after,
            shape=shape,
        )
        if self.close:
            resp.force_close()
        return resp
