"""`scripts/gpu-check [--out DIR]`: every GPU path of the appliance, on this machine's
NVIDIA GPUs, or (none here) against the fake pynvml; one line per check.

Environment: ``GPU_CHECK_FAKE=1`` uses the fake even where a GPU is present;
``GPU_CHECK_FAULT=wrong-gpu,leak`` breaks the fake on purpose (fake_nvml.FAULTS), to see
the check fail; ``PYTHON`` is the interpreter the launcher picked (the daemon and the
stand-in engines run on it too).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import secrets
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.gpu_check import checks, fake_nvml, lifecycle
from tests.gpu_check.checks import Ctx
from tests.gpu_check.daemon import REPO, CheckFailed, Daemon, base_config, daemon_env
from tests.gpu_check.load import Load
from tests.gpu_check.nvml_view import NvmlView
from tests.gpu_check.report import Line, Report
from tests.gpu_check.swap import SwapRun, swap

SHARE = 0.3  # of each GPU's memory per engine: well above the supervisor's "free" (10 %)
CHECKS = ("placement", "telemetry", "restart", "doctor", "heat", "cleanup", "swap", "sleep")


def _real_nvml() -> types.ModuleType | None:
    """The real pynvml when it sees at least one GPU (and no one asked for the fake)."""
    if os.environ.get("GPU_CHECK_FAKE") == "1":
        return None
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
        try:
            return nvml if int(nvml.nvmlDeviceGetCount()) > 0 else None
        finally:
            nvml.nvmlShutdown()
    except Exception:  # no library, no driver, no GPU: the same answer
        return None


def _fake(work: Path, gpus: int = 2) -> tuple[Path, types.ModuleType]:
    directory = work / "nvml"
    fault = os.environ.get("GPU_CHECK_FAULT", "")
    unknown = set(filter(None, fault.split(","))) - set(fake_nvml.FAULTS)
    if unknown:
        raise SystemExit(f"gpu-check: GPU_CHECK_FAULT: unknown {sorted(unknown)}")
    fake_nvml.write_state(directory, [fake_nvml.default_gpu(i) for i in range(gpus)], fault)
    fake_nvml.write_shim(directory)
    return directory, fake_nvml.build(directory)


def _head(view: NvmlView, fake: bool) -> str:
    names = ", ".join(f"{s.index}: {s.name}" for s in view.samples())
    if fake:
        fault = os.environ.get("GPU_CHECK_FAULT")
        broken = f"; fake broken on purpose: {fault}" if fault else ""
        return (
            "gpu-check: no NVIDIA GPU here: the checks run against the fake pynvml "
            f"(tests/fakes/fake_pynvml.py), {view.count} fake GPU(s) [{names}]{broken}"
        )
    return f"gpu-check: {view.count} NVIDIA GPU(s) [{names}], driver {view.driver}"


def _run_check(report: Report, name: str, fn: Callable[[], Line]) -> None:
    try:
        line = fn()
    except CheckFailed as exc:
        line = Line(name, False, str(exc))
    except Exception as exc:  # a check that broke says so; the others still run
        line = Line(name, False, f"{type(exc).__name__}: {exc}")
    report.add(line)


def _checks(report: Report, ctx: Ctx) -> None:
    engines = ctx.daemon.wait_for(ctx.daemon.engines_ready, 240, "every engine READY")
    report.say(f"  daemon up, {len(engines)} engine(s) READY (log: {ctx.daemon.log_path})")
    _run_check(report, "placement", lambda: checks.placement(ctx, engines))
    with Load(ctx.daemon.url, ctx.daemon.admin_key) as load:
        _run_check(report, "telemetry", lambda: checks.telemetry(ctx))
        _run_check(report, "restart", lambda: lifecycle.restart(ctx))
        _run_check(report, "doctor", lambda: checks.doctor(ctx))
        _run_check(report, "heat", lambda: lifecycle.heat(ctx))
    ctx.figures["load_outcomes"] = dict(load.outcomes)


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    """Keys, sockets and the fake's state: short paths (a socket's is 107 bytes at most)."""
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(out: Path, python: str) -> Report:
    run_id = secrets.token_hex(6)
    with _workdir() as work:
        real = _real_nvml()
        fake_dir, nvml = (None, real) if real is not None else _fake(work)
        view = NvmlView(nvml)
        report = Report(_head(view, fake_dir is not None))
        report.say(report.head)
        before = view.samples()
        engine_env = {"GPU_CHECK_RUN": run_id}
        if fake_dir is not None:
            engine_env[fake_nvml.FAKE_DIR_ENV] = str(fake_dir)
        env = daemon_env(REPO, fake_dir, run_id, work)
        env.update(engine_env)
        daemon = Daemon(work, python, env, base_config(work, python, SHARE, engine_env))
        # The fake frees a dead engine's memory at once; a driver may take seconds.
        release_s, warm_s = (10, 0) if fake_dir else (60, 25)
        ctx = Ctx(daemon, view, SHARE, before, fake_dir, release_s, warm_s)
        try:
            daemon.start()
            _checks(report, ctx)
        except Exception as exc:  # the daemon never came up: the checks left fail with it
            why = str(exc) if isinstance(exc, CheckFailed) else f"{type(exc).__name__}: {exc}"
            for name in CHECKS[: CHECKS.index("cleanup")]:
                if name not in {line.name for line in report.lines}:
                    report.add(Line(name, False, why))
        finally:
            _run_check(report, "cleanup", lambda: lifecycle.cleanup(ctx, run_id))
            with contextlib.suppress(OSError):
                shutil.copy(daemon.log_path, out / "daemon.log")
        cleaned = report.lines[-1].ok
        for mode in ("stop", "sleep"):
            turns = SwapRun(work, python, engine_env, fake_dir, run_id, view, release_s, mode)
            if cleaned:
                _run_check(report, turns.line, lambda turns=turns: swap(turns))
            else:  # memory still held (or processes left) would stall or skew its turns
                report.add(Line(turns.line, False, "not run: the first daemon did not clean up"))
            with contextlib.suppress(OSError):
                shutil.copy(work / turns.line / "daemon.log", out / f"{turns.line}-daemon.log")
        view.close()
        report.figures.update(
            ctx.figures,
            mode="fake" if fake_dir else "nvidia",
            gpus=[s.name for s in before],
            run_id=run_id,
        )
        return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="where gpu-check.txt/.json go (default: a temp dir)")
    args = p.parse_args(argv)
    out: Path = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-out-"))
    out.mkdir(parents=True, exist_ok=True)
    python = os.environ.get("PYTHON") or sys.executable
    start = time.monotonic()
    report = run(out, python)
    elapsed = time.monotonic() - start
    tail = f"gpu-check: {'PASS' if report.ok else 'FAIL'} in {elapsed:.0f} s; results in {out}"
    report.write(out, elapsed, tail)
    print(tail, flush=True)
    return 0 if report.ok else 1
