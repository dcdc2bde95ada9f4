"""Prefix routing on real vLLM: later turns of concurrent conversations, four front ends.

Two real CPU engines (SmolLM2-135M, one core each) behind one appliance. N conversations
at once, each with a shared system prompt and a long document of its own, each turn
resending the whole conversation (as chat clients and coding agents do), T turns one
after the other within a conversation. The same engines are reached four ways, one
after the other in a round, the order rotated by one every round:

- ``appliance``: the gateway, no hint (prefix routing decides);
- ``appliance+user``: the gateway, ``user`` set to the conversation (the session rule);
- ``router cache_aware`` / ``router round_robin``: vllm-router 0.1.17 (installed under the
  user cache when missing, tests/fakes/router_proc.py) with its default thresholds, in
  front of the two engines. vllm-router sends one ``--api-key`` to every worker and each
  engine has its own per-boot key, so each engine is reached through a small hop of this
  process that adds its key (aiohttp, a few hundred µs: nothing against a CPU TTFT).

Every path's conversations have documents of their own (a fresh random beginning), so no
path hits what another one cached; the system prompt is the same for all.

Per path: the later turns' (2..T) TTFT p50 / p90 (to the first streamed event) and the
engines' prefix-cache hit rate over the path's requests (``vllm:prefix_cache_hits_total``
/ ``vllm:prefix_cache_queries_total``, summed over both engines, tokens).

    flock /tmp/vllm-e2e.lock .venv/bin/python -m bench.prefix_routing \\
        [--conversations 4] [--turns 4] [--rounds 1] [--doc-words 600] [--tokens 24]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from appliance import paths
from appliance.endpoint import EngineAddress
from bench._common import Daemon, Table, client_session, pct, wait_for_quiet
from tests.fakes.appliance_proc import real_engine_config, run_appliance
from tests.fakes.engine_proc import free_port
from tests.fakes.router_proc import Router, install_router, run_router

MODEL = paths.PACKAGED_MODEL_NAME
PATHS = ("appliance", "appliance+user", "router cache_aware", "router round_robin")
SYSTEM = (
    "You are the archivist of a large collection. You answer questions about the "
    "documents the user shares, briefly and precisely, quoting item numbers. " * 6
)
# vLLM serves /health; the router's own checks go there through the hops.
ROUTER_HEALTH = (
    "--health-check-endpoint",
    "/health",
    "--health-check-interval-secs",
    "2",
    "--health-failure-threshold",
    "3",
    "--health-success-threshold",
    "1",
    "--worker-startup-check-interval",
    "1",
)


@dataclass
class PathFigures:
    later_ttft: list[float] = field(default_factory=list)
    first_ttft: list[float] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0
    errors: list[str] = field(default_factory=list)


@contextlib.contextmanager
def real_daemon(max_model_len: int) -> Iterator[Daemon]:
    home = paths.appliance_home()
    if not paths.engine_python(home).exists():
        raise SystemExit(f"no engine venv under {home}: run scripts/setup first")
    tmp = Path(tempfile.mkdtemp(prefix="llm-appliance-bench-prefix-"))
    cfg = real_engine_config(
        tmp,
        2,
        engine={"max_model_len": max_model_len},
        health={"interval_s": 5, "probe_timeout_s": 30, "failures_to_restart": 5},
    )
    try:
        with run_appliance(tmp, cfg, env={"LLM_APPLIANCE_HOME": str(home)}) as app:
            app.wait_ready(timeout=420)
            d = Daemon(app, tmp, (tmp / "admin.key").read_text().strip())
            d.wait_engines_ready(timeout=420)
            yield d
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.asynccontextmanager
async def key_hop(address: EngineAddress, key: str) -> AsyncIterator[str]:
    """A loopback URL that relays every request to the engine at ``address`` with its
    key added, streams passed on as they come."""
    session = client_session(address)

    async def handle(request: web.Request) -> web.StreamResponse:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        body = await request.read()
        async with session.request(
            request.method, address.base_url + request.path_qs, data=body or None, headers=headers
        ) as r:
            out = web.StreamResponse(
                status=r.status,
                headers={"Content-Type": r.headers.get("Content-Type", "application/json")},
            )
            await out.prepare(request)
            # The router may close its end once it has the stream's last event: quietly.
            with contextlib.suppress(ConnectionResetError):
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            return out

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await session.close()


async def engine_cache(d: Daemon) -> tuple[float, float]:
    """Both engines' prefix-cache (hits, queries), in tokens."""
    hits = queries = 0.0
    for i in range(2):
        async with (
            client_session(d.engine_address(i)) as s,
            s.get(d.engine_url(i) + "/metrics") as r,
        ):
            text = await r.text()
        for name, value in re.findall(
            r"^(vllm:prefix_cache_(?:hits|queries)_total)(?:\{[^}]*\})?\s+(\S+)", text, re.M
        ):
            if name.endswith("hits_total"):
                hits += float(value)
            else:
                queries += float(value)
    return hits, queries


async def ask(
    session: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any]
) -> tuple[float, str]:
    """One streamed chat turn: (TTFT to the first event, the answer's text)."""
    t0 = time.monotonic()
    ttft = 0.0
    text: list[str] = []
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {(await r.read())[:200]!r}")
        buf = b""
        async for chunk in r.content.iter_any():
            if not ttft:
                ttft = time.monotonic() - t0
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ").strip()
                if not data or data == b"[DONE]":
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"error event: {obj['error']}")
                for choice in obj.get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "")
    return ttft, "".join(text)


