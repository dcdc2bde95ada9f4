"""Chaos soak: mixed load while engines are killed, frozen, heated and keys corrupted.

    .venv/bin/python -m bench.soak --duration 600 --engines fake
    .venv/bin/python -m bench.soak --duration 600 --engines real

Runs a real ``llm-appliance serve`` (two engines: fast fake engines, or real vLLM on
CPU with one core each) on loopback, drives it with a mixed load (streaming and not,
short and long, interactive and batch keys, clients that disconnect mid-stream), and
fires a chaos schedule spread over the run: SIGKILL of an engine's API server, an
engine OOM-killed by the kernel, SIGSTOP of an engine, the state disk full for a minute,
a GPU heated through ``file:`` telemetry, a corrupt keys file then a good one, a flood
past ``max_queue``, SIGHUP, and at last ``serve`` itself SIGKILLed and started again (the
faults outside the happy path are ``bench.soak_faults``: what each checks is there).
Every request ends in exactly one class:

- ``ok``: a complete answer (non-streamed JSON with choices; a stream ending in [DONE]);
- ``refused``: 429/503 with Retry-After, or a stream ended by an error event, or an
  OpenAI-shaped 502/504 (the engine failed before answering on both tries) — a clean no;
- ``disconnected``: the client hung up on purpose;
- ``on_killed_supervisor``: its connection broke or was refused while ``serve`` was
  dead (SIGKILLed, not yet serving again): what a client of a killed daemon sees, and
  the only requests the gateway had accepted that may end without an answer;
- ``lost``: no answer, a hang past the client timeout, a broken stream without an error
  event, a non-JSON error, a 5xx other than 502/503/504. **Must be 0.**

At the end the daemon (the last life) gets SIGTERM; it must exit 0 and leave no engine
process behind, and no fault may have left a process or damaged a state file.
Supervisor RSS and open fds are reported at start and end. Bounded in time; only
loopback addresses are used.

The report (``--out``) carries a per-second timeline: requests by class (by when they
ended), the p99 of the OK ones, both engines' states from ``/admin/status`` every
0.5 s, their restarts, and the chaos events; ``--plot`` (or ``--out`` alone: the PNG
goes next to it) draws it (``bench.plots``; needs matplotlib, the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from appliance import paths
from bench import plots
from bench._common import StatePoller, plot_path, write_plot
from bench.soak_box import StateDisk
from bench.soak_faults import (
    Faults,
    disk_full,
    engine_oom,
    engine_view,
    kill_supervisor,
    named_exit,
)
from bench.soak_report import (
    CLASSES,
    Tally,
    after_events,
    exit_cause_counts,
    fault_table,
    percentile,
    timeline,
)
from tests.fakes.appliance_proc import (
    REPO,
    Appliance,
    fake_engine_config,
    get_json,
    real_engine_config,
    run_appliance,
)

RETRY_STATUSES = {429, 503}
STATES_EVERY_S = 0.5
CLEAN_ENGINE_FAILURES = {502, 504}


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    model: str,
    rng: random.Random,
    tally: Tally,
    t0: float,
    timeout_s: float,
    long_tokens: int,
) -> None:
    stream = rng.random() < 0.6
    long = rng.random() < 0.25
    hang_up = stream and rng.random() < 0.1
    chat = rng.random() < 0.5
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": long_tokens if long else 8,
        "stream": stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": "Tell me something."}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = "Once upon a time"
        path = "/v1/completions"
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(
                url + path, json=body, headers={"Authorization": f"Bearer {key}"}
            ) as resp:
                if resp.status == 200 and stream:
                    chunks = 0
                    tail = b""
                    async for chunk in resp.content.iter_any():
                        chunks += 1
                        tail = (tail + chunk)[-4096:]
                        if hang_up and chunks >= 2:
                            tally.add("disconnected")
                            return
                    if b"data: [DONE]" in tail:
                        tally.add("ok")
                    elif b'"error"' in tail:
                        tally.add("refused", "error event mid-stream")
                        return
                    else:
                        tally.cut(
                            started,
                            "stream ended without [DONE] or error event",
                            f"{path} stream tail {tail[-200:]!r}",
                        )
                        return
                elif resp.status == 200:
                    data = await resp.json(content_type=None)
                    if data.get("choices"):
                        tally.add("ok")
                    else:
                        tally.add("lost", "200 without choices", str(data)[:200])
                        return
                else:
                    raw = await resp.read()
                    try:
                        err = json.loads(raw)["error"]
                    except (ValueError, KeyError, TypeError):
                        tally.add(
                            "lost",
                            f"{resp.status} not OpenAI-shaped",
                            f"{resp.status} {raw[:200]!r}",
                        )
                        return
                    retry_ok = resp.status in RETRY_STATUSES and resp.headers.get("Retry-After")
                    if retry_ok or resp.status in CLEAN_ENGINE_FAILURES:
                        tally.add("refused", f"{resp.status} {err.get('code')}")
                    elif resp.status == 401:
                        tally.add("refused", "401 (keys file being replaced)")
                    else:
                        tally.add(
                            "lost", f"unexpected {resp.status}", f"{resp.status} {raw[:200]!r}"
                        )
                    return
    except TimeoutError:
        tally.add("lost", "no answer within the client timeout", f"{path} stream={stream}")
        return
    except aiohttp.ClientError as exc:
        tally.cut(started, f"connection: {type(exc).__name__}", f"{path}: {exc!r}")
        return
    latency = time.monotonic() - started
    tally.latencies.append(latency)
    tally.timeline.append((time.monotonic() - t0, latency))


async def client(
    worker: int,
    session: aiohttp.ClientSession,
    url: str,
    keys: list[str],
    model: str,
    tally: Tally,
    t0: float,
    until: float,
    timeout_s: float,
    long_tokens: int,
    pause_s: float,
) -> None:
    rng = random.Random(worker)
    while time.monotonic() < until:
        await one_request(
            session, url, rng.choice(keys), model, rng, tally, t0, timeout_s, long_tokens
        )
        await asyncio.sleep(rng.uniform(0, pause_s))


def write_sensors(path: Path, temps: list[float]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"gpus": [{"index": i, "temperature_c": t} for i, t in enumerate(temps)]})
    )
    tmp.replace(path)


def engine_pid(app: Appliance, key: str, i: int) -> int | None:
    code, body = get_json(app.url + "/admin/status", headers={"Authorization": f"Bearer {key}"})
    if code != 200:
        return None
    pid = body["engines"][i]["pid"]
    return int(pid) if pid else None


async def chaos(
    faults: Faults,
    sensors: Path,
    keys_file: Path,
    tally: Tally,
    duration: float,
    flood: Any,
) -> None:
    """The schedule: each event at a fixed share of the run (an event that waits for the
    daemon to recover can push the next ones later; each is noted when it happens)."""
    app, admin, t0, note = faults.app, faults.admin, faults.t0, tally.note
    good_keys = keys_file.read_bytes()

    async def at(share: float) -> None:
        await asyncio.sleep(max(0.0, t0 + share * duration - time.monotonic()))

    # First, while both engines serve (real ones take minutes to come back on a busy
    # box): usage must be counted while the disk is full for the check to mean anything.
    await at(0.01)
    await disk_full(faults, min(60.0, 0.1 * duration))
    await at(0.12)
    pid = engine_pid(app, admin, 0)
    if pid:
        rec = faults.record("engine0 SIGKILL")
        before = engine_view(app, admin, 0).get("last_exit")
        os.kill(pid, signal.SIGKILL)
        note(f"SIGKILL engine0 API server (pid {pid})")
        rec.exit_cause = await named_exit(app, admin, 0, before)
        faults.close_when_ready(rec, 0)
    await at(0.17)
    await engine_oom(faults, 1)
    await at(0.25)
    pid = engine_pid(app, admin, 1)
    if pid:
        os.kill(pid, signal.SIGSTOP)
        note(f"SIGSTOP engine1 (pid {pid})")
    await at(0.40)
    write_sensors(sensors, [95, 60])
    note("GPU 0 heated to 95 °C")
    await at(0.50)
    write_sensors(sensors, [60, 60])
    note("GPU 0 cooled to 60 °C")
    await at(0.55)
    keys_file.write_text("{ this is not json")
    note("keys file corrupted")
    await at(0.60)
    tmp = keys_file.with_suffix(".soak")
    tmp.write_bytes(good_keys)
    tmp.replace(keys_file)
    note("good keys file restored")
    await at(0.70)
    note("flood past max_queue")
    await flood()
    await at(0.80)
    app.signal(signal.SIGHUP)
    note("SIGHUP")
    await at(0.85)
    await kill_supervisor(faults)


def config_for(kind: str, tmp: Path, sensors: Path) -> dict[str, dict[str, Any]]:
    common: dict[str, dict[str, Any]] = {
        "telemetry": {"source": f"file:{sensors}", "interval_s": 0.5},
        "restart": {
            "backoff_initial_s": 1,
            "backoff_max_s": 10,
            "drain_timeout_s": 30,
            "max_restarts_per_hour": 30,
        },
    }
    if kind == "fake":
        cfg = fake_engine_config(
            tmp,
            2,
            "--token-delay-ms",
            "5",
            gateway={"max_queue": 64, "queue_timeout_s": 10},
            engine={"max_inflight": 16},
            health={"interval_s": 0.5, "probe_timeout_s": 2, "failures_to_restart": 3},
            **common,
        )
        return cfg
    return real_engine_config(
        tmp,
        2,
        gateway={"max_queue": 32, "queue_timeout_s": 60},
        engine={"max_inflight": 8},
        **common,
    )


def create_key(cfg_path: Path, name: str, priority: str) -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "appliance.cli",
            "keys",
            "create",
            "--name",
            name,
            "--priority",
            priority,
            "--config",
            str(cfg_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    return out.stdout.splitlines()[0].strip()


@dataclass
class Run:
    """One soak's daemon and what the load needs of it."""

    app: Appliance
    faults: Faults
    keys: list[str]
    model: str
    keys_file: Path
    sup: psutil.Process  # the first life: its RSS and fds at start
    poller: StatePoller
    good_keys: bytes  # the keys file as the soak made it: any other bytes are damage
    rss0: int = 0
    fds0: int = 0


