"""Restart after SIGKILL, the heat governor on real readings, and cleanup: the checks
that change what runs (never the GPU's own settings)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from typing import Any

import psutil

from tests.gpu_check.checks import Ctx, engine_tree, metrics
from tests.gpu_check.daemon import MODEL, CheckFailed
from tests.gpu_check.nvml_view import GpuSample
from tests.gpu_check.report import Line, gib

# The supervisor's log stamps and the check's polls may disagree by this much.
STAMP_SLACK_S = 0.25


def _released(ctx: Ctx, tree: set[int]) -> Any:
    """GPU 0's memory is back within half a share of its level before the engines."""
    limit = ctx.before[0].memory_used + ctx.share * ctx.before[0].memory_total / 2

    def done(s: GpuSample) -> bool:
        return not tree & s.processes.keys() and s.memory_used < limit

    return done


def _first(ctx: Ctx, transition: str, after: float) -> float | None:
    events = ctx.daemon.log_events(rf"engine0: \S+ -> {transition}\b", after - STAMP_SLACK_S)
    return events[0][0] if events else None


def _new_engine(ctx: Ctx, old_pid: int) -> Any:
    def probe() -> dict[str, Any] | None:
        e = ctx.daemon.status()["engines"][0]
        return e if e["state"] == "READY" and e["pid"] not in (None, old_pid) else None

    return probe


def _serves(ctx: Ctx) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    code, answer = ctx.daemon.request("/v1/chat/completions", body)
    if code != 200:
        raise CheckFailed(f"a completion after the restart answered {code}: {answer[:200]!r}")


def restart(ctx: Ctx) -> Line:
    e = ctx.daemon.status()["engines"][0]
    tree = engine_tree(e["pid"])
    ctx.daemon.pids_seen.update(tree)
    t_kill = time.time()
    os.kill(e["pid"], signal.SIGKILL)
    sample, t_free = ctx.nvml.wait_until(0, _released(ctx, tree), ctx.release_timeout_s)
    if t_free is None:
        held = sorted(sample.processes)
        return Line(
            "restart",
            False,
            f"GPU 0 memory never released: {gib(sample.memory_used)} in use "
            f"{ctx.release_timeout_s:.0f} s after SIGKILL (before the engines: "
            f"{gib(ctx.before[0].memory_used)}; processes NVML lists on it: {held})",
            {"released_s": None},
        )
    new = ctx.daemon.wait_for(_new_engine(ctx, e["pid"]), 180, "engine 0 READY again")
    _serves(ctx)
    return _restart_line(ctx, e, new, t_kill, t_free)


def _restart_line(
    ctx: Ctx, old: dict[str, Any], new: dict[str, Any], t_kill: float, t_free: float
) -> Line:
    t_exited = _first(ctx, "EXITED", t_kill)
    t_start = _first(ctx, "STARTING", t_kill)
    t_ready = _first(ctx, "READY", t_kill)
    figures = {
        "released_s": round(t_free - t_kill, 2),
        "exited_s": None if t_exited is None else round(t_exited - t_kill, 2),
        "starting_s": None if t_start is None else round(t_start - t_kill, 2),
        "ready_s": None if t_ready is None else round(t_ready - t_kill, 2),
        "restarts": new["restarts"],
    }
    text = (
        f"SIGKILL → NVML memory released {figures['released_s']} s, EXITED "
        f"{figures['exited_s']} s, new engine STARTING {figures['starting_s']} s, READY "
        f"{figures['ready_s']} s (pid {old['pid']} → {new['pid']}), and it serves"
    )
    if t_start is None or t_exited is None:
        return Line("restart", False, f"no EXITED/STARTING line in the log; {text}", figures)
    if t_start < t_free - STAMP_SLACK_S:
        return Line(
            "restart", False, f"started before NVML showed the memory free: {text}", figures
        )
    if new["restarts"] != old["restarts"] + 1:
        return Line(
            "restart", False, f"restarts {old['restarts']} → {new['restarts']}; {text}", figures
        )
    return Line("restart", True, text, figures)


