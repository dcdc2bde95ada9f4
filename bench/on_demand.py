"""Models on demand (issue 23): time to first token by the model's state, and swaps per
minute under an alternating two-model load, with and without the minimum residency.

**TTFT by state.** One request (a 4-token chat stream) timed from sending to its first
SSE event, for a model that is

- *loaded*: its engine runs;
- *asleep, slot free* (``swap = "sleep"``): woken, nothing else to put away;
- *asleep, other model loaded*: the other model of its slot is drained and put to sleep,
  then this one is woken;
- *unloaded, slot free* (``swap = "stop"``): a cold start;
- *unloaded, other model loaded*: the other is drained and stopped, then a cold start.

On fakes (``--parts fake``) the daemon sees fake GPUs (the GPU check's fake ``pynvml``):
a sleep slot (GPU 0) and a stop slot (GPU 2), two models each, minimum residency 0; a
wake takes the fake engine's ``--wake-delay-s``, a cold start is the fake engine's own
process start. On real vLLM (``--parts real``, CPU, the packaged SmolLM2 under two
names) there is no sleep mode: loaded and unloaded only. Each state is measured once
per round; the table gives the median and the range.

**Swaps per minute** (``--parts swaps``, fakes): two closed-loop clients, one per model
of a slot, each sending its next request as soon as the last is answered, for
``--swap-round-s`` seconds. Four slots of the same daemon, measured in turn: sleep and
stop, each with ``min_residency_s`` 0 and ``--residency-s``. Counted: loads (from
``appliance_model_loads_total``; a round starts with both models put away, so swaps =
loads - 1), requests answered and failed per model, and the time each request waited
for its first token; each failed request's HTTP status and error code (0 and the
exception's name when no answer came), with how long it had waited.

    .venv/bin/python -m bench.on_demand [--parts fake,swaps,real] [--rounds 5]
        [--real-rounds 2] [--wake-delay-s 0.5] [--residency-s 5] [--swap-round-s 20]
        [--slots sleep,sleep-r,stop,stop-r] [--journal FILE.log]
        [--json FILE.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from appliance import paths
from bench._common import (
    SSE_DATA,
    Daemon,
    pct,
    plot_path,
    wait_for_quiet,
    write_plot,
)
from bench.on_demand_report import chart, report, ttft_summary
from tests.fakes.appliance_proc import (
    REPO,
    fake_engine_config,
    get_json,
    real_engine_config,
    run_appliance,
)
from tests.gpu_check.fake_nvml import FAKE_DIR_ENV, default_gpu, write_shim, write_state

# The fake daemon's slots: (swap, min_residency_s is the bench's --residency-s) by GPU.
SLOTS = {
    "sleep": ("sleep", False, 0),
    "sleep-r": ("sleep", True, 1),
    "stop": ("stop", False, 2),
    "stop-r": ("stop", True, 3),
}
LOAD_TIMEOUT_S = 60.0
REAL_LOAD_TIMEOUT_S = 420.0  # a cold SmolLM2 on a loaded 2-core box has taken minutes
CHAT = [{"role": "user", "content": "Say hello."}]


def pair(slot: str) -> tuple[str, str]:
    return f"{slot}-a", f"{slot}-b"


@dataclass(slots=True)
class Asked:
    """One request: its model, answered or not, seconds to its first token (or to its
    failure); a failure's HTTP status (0: no answer) and error code."""

    model: str
    ok: bool
    wait_s: float
    status: int = 200
    code: str = ""

    @property
    def failure(self) -> str:
        """How it failed, as the table counts it: "503 model_loading"."""
        return f"{self.status} {self.code}"


# ---------------------------------------------------------------------------- daemons


