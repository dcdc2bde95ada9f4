"""Speculative decoding on vs off, same model, same prompts, rounds alternating (CPU).

One daemon serves SmolLM2 twice, one engine each on its own core: ``spec`` with n-gram
speculation (``--speculative-config``) and ``plain`` without. Two workloads:

- **rewrite**: "copy this text with small changes": the answer repeats the prompt, so
  n-gram lookup proposes the right tokens often;
- **chat**: free questions: little to look up in the prompt.

Per workload and model: completion tokens/s (closed loop, ``--clients`` at once) and, for
``spec``, the acceptance rate and mean accepted length over the workload's rounds (from
the engine's own counters, through the gateway's /metrics). Rounds alternate spec/plain
(order flipped every round). Reported as measured, a slowdown included.

    .venv/bin/python -m bench.speculation [--rounds 3] [--round-s 20] [--clients 2]
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
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from appliance import paths
from bench._common import Daemon, Table, client_session, header, module_argv, wait_for_quiet
from tests.fakes.appliance_proc import real_engine_config, run_appliance

MODELS = ("spec", "plain")
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
REWRITE = (
    "Rewrite this paragraph, changing only 'Tuesday' to 'Friday': The weekly team "
    "meeting is held every Tuesday at ten in the small room on the second floor. Bring "
    "your notes from the week, the list of open issues and any questions for the group. "
    "The meeting ends at eleven, and the notes are sent to everyone on Tuesday afternoon."
)
CHAT = (
    "What should I pack for a weekend of hiking in the mountains?",
    "Explain in a few sentences why the sky is blue.",
    "Suggest three names for a small coffee shop.",
)
SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


@contextlib.contextmanager
def spec_and_plain() -> Iterator[Daemon]:
    home = paths.appliance_home()
    tmp = Path(tempfile.mkdtemp(prefix="llm-appliance-bench-spec-"))
    cfg: dict[str, Any] = real_engine_config(
        tmp, 1, health={"interval_s": 5, "probe_timeout_s": 30, "failures_to_restart": 5}
    )
    cfg["models"] = [{"name": "spec", "speculative": SPECULATIVE}, {"name": "plain"}]
    try:
        with run_appliance(tmp, cfg, env={"LLM_APPLIANCE_HOME": str(home)}) as app:
            app.wait_for((tmp / "admin.key").exists, 300, "admin.key written")
            d = Daemon(app, tmp, (tmp / "admin.key").read_text().strip())
            d.wait_engines_ready(timeout=300)
            yield d
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def body(model: str, workload: str, max_tokens: int) -> bytes:
    prompt = REWRITE if workload == "rewrite" else secrets.choice(CHAT)
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
    ).encode()


async def completion_tokens(s: aiohttp.ClientSession, d: Daemon, payload: bytes) -> int:
    headers = {**d.auth, "Content-Type": "application/json"}
    async with s.post(d.url + "/v1/chat/completions", data=payload, headers=headers) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data}")
        return int(data["usage"]["completion_tokens"])


async def round_tokens_per_s(
    s: aiohttp.ClientSession, d: Daemon, model: str, workload: str, args: argparse.Namespace
) -> float:
    deadline = time.monotonic() + args.round_s
    total = 0

    async def client() -> None:
        nonlocal total
        while time.monotonic() < deadline:
            total += await completion_tokens(s, d, body(model, workload, args.max_tokens))

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(args.clients)))
    return total / (time.monotonic() - t0)


def spec_counters(d: Daemon) -> dict[str, float]:
    """The spec engine's counters, as the gateway re-exports them (engine 0 is ``spec``)."""
    req = urllib.request.Request(d.url + "/metrics", headers=d.auth)
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in SPEC_COUNTERS:
            prefix = f"appliance_engine_spec_{name}_total{{"
            if line.startswith(prefix) and 'engine="0"' in line:
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def run(args: argparse.Namespace, d: Daemon) -> dict[str, Any]:
    rates: dict[tuple[str, str], list[float]] = defaultdict(list)
    spec: dict[str, dict[str, float]] = {}
    async with client_session() as s:
        for model in MODELS:  # warm-up
            await round_tokens_per_s(
                s, d, model, "chat", argparse.Namespace(**{**vars(args), "round_s": 3.0})
            )
        for workload in ("rewrite", "chat"):
            await asyncio.sleep(6)  # a health check reads the counters before we start
            before = spec_counters(d)
            for r in range(args.rounds):
                for model in MODELS if r % 2 == 0 else MODELS[::-1]:
                    rates[(workload, model)].append(
                        await round_tokens_per_s(s, d, model, workload, args)
                    )
            await asyncio.sleep(6)  # and after
            after = spec_counters(d)
            spec[workload] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
            print(f"  {workload} done", flush=True)
    return {"rates": rates, "spec": spec}


def report(args: argparse.Namespace, quiet: Any, acc: dict[str, Any]) -> str:
    t = Table(
        [
            "workload",
            "tokens/s plain",
            "tokens/s spec",
            "ratio spec/plain",
            "acceptance rate",
            "mean accepted length",
        ]
    )
    figures: dict[str, Any] = {}
    for workload in ("rewrite", "chat"):
        plain = sum(acc["rates"][(workload, "plain")]) / args.rounds
        spec = sum(acc["rates"][(workload, "spec")]) / args.rounds
        c = acc["spec"][workload]
        rate = c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else float("nan")
        length = 1 + c["accepted_tokens"] / c["drafts"] if c["drafts"] else float("nan")
        t.add(
            workload,
            f"{plain:.1f}",
            f"{spec:.1f}",
            f"{spec / plain:.3f}",
            f"{rate:.2f}",
            f"{length:.2f}",
        )
        figures[workload] = {"tok_s": [round(plain, 1), round(spec, 1)], "acceptance": rate}
    out = [header("Speculative decoding on vs off (CPU)", module_argv("bench.speculation"), quiet)]
    out.append(
        f"- SmolLM2-135M twice, one engine each on its own core; spec: {json.dumps(SPECULATIVE)}; "
        f"{args.clients} clients, {args.max_tokens} max tokens, temperature 0; {args.rounds} "
        f"rounds × {args.round_s:g} s per model per workload, alternating\n"
    )
    out.append(t.markdown() + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per model per workload")
    ap.add_argument("--round-s", type=float, default=20.0, help="seconds per round")
    ap.add_argument("--clients", type=int, default=2, help="concurrent clients")
    ap.add_argument("--max-tokens", type=int, default=96, help="max tokens per answer")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    with spec_and_plain() as d:
        acc = asyncio.run(run(args, d))
    print(report(args, quiet, acc))


if __name__ == "__main__":
    main()
