"""The [gateway] section: where the gateway listens, TLS, limits on requests and answers.

Kept apart from :mod:`appliance.config.sections` for size; that module re-exports
:class:`GatewayConfig`, so imports of it from there (or from ``appliance.config``) work.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.config.field_spec import config_field as _f


@dataclass(frozen=True)
class GatewayConfig:
    host: str = _f(
        "127.0.0.1",
        "Address the gateway listens on. A non-loopback address needs "
        "`allow_lan = true` (and should use TLS).",
    )
    port: int = _f(8080, "TCP port of the gateway.", lo=1, hi=65535)
    allow_lan: bool = _f(False, "Allow `host` to be a non-loopback address.")
    tls_cert: str = _f("", "PEM certificate file; with `tls_key` the gateway serves HTTPS.")
    tls_key: str = _f("", "PEM private key file for `tls_cert`.")
    keys_file: str = _f(
        "/var/lib/llm-appliance/keys.json",
        "API keys file (hashes only, mode 0600). Created with one admin key on "
        "first start when missing or empty.",
    )
    max_body_bytes: int = _f(1048576, "Largest request body accepted; larger gets 413.", lo=1024)
    max_tokens_cap: int = _f(
        4096,
        "Largest `max_tokens` a request may ask for; larger is "
        "refused with 400 (never silently clamped), except on `/v1/messages`, where it "
        "is lowered to this value and the answer says so (`X-Appliance-Max-Tokens`; "
        "Claude Code asks for 32000). A chat request without "
        "`max_tokens` (or with null) is sent to the engine with this value, never "
        "more than the context leaves.",
        lo=1,
        live=True,
    )
    max_n: int = _f(
        16,
        "Largest `n` (answers per prompt) a request may ask for; larger gets 400. "
        "Each answer is counted in the request's token cost.",
        lo=1,
        hi=16384,
        live=True,
    )
    max_best_of: int = _f(
        16,
        "Largest `best_of` a request may ask for; larger gets 400. Counted like `n` "
        "(vLLM 0.32 ignores it, other engines generate that many sequences).",
        lo=1,
        hi=16384,
        live=True,
    )
    max_prompts: int = _f(
        2048,
        "Longest list of prompts (`/v1/completions` `prompt`) or inputs "
        "(`/v1/embeddings` `input`) one request may carry; longer gets 400. Every "
        "prompt is counted in the request's token cost.",
        lo=1,
        live=True,
    )
    max_answer_bytes: int = _f(
        33554432,
        "Largest non-streamed answer the gateway relays (it holds each one whole); "
        "larger gets 502 and should be streamed. The default (32 MiB) holds the "
        "longest plain-text answer the other limits allow many times over, and a "
        "full batch of float embeddings of a small model.",
        lo=65536,
        live=True,
    )
    max_queue: int = _f(
        256,
        "Requests waiting for an engine beyond this get 503 with Retry-After.",
        lo=0,
        live=True,
    )
    queue_timeout_s: float = _f(
        30.0,
        "Longest a request waits in the queue before 503.",
        lo=0,
        lo_open=True,
        live=True,
    )
    queue_aging_s: float = _f(
        10.0,
        "A queued request too large for the room any engine has now lets smaller ones "
        "behind it go first, for at most this long; after that nobody passes it, so "
        "it is not starved. 0 = strict arrival order.",
        lo=0,
        live=True,
    )
    key_token_share: float = _f(
        0.5,
        "While another key that holds less of a model waits for it, a key that already "
        "holds this share of the model's in-flight token budget (`max_inflight_tokens` "
        "summed over its engines) takes no more: its further requests wait until it "
        "holds less. A key with nothing in flight may always run one request, and with "
        "nobody else waiting a key may use the whole budget. 1 = no bound.",
        lo=0,
        hi=1,
        lo_open=True,
        live=True,
    )
    prefix_routing: bool = _f(
        True,
        "Keep a conversation on the engine that holds its prompt's beginning in its prefix "
        "cache, with no client hint: a request whose prompt begins with what an engine "
        "was sent before goes there, unless that engine is hotter, draining, full or far "
        "more loaded than the least-loaded one (docs/operations.md). `X-Session-Id`, "
        "`prompt_cache_key`, Anthropic `metadata.user_id` and `user` pin a conversation "
        "whatever this says. false: least-loaded only.",
        live=True,
    )
    stall_timeout_s: float = _f(
        60.0,
        "A streamed answer whose client reads none of it for this long (the gateway's "
        "buffer for it full, nothing taken from it since) is ended: the engine stops "
        "generating it, its slot and token budget go to others, and the client's "
        "connection is closed. A slow reader that keeps reading is never cut.",
        lo=0,
        lo_open=True,
        live=True,
    )
    stored_responses_per_key: int = _f(
        10000,
        "Stored responses (Responses API, `store`) the gateway remembers per key, of the "
        "100,000 it remembers in all: a key that stores more forgets its own least "
        "recently made or used first, so one key cannot push out every other key's. A "
        "forgotten one reads as 404; vLLM keeps it in the engine's memory until the "
        "engine restarts.",
        lo=1,
        hi=100000,
        live=True,
    )
    metrics_public: bool = _f(
        False,
        "false: /metrics needs a key with scope `metrics` or "
        "`admin`; true: anyone who can reach the gateway may read it.",
        live=True,
    )
    max_connections: int = _f(
        1024,
        "Client connections open at once. One more is answered 503 and closed at once; "
        "the open ones carry on. Each takes a file descriptor: serve raises its soft "
        "open-files limit to fit, up to the hard limit (the unit's LimitNOFILE).",
        lo=1,
        hi=100_000,
    )
    header_timeout_s: float = _f(
        10.0,
        "A connection must send a complete request head (request line and headers) "
        "within this of opening, or of the first byte of a later request; else 408 and "
        "it is closed. Answers are not timed as such: long streams to slow readers go "
        "on (a client that stops reading is `stall_timeout_s`'s). An "
        "idle keep-alive connection is closed after 75 s.",
        lo=0,
        hi=3600,
        lo_open=True,
    )
    body_timeout_s: float = _f(
        30.0,
        "A request body must be complete within this of its head; else 408 and the "
        "connection is closed.",
        lo=0,
        hi=3600,
        lo_open=True,
    )
