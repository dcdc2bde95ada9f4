#!/usr/bin/env python3
"""A fake vLLM OpenAI server, for fast deterministic tests.

Standalone: imports only the standard library and aiohttp, so the supervisor can
start it exactly as it starts ``python -m vllm.entrypoints.openai.api_server``:

    python fake_engine.py --host 127.0.0.1 --port 8123 --api-key KEY \
        --served-model-name smollm2 --model /x [any other vLLM flags, ignored]

It imitates vLLM 0.32's OpenAI server closely enough for the supervisor and the
gateway: ``/health``, ``/version``, ``/metrics`` (Prometheus text with vLLM's metric
names and labels), ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``
(streaming and not), ``/v1/embeddings``, Bearer auth on ``/v1`` like vLLM's
``AuthenticationMiddleware``, and cancellation when a client disconnects.

Generated tokens are the words " tok0", " tok1", ... one every ``--token-delay-ms``.
With ``--fake-spec-decode`` it also exports vLLM's speculative decoding counters
(``vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total``), each generated
token counting one draft of 4 tokens, 3 accepted.

Fault injection, from the command line and at run time (``POST /fake/control`` with
a JSON object, loopback only, no auth; ``GET /fake/stats`` for counters):

    hang                    /health stays 200 but generation produces no tokens
    health_status           status code /health answers with
    health_delay_s          /health answers after this many seconds
    token_delay_ms          delay between tokens
    first_token_delay_ms    extra delay before the first token (prefill)
    kv_cache_usage          fixed vllm:kv_cache_usage_perc (null: derived from load)
    preemptions_per_request added to vllm:num_preemptions_total per request
    fail_requests           inference routes answer 500
    crash                   exit at once (true: code 1, or an int code), child left
    crash_on_wake           the next POST /wake_up exits (code 1) halfway through its delay
    reset_stats             zero the counters
    allocate_mib            allocate and keep N MiB, every page written (the soak's OOM
                            fault: the kernel's OOM killer must find it under a limit)
    json_spaces             write stream events as json.dumps does by default ("a": 1),
                            as other OpenAI-compatible servers do, not vLLM's compact JSON
    break_before_usage      a stream's connection drops after its last token, before the
                            finishing and usage events

Bad HTTP framing, per request (body field ``fake_framing``, see :class:`Misframing`):
``{"stray_response": true}`` answers twice, ``{"huge_chunk": N, "at_token": T}`` sends
one chunk of N bytes before token T of a stream.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import math
import os
import secrets
import signal
import struct
import subprocess
import sys
import time
from typing import Any

from aiohttp import web

try:
    from tests.fakes import fake_lora
    from tests.fakes.fake_protocols import ProtocolRoutes, context_error
    from tests.fakes.fake_sleep import SleepMode
except ImportError:  # run as a script without the repository on sys.path: its folder is
    import fake_lora  # type: ignore[import-not-found,no-redef]
    from fake_protocols import (  # type: ignore[import-not-found,no-redef]
        ProtocolRoutes,
        context_error,
    )
    from fake_sleep import SleepMode  # type: ignore[import-not-found,no-redef]

VERSION = "0.32.0-fake"
EMBEDDING_DIM = 8
SYSTEM_FINGERPRINT = "vllm-0.32.0-fake-0123abcd"
COMPACT = (",", ":")  # vLLM (pydantic) writes its events without spaces
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
SPEC_DRAFT_TOKENS = 4  # --fake-spec-decode: per generated token, one draft of 4 tokens,
SPEC_ACCEPTED_TOKENS = 3  # 3 of them accepted (acceptance rate 0.75)
CONTROL_KEYS = {
    "hang",
    "health_status",
    "health_delay_s",
    "token_delay_ms",
    "first_token_delay_ms",
    "kv_cache_usage",
    "preemptions_per_request",
    "fail_requests",
    "crash",
    "reset_stats",
    "allocate_mib",
    "crash_on_wake",
}
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
STREAM_FAULTS = ("json_spaces", "break_before_usage")  # control-only switches, off at start


def log(msg: str) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"INFO {stamp} [fake_engine.py] {msg}", flush=True)


# --------------------------------------------------------------------------- args


def stream_interval(body: dict[str, Any]) -> int:
    """The request's ``stream_interval`` (a vLLM field on chat and completions), else 1."""
    value = body.get("stream_interval")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="fake_engine", allow_abbrev=False, add_help=True)
    # vLLM's own flags that the fake honours.
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--uds", default=None, help="Unix socket path (like vLLM: host/port ignored)")
    p.add_argument("--api-key", nargs="+", default=None)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    fake_lora.add_arguments(p)  # --enable-lora, --max-lora-rank, --lora-modules
    # vLLM's: a line per request only when asked (off by default in vLLM 0.32, which the
    # appliance does not pass), so the daemon relays no per-request output by default.
    p.add_argument("--enable-log-requests", action="store_true")
    # Fake-only flags.
    p.add_argument("--token-delay-ms", type=float, default=2.0)
    p.add_argument("--first-token-delay-ms", type=float, default=0.0)
    p.add_argument("--startup-delay", type=float, default=0.0)
    p.add_argument("--exit-immediately", type=int, default=None, metavar="CODE")
    p.add_argument("--spawn-child", action="store_true")
    p.add_argument("--child-mode", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hang", action="store_true")
    p.add_argument("--health-status", type=int, default=200)
    p.add_argument("--health-delay-s", type=float, default=0.0)
    p.add_argument("--kv-cache-usage", type=float, default=None)
    p.add_argument("--preemptions-per-request", type=int, default=0)
    p.add_argument("--fail-requests", action="store_true")
    # Speculative decoding as vLLM reports it: each generated token counts one draft of
    # SPEC_DRAFT_TOKENS tokens of which SPEC_ACCEPTED_TOKENS were accepted.
    p.add_argument("--fake-spec-decode", action="store_true")
    p.add_argument("--shutdown-timeout", type=float, default=5.0)
    # GPU mode, for scripts/gpu-check: see "GPU mode" below.
    p.add_argument("--gpu-share", type=float, default=0.0, metavar="FRACTION")
    p.add_argument("--wake-delay-s", type=float, default=0.5)  # sleep mode: fake_sleep.py
    return p.parse_known_args(argv)


# --------------------------------------------------------------------------- child


def child_main(gpu_share: float = 0.0) -> None:
    """Imitates VLLM::EngineCore: same process group, sleeps until SIGTERM (with
    ``--gpu-share``, holding GPU memory: :func:`gpu_hold`).

    Like vLLM 0.32's EngineCore it does not watch its parent (no prctl, getppid or death
    pipe in vllm/v1/engine/): when the API server dies, it lives on unless the API
    server ended it first (as vLLM's does on SIGTERM, and this fake's does too).
    """
    title = "VLLM::EngineCore"
    try:
        import setproctitle  # type: ignore[import-not-found]

        setproctitle.setproctitle(title)
    except ImportError:
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL(None)
            libc.prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME: /proc/pid/comm

    parent = os.getppid()

    def _bye(signum: int, frame: Any) -> None:
        if gpu_share > 0 and os.getppid() != parent:
            time.sleep(GPU_ORPHAN_STOP_DELAY_S)  # orphaned: slow to obey, as EngineCore is
        os._exit(0)

    signal.signal(signal.SIGTERM, _bye)
    signal.signal(signal.SIGINT, _bye)
    if gpu_share > 0:
        gpu_hold(gpu_share)
        ack = int(os.environ[GPU_READY_FD_ENV])
        os.write(ack, b"1")

        def _toggle(signum: int, frame: Any) -> None:  # fake_sleep.py: asleep or awake
            if signum == signal.SIGUSR2:
                gpu_hold(gpu_share)
                os.write(ack, b"1")
            else:
                gpu_release()
                os.write(ack, b"0")

        signal.signal(signal.SIGUSR1, _toggle)
        signal.signal(signal.SIGUSR2, _toggle)
    while True:
        signal.pause()


# --------------------------------------------------------------------------- GPU mode
# ``--gpu-share FRACTION`` (scripts/gpu-check): the engine stands in for vLLM on a GPU.
# Its child (the fake EngineCore) takes FRACTION of its GPU's memory, as vLLM's KV cache
# does, and the API server runs one matmul per generated token, so NVML's memory, power
# and temperature really move. With torch and CUDA that is a real allocation and real
# work on the GPU CUDA_VISIBLE_DEVICES names. Without a GPU (GPU_CHECK_FAKE_NVML set to
# the check's fake NVML directory) the child only records, for the fake pynvml, which GPU
# it "holds" and how much; nothing else is done. The API server listens only once the
# memory is held, as vLLM does once its model is loaded.

GPU_FAKE_DIR_ENV = "GPU_CHECK_FAKE_NVML"
GPU_READY_FD_ENV = "FAKE_ENGINE_GPU_READY_FD"
GPU_ORPHAN_STOP_DELAY_S = 5.0  # orphaned EngineCore obeys SIGTERM late (vllm#55510)
GPU_MATMUL_N = 8192  # one bf16 8192x8192 matmul per token: about 1 ms on an H100


def _cuda_torch() -> Any | None:
    """torch when it sees a CUDA device and no fake NVML is in use; else None."""
    if os.environ.get(GPU_FAKE_DIR_ENV):
        return None
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def gpu_hold(share: float) -> None:
    """Take ``share`` of this GPU's memory until :func:`gpu_release` (held in a module
    global). The child then says so on the fd the API server waits on."""
    torch = _cuda_torch()
    fake_dir = os.environ.get(GPU_FAKE_DIR_ENV)
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    if torch is not None:
        _free, total = torch.cuda.mem_get_info()
        _HELD.append(torch.empty(int(total * share), dtype=torch.uint8, device="cuda"))
        log(f"GPU {gpu}: holding {int(total * share)} bytes ({share:.0%} of {total})")
    elif fake_dir:
        record = {"pid": os.getpid(), "gpu": int(gpu), "share": share}
        procs = os.path.join(fake_dir, "procs")
        os.makedirs(procs, exist_ok=True)
        tmp = os.path.join(procs, f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(procs, f"{os.getpid()}.json"))
        log(f"fake GPU {gpu}: holding {share:.0%} of its memory")
    else:
        log("--gpu-share: no CUDA device and no fake NVML: holding nothing")


def gpu_release() -> None:
    """Give the memory back, as vLLM's level-1 sleep does before it answers."""
    torch = _cuda_torch()
    _HELD.clear()
    if torch is not None:
        torch.cuda.empty_cache()
    fake_dir = os.environ.get(GPU_FAKE_DIR_ENV)
    if fake_dir:
        gpu = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
        path = os.path.join(fake_dir, "procs", f"{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "gpu": gpu, "share": 0.0}, f)
        os.replace(tmp, path)
    log("GPU memory given back (asleep)")


_HELD: list[Any] = []


class GpuWork:
    """One matmul per generated token on the engine's GPU (torch and CUDA only)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        shape = (GPU_MATMUL_N, GPU_MATMUL_N)
        self.a = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    @classmethod
    def start(cls, share: float) -> GpuWork | None:
        torch = _cuda_torch() if share > 0 else None
        return None if torch is None else cls(torch)

    def _step(self) -> None:
        # A worker thread has no current CUDA context until it sets one (else cuBLAS
        # warns on every thread's first matmul).
        self.torch.cuda.set_device(0)
        self.torch.matmul(self.a, self.b)
        self.torch.cuda.synchronize()

    async def step(self) -> None:
        await asyncio.to_thread(self._step)


# --------------------------------------------------------------------------- helpers


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(
    message: str, err_type: str = "BadRequestError", code: int = 400, param: str | None = None
) -> web.Response:
    return web.json_response(error_body(message, err_type, code, param), status=code)


def redact_argv(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--api-key" and i + 1 < len(out):
            out[i + 1] = "<redacted>"
        elif a.startswith("--api-key="):
            out[i] = "--api-key=<redacted>"
    return out


def count_words(text: str) -> int:
    return len(text.split())


def message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return " ".join(parts)
    return ""


def prompt_tokens_of(prompt: Any) -> int:
    """Prompt tokens for one completions prompt: a string or a list of token ids."""
    if isinstance(prompt, str):
        return max(1, count_words(prompt))
    if isinstance(prompt, list):
        return max(1, len(prompt))
    return 1


def embedding_of(item: Any) -> list[float]:
    text = item if isinstance(item, str) else json.dumps(item)
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    vec = [(b - 127.5) / 127.5 for b in digest[:EMBEDDING_DIM]]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [round(v / norm, 6) for v in vec]


def fmt(v: float) -> str:
    """Render a sample value the way prometheus_client does."""
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.count += 1
        self.sum += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


# --------------------------------------------------------------------------- misframing


class Misframing:
    """An engine that does not keep to HTTP/1.1's framing, for the gateway's splice relay
    (tests/integration/test_engine_framing.py), asked for by a request's ``fake_framing``
    object, which vLLM would ignore:

    - ``"stray_response": true``: after the stream, a second, unasked-for answer
      (``PLANTED``) on the same connection a moment later (while the gateway's connection
      is idle), and again before its answer to each later request read there;
    - ``"huge_chunk": N`` (``"at_token": T``, default 0): one chunk of N bytes before
      token T (0: as the stream's first chunk).
    """

    PLANTED = b"".join(
        [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"]
        + [b"Transfer-Encoding: chunked\r\n\r\n"]
        + [
            b"%x\r\n%s\r\n" % (len(event), event)
            for event in (
                b'data: {"choices":[{"index":0,"delta":{"content":"PLANTED"}}]}\n\n',
                b"data: [DONE]\n\n",
                b"",
            )
        ]
    )
    STRAY_AFTER_S = 0.2  # the gateway has read the answer whole and pooled the connection

    def __init__(self) -> None:
        self.replaying: set[Any] = set()  # transports that got a stray answer
        self.strays = 0

    @staticmethod
    def ask(body: dict[str, Any]) -> dict[str, Any]:
        asked = body.get("fake_framing")
        return asked if isinstance(asked, dict) else {}

    def before(self, request: web.Request) -> None:
        """Before the answer: the stray one again, on a connection that had one."""
        if request.transport is not None and request.transport in self.replaying:
            request.transport.write(self.PLANTED)
            self.strays += 1

    async def before_token(self, body: dict[str, Any], resp: web.StreamResponse, t: int) -> None:
        asked = self.ask(body)
        if "huge_chunk" in asked and t == int(asked.get("at_token", 0)):
            await resp.write(b"data: " + b"x" * int(asked["huge_chunk"]) + b"\n\n")

    def after(self, body: dict[str, Any], request: web.Request) -> None:
        transport = request.transport
        if self.ask(body).get("stray_response") and transport is not None:
            self.replaying.add(transport)
            asyncio.get_running_loop().call_later(self.STRAY_AFTER_S, self._stray, transport)

    def _stray(self, transport: Any) -> None:
        if not transport.is_closing():
            transport.write(self.PLANTED)
            self.strays += 1


# --------------------------------------------------------------------------- engine


class FakeEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = args.model
        self.served = list(args.served_model_name or [args.model])
        self.model_name = self.served[0]
        keys = args.api_key or (
            [os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else []
        )
        self.api_key_hashes = [hashlib.sha256(k.encode()).digest() for k in keys]
        self.created = int(time.time())
        self.child: subprocess.Popen[bytes] | None = None
        self.gpu_ready_fd = -1  # --gpu-share: the child writes b"1" here once it holds
        # knobs
        self.hang = bool(args.hang)
        self.unhung = asyncio.Event()
        if not self.hang:
            self.unhung.set()
        self.health_status = args.health_status
        self.health_delay_s = args.health_delay_s
        self.token_delay_ms = args.token_delay_ms
        self.first_token_delay_ms = args.first_token_delay_ms
        self.kv_cache_usage: float | None = args.kv_cache_usage
        self.health_checks = 0  # GET /health answered
        self.preemptions_per_request = args.preemptions_per_request
        self.fail_requests = bool(args.fail_requests)
        self.slots = asyncio.Semaphore(max(1, args.max_num_seqs))
        self.faults = dict.fromkeys(STREAM_FAULTS, False)
        self.misframing = Misframing()
        self.ballast: list[bytes] = []  # allocate_mib's memory, kept
        self.gpu_work = GpuWork.start(args.gpu_share)
        self.sleep_mode = SleepMode(self, args.wake_delay_s)  # VLLM_SERVER_DEV_MODE=1 only
        self.lora = fake_lora.FakeLora(args, self.served)  # --enable-lora: fake_lora.py
        self.reset_stats()

    def reset_stats(self) -> None:
        self.running = 0
        self.waiting = 0
        self.requests = 0
        self.requests_by_route: dict[str, int] = {}
        self.aborts = 0
        self.failed = 0
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.spec_drafts = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.last_request: dict[str, Any] | None = None

    # ------------------------------------------------------------------ app

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self.access_log_mw, self.auth_mw])
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/ping", self.health)
        r.add_post("/ping", self.health)
        r.add_get("/version", self.version)
        r.add_get("/load", self.load)
        r.add_get("/metrics", self.metrics)
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/embeddings", self.embeddings)
        ProtocolRoutes(self).add_routes(r)  # responses, messages, tokenize, score, rerank
        r.add_get("/fake/stats", self.fake_stats)
        r.add_post("/fake/control", self.fake_control)
        if SleepMode.enabled():  # vLLM's development routes, as vLLM registers them
            self.sleep_mode.add_routes(r)
        self.lora.add_routes(r)  # VLLM_ALLOW_RUNTIME_LORA_UPDATING: load and unload
        return app

    @web.middleware
    async def access_log_mw(self, request: web.Request, handler: Any) -> web.StreamResponse:
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            if not self.args.disable_uvicorn_access_log:
                peer = request.transport.get_extra_info("peername") if request.transport else None
                where = f"{peer[0]}:{peer[1]}" if peer else "-"
                ver = f"{request.version.major}.{request.version.minor}"
                print(
                    f'INFO:     {where} - "{request.method} {request.path_qs} HTTP/{ver}" {status}',
                    flush=True,
                )

    @web.middleware
    async def auth_mw(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if (
            self.api_key_hashes
            and request.method != "OPTIONS"
            and request.path.startswith("/v1")
            and not self.verify_token(request.headers.get("Authorization"))
        ):
            # Exactly what vLLM 0.32's AuthenticationMiddleware answers.
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    def verify_token(self, header: str | None) -> bool:
        if not header:
            return False
        scheme, _, param = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        h = hashlib.sha256(param.encode()).digest()
        ok = False
        for k in self.api_key_hashes:
            ok |= secrets.compare_digest(h, k)
        return ok

    # ------------------------------------------------------------------ plain routes

    async def health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        if self.health_delay_s > 0:
            await asyncio.sleep(self.health_delay_s)
        return web.Response(status=self.health_status)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response({"server_load": self.running + self.waiting})

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": self.model,
                "parent": None,
                "max_model_len": self.args.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{secrets.token_hex(16)}",
                        "object": "model_permission",
                        "created": self.created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in self.served
        ]
        data += self.lora.cards(self.created)
        return web.json_response({"object": "list", "data": data})

    def kv_usage(self) -> float:
        if self.kv_cache_usage is not None:
            return float(self.kv_cache_usage)
        return min(1.0, 0.01 * self.running)

    async def metrics(self, request: web.Request) -> web.Response:
        labels = f'engine="0",model_name="{self.model_name}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{lbl} {fmt(v)}" for lbl, v in samples)

        def simple(name: str, kind: str, help_: str, value: float) -> None:
            metric(name, kind, help_, [(f"{name}{{{labels}}}", value)])

        def histogram(name: str, help_: str, h: Histogram) -> None:
            # prometheus_client sorts label names: engine, le, model_name.
            mn = f'model_name="{self.model_name}"'
            samples: list[tuple[str, float]] = [
                (f'{name}_bucket{{engine="0",le="{fmt(b)}",{mn}}}', c)
                for b, c in zip(h.buckets, h.counts, strict=True)
            ]
            samples.append((f'{name}_bucket{{engine="0",le="+Inf",{mn}}}', h.count))
            samples.append((f"{name}_count{{{labels}}}", h.count))
            samples.append((f"{name}_sum{{{labels}}}", h.sum))
            metric(name, "histogram", help_, samples)

        simple(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            self.running,
        )
        simple(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            self.waiting,
        )
        metric(
            "vllm:engine_sleep_state",
            "gauge",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
            "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means "
            "sleep level 2.",
            [
                (f'vllm:engine_sleep_state{{{labels},sleep_state="awake"}}', 1),
                (f'vllm:engine_sleep_state{{{labels},sleep_state="weights_offloaded"}}', 0),
                (f'vllm:engine_sleep_state{{{labels},sleep_state="discard_all"}}', 0),
            ],
        )
        simple(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            self.kv_usage(),
        )
        simple(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            self.prompt_tokens,
        )
        simple(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            0,
        )
        simple(
            "vllm:num_preemptions_total",
            "counter",
            "Cumulative number of preemption from the engine.",
            self.preemptions,
        )
        simple(
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            self.prompt_tokens,
        )
        simple(
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            self.generation_tokens,
        )
        if self.args.fake_spec_decode:
            for name, help_, per_draft in (
                ("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", 1),
                (
                    "vllm:spec_decode_num_draft_tokens_total",
                    "Number of draft tokens.",
                    SPEC_DRAFT_TOKENS,
                ),
                (
                    "vllm:spec_decode_num_accepted_tokens_total",
                    "Number of accepted tokens.",
                    SPEC_ACCEPTED_TOKENS,
                ),
            ):
                simple(name, "counter", help_, self.spec_drafts * per_draft)
        metric(
            "vllm:request_success_total",
            "counter",
            "Count of successfully processed requests.",
            [
                (
                    f'vllm:request_success_total{{engine="0",finished_reason="{r}",'
                    f'model_name="{self.model_name}"}}',
                    n,
                )
                for r, n in self.success.items()
            ],
        )
        histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            self.ttft,
        )
        histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            self.e2e,
        )
        text = "\n".join(out) + "\n"
        return web.Response(
            text=text, content_type="text/plain", headers={"X-Fake-Engine": VERSION}
        )

    # ------------------------------------------------------------------ fake control

    def stats(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "child_pid": self.child.pid if self.child else None,
            "sleeping": self.sleep_mode.sleeping,
            "adapters": dict(self.lora.adapters),  # LoRA: name -> folder (fake_lora.py)
            "sleeps": self.sleep_mode.sleeps,
            "wakes": self.sleep_mode.wakes,
            "running": self.running,
            "waiting": self.waiting,
            "requests": self.requests,
            "requests_by_route": dict(self.requests_by_route),
            "health_checks": self.health_checks,
            "aborts": self.aborts,
            "failed": self.failed,
            "preemptions": self.preemptions,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "success": dict(self.success),
            "hang": self.hang,
            "health_status": self.health_status,
            "health_delay_s": self.health_delay_s,
            "token_delay_ms": self.token_delay_ms,
            "first_token_delay_ms": self.first_token_delay_ms,
            "kv_cache_usage": self.kv_usage(),
            "preemptions_per_request": self.preemptions_per_request,
            "fail_requests": self.fail_requests,
            "model": self.model,
            "served_model_name": self.model_name,
            "last_request": self.last_request,
            "stray_responses": self.misframing.strays,
            "argv": redact_argv(sys.argv[1:]),
        }

    def _loopback_only(self, request: web.Request) -> web.Response | None:
        # Over a Unix socket there is no address ("" or None): local by construction.
        if request.remote not in LOOPBACK and request.remote not in ("", None):
            return error_response("loopback only", "Forbidden", 403)
        return None

    async def fake_stats(self, request: web.Request) -> web.Response:
        return self._loopback_only(request) or web.json_response(self.stats())

    async def fake_control(self, request: web.Request) -> web.Response:
        if denied := self._loopback_only(request):
            return denied
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response("body must be JSON")
        if not isinstance(body, dict):
            return error_response("body must be a JSON object")
        unknown = set(body) - CONTROL_KEYS - set(STREAM_FAULTS)
        if unknown:
            return error_response(
                f"unknown control keys {sorted(unknown)}; allowed: {sorted(CONTROL_KEYS)}"
            )
        if "crash" in body and body["crash"] not in (False, None):
            code = 1 if body["crash"] is True else int(body["crash"])
            print(f"ERROR fake engine crashing with code {code}", file=sys.stderr, flush=True)
            os._exit(code)
        self.faults.update({k: bool(body[k]) for k in STREAM_FAULTS if k in body})
        if body.get("reset_stats"):
            self.reset_stats()
        if "allocate_mib" in body:  # written, not just reserved: pages the kernel charges
            self.ballast.append(b"\x01" * (int(body["allocate_mib"]) << 20))
        if "hang" in body:
            self.hang = bool(body["hang"])
            if self.hang:
                self.unhung.clear()
            else:
                self.unhung.set()
        if "health_status" in body:
            self.health_status = int(body["health_status"])
        if "health_delay_s" in body:
            self.health_delay_s = float(body["health_delay_s"])
        if "token_delay_ms" in body:
            self.token_delay_ms = float(body["token_delay_ms"])
        if "first_token_delay_ms" in body:
            self.first_token_delay_ms = float(body["first_token_delay_ms"])
        if "kv_cache_usage" in body:
            v = body["kv_cache_usage"]
            self.kv_cache_usage = None if v is None else float(v)
        if "preemptions_per_request" in body:
            self.preemptions_per_request = int(body["preemptions_per_request"])
        if "fail_requests" in body:
            self.fail_requests = bool(body["fail_requests"])
        if "crash_on_wake" in body:  # fake_sleep.py: the next /wake_up dies halfway
            self.sleep_mode.crash_on_wake = bool(body["crash_on_wake"])
        log(f"control: {json.dumps(body, sort_keys=True)}")
        return web.json_response(self.stats())

    # ------------------------------------------------------------------ inference

    async def _read_body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(f"Invalid JSON body: {e}")
        if not isinstance(body, dict):
            return error_response("Request body must be a JSON object")
        route = request.path
        self.requests += 1
        self.requests_by_route[route] = self.requests_by_route.get(route, 0) + 1
        # vLLM reads a request's priority from this header too (Messages: only there)
        priority = request.headers.get("X-Vllm-Priority")
        self.last_request = {"path": route, "body": body, "priority_header": priority}
        model = body.get("model")
        if model is not None and model not in self.served and not self.lora.serves(model):
            return error_response(
                f"The model `{model}` does not exist.", "NotFoundError", 404, "model"
            )
        if self.fail_requests:
            self.failed += 1
            self.success["error"] += 1
            return error_response("Fake engine: injected failure", "InternalServerError", 500)
        return body

    def _max_tokens(self, body: dict[str, Any], prompt_tokens: int) -> int | web.Response:
        raw = body.get("max_completion_tokens")
        if raw is None:
            raw = body.get("max_tokens")
        if raw is None:
            return 16
        if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
            return error_response(f"max_tokens must be at least 1, got {raw}.", param="max_tokens")
        limit = self.args.max_model_len
        if prompt_tokens > limit:  # vLLM's 400, checked before max_tokens
            return error_response(context_error(limit, prompt_tokens))
        if prompt_tokens + raw > limit:
            return error_response(
                f"'max_tokens' or 'max_completion_tokens' is too large: {raw}. This model's "
                f"maximum context length is {limit} tokens and your request has "
                f"{prompt_tokens} input tokens ({raw} > {limit} - {prompt_tokens}).",
                param="max_tokens",
            )
        return raw

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return error_response("'messages' must be a non-empty list", param="messages")
        prompt_tokens = 0
        for m in messages:
            if not isinstance(m, dict):
                return error_response("each message must be an object", param="messages")
            prompt_tokens += count_words(message_text(m.get("content"))) + 4
        prompt_tokens += 2
        return await self._generate(request, body, "chat", [prompt_tokens])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            return error_response("'prompt' is required", param="prompt")
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        ):
            prompts = [prompt]
        elif isinstance(prompt, list):
            prompts = prompt
        else:
            return error_response("'prompt' has an invalid type", param="prompt")
        return await self._generate(
            request, body, "completion", [prompt_tokens_of(p) for p in prompts]
        )

    async def _generate(
        self, request: web.Request, body: dict[str, Any], kind: str, prompts: list[int]
    ) -> web.StreamResponse:
        max_tokens = self._max_tokens(body, max(prompts))
        if isinstance(max_tokens, web.Response):
            return max_tokens
        # vLLM answers a LoRA adapter's request under the adapter's name.
        answered = body["model"] if self.lora.serves(body.get("model", "")) else self.model_name
        stream = bool(body.get("stream"))
        stream_options = body.get("stream_options") or {}
        include_usage = bool(stream_options.get("include_usage")) if stream else False
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        req_id = f"{prefix}-{secrets.token_hex(16)}"
        created = int(time.time())
        obj_chunk = "chat.completion.chunk" if kind == "chat" else "text_completion"
        n = len(prompts)
        prompt_total = sum(prompts)
        self.preemptions += self.preemptions_per_request
        start = time.monotonic()
        resp: web.StreamResponse | None = None
        produced = 0
        admitted = False

        def chunk(choices: list[dict[str, Any]], usage: Any = None, stamp: bool = False) -> bytes:
            data: dict[str, Any] = {
                "id": req_id,
                "object": obj_chunk,
                "created": created,
                "model": answered,
                "choices": choices,
            }
            if usage is not None:
                data["usage"] = usage
            if stamp:
                data["system_fingerprint"] = SYSTEM_FINGERPRINT
            spaces = self.faults["json_spaces"]
            return f"data: {json.dumps(data, separators=None if spaces else COMPACT)}\n\n".encode()

        def piece(i: int, text: str, finish: str | None) -> dict[str, Any]:
            if kind == "chat":
                delta: dict[str, Any] = {"content": text}
                return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}

        self.misframing.before(request)
        try:
            if stream:
                resp = web.StreamResponse(
                    status=200,
                    headers={"Content-Type": "text/event-stream; charset=utf-8"},
                )
                await resp.prepare(request)
            self.waiting += 1
            try:
                await self.slots.acquire()
            finally:
                self.waiting -= 1
            admitted = True
            self.running += 1
            self.prompt_tokens += prompt_total
            # As vLLM 0.32: an event once stream_interval tokens are new (and the first
            # and the last token at once), so one event may carry several tokens.
            interval, unsent = stream_interval(body), []
            for t in range(max_tokens):
                await self.unhung.wait()
                if resp is not None:
                    await self.misframing.before_token(body, resp, t)
                delay = self.token_delay_ms + (self.first_token_delay_ms if t == 0 else 0)
                if delay > 0:
                    await asyncio.sleep(delay / 1000)
                await self.unhung.wait()
                if self.gpu_work is not None:
                    await self.gpu_work.step()
                if t == 0:
                    self.ttft.observe(time.monotonic() - start)
                    if resp is not None and kind == "chat":
                        role = {"role": "assistant", "content": ""}
                        await resp.write(
                            chunk(
                                [
                                    {
                                        "index": i,
                                        "delta": role,
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                    for i in range(n)
                                ]
                            )
                        )
                produced = t + 1
                self.generation_tokens += n
                self.spec_drafts += n
                unsent.append(f" tok{t}")
                due = t == 0 or len(unsent) >= interval or produced == max_tokens
                if resp is not None and due:
                    text, unsent = "".join(unsent), []
                    await resp.write(chunk([piece(i, text, None) for i in range(n)]))
        except asyncio.CancelledError:
            self._count_abort(req_id, produced)
            raise
        except ConnectionResetError:
            self._count_abort(req_id, produced)
            return resp if resp is not None else web.Response(status=499)
        finally:
            if admitted:
                self.running -= 1
                self.slots.release()

        self.success["length"] += 1
        self.e2e.observe(time.monotonic() - start)
        usage = {
            "prompt_tokens": prompt_total,
            "completion_tokens": produced * n,
            "total_tokens": prompt_total + produced * n,
        }
        if self.args.enable_log_requests:
            made = produced * n
            log(f"Finished request {req_id}: {prompt_total} prompt, {made} generated tokens.")
        text = "".join(f" tok{t}" for t in range(produced))
        if resp is None:
            if kind == "chat":
                choices: list[dict[str, Any]] = [
                    {
                        "index": i,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "tool_calls": [],
                            "reasoning_content": None,
                        },
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                    }
                    for i in range(n)
                ]
                obj = "chat.completion"
            else:
                choices = [
                    {
                        "index": i,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                        "prompt_logprobs": None,
                    }
                    for i in range(n)
                ]
                obj = "text_completion"
            return web.json_response(
                {
                    "id": req_id,
                    "object": obj,
                    "created": created,
                    "model": answered,
                    "choices": choices,
                    "usage": usage,
                    "prompt_logprobs": None,
                    "kv_transfer_params": None,
                }
            )
        if self.faults["break_before_usage"] and request.transport is not None:
            request.transport.close()  # the client reads a body cut short
            return resp
        try:
            # As vLLM 0.32: the fingerprint on the finishing events, or, with
            # include_usage, on the usage event (just before [DONE]) instead.
            finish = [piece(i, "", "length") for i in range(n)]
            await resp.write(chunk(finish, stamp=not include_usage))
            if include_usage:
                await resp.write(chunk([], usage, stamp=True))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.misframing.after(body, request)
        except ConnectionResetError:
            pass
        return resp

    def _count_abort(self, req_id: str, produced: int) -> None:
        self.aborts += 1
        self.success["abort"] += 1
        if self.args.enable_log_requests:
            log(f"Aborted request {req_id} after {produced} tokens (client disconnected).")

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        inp = body.get("input")
        if isinstance(inp, str) or (
            isinstance(inp, list) and inp and all(isinstance(t, int) for t in inp)
        ):
            items: list[Any] = [inp]
        elif isinstance(inp, list) and inp:
            items = inp
        else:
            return error_response("'input' must be a string or a non-empty list", param="input")
        fmt_ = body.get("encoding_format") or "float"
        if fmt_ not in ("float", "base64"):
            return error_response(f"unknown encoding_format {fmt_!r}", param="encoding_format")
        data = []
        tokens = 0
        for i, item in enumerate(items):
            tokens += prompt_tokens_of(item)
            vec = embedding_of(item)
            emb: Any = vec
            if fmt_ == "base64":
                emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"object": "embedding", "embedding": emb, "index": i})
        self.prompt_tokens += tokens
        self.success["stop"] += 1
        return web.json_response(
            {
                "id": f"embd-{secrets.token_hex(16)}",
                "object": "list",
                "created": int(time.time()),
                "model": self.model_name,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
            }
        )

    # ------------------------------------------------------------------ lifecycle

    def spawn_child(self) -> None:
        argv = [sys.executable, os.path.abspath(__file__), "--child-mode"]
        share = self.args.gpu_share
        if share <= 0:
            self.child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        else:
            ready, w = os.pipe()
            env = {**os.environ, GPU_READY_FD_ENV: str(w)}
            argv += ["--gpu-share", str(share)]
            self.child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=(w,), env=env)
            os.close(w)
            self.gpu_ready_fd = ready
        log(f"Started engine core process (fake VLLM::EngineCore) pid={self.child.pid}")

    async def gpu_held(self) -> bool:
        """--gpu-share: the child's next word, whether it holds its memory (False: it
        gave it back to sleep, or died). The fd stays open: the child answers each sleep
        and wake on it too (fake_sleep.py)."""
        return await asyncio.to_thread(os.read, self.gpu_ready_fd, 1) == b"1"

    def stop_child(self) -> None:
        if self.child is None or self.child.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.child.terminate()
        try:
            self.child.wait(timeout=3)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.child.kill()
            self.child.wait()


async def serve(args: argparse.Namespace, unknown: list[str]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    engine = FakeEngine(args)
    log(f"vLLM API server version {VERSION}")
    shown = {k: ("<redacted>" if k == "api_key" and v else v) for k, v in vars(args).items()}
    log(f"non-default args: {shown}; ignored: {unknown}")
    if args.spawn_child or args.gpu_share > 0:
        engine.spawn_child()
    try:
        if args.gpu_share > 0 and not await engine.gpu_held():
            log("ERROR: the engine core could not take its GPU memory")
            return 1
        if args.startup_delay > 0:
            log(f"Loading model weights (fake, {args.startup_delay}s) ...")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.startup_delay)
            if stop.is_set():
                log("Shutdown requested during start-up.")
                return 0

        try:
            engine.lora.load_static(args.lora_modules)  # vLLM: before the server listens
        except SystemExit as exc:
            log(f"ERROR: {exc}")
            return 1
        runner = web.AppRunner(
            engine.make_app(),
            handle_signals=False,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=args.shutdown_timeout,
        )
        await runner.setup()
        site: web.BaseSite = (
            web.UnixSite(runner, args.uds)
            if args.uds
            else web.TCPSite(runner, args.host, args.port)
        )
        where = f"unix:{args.uds}" if args.uds else f"http://{args.host}:{args.port}"
        try:
            await site.start()
        except OSError as e:
            print(
                f"ERROR: [Errno {e.errno}] error while attempting to bind on address "
                f"({args.uds or args.host!r}, {args.port}): {e.strerror}",
                file=sys.stderr,
                flush=True,
            )
            await runner.cleanup()
            return 1
        pid = os.getpid()
        print(f"INFO:     Started server process [{pid}]", flush=True)
        print("INFO:     Waiting for application startup.", flush=True)
        print("INFO:     Application startup complete.", flush=True)
        print(
            f"INFO:     Uvicorn running on {where} (Press CTRL+C to quit)",
            flush=True,
        )
        await stop.wait()
        # vLLM stops its EngineCore before its HTTP server, aborting what runs (its
        # shutdown_timeout is 0 by default): launcher.py's handle_shutdown. So the child
        # goes at once, even with streams open (which the HTTP cleanup waits for).
        engine.stop_child()
        print("INFO:     Shutting down", flush=True)
        await runner.cleanup()
        print(f"INFO:     Finished server process [{pid}]", flush=True)
        return 0
    finally:
        engine.stop_child()


def main(argv: list[str] | None = None) -> int:
    args, unknown = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child_mode:
        child_main(args.gpu_share)
        return 0
    if args.exit_immediately is not None:
        print(
            f"ERROR {time.strftime('%m-%d %H:%M:%S')} [fake_engine.py] Engine failed to start "
            f"(injected), exiting with code {args.exit_immediately}",
            file=sys.stderr,
            flush=True,
        )
        return args.exit_immediately
    return asyncio.run(serve(args, unknown))


if __name__ == "__main__":
    sys.exit(main())
