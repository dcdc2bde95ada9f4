"""CPU engine settings on real vLLM: dtype (bfloat16 vs float32) and LD_PRELOAD.

Each phase starts one daemon per variant (one real vLLM engine each, on every usable
core, on its Unix socket), all at once, then loads ONE engine at a time, straight to its
socket with its per-spawn key, in alternating rounds: at each concurrency, round r gives
each variant one batch, in an order rotated by r, so a slow spell of the shared machine
falls on every variant alike. A batch is N streams started together, of ``--tokens``
tokens each (``ignore_eos``) on ~130-token prompts (a random first word: no prefix-cache
hits); it ends when the last stream does. Short, whole batches rather than timed closed
loops: alternation is fine-grained and no round overruns its time. Per variant and
concurrency it reports tokens/s (all its batches together, and its slowest and fastest
batch), TTFT p50/p99, and tokens/s against the phase's first variant.

Variants differ only in what the config gives the engine: ``engine.extra_args``
``--dtype X`` and ``engine.env`` ``LD_PRELOAD`` ("" for none: vLLM then preloads
PyTorch's libgomp itself). Idle engines stay up during other variants' rounds; the CPU
they use meanwhile is reported.

    .venv/bin/python -m bench.cpu_engine [--phases dtype,preload] [--levels 1,8]
        [--rounds 8,4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import shutil
import signal
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from appliance import paths
from appliance.plan import IOMP, TCMALLOC, cpu_preload_libs, read_cpu_flags
from bench._common import (
    Daemon,
    Result,
    Table,
    client_session,
    header,
    module_argv,
    ms,
    pct,
    request,
    wait_for_quiet,
)
from tests.fakes.appliance_proc import real_engine_config, run_appliance

MODEL = paths.PACKAGED_MODEL_NAME
STORY = (
    "the keeper of the lighthouse climbed the stairs each night to light the lamp and "
    "watch the ships pass along the rocky coast while storms rolled in from the sea and "
    "gulls cried over the harbour where fishing boats waited for morning tides to carry "
    "them out past the reef toward the deep water where the cod and herring ran in "
    "silver shoals beneath the grey sky that hung low over the town and its chapel"
)
WORDS = tuple(STORY.split(" "))


@dataclass(frozen=True)
class Variant:
    name: str
    dtype: str
    preload: tuple[str, ...]  # library file names to preload (found on this machine)


PHASES: dict[str, tuple[Variant, ...]] = {
    "dtype": (
        Variant("bfloat16", "bfloat16", ()),
        Variant("float32", "float32", ()),
    ),
    "preload": (
        # Each library on top of the previous: iomp alone, then tcmalloc added to it.
        Variant("float32, no preload", "float32", ()),
        Variant("float32 + iomp", "float32", (IOMP,)),
        Variant("float32 + iomp + tcmalloc", "float32", (TCMALLOC, IOMP)),
    ),
}


@dataclass
class Running:
    variant: Variant
    daemon: Daemon
    ld_preload: str
    results: dict[int, list[Result]] = field(default_factory=lambda: defaultdict(list))
    elapsed: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    round_rates: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    idle_cpu_s: float = 0.0  # CPU its tree used while another variant was loaded
    idle_wall_s: float = 0.0


def prompt() -> str:
    # A random first word: no two prompts share a first KV block, so none hits the cache.
    words = random.choices(WORDS, k=120)
    return f"{secrets.token_hex(4)} " + " ".join(words)


def body(tokens: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "prompt": prompt(),
            "max_tokens": tokens,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()


def preload_value(names: tuple[str, ...], found: dict[str, str]) -> str:
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"cannot preload {missing}: not found (run `llm-appliance setup`)")
    return ":".join(found[n] for n in names)


@contextlib.contextmanager
def start_variants(variants: tuple[Variant, ...], found: dict[str, str]) -> Iterator[list[Running]]:
    """One daemon per variant, started together; all engines READY on exit of the setup."""
    home = paths.appliance_home()
    with contextlib.ExitStack() as stack:
        started: list[tuple[Variant, Any, Path, str]] = []
        for v in variants:
            tmp = Path(tempfile.mkdtemp(prefix="llm-appliance-bench-cpu-"))
            stack.callback(shutil.rmtree, tmp, ignore_errors=True)
            ld = preload_value(v.preload, found)
            cfg = real_engine_config(
                tmp,
                1,
                engine={"extra_args": ["--dtype", v.dtype], "env": {"LD_PRELOAD": ld}},
                # Rare probes: an idle variant should cost the loaded one nothing.
                health={"interval_s": 30, "probe_timeout_s": 60, "failures_to_restart": 5},
            )
            app = stack.enter_context(
                run_appliance(tmp, cfg, env={"LLM_APPLIANCE_HOME": str(home)})
            )
            stack.callback(_stop, app)
            started.append((v, app, tmp, ld))
        out = []
        for v, app, tmp, ld in started:
            app.wait_ready(timeout=600)
            d = Daemon(app, tmp, (tmp / "admin.key").read_text().strip())
            d.wait_engines_ready(timeout=600)
            out.append(Running(v, d, ld))
        yield out


def _stop(app: Any) -> None:
    """SIGTERM, as systemd would: the daemon takes its engine's whole tree down."""
    if app.proc.poll() is None:
        app.signal(signal.SIGTERM)
        with contextlib.suppress(Exception):
            app.wait_exit(90)


