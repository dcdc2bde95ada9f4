"""Chat + embeddings on one CPU box: start-up to READY, and embeddings through the gateway
vs straight to the engine.

One daemon serves two models with real vLLM on CPU, one engine each, each pinned to its
own share of the cores: ``chat`` (the packaged SmolLM2) and ``embed`` (the packaged
all-MiniLM-L6-v2 on vLLM's pooling runner). It reports how long the daemon took until
both engines were READY, then embeddings inputs/s at each concurrency, direct (the embed
engine's own Unix socket, with its per-spawn key) and through the gateway, rounds
alternating (order flipped every round), and their ratio.

    .venv/bin/python -m bench.embeddings [--levels 1,16] [--rounds 3] [--round-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from appliance import paths
from bench._common import Daemon, Result, header, module_argv, wait_for_quiet
from bench.direct_vs_gateway import Measure, Samples, alternate, compare
from tests.fakes.appliance_proc import real_engine_config, run_appliance

EMBED = "all-minilm-l6-v2"
SENTENCES = (
    "The lighthouse keeper climbed the stairs at dusk.",
    "Quarterly revenue rose by eight percent.",
    "A cat slept on the warm windowsill.",
    "The train to the coast leaves at nine.",
)


@contextlib.contextmanager
def chat_and_embed() -> Iterator[tuple[Daemon, float]]:
    """The daemon, both engines READY, and the seconds that took."""
    home = paths.appliance_home()
    if not (paths.packaged_model(home, EMBED) / "config.json").exists():
        raise SystemExit(
            f"packaged:{EMBED} not prepared: scripts/setup --config <a config naming it>"
        )
    tmp = Path(tempfile.mkdtemp(prefix="llm-appliance-bench-embed-"))
    cfg: dict[str, Any] = real_engine_config(
        tmp, 1, health={"interval_s": 5, "probe_timeout_s": 30, "failures_to_restart": 5}
    )
    cfg["models"] = [
        {"name": "chat", "model": "packaged:smollm2-135m-instruct"},
        {"name": "embed", "model": f"packaged:{EMBED}"},
    ]
    try:
        started = time.monotonic()
        with run_appliance(tmp, cfg, env={"LLM_APPLIANCE_HOME": str(home)}) as app:
            app.wait_for((tmp / "admin.key").exists, 300, "admin.key written")
            d = Daemon(app, tmp, (tmp / "admin.key").read_text().strip())
            d.wait_engines_ready(timeout=300)
            yield d, time.monotonic() - started
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def body() -> bytes:
    # A fresh word in each input: no cache on either path makes one look faster.
    tag = secrets.token_hex(3)
    return json.dumps({"model": "embed", "input": [f"{tag} {s}" for s in SENTENCES]}).encode()


async def embed_request(session: aiohttp.ClientSession, base_url: str, key: str) -> Result:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    t0 = time.monotonic()
    try:
        async with session.post(base_url + "/v1/embeddings", data=body(), headers=headers) as r:
            data = await r.read()
            now = time.monotonic()
            ok = r.status == 200 and len(json.loads(data).get("data", [])) == len(SENTENCES)
            err = "" if ok else f"{r.status} {data[:120]!r}"
            return Result(ok, t0, now - t0, now - t0, 0, False, r.status, err)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        now = time.monotonic()
        return Result(False, t0, 0.0, now - t0, 0, False, 0, type(exc).__name__)


async def run(args: argparse.Namespace, d: Daemon) -> Samples:
    embed_id = next(e["id"] for e in d.status()["engines"] if e.get("model") == "embed")

    async def send(s: aiohttp.ClientSession, base: str, key: str, _w: int) -> Result:
        return await embed_request(s, base, key)

    return await alternate(d, embed_id, args.levels, args.rounds, args.round_s, send, "clients")


INPUTS = Measure(
    "clients",
    "inputs/s",
    "inputs_s",
    "latency",
    lambda ok, elapsed: len(ok) * len(SENTENCES) / elapsed,
    lambda r: r.total,
)


def report(args: argparse.Namespace, quiet: Any, ready_s: float, samples: Samples) -> str:
    t, figures = compare(args.levels, samples, INPUTS)
    figures = {"ready_s": round(ready_s, 1), **figures}
    out = [header("Embeddings through the gateway (CPU)", module_argv("bench.embeddings"), quiet)]
    out.append(
        f"- start-up: daemon start to both engines READY (chat: SmolLM2-135M, embed: "
        f"all-MiniLM-L6-v2, one engine each on its own core): {ready_s:.1f} s\n"
        f"- load: {len(SENTENCES)} inputs per /v1/embeddings request, closed loop; "
        f"{args.rounds} rounds × {args.round_s:g} s per path per concurrency, "
        "direct/gateway alternating\n"
    )
    out.append(t.markdown() + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--levels", default="1,16", help="concurrent clients, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per path per concurrency")
    ap.add_argument("--round-s", type=float, default=10.0, help="seconds per round")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    with chat_and_embed() as (d, ready_s):
        print(f"both engines READY after {ready_s:.0f} s", flush=True)
        acc = asyncio.run(run(args, d))
    print(report(args, quiet, ready_s, acc))


if __name__ == "__main__":
    main()