class Box:
    """A daemon's admin door: one timed request, model states, loads, put away."""

    def __init__(self, d: Daemon, load_timeout_s: float) -> None:
        self.d = d
        self.timeout = aiohttp.ClientTimeout(total=load_timeout_s + 60)

    async def ttft(self, s: aiohttp.ClientSession, model: str) -> Asked:
        """One 4-token chat stream: answered, seconds to its first SSE event (or to its
        failure), and a failure's HTTP status and error code."""
        body = {"model": model, "messages": CHAT, "max_tokens": 4, "stream": True}
        headers = {**self.d.auth, "Content-Type": "application/json"}
        t0 = time.monotonic()
        first = 0.0
        try:
            async with s.post(
                self.d.url + "/v1/chat/completions",
                json=body,
                headers=headers,
                timeout=self.timeout,
            ) as r:
                if r.status != 200:
                    code = _error_code(await r.read())
                    return Asked(model, False, time.monotonic() - t0, r.status, code)
                async for chunk in r.content.iter_any():
                    if not first and SSE_DATA in chunk:
                        first = time.monotonic() - t0
            if first > 0:
                return Asked(model, True, first)
            return Asked(model, False, time.monotonic() - t0, 200, "no_event")
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return Asked(model, False, time.monotonic() - t0, 0, type(e).__name__)

    def states(self) -> dict[str, str]:
        return {m["name"]: m["state"] for m in self.d.status()["models"]}

    def loads(self, models: tuple[str, ...]) -> int:
        """Loads of ``models`` so far, cold and wake, from /metrics."""
        code, text = _get_text(self.d.url + "/metrics", self.d.auth)
        if code != 200:
            raise RuntimeError(f"/metrics answered {code}")
        total = 0
        for m in re.finditer(r"^appliance_model_loads_total\{(.*)\} (\S+)$", text, re.M):
            if any(f'model="{name}"' in m.group(1) for name in models):
                total += int(float(m.group(2)))
        return total

    async def put_away(self, models: tuple[str, ...], timeout_s: float = 120) -> None:
        """Unload (or put to sleep) ``models`` and wait until neither holds its slot."""
        for name in models:
            code, body = _post(self.d.url + f"/admin/models/{name}/unload", self.d.auth)
            if code != 202:
                raise RuntimeError(f"unload {name}: {code} {body}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.states()
            if all(st[n] in ("unloaded", "sleeping") for n in models):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{models} not put away in {timeout_s:.0f} s: {self.states()}")


def _error_code(raw: bytes) -> str:
    """An error body's ``error.code`` (OpenAI's shape), or "?" when it has none."""
    try:
        code = json.loads(raw)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return "?"
    return str(code) if code else "?"


def _get_text(url: str, headers: dict[str, str]) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def _post(url: str, headers: dict[str, str]) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=b"", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read()[:200]


@contextlib.contextmanager
def fake_daemon(args: argparse.Namespace) -> Iterator[Box]:
    """Four fake GPUs, one slot of two on-demand models each (SLOTS), none loaded."""
    tmp = Path(tempfile.mkdtemp(prefix="llm-appliance-bench-ondemand-"))
    nvml = tmp / "nvml"
    write_state(nvml, [default_gpu(i) for i in range(len(SLOTS))])
    write_shim(nvml)
    try:
        cfg: dict[str, Any] = fake_engine_config(
            tmp,
            2 * len(SLOTS),
            telemetry={"source": "nvml", "interval_s": 0.5},
            health={"interval_s": 2.0, "probe_timeout_s": 10.0, "failures_to_restart": 3},
        )
        cfg["engine"]["device"] = "cuda"
        command = [*cfg["engine"]["command"], "--gpu-share", "0.4"]
        command += ["--wake-delay-s", f"{args.wake_delay_s:g}", "--token-delay-ms", "5"]
        cfg["models"] = [
            {
                "name": name,
                "load": "on_demand",
                "swap": swap,
                "gpus": [gpu],
                "min_residency_s": args.residency_s if resident else 0,
                "idle_unload_s": 0,
                "load_timeout_s": LOAD_TIMEOUT_S,
                "command": command,
            }
            for slot, (swap, resident, gpu) in SLOTS.items()
            for name in pair(slot)
        ]
        env = {FAKE_DIR_ENV: str(nvml), "PYTHONPATH": f"{nvml}:{REPO}"}
        env["RUNTIME_DIRECTORY"] = str(tmp / "run")
        with run_appliance(tmp, cfg, env=env) as app:
            yield Box(_admin(app, tmp, 60), LOAD_TIMEOUT_S)
    finally:
        if args.journal and (tmp / "appliance.log").exists():
            shutil.copyfile(tmp / "appliance.log", args.journal)
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def real_daemon() -> Iterator[Box]:
    """Real vLLM on CPU: "one" and "two", the packaged SmolLM2 on demand (swap = stop)."""
    home = paths.appliance_home()
    if not (paths.packaged_model(home) / "config.json").exists():
        raise SystemExit("the packaged SmolLM2 is not prepared: run scripts/setup first")
    tmp = Path(tempfile.mkdtemp(prefix="llm-appliance-bench-ondemand-real-"))
    cfg: dict[str, Any] = real_engine_config(
        tmp, 1, health={"interval_s": 5, "probe_timeout_s": 30, "failures_to_restart": 5}
    )
    common: dict[str, Any] = {"model": "packaged:smollm2-135m-instruct", "load": "on_demand"}
    common |= {"swap": "stop", "min_residency_s": 0, "idle_unload_s": 0}
    common["load_timeout_s"] = REAL_LOAD_TIMEOUT_S
    cfg["models"] = [{"name": "one", **common}, {"name": "two", **common}]
    try:
        with run_appliance(tmp, cfg, env={"LLM_APPLIANCE_HOME": str(home)}) as app:
            yield Box(_admin(app, tmp, 300), REAL_LOAD_TIMEOUT_S)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _admin(app: Any, tmp: Path, timeout_s: float) -> Daemon:
    app.wait_for((tmp / "admin.key").exists, timeout_s, "admin.key written")
    d = Daemon(app, tmp, (tmp / "admin.key").read_text().strip())
    app.wait_for(lambda: get_json(app.url + "/healthz")[0] == 200, timeout_s, "the gateway")
    return d


# ---------------------------------------------------------------------------- TTFT


async def ttft_round(
    box: Box, s: aiohttp.ClientSession, a: str, b: str, sleep: bool
) -> dict[str, float]:
    """One round on a slot of ``a`` and ``b``, both put away when it starts."""
    away = "asleep" if sleep else "unloaded"
    out: dict[str, float] = {}
    for state, model in (
        (f"{away}, slot free", a),
        ("loaded", a),
        (f"{away}, other model loaded", b),
    ):
        got = await box.ttft(s, model)
        if not got.ok:
            raise RuntimeError(f"{model} ({state}) failed ({got.failure}): {box.states()}")
        out[state] = got.wait_s
    await box.put_away((a, b))
    return out


async def ttft_runs(
    box: Box, slots: dict[str, bool], rounds: int
) -> dict[str, dict[str, list[float]]]:
    """``slots``: slot name -> its models sleep. Per slot, per state: seconds by round."""
    res: dict[str, dict[str, list[float]]] = {}
    async with aiohttp.ClientSession(trust_env=False) as s:
        for slot, sleep in slots.items():
            a, b = pair(slot) if slot in SLOTS else ("one", "two")
            if sleep:  # a first load of each is cold: wake them once, then put both to sleep
                for m in (a, b):
                    await box.ttft(s, m)
                await box.put_away((a, b))
            for r in range(rounds):
                for state, took in (await ttft_round(box, s, a, b, sleep)).items():
                    res.setdefault(slot, {}).setdefault(state, []).append(took)
                print(f"  TTFT {slot}: round {r + 1}/{rounds} done", flush=True)
    return res


# ---------------------------------------------------------------------------- swaps


async def swap_round(box: Box, slot: str, round_s: float) -> dict[str, Any]:
    """Two clients, one per model of ``slot``, back to back for ``round_s``."""
    models = pair(slot)
    await box.put_away(models)
    before = box.loads(models)
    asked: list[Asked] = []
    deadline = time.monotonic() + round_s

    async def client(s: aiohttp.ClientSession, model: str) -> None:
        while time.monotonic() < deadline:
            asked.append(await box.ttft(s, model))

    async with aiohttp.ClientSession(trust_env=False) as s:
        t0 = time.monotonic()
        await asyncio.gather(*(client(s, m) for m in models))
        took = time.monotonic() - t0
    loads = box.loads(models) - before
    return {"slot": slot, "seconds": took, "loads": loads, "asked": asked}


def swap_figures(args: argparse.Namespace, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per slot: swaps per minute, answered and failed per model, waits for the first
    token (p50, p99, max: the residency shows in the longest waits)."""
    out: dict[str, dict[str, Any]] = {}
    for slot, (swap, resident, _) in SLOTS.items():
        mine = [r for r in rounds if r["slot"] == slot]
        if not mine:
            continue
        asked = [a for r in mine for a in r["asked"]]
        minutes = sum(r["seconds"] for r in mine) / 60
        swaps = sum(max(0, r["loads"] - 1) for r in mine)
        waits = [a.wait_s for a in asked if a.ok]
        out[slot] = {
            "swap": swap,
            "residency_s": args.residency_s if resident else 0.0,
            "models": pair(slot),
            "swaps": swaps,
            "swaps_per_minute": round(swaps / minutes, 1),
            "minutes": round(minutes, 2),
            "answered": {m: sum(a.ok for a in asked if a.model == m) for m in pair(slot)},
            "failed": {m: sum(not a.ok for a in asked if a.model == m) for m in pair(slot)},
            "failures": _failures(asked),
            "wait_p50_s": round(pct(waits, 50), 3),
            "wait_p99_s": round(pct(waits, 99), 3),
            "wait_max_s": round(max(waits, default=float("nan")), 3),
        }
    return out


def _failures(asked: list[Asked]) -> dict[str, dict[str, list[float]]]:
    """Per model, per "status code": how long each failed request had waited (s)."""
    out: dict[str, dict[str, list[float]]] = {}
    for a in asked:
        if not a.ok:
            out.setdefault(a.model, {}).setdefault(a.failure, []).append(round(a.wait_s, 1))
    return out


# ---------------------------------------------------------------------------- main


async def run_fake(args: argparse.Namespace, parts: set[str], result: dict[str, Any]) -> None:
    with fake_daemon(args) as box:
        if "fake" in parts:
            res = await ttft_runs(box, {"sleep": True, "stop": False}, args.rounds)
            result["ttft"].update(ttft_summary(res))
        if "swaps" in parts:
            rounds = []
            for r in range(args.swap_rounds):
                for slot in args.slots.split(","):
                    rounds.append(await swap_round(box, slot, args.swap_round_s))
                    print(f"  swaps {slot}: round {r + 1}/{args.swap_rounds} done", flush=True)
            result["swaps"] = swap_figures(args, rounds)


async def run_real(args: argparse.Namespace, result: dict[str, Any]) -> None:
    with real_daemon() as box:
        res = await ttft_runs(box, {"real": False}, args.real_rounds)
        result["ttft"].update(ttft_summary(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default="fake,swaps,real", help="any of fake, swaps, real")
    ap.add_argument("--rounds", type=int, default=5, help="TTFT rounds on fakes")
    ap.add_argument("--real-rounds", type=int, default=2, help="TTFT rounds on real vLLM")
    ap.add_argument("--wake-delay-s", type=float, default=0.5, help="the fake engine's wake")
    ap.add_argument("--residency-s", type=float, default=5.0, help="min_residency_s, when on")
    ap.add_argument("--swap-round-s", type=float, default=20.0)
    ap.add_argument("--swap-rounds", type=int, default=2, help="rounds per slot")
    ap.add_argument("--slots", default=",".join(SLOTS), help="swaps: any of " + ",".join(SLOTS))
    ap.add_argument("--journal", default="", help="keep the fake daemon's journal here")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    ap.add_argument("--add-to", default="", help="start from an earlier run's --json file")
    ap.add_argument("--plot", default="", help="PNG chart (default: beside --json)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if unknown := set(args.slots.split(",")) - set(SLOTS):
        ap.error(f"--slots: no slot {', '.join(sorted(unknown))}; the slots: {', '.join(SLOTS)}")
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    quiet.start_watching()
    t0 = time.monotonic()
    result: dict[str, Any] = {"ttft": {}, "swaps": {}}
    if args.add_to:  # figures of an earlier run (say, real vLLM's) shown with these
        result = json.loads(Path(args.add_to).read_text())
    if parts & {"fake", "swaps"}:
        asyncio.run(run_fake(args, parts, result))
    if "real" in parts:
        asyncio.run(run_real(args, result))
    quiet.stop_watching()
    print()
    print(report(args, quiet, result))
    print(f"(took {time.monotonic() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    write_plot(chart, result, plot_path(args.plot, args.json or None))


if __name__ == "__main__":
    main()