def tree_cpu_s(pid: int) -> float:
    total = 0.0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
    return total


async def run_phase(args: argparse.Namespace, running: list[Running]) -> None:
    keys = [r.daemon.engine_key(0) for r in running]
    sessions = [client_session(r.daemon.engine_address(0)) for r in running]
    try:

        async def batch(i: int, streams: int, tokens: int) -> tuple[list[Result], float]:
            url = running[i].daemon.engine_url(0)
            t0 = time.monotonic()
            results = await asyncio.gather(
                *(request(sessions[i], url, keys[i], body(tokens), True) for _ in range(streams))
            )
            return list(results), time.monotonic() - t0

        for i in range(len(running)):  # warm-up: connections open, first batch done
            await batch(i, 2, 8)
        for c, rounds in zip(args.levels, args.rounds, strict=True):
            for rnd in range(rounds):
                shift = rnd % len(running)
                for i in [*range(shift, len(running)), *range(shift)]:
                    idle = [r for j, r in enumerate(running) if j != i]
                    cpu0 = [tree_cpu_s(r.daemon.pid) for r in idle]
                    results, elapsed = await batch(i, c, args.tokens)
                    for r, before in zip(idle, cpu0, strict=True):
                        r.idle_cpu_s += tree_cpu_s(r.daemon.pid) - before
                        r.idle_wall_s += elapsed
                    r = running[i]
                    r.results[c] += results
                    r.elapsed[c] += elapsed
                    r.round_rates[c].append(tokens(results) / elapsed)
            print(f"  {c} stream(s) done", flush=True)
    finally:
        for s in sessions:
            await s.close()


def tokens(results: list[Result]) -> int:
    # Events minus the final chunk and [DONE]: one event per token.
    return sum(max(0, r.events - 2) for r in results if r.ok)


def engine_facts(r: Running) -> dict[str, Any]:
    """What the engine's own log says about its dtype and preloaded libraries."""
    log = r.daemon.app.log()
    return {
        "dtype_in_log": next(
            (d for d in ("float32", "bfloat16") if f"dtype=torch.{d}" in log), "?"
        ),
        "warns_tcmalloc": "libtcmalloc is not found in LD_PRELOAD" in log,
        "warns_iomp": "libiomp is not found in LD_PRELOAD" in log,
    }


