"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the gateway makes goes through :func:`error_response`, so clients (the
official ``openai`` package maps status codes to exception classes) always get the same
shape, and never a stack trace.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from aiohttp import web

ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "service_unavailable",
    504: "timeout_error",
}


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
) -> web.Response:
    hdrs = dict(headers or {})
    if retry_after is not None:
        hdrs["Retry-After"] = str(max(1, int(retry_after + 0.999)))
    if status == 401:
        hdrs.setdefault("WWW-Authenticate", 'Bearer realm="llm-appliance"')
    return web.Response(
        status=status,
        body=json.dumps(error_body(status, message, param=param, code=code, type_=type_)),
        content_type="application/json",
        headers=hdrs,
    )


def sse_error_event(status: int, message: str, code: str) -> bytes:
    """The event that ends a stream cleanly when the engine fails after the first byte."""
    return b"data: " + json.dumps(error_body(status, message, code=code)).encode() + b"\n\n"


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

    def response(self) -> web.Response:
        resp = error_response(
            self.status,
            self.message,
            param=self.param,
            code=self.code,
            retry_after=self.retry_after,
        )
        if self.close:
            resp.force_close()
        return resp