async def soak(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    sensors = tmp / "sensors.json"
    write_sensors(sensors, [60, 60])
    # The state directory (keys, usage, audit, admin.key) on a tmpfs of its own, which
    # the disk-full fault fills; a plain directory (and that fault skipped) without root.
    disk = StateDisk.make(tmp / "state")
    if not disk.mounted:
        print(f"[soak] the disk-full fault will be skipped: {disk.why_not}", flush=True)
    cfg = config_for(args.engines, tmp, sensors)
    cfg["gateway"]["keys_file"] = str(disk.path / "keys.json")
    env = {"LLM_APPLIANCE_HOME": str(paths.appliance_home())} if args.engines == "real" else {}
    tally = Tally()
    try:
        with run_appliance(tmp, cfg, env=env) as app, contextlib.ExitStack() as stack:
            # run_appliance's teardown knows the first life only: a later one, if the
            # soak breaks, is ended here.
            stack.callback(kill_if_running, app)
            run = await start(app, args, disk, tally, tmp)
            stack.callback(run.faults.cleanup)
            await load(run, args, cfg, sensors, tally)
            return finish(run, args, tally)
    finally:
        disk.unmount()


def kill_if_running(app: Appliance) -> None:
    if app.proc.poll() is None:
        app.proc.kill()
        app.proc.wait(10)


async def start(
    app: Appliance, args: argparse.Namespace, disk: StateDisk, tally: Tally, tmp: Path
) -> Run:
    app.wait_ready(300)
    if args.engines == "real":
        app.wait_for(
            lambda: get_json(app.url + "/readyz")[1].get("engines_ready") == [0, 1],
            300,
            "both engines ready",
        )
    admin = (disk.path / "admin.key").read_text().strip()
    cfg_path = tmp / "config.toml"
    keys = [
        create_key(cfg_path, "soak-interactive", "interactive"),
        create_key(cfg_path, "soak-batch", "batch"),
    ]
    await asyncio.sleep(2.5)  # the daemon picks key changes up within 2 s
    models = get_json(app.url + "/v1/models", headers={"Authorization": f"Bearer {admin}"})[1]
    model = str(models["data"][0]["id"])
    tally.t0 = time.monotonic()
    faults = Faults(
        app, admin, disk, args.engines == "fake", tally.t0, tally.note, keys[0], model, tally.down
    )
    faults.journals.append(app.log_path)
    sup = psutil.Process(app.proc.pid)
    poller = StatePoller(app.url, {"Authorization": f"Bearer {admin}"}, tally.t0, STATES_EVERY_S)
    keys_file = disk.path / "keys.json"
    run = Run(app, faults, keys, model, keys_file, sup, poller, keys_file.read_bytes())
    run.rss0, run.fds0 = sup.memory_info().rss, sup.num_fds()
    return run


async def load(
    run: Run, args: argparse.Namespace, cfg: dict[str, Any], sensors: Path, tally: Tally
) -> None:
    """The mixed load from ``args.concurrency`` clients, and the chaos schedule beside it."""
    app, t0 = run.app, tally.t0
    until = t0 + args.duration
    timeout_s = 120.0 if args.engines == "real" else 30.0
    long_tokens = 128 if args.engines == "real" else 64
    connector = aiohttp.TCPConnector(limit=0)
    poller = run.poller
    stop_polling = asyncio.Event()
    async with aiohttp.ClientSession(connector=connector) as session:
        polling = asyncio.create_task(poller.run(session, stop_polling))

        def ask(worker_rng: random.Random, key: str) -> Any:
            return one_request(
                session, app.url, key, run.model, worker_rng, tally, t0, timeout_s, long_tokens
            )

        async def flood() -> None:
            n = int(cfg["gateway"]["max_queue"]) * 3
            await asyncio.gather(
                *(ask(random.Random(10_000 + i), run.keys[i % 2]) for i in range(n))
            )

        pause_s = 0.2 if args.engines == "fake" else 1.0
        workers = [
            client(
                w,
                session,
                app.url,
                run.keys,
                run.model,
                tally,
                t0,
                until,
                timeout_s,
                long_tokens,
                pause_s,
            )
            for w in range(args.concurrency)
        ]
        await asyncio.gather(
            chaos(run.faults, sensors, run.keys_file, tally, args.duration, flood), *workers
        )
        await run.faults.settle(60)
        stop_polling.set()
        await polling


def finish(run: Run, args: argparse.Namespace, tally: Tally) -> int:
    """SIGTERM to the daemon (the last life), what it left, the report."""
    app = run.app
    sup = psutil.Process(app.proc.pid)
    rss1, fds1 = sup.memory_info().rss, sup.num_fds()
    pids = {p.pid for p in sup.children(recursive=True)}
    groups = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(pid))
    app.signal(signal.SIGTERM)
    code = app.wait_exit(120)
    time.sleep(0.5)
    left = [
        p.pid for p in psutil.process_iter() if p.pid in pids and p.status() != psutil.STATUS_ZOMBIE
    ]
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(p.pid) in groups - {os.getpgrp()} and p.pid not in left:
                left.append(p.pid)
    damaged_at_end = run.faults.disk.problems(run.good_keys)
    report = {
        "engines": args.engines,
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "sent": sum(tally.classes.values()),
        # Every class, zero included: a report must say "lost: 0", not leave it out.
        **{c: tally.classes[c] for c in CLASSES},
        "reasons": dict(tally.reasons),
        "lost_examples": tally.lost_examples,
        "ok_latency_p50_s": round(percentile(tally.latencies, 0.5), 3),
        "ok_latency_p99_s": round(percentile(tally.latencies, 0.99), 3),
        # The first life's at the start, the last life's at the end.
        "supervisor_rss_mib": [round(run.rss0 / 2**20, 1), round(rss1 / 2**20, 1)],
        "supervisor_fds": [run.fds0, fds1],
        "exit_code": code,
        "engine_processes_left": len(left),
        "files_damaged_at_end": damaged_at_end,
        "faults": fault_table(run.faults.records, tally),
        "exit_causes": exit_cause_counts(run.faults.journals),
        "events": tally.events,
        "latency_after_events": after_events(tally),
        "logs": [str(p) for p in run.faults.journals],
    }
    print(json.dumps(report, indent=2))
    # The timeline goes in the file (for the chart), not on the screen: hundreds of numbers.
    report["timeline"] = timeline(tally, run.poller, args.duration)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    write_plot(plots.soak, report, plot_path(args.plot, args.out))
    records = run.faults.records
    clean = (
        not left
        and not damaged_at_end
        and all(not r.processes_left and not r.files_damaged for r in records)
    )
    return 0 if tally.classes["lost"] == 0 and clean and code == 0 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600, help="seconds of load (bounded)")
    ap.add_argument("--engines", choices=["fake", "real"], default="fake")
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--out", help="also write the report as JSON here")
    ap.add_argument(
        "--plot",
        default="",
        help="draw the run's timeline into this PNG (default: next to --out; needs "
        "matplotlib, the 'bench' extra)",
    )
    args = ap.parse_args()
    args.duration = min(args.duration, 3600.0)
    if args.concurrency is None:
        args.concurrency = 32 if args.engines == "fake" else 6
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