def report_phase(args: argparse.Namespace, phase: str, running: list[Running]) -> str:
    t = Table(
        [
            "variant",
            "streams",
            "requests (failed)",
            "tokens/s",
            "slowest / fastest batch",
            "vs first",
            "vs first, same round: median (rounds faster)",
            "TTFT p50 (ms)",
            "TTFT p99 (ms)",
        ]
    )
    for c in args.levels:
        first = running[0]
        base = tokens(first.results[c]) / first.elapsed[c]
        for r in running:
            # Paired by round: a slow spell of the machine hits both batches of a round.
            paired = [a / b for a, b in zip(r.round_rates[c], first.round_rates[c], strict=True)]
            faster = sum(x > 1 for x in paired)
            res = r.results[c]
            ok = [x for x in res if x.ok]
            rate = tokens(res) / r.elapsed[c] if r.elapsed[c] else float("nan")
            ttft = [x.ttft for x in ok]
            t.add(
                r.variant.name,
                c,
                f"{len(res)} ({len(res) - len(ok)})",
                f"{rate:.1f}",
                f"{min(r.round_rates[c]):.1f} / {max(r.round_rates[c]):.1f}",
                f"{rate / base:.2f}×" if base else "–",
                "–" if r is first else f"{statistics.median(paired):.2f}× ({faster}/{len(paired)})",
                ms(pct(ttft, 50)),
                ms(pct(ttft, 99)),
            )
    notes = []
    for r in running:
        f = engine_facts(r)
        idle = r.idle_cpu_s / r.idle_wall_s if r.idle_wall_s else 0.0
        ld = r.ld_preload or '""'
        notes.append(
            f"- {r.variant.name}: LD_PRELOAD={ld}; engine log: dtype "
            f"{f['dtype_in_log']}, tcmalloc warning {'yes' if f['warns_tcmalloc'] else 'no'}, "
            f"iomp warning {'yes' if f['warns_iomp'] else 'no'}; idle during the others' "
            f"rounds it used {idle:.0%} of one core"
        )
    return f"### Phase: {phase}\n\n" + t.markdown() + "\n\n" + "\n".join(notes) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phases", default="dtype,preload", help=f"of {', '.join(PHASES)}")
    ap.add_argument("--levels", default="1,8", help="concurrent streams, comma-separated")
    ap.add_argument(
        "--rounds", default="8,4", help="batches per variant at each concurrency, comma-separated"
    )
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    args.rounds = [int(x) for x in args.rounds.split(",")]
    if len(args.rounds) != len(args.levels):
        raise SystemExit("--rounds needs one count per concurrency in --levels")
    phases = [p for p in args.phases.split(",") if p]
    if unknown := [p for p in phases if p not in PHASES]:
        raise SystemExit(f"unknown phase(s) {unknown}; known: {', '.join(PHASES)}")
    home = paths.appliance_home()
    python = paths.engine_python(home)
    if not python.exists():
        raise SystemExit(f"no engine venv under {home}: run scripts/setup first")
    found = {Path(f).name: f for f in cpu_preload_libs(str(python))}
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    t_start = time.monotonic()
    sections: list[str] = []
    figures: dict[str, Any] = {}
    for phase in phases:
        t0 = time.monotonic()
        with start_variants(PHASES[phase], found) as running:
            print(
                f"{phase}: {len(running)} engines READY in {time.monotonic() - t0:.0f} s",
                flush=True,
            )
            asyncio.run(run_phase(args, running))
            sections.append(report_phase(args, phase, running))
            figures[phase] = {
                r.variant.name: {
                    str(c): {
                        "tok_s": round(tokens(r.results[c]) / r.elapsed[c], 2),
                        "ttft_p50_ms": round(
                            pct([x.ttft for x in r.results[c] if x.ok], 50) * 1e3, 1
                        ),
                    }
                    for c in args.levels
                }
                for r in running
            }
    levels = "/".join(map(str, args.levels))
    rounds = "/".join(map(str, args.rounds))
    flags = read_cpu_flags()
    isa = sorted(f for f in flags if f.startswith(("avx", "amx")))
    out = [
        header(
            "CPU engine: dtype and LD_PRELOAD (real vLLM)", module_argv("bench.cpu_engine"), quiet
        )
    ]
    out.append(
        f"- CPU flags: {' '.join(isa) or 'no AVX'}; whole run {time.monotonic() - t_start:.0f} s\n"
        f"- load: 1 real vLLM engine per variant (SmolLM2-135M, --enforce-eager, all cores, "
        f"Unix socket), straight to the engine; ~130-token prompts, {args.tokens}-token "
        f"streams with ignore_eos on /v1/completions; at {levels} stream(s), {rounds} "
        f"batches per variant (N streams started together), variants alternating, order "
        f"rotated every round\n"
    )
    out += sections
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    print("\n".join(out))


if __name__ == "__main__":
    main()
