"""The one middleware every request passes: refusals before anything is read, the key
and its scope, every refusal in the shape of its route's protocol, and the request
metrics. It is given the few parts it reads (the gateway section of the config, the
keys, the adapter counts, the request metrics); app.py builds it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from appliance.config import Config, GatewayConfig
from appliance.gateway.admission.adapter_work import AdapterWork
from appliance.gateway.admission.models import UNKNOWN_MODEL
from appliance.gateway.errors import GatewayError, error_response
from appliance.gateway.http.server import BodyTimeout
from appliance.gateway.keys import KeyStore, required_scope
from appliance.gateway.observe.metrics import GatewayMetrics
from appliance.gateway.observe.probes import KEYS_UNUSABLE
from appliance.gateway.protocols import shape_of_path

log = logging.getLogger("appliance.gateway")

BEARER = "bearer "


def _route_label(request: web.Request) -> str:
    """The route's pattern (bounded label values), or "unmatched" for unknown paths."""
    info = request.match_info
    resource = info.route.resource
    if info.http_exception is not None or resource is None:
        return "unmatched"
    return resource.canonical


def _presented_key(request: web.Request) -> str | None:
    """The key the client sent: ``Authorization: Bearer``, or on Anthropic's routes
    ``x-api-key`` as well (what the ``anthropic`` SDK sends; Claude Code with a token
    sends the bearer)."""
    header = request.headers.get("Authorization", "")
    if header[: len(BEARER)].lower() == BEARER:
        return header[len(BEARER) :]
    if shape_of_path(request.path) == "anthropic":
        return request.headers.get("x-api-key")
    return None


def _authenticate(keys: KeyStore, request: web.Request, scope: str) -> None:
    presented = _presented_key(request)
    if presented is None:
        also = " or 'x-api-key: <key>'" if shape_of_path(request.path) == "anthropic" else ""
        raise GatewayError(
            401,
            f"missing API key: send 'Authorization: Bearer <key>'{also}",
            code="missing_api_key",
            reason="auth",
        )
    if keys.problem is not None:
        # No key can be checked: telling a client "invalid key" would send them to the
        # admin for a new one. The details (path, parse error) are for the journal.
        raise GatewayError(
            503,
            KEYS_UNUSABLE + "; retry later",
            code="keys_file_error",
            retry_after=5,
        )
    record, reason = keys.lookup(presented.strip())
    if record is None:
        message = "this API key has expired" if reason == "expired" else "invalid API key"
        raise GatewayError(401, message, code="invalid_api_key", reason="auth")
    if not record.allows(scope):
        raise GatewayError(
            403,
            f"this key lacks the '{scope}' scope needed for {request.path}",
            code="insufficient_scope",
            reason="scope",
        )
    request["key"] = record


def _refuse_encoded_body(request: web.Request) -> None:
    """415 for a body in any Content-Encoding but ``identity``, before anything reads it.

    The server does not inflate bodies (``auto_decompress=False`` in start_gateway): a
    0.5 MB gzip body that inflates to 500 MiB took the event loop for seconds, before
    authentication, every stream on the box frozen with it. The body is never read; the
    answer closes the connection (aiohttp discards what the client still sends, raw, for
    at most its lingering time). OpenAI's and Anthropic's clients send plain bodies."""
    encodings = request.headers.getall("Content-Encoding", ())
    if all(e.strip().lower() in ("", "identity") for e in encodings):
        return
    raise GatewayError(
        415,
        "compressed request bodies are not accepted: send the body without "
        "Content-Encoding (or with 'identity')",
        code="unsupported_content_encoding",
        reason="content_encoding",
        close=True,
    )


def _check_access(gateway: GatewayConfig, keys: KeyStore, request: web.Request) -> None:
    """The key the route's scope needs (none for open routes, nor /metrics made public)."""
    scope = required_scope(request.path)
    # metrics_public opens /metrics alone: the status page's data still needs a key.
    if scope is not None and not (request.path == "/metrics" and gateway.metrics_public):
        _authenticate(keys, request, scope)


def _http_error(
    gateway: GatewayConfig, request: web.Request, exc: web.HTTPException
) -> web.Response:
    """aiohttp's own refusals (body too large, no route, wrong method) in the shape of the
    route's protocol."""
    shape = shape_of_path(request.path)
    if exc.status == 413:
        limit = gateway.max_body_bytes
        return error_response(
            413,
            f"the request body is larger than {limit} bytes",
            code="request_too_large",
            shape=shape,
        )
    if exc.status == 404:
        return error_response(
            404, f"no such route: {request.method} {request.path}", code="unknown_route"
        )
    if exc.status == 405:
        return error_response(
            405,
            f"{request.method} is not allowed on {request.path}",
            code="method_not_allowed",
            headers={"Allow": exc.headers.get("Allow", "")},
            shape=shape,
        )
    return error_response(exc.status, exc.reason or "request refused", shape=shape)


class GatewayMiddleware:
    """The middleware (aiohttp's new style: an awaitable of the request and the handler)."""

    __middleware_version__ = 1  # what aiohttp's @web.middleware marks: the new style

    def __init__(
        self,
        config: Callable[[], Config],
        keys: KeyStore,
        adapter_work: AdapterWork,
        metrics: GatewayMetrics,
    ) -> None:
        self._config = config  # read per request: a SIGHUP may change the live keys
        self._keys = keys
        self._adapter_work = adapter_work
        self._metrics = metrics

    async def __call__(self, request: web.Request, handler: Any) -> web.StreamResponse:
        started = time.monotonic()
        route = _route_label(request)
        status = 500
        try:
            _refuse_encoded_body(request)
            _check_access(self._config().gateway, self._keys, request)
            resp: web.StreamResponse = await handler(request)
            status = request.get("status", resp.status)
            return resp
        except GatewayError as exc:
            status = exc.status
            return exc.response(shape_of_path(request.path))
        except BodyTimeout as exc:  # the connection's body timer (gateway.server) ran out
            status = 408
            return exc.response(shape_of_path(request.path))
        except web.HTTPException as exc:
            status = exc.status
            return _http_error(self._config().gateway, request, exc)
        except asyncio.CancelledError:
            status = 499  # the client went away; the upstream request was closed with it
            raise
        except ConnectionError:
            status = 499
            raise
        except Exception:
            log.exception("unexpected error on %s %s", request.method, request.path)
            status = 500
            return error_response(
                500,
                "internal error in the gateway; see its log",
                code="internal_error",
                shape=shape_of_path(request.path),
            )
        finally:
            self._adapter_work.end(request)  # a request for a LoRA adapter: counted no more
            # The model label is a configured name once the relay resolved one, else "".
            model = request.get("model", UNKNOWN_MODEL)
            self._metrics.answered(route, status, model, started)
