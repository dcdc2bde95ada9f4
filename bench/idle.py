"""The idle daemon's CPU: what it costs to run with no client traffic at all.

A real ``llm-appliance serve`` with 1 and then 2 fake engines (Unix sockets, the
default), health checks every ``--health-interval`` s (1 s), ``file:`` telemetry read
every ``--telemetry-interval`` s (0.5 s), and nobody calling it. After a warm-up, the
daemon process's user+system CPU (psutil) over a ``--seconds`` window, divided by the
window's wall time, is its idle cost in CPU milliseconds per second. The engines' own
CPU is not counted: they are the same fake engine whatever the daemon's code.

``--baseline REV`` also runs the code of git revision REV from a throw-away
``git worktree`` (the daemon started there, with ``PYTHONPATH`` at it), in alternating
rounds of the same run (the order flipped every round), and prints both side by side
with their ratio. Both sides use this tree's fake engine and config.

    .venv/bin/python -m bench.idle [--baseline ed95ebd] [--rounds 3] [--seconds 30]
        [--engines 1,2] [--json FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench._common import Table, header, wait_for_quiet
from bench._trees import commit_label, head_label, worktree
from tests.fakes.appliance_proc import fake_engine_config, get_json, write_config

REPO = Path(__file__).resolve().parents[1]
HEAD_SIDE = "HEAD"


@dataclass(frozen=True)
class CpuSample:
    """The daemon's CPU times (user, system, seconds) at a monotonic instant."""

    t: float
    user: float
    system: float


def cpu_ms_per_s(before: CpuSample, after: CpuSample) -> float:
    """CPU milliseconds the process used per second of wall time between two samples."""
    wall = after.t - before.t
    if wall <= 0:
        raise ValueError("the window must have a positive length")
    used = (after.user - before.user) + (after.system - before.system)
    return 1000.0 * used / wall


def summary(figures: Sequence[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) of one side's rounds."""
    return statistics.median(figures), min(figures), max(figures)


def sample(proc: psutil.Process) -> CpuSample:
    times = proc.cpu_times()
    return CpuSample(time.monotonic(), times.user, times.system)


# ---------------------------------------------------------------------------- trees


# ---------------------------------------------------------------------------- one daemon


def idle_config(tmp: Path, engines: int, health_s: float, telemetry_s: float) -> tuple[Path, int]:
    """A config with ``engines`` fake engines, file telemetry, and the given intervals;
    its path and the gateway's port."""
    sensors = tmp / "sensors.json"
    gpus = [
        {"index": i, "temperature_c": 50, "power_w": 100, "power_limit_w": 450}
        for i in range(engines)
    ]
    sensors.write_text(json.dumps({"gpus": gpus}))
    cfg = fake_engine_config(
        tmp,
        engines,
        engine={"served_model_name": "idle-model"},
        telemetry={"source": f"file:{sensors}", "interval_s": telemetry_s},
        health={"interval_s": health_s, "probe_timeout_s": 10, "failures_to_restart": 3},
    )
    return write_config(tmp / "config.toml", cfg), int(cfg["gateway"]["port"])


def wait_all_ready(url: str, engines: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited:\n{log.read_text(errors='replace')[-3000:]}")
        code, body = get_json(url + "/readyz")
        if (
            code == 200
            and isinstance(body, dict)
            and body.get("engines_ready") == [*range(engines)]
        ):
            return
        time.sleep(0.1)
    raise RuntimeError(f"engines not READY in time:\n{log.read_text(errors='replace')[-3000:]}")


def measure(tree: Path, engines: int, args: argparse.Namespace) -> float:
    """Start the daemon of ``tree``, let it settle, and its idle CPU ms per second."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-idle-run-"))
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700)
    config, port = idle_config(tmp, engines, args.health_interval, args.telemetry_interval)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
    }
    env.update(
        PYTHONPATH=str(tree), LLM_APPLIANCE_HOME=str(tmp / "home"), RUNTIME_DIRECTORY=str(run_dir)
    )
    log = tmp / "appliance.log"
    argv = [sys.executable, "-m", "appliance.cli", "serve", "--config", str(config)]
    with open(log, "wb") as out:
        # cwd=tree: `python -m` puts the working directory first on sys.path.
        proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_all_ready(f"http://127.0.0.1:{port}", engines, proc, log)
        time.sleep(args.warmup)  # the first checks, imports on first use, GC of start-up
        daemon = psutil.Process(proc.pid)
        before = sample(daemon)
        time.sleep(args.seconds)
        return cpu_ms_per_s(before, sample(daemon))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- the run


def run(trees: dict[str, Path], args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """{engines: {side: [ms/s per round]}}, sides alternating, order flipped every round."""
    figures: dict[str, dict[str, list[float]]] = {}
    sides = list(trees)
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for engines in args.engines:
            for side in order:
                ms = measure(trees[side], engines, args)
                figures.setdefault(str(engines), {}).setdefault(side, []).append(ms)
                print(f"  round {r + 1}: {engines} engine(s), {side}: {ms:.2f} ms/s", flush=True)
    return figures


def report(figures: dict[str, dict[str, list[float]]], labels: dict[str, str]) -> str:
    sides = list(labels)
    headers = ["engines"] + [f"{labels[s]} ms/s (median, range)" for s in sides]
    if len(sides) == 2:
        headers.append(f"{sides[0]} / {sides[1]}")
    table = Table(headers)
    for engines, per_side in figures.items():
        cells: list[str] = [engines]
        for side in sides:
            mid, low, high = summary(per_side[side])
            cells.append(f"{mid:.2f} ({low:.2f}–{high:.2f})")
        if len(sides) == 2:
            cells.append(f"{summary(per_side[sides[0]])[0] / summary(per_side[sides[1]])[0]:.2f}")
        table.add(*cells)
    return table.markdown()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.idle", description=__doc__.split("\n")[0])
    p.add_argument("--baseline", help="a git revision to run beside this tree")
    p.add_argument("--engines", default="1,2", help="engine counts, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=30.0, help="measured window per daemon")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds after READY, unmeasured")
    p.add_argument("--health-interval", type=float, default=1.0)
    p.add_argument("--telemetry-interval", type=float, default=0.5)
    p.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args(argv)
    args.engines = [int(x) for x in args.engines.split(",") if x.strip()]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    quiet = wait_for_quiet(0 if args.no_wait else 600)
    quiet.start_watching()
    labels = {HEAD_SIDE: head_label()}
    with contextlib.ExitStack() as stack:
        trees = {HEAD_SIDE: REPO}
        if args.baseline:
            trees["baseline"] = stack.enter_context(
                worktree(prefix="bench-idle-", ref=args.baseline)
            )
            labels["baseline"] = commit_label(args.baseline)
        figures = run(trees, args)
    quiet.stop_watching()
    print()
    print(header("Idle daemon CPU", ["bench.idle", *sys.argv[1:]], quiet))
    print(
        f"health every {args.health_interval} s, file telemetry every "
        f"{args.telemetry_interval} s, no client traffic; {args.rounds} round(s) of "
        f"{args.seconds:.0f} s per side after {args.warmup:.0f} s of warm-up\n"
    )
    print(report(figures, labels))
    if args.json:
        data: dict[str, Any] = {"labels": labels, "figures": figures}
        data["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
