"""The fake engine's other protocols, in vLLM 0.32's shapes (issue 22).

OpenAI's Responses API with its store (``/v1/responses``, retrieve, cancel), Anthropic's
Messages API streamed and not (``/v1/messages``, ``count_tokens``), the tokenizer routes
and scoring (``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``). A
token is a word, as in the fake's chat; the answer is `` tok0 tok1 ...``. Events are
written compact, one per chunk, as vLLM's StreamingResponse writes them. Standard
library and aiohttp only, like fake_engine.py, which adds these routes to its app.

Faults honoured: ``fail_requests`` (the engine's 500), ``break_before_usage`` (the
connection closes before the stream's final counts), the token delays.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

from aiohttp import web

COMPACT = (",", ":")


def dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=COMPACT).encode()


def sse(event: str, obj: Any) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + dump(obj) + b"\n\n"


def words(value: Any) -> int:
    """Words in every string of a JSON value (the fake's tokens)."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(words(v) for v in value)
    if isinstance(value, dict):
        return sum(words(v) for k, v in value.items() if k in ("text", "content", "input"))
    return 0


def context_error(limit: int, prompt_tokens: int) -> str:
    """vLLM 0.32's words for a prompt longer than the context (renderers/params.py), as
    its error response carries them (the VLLMValidationError's str, with its extras)."""
    return (
        f"This model's maximum context length is {limit} tokens. However, your prompt "
        f"contains {prompt_tokens} input tokens, which exceeds this limit even without "
        f"any output tokens. Please reduce the length of the input prompt. "
        f"(parameter=input_tokens, value={prompt_tokens})"
    )


def anthropic_error(message: str, kind: str = "invalid_request_error", code: int = 400) -> Any:
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return web.json_response(body, status=code)


class ProtocolRoutes:
    """The routes, over a FakeEngine (its body reader, model name, knobs and counters)."""

    def __init__(self, engine: Any) -> None:
        self.e = engine
        self.store: dict[str, dict[str, Any]] = {}  # vLLM's response store (in memory)
        self.events: dict[str, list[bytes]] = {}  # background streams' events (event_store)

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/v1/responses", self.responses)
        r.add_get("/v1/responses/{rid}", self.retrieve)
        r.add_post("/v1/responses/{rid}/cancel", self.cancel)
        r.add_post("/v1/messages", self.messages)
        r.add_post("/v1/messages/count_tokens", self.count_tokens)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        for path in ("/score", "/v1/score"):
            r.add_post(path, self.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r.add_post(path, self.rerank)

    async def _tokens(self, n: int, each: Any) -> None:
        """Generate ``n`` tokens, calling ``each(t)`` (a coroutine) per token."""
        e = self.e
        for t in range(n):
            delay = e.token_delay_ms + (e.first_token_delay_ms if t == 0 else 0)
            if delay > 0:
                await asyncio.sleep(delay / 1000)
            e.generation_tokens += 1
            await each(t)

    async def _open(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        return resp

    def _broken(self, request: web.Request) -> bool:
        if self.e.faults["break_before_usage"] and request.transport is not None:
            request.transport.close()
            return True
        return False

    # ---- Responses -------------------------------------------------------------------
    def _response(self, body: dict[str, Any], status: str, text: str, usage: Any) -> Any:
        rid = body.get("request_id") or f"resp_{secrets.token_hex(16)}"
        out = [
            {
                "id": f"msg_{rid[5:]}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ]
        return {
            "id": rid,
            "created_at": int(time.time()),
            "model": self.e.model_name,
            "object": "response",
            "output": out if text else [],
            "previous_response_id": body.get("previous_response_id"),
            "status": status,
            "usage": usage,
        }

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await self.e._read_body(request)
        if isinstance(body, web.Response):
            return body
        prev = body.get("previous_response_id")
        if prev is not None and prev not in self.store:
            return self._not_found(prev)
        prompt = words(body.get("input")) + words(body.get("instructions") or "") + 4
        if prev is not None:
            prompt += self.store[prev]["usage"]["input_tokens"]
        n = body.get("max_output_tokens") or 16
        self.e.prompt_tokens += prompt
        if body.get("stream"):
            return await self._responses_stream(request, body, prompt, n)
        await self._tokens(n, _nothing)
        return web.json_response(self._done(body, prompt, n))

    def _done(self, body: dict[str, Any], prompt: int, n: int) -> dict[str, Any]:
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + n,
        }
        text = "".join(f" tok{t}" for t in range(n))
        # vLLM 0.32: an answer cut by max_output_tokens is "incomplete" (with why), in a
        # stream still sent as the response.completed event.
        cut = n >= (body.get("max_output_tokens") or n + 1)
        done = self._response(body, "incomplete" if cut else "completed", text, usage)
        if cut:
            done["incomplete_details"] = {"reason": "max_output_tokens"}
        if body.get("store") is not False:
            self.store[done["id"]] = done
        return done

    async def _responses_stream(
        self, request: web.Request, body: dict[str, Any], prompt: int, n: int
    ) -> web.StreamResponse:
        resp = await self._open(request)
        seq = iter(range(1 << 30))
        start = self._response(body, "in_progress", "", None)
        # vLLM keeps a background stream's events, which a retrieve with stream=true replays.
        kept: list[bytes] = (
            self.events.setdefault(start["id"], []) if body.get("background") else []
        )

        async def send(event: bytes) -> None:
            kept.append(event)
            await resp.write(event)

        await send(sse("response.created", _ev("response.created", seq, response=start)))
        await send(sse("response.in_progress", _ev("response.in_progress", seq, response=start)))

        async def token(t: int) -> None:
            kind = "response.output_text.delta"
            await send(sse(kind, _ev(kind, seq, delta=f" tok{t}", output_index=0)))

        await self._tokens(n, token)
        if self._broken(request):
            return resp
        done = self._done(body, prompt, n)
        await send(sse("response.completed", _ev("response.completed", seq, response=done)))
        await resp.write_eof()
        return resp

    def _not_found(self, rid: str) -> web.Response:
        err = {
            "message": f"Response with id '{rid}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
        return web.json_response({"error": err}, status=404)

    def _count(self, request: web.Request) -> None:
        by_route = self.e.requests_by_route
        by_route[request.path] = by_route.get(request.path, 0) + 1

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        self._count(request)
        rid = request.match_info["rid"]
        found = self.store.get(rid)
        if found is None:
            return self._not_found(rid)
        if request.query.get("stream") != "true":
            return web.json_response(found)
        # vLLM 0.32 replays a background stream's events; for any other response its
        # generator raises after the 200 head, which ends the connection with no event.
        resp = await self._open(request)
        for event in self.events.get(rid, []):
            await resp.write(event)
        if rid in self.events:
            await resp.write_eof()
        elif request.transport is not None:
            request.transport.close()
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        self._count(request)
        rid = request.match_info["rid"]
        if rid not in self.store:
            return self._not_found(rid)
        err = {
            "message": "Cannot cancel a synchronous response.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 400,
        }
        return web.json_response({"error": err}, status=400)

    # ---- Messages --------------------------------------------------------------------
    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await self.e._read_body(request)
        if isinstance(body, web.Response):
            return body
        n = body.get("max_tokens")
        if not isinstance(n, int):
            return anthropic_error("max_tokens: Field required")
        prompt = words(body.get("messages")) + words(body.get("system") or "") + 4
        if prompt > self.e.args.max_model_len:
            # vLLM 0.32's Messages route: Anthropic's envelope around its own error's
            # type and words (anthropic/api_router.py, translate_error_response).
            limit = self.e.args.max_model_len
            return anthropic_error(context_error(limit, prompt), "BadRequestError")
        self.e.prompt_tokens += prompt
        mid = f"chatcmpl-{secrets.token_hex(16)}"
        if not body.get("stream"):
            await self._tokens(n, _nothing)
            text = "".join(f" tok{t}" for t in range(n))
            return web.json_response(
                {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "text", "text": text}],
                    "model": self.e.model_name,
                    "stop_reason": "max_tokens",
                    "usage": {"input_tokens": prompt, "output_tokens": n},
                }
            )
        return await self._messages_stream(request, mid, prompt, n)

    async def _messages_stream(
        self, request: web.Request, mid: str, prompt: int, n: int
    ) -> web.StreamResponse:
        resp = await self._open(request)
        message = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.e.model_name,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": 0},
        }
        await resp.write(sse("message_start", {"type": "message_start", "message": message}))

        async def token(t: int) -> None:
            if t == 0:
                block = {"type": "text", "text": ""}
                start = {"type": "content_block_start", "index": 0, "content_block": block}
                await resp.write(sse("content_block_start", start))
            delta = {"type": "text_delta", "text": f" tok{t}"}
            ev = {"type": "content_block_delta", "index": 0, "delta": delta}
            await resp.write(sse("content_block_delta", ev))

        await self._tokens(n, token)
        await resp.write(sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
        if self._broken(request):
            return resp
        usage = {"input_tokens": prompt, "output_tokens": n}
        delta = {"stop_reason": "max_tokens", "stop_sequence": None}
        await resp.write(
            sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        )
        await resp.write(sse("message_stop", {"type": "message_stop"}))
        await resp.write_eof()
        return resp

    async def count_tokens(self, request: web.Request) -> web.Response:
        body = await self.e._read_body(request)
        if isinstance(body, web.Response):
            return body
        prompt = words(body.get("messages")) + words(body.get("system") or "") + 4
        return web.json_response({"input_tokens": prompt})

    # ---- tokenizer, scoring ----------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self.e._read_body(request)
        if isinstance(body, web.Response):
            return body
        text = body.get("prompt")
        n = words(text) if isinstance(text, str) else words(body.get("messages")) + 4
        tokens = list(range(100, 100 + n))
        return web.json_response(
            {"count": n, "max_model_len": self.e.args.max_model_len, "tokens": tokens}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self.e._read_body(request)
        if isinstance(body, web.Response):
            return body
        return web.json_response({"prompt": " ".join(f"tok{t}" for t in body["tokens"])})

    async def score(self, request: web.Request) -> web.Response:
        body = await self.e._read_body(request)
        if isinstance(body, web.Response):
            return body
        first = body.get("queries", body.get("data_1", body.get("text_1")))
        second = body.get("documents", body.get("items", body.get("data_2", body.get("text_2"))))
        docs = second if isinstance(second, list) else [second]
        tokens = words(first) + words(docs)
        data = [{"index": i, "object": "score", "score": 1.0 / (i + 1)} for i in range(len(docs))]
        return web.json_response(
            {
                "id": f"score-{secrets.token_hex(8)}",
                "object": "list",
                "created": int(time.time()),
                "model": self.e.model_name,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def rerank(self, request: web.Request) -> web.Response:
        body = await self.e._read_body(request)
        if isinstance(body, web.Response):
            return body
        docs = body["documents"] if isinstance(body["documents"], list) else [body["documents"]]
        tokens = words(body.get("query")) + words(docs)
        results = [
            {"index": i, "document": {"text": d}, "relevance_score": 1.0 / (i + 1)}
            for i, d in enumerate(docs)
        ]
        return web.json_response(
            {
                "id": f"rerank-{secrets.token_hex(8)}",
                "model": self.e.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results,
            }
        )


async def _nothing(t: int) -> None:
    return None


def _ev(kind: str, seq: Any, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "sequence_number": next(seq), **fields}