def _levels(ctx: Ctx) -> tuple[list[int], list[float]]:
    """Throttle level of every GPU in /admin/status and in /metrics."""
    gpus = ctx.daemon.status()["gpus"]
    m = metrics(ctx.daemon)
    return [g["throttle_level"] for g in gpus], [
        m.get(("appliance_throttle_level", str(g["index"])), -1) for g in gpus
    ]


def _wait_levels(ctx: Ctx, hot: bool, what: str) -> tuple[list[int], float]:
    start = time.monotonic()

    def probe() -> list[int] | None:
        status, exported = _levels(ctx)
        want = (lambda v: v >= 1) if hot else (lambda v: v == 0)
        return status if all(map(want, status + exported)) and status else None

    return ctx.daemon.wait_for(probe, 30, what), time.monotonic() - start


def heat(ctx: Ctx) -> Line:
    temps = [g["temperature_c"] for g in ctx.daemon.status()["gpus"]]
    if any(t is None for t in temps):
        raise CheckFailed(f"a GPU reports no temperature: {temps}")
    coolest = min(temps)
    soft = math.floor(coolest) - 2
    if soft < 20:
        raise CheckFailed(f"GPUs at {temps} °C: thermal.soft_limit_c cannot go below 20")
    hard = min(130, math.ceil(max(temps)) + 15)
    ctx.daemon.reload(thermal={"soft_limit_c": soft, "hard_limit_c": hard})
    hot, rise_s = _wait_levels(ctx, True, f"throttle level ≥ 1 with soft_limit_c = {soft}")
    cool_soft = min(110, math.ceil(max(temps)) + 30)
    ctx.daemon.reload(thermal={"soft_limit_c": cool_soft, "hard_limit_c": cool_soft + 10})
    cool, fall_s = _wait_levels(ctx, False, f"throttle level 0 with soft_limit_c = {cool_soft}")
    figures = {
        "temperatures_c": temps,
        "soft_limit_c": soft,
        "hard_limit_c": hard,
        "levels_hot": hot,
        "rise_s": round(rise_s, 2),
        "cool_soft_limit_c": cool_soft,
        "fall_s": round(fall_s, 2),
    }
    text = (
        f"GPUs at {temps} °C; soft {soft} °C → level {hot} in {rise_s:.1f} s "
        f"(/admin/status and /metrics); SIGHUP soft {cool_soft} °C → level {cool} in {fall_s:.1f} s"
    )
    return Line("heat", True, text, figures)


def ours_alive(pids_seen: set[int], run_id: str) -> list[str]:
    """Processes of this run still alive: seen pids, and any carrying its mark."""
    left = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            marked = proc.environ().get("GPU_CHECK_RUN") == run_id
        except psutil.Error:  # another user's process, or gone: not ours
            marked = False
        with contextlib.suppress(psutil.Error):
            ours = marked or proc.pid in pids_seen
            if ours and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.info['name']} ({proc.pid})")
    return left


def cleanup(ctx: Ctx, run_id: str) -> Line:
    code = ctx.daemon.stop()
    tolerance = 0 if ctx.fake_dir else 256 * 1024**2
    back = []
    deadline = time.monotonic() + ctx.release_timeout_s  # for all GPUs together
    for s in ctx.before:
        now, when = ctx.nvml.wait_until(
            s.index,
            lambda n, s=s: n.memory_used <= s.memory_used + tolerance,
            max(0.0, deadline - time.monotonic()),
            0.2,
        )
        back.append((s, now, when is not None))
    left = ours_alive(ctx.daemon.pids_seen, run_id)
    memory = ", ".join(
        f"GPU {s.index} {gib(n.memory_used)} (before {gib(s.memory_used)})" for s, n, _ in back
    )
    figures = {
        "exit_code": code,
        "left": left,
        "memory_used": {str(s.index): n.memory_used for s, n, _ in back},
    }
    problems = [] if code == 0 else [f"the daemon exited {code} after SIGTERM"]
    problems += [f"processes left: {left}"] if left else []
    problems += [f"GPU {s.index} memory not back" for s, _, fine in back if not fine]
    detail = "; ".join(problems) or f"SIGTERM → exit 0, no process left, {memory}"
    return Line("cleanup", not problems, detail if not problems else f"{detail}; {memory}", figures)