def document(rng: random.Random, words: int) -> str:
    vocab = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 9))) for _ in range(2000)
    ]
    head = f"Document {rng.getrandbits(64):016x}. "  # no two paths share a beginning
    return head + " ".join(
        f"item {i}: {' '.join(rng.choices(vocab, k=11))}." for i in range(words // 13)
    )


async def conversation(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    doc: str,
    user: str | None,
    args: argparse.Namespace,
    fig: PathFigures,
) -> None:
    msgs: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{doc}\n\nWhat is item 1 about?"},
    ]
    for turn in range(1, args.turns + 1):
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": msgs,
            "max_tokens": args.tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        if user is not None:
            body["user"] = user
        try:
            ttft, said = await ask(session, url, key, body)
        except (RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
            fig.errors.append(f"turn {turn}: {exc}")
            return
        (fig.first_ttft if turn == 1 else fig.later_ttft).append(ttft)
        msgs += [
            {"role": "assistant", "content": said},
            {"role": "user", "content": f"And what is item {turn + 1} about?"},
        ]


async def one_path(
    d: Daemon, url: str, key: str, hinted: bool, rng: random.Random, args: argparse.Namespace
) -> PathFigures:
    fig = PathFigures()
    docs = [document(rng, args.doc_words) for _ in range(args.conversations)]
    hits0, queries0 = await engine_cache(d)
    async with client_session() as session:
        await asyncio.gather(
            *(
                conversation(session, url, key, doc, f"conv-{i}" if hinted else None, args, fig)
                for i, doc in enumerate(docs)
            )
        )
    hits1, queries1 = await engine_cache(d)
    fig.hits, fig.queries = hits1 - hits0, queries1 - queries0
    return fig


async def wait_healthy(router: Router, workers: int) -> None:
    for _ in range(600):
        health = await asyncio.to_thread(router.healthy)
        if len(health) == workers and all(health.values()):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"vllm-router never saw its workers healthy:\n{router.log()[-2000:]}")


async def run(args: argparse.Namespace, d: Daemon) -> dict[str, PathFigures]:
    rng = random.Random(args.seed)
    figures = {p: PathFigures() for p in args.paths}
    async with contextlib.AsyncExitStack() as stack:
        urls = {"appliance": d.url, "appliance+user": d.url}
        keys = dict.fromkeys(PATHS, d.admin_key)
        routed = [p for p in args.paths if p.startswith("router")]
        if routed:
            exe = install_router()
            if isinstance(exe, str):
                print(f"  vllm-router left out: {exe}")
                args.paths = [p for p in args.paths if p not in routed]
                for p in routed:
                    del figures[p]
            else:
                hops = [
                    await stack.enter_async_context(key_hop(d.engine_address(i), d.engine_key(i)))
                    for i in range(2)
                ]
                tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-router-"))
                stack.callback(shutil.rmtree, tmp, True)
                for p in routed:
                    policy = p.split()[1]
                    (tmp / policy).mkdir()
                    rt = stack.enter_context(
                        run_router(exe, tmp / policy, hops, policy=policy, health=ROUTER_HEALTH)
                    )
                    await wait_healthy(rt, 2)
                    urls[p] = rt.url
                    keys[p] = "unused"  # the hops add each engine's key
        # One conversation first, on each engine: the system prompt and the first
        # requests' warm-up are paid by nobody measured.
        await one_path(
            d,
            d.url,
            d.admin_key,
            False,
            rng,
            argparse.Namespace(**{**vars(args), "conversations": 2, "turns": 1, "doc_words": 100}),
        )
        for r in range(args.rounds):
            order = args.paths[r % len(args.paths) :] + args.paths[: r % len(args.paths)]
            for p in order:
                started = time.monotonic()
                fig = await one_path(d, urls[p], keys[p], p == "appliance+user", rng, args)
                took = time.monotonic() - started
                total = figures[p]
                total.later_ttft += fig.later_ttft
                total.first_ttft += fig.first_ttft
                total.hits += fig.hits
                total.queries += fig.queries
                total.errors += fig.errors
                print(
                    f"  round {r + 1} {p:<20} {took:6.1f} s, later-turn TTFT p50 "
                    f"{pct(fig.later_ttft, 50) * 1000:7.0f} ms, hit rate "
                    f"{fig.hits / max(1.0, fig.queries):6.1%}, errors {len(fig.errors)}",
                    flush=True,
                )
    return figures


def summary(figures: dict[str, PathFigures]) -> Table:
    t = Table(
        [
            "path",
            "later-turn TTFT p50 ms",
            "p90 ms",
            "first-turn TTFT p50 ms",
            "prefix-cache hit rate",
            "later turns",
            "errors",
        ]
    )
    for p, f in figures.items():
        t.add(
            p,
            f"{pct(f.later_ttft, 50) * 1000:,.0f}",
            f"{pct(f.later_ttft, 90) * 1000:,.0f}",
            f"{pct(f.first_ttft, 50) * 1000:,.0f}",
            f"{f.hits / max(1.0, f.queries):.1%}",
            len(f.later_ttft),
            len(f.errors),
        )
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--doc-words", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=24, help="max_tokens of each answer")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated of {PATHS}")
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args()
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = set(args.paths) - set(PATHS)
    if unknown:
        raise SystemExit(f"--paths: unknown {sorted(unknown)}; known: {PATHS}")
    quiet = wait_for_quiet(max_wait_s=60)  # the paths are rotated: noise hits them all
    print(f"noise: {quiet.describe()}", flush=True)
    with real_daemon(args.max_model_len) as d:
        figures = asyncio.run(run(args, d))
    print()
    print(summary(figures).markdown())
    for p, f in figures.items():
        for e in f.errors[:3]:
            print(f"  {p}: {e}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    p: {
                        "later_ttft_s": f.later_ttft,
                        "first_ttft_s": f.first_ttft,
                        "hits": f.hits,
                        "queries": f.queries,
                        "errors": f.errors,
                    }
                    for p, f in figures.items()
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
