"""Placement, telemetry and doctor: what the running daemon shows, judged against what
the driver itself says (the check's own NVML reads) and plausible ranges."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.gpu_check.daemon import CheckFailed, Daemon
from tests.gpu_check.nvml_view import GpuSample, NvmlView
from tests.gpu_check.report import Line, gib

# A real memory share shows up on its GPU at least this much of it (allocator rounding).
SHOWN_SHARE = 0.8
# (field in /admin/status, metric, low, high): plausible for any NVIDIA datacentre or
# workstation GPU; power 0 W is a sensor that lies, over 2 kW is no single GPU.
RANGES: tuple[tuple[str, str, float, float], ...] = (
    ("temperature_c", "appliance_gpu_temperature_celsius", 5, 110),
    ("power_w", "appliance_gpu_power_watts", 1, 2000),
    ("power_limit_w", "appliance_gpu_power_limit_watts", 50, 2000),
    ("sm_clock_mhz", "appliance_gpu_sm_clock_mhz", 100, 4000),
    ("memory_used_bytes", "appliance_gpu_memory_used_bytes", 1, 2**44),
)
_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")


@dataclass
class Ctx:
    daemon: Daemon
    nvml: NvmlView
    share: float
    before: list[GpuSample]
    fake_dir: Path | None
    release_timeout_s: float
    warm_s: float  # longest the load is given to move power before telemetry is read
    figures: dict[str, Any] = field(default_factory=dict)


def engine_tree(pid: int) -> set[int]:
    try:
        proc = psutil.Process(pid)
        return {pid} | {c.pid for c in proc.children(recursive=True)}
    except psutil.Error:
        return set()


def _ours(ctx: Ctx, engines: list[dict[str, Any]]) -> dict[int, int]:
    """pid -> engine id, for every process of every engine."""
    owner = {}
    for e in engines:
        for pid in engine_tree(e["pid"]):
            owner[pid] = e["id"]
    ctx.daemon.pids_seen.update(owner)
    return owner


def _placed(ctx: Ctx, e: dict[str, Any], owner: dict[int, int]) -> tuple[str, str | None]:
    """(figure, problem or None) for one engine."""
    i, pid = e["id"], e["pid"]
    cvd = psutil.Process(pid).environ().get("CUDA_VISIBLE_DEVICES")
    sample = ctx.nvml.sample(i)
    want = ctx.share * sample.memory_total
    listed = {p: b for p, b in sample.processes.items() if p in owner}
    mine = sum(b or 0 for p, b in listed.items() if owner[p] == i)
    rise = sample.memory_used - ctx.before[i].memory_used
    if listed:  # NVML names our processes: judge by them
        shown, how = mine, "its processes"
    else:  # a PID namespace hides them: judge by the device's memory
        shown, how = rise, "the device's used memory rose"
    figure = f"engine {i} on GPU {e['gpus']} (CUDA_VISIBLE_DEVICES={cvd}), {how}: {gib(shown)}"
    if e["gpus"] != [i] or cvd != str(i):
        return figure, f"engine {i} should be on GPU {i} alone (CUDA_VISIBLE_DEVICES={i})"
    if shown < SHOWN_SHARE * want:
        elsewhere = sorted({g for p, g in owner.items() if p in listed and g != i})
        where = f" (it holds memory of engine(s) {elsewhere})" if elsewhere else ""
        return figure, f"engine {i}'s {gib(want)} not on GPU {i}{where}"
    return figure, None


def placement(ctx: Ctx, engines: list[dict[str, Any]]) -> Line:
    owner = _ours(ctx, engines)
    figures, problems = [], []
    for e in engines:
        figure, problem = _placed(ctx, e, owner)
        figures.append(figure)
        if problem:
            problems.append(problem)
    detail = "; ".join(problems + figures)
    return Line("placement", not problems, detail, {"engines": figures})


def metrics(daemon: Daemon) -> dict[tuple[str, str], float]:
    """(metric name, gpu label) -> value, for appliance_gpu_* and appliance_throttle_level."""
    code, body = daemon.request("/metrics", timeout=10)
    if code != 200:
        raise CheckFailed(f"/metrics answered {code}")
    out = {}
    for line in body.decode().splitlines():
        m = _SAMPLE.match(line)
        if m and (m[1].startswith("appliance_gpu_") or m[1] == "appliance_throttle_level"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
            if "gpu" in labels and "reason" not in labels:
                out[(m[1], labels["gpu"])] = float(m[3])
    return out


def warm_up(ctx: Ctx) -> float:
    """Seconds until GPU 0 draws clearly more than idle (bounded by ``warm_s``)."""
    idle = ctx.before[0].power_w or 0.0
    start = time.monotonic()
    ctx.nvml.wait_until(0, lambda s: (s.power_w or 0) > 1.3 * idle + 20, ctx.warm_s, 0.5)
    return time.monotonic() - start


def _judge_gpu(
    g: dict[str, Any], cli: dict[str, Any], m: dict[tuple[str, str], float], s: GpuSample
) -> list[str]:
    idx = str(g["index"])
    bad = []
    for key, metric, lo, hi in RANGES:
        for where, value in (
            ("/admin/status", g.get(key)),
            ("status --json", cli.get(key)),
            ("/metrics", m.get((metric, idx))),
        ):
            if value is None or not lo <= float(value) <= hi:
                bad.append(f"GPU {idx} {key} in {where}: {value} (expected {lo}..{hi})")
    if g.get("memory_total_bytes") != s.memory_total:
        bad.append(
            f"GPU {idx} memory total {g.get('memory_total_bytes')} != NVML's {s.memory_total}"
        )
    if abs(float(g.get("temperature_c") or -99) - s.temperature_c) > 5:
        bad.append(
            f"GPU {idx} temperature {g.get('temperature_c')} far from NVML's {s.temperature_c}"
        )
    if (
        not isinstance(g.get("throttle_reasons"), list)
        or ("appliance_throttle_level", idx) not in m
    ):
        bad.append(f"GPU {idx}: throttle reasons or level missing")
    return bad


def telemetry(ctx: Ctx) -> Line:
    warmed = warm_up(ctx)
    doc = ctx.daemon.status()
    run = ctx.daemon.cli("status", "--json", "--url", ctx.daemon.url, "--key", ctx.daemon.admin_key)
    if run.returncode != 0:
        raise CheckFailed(
            f"`llm-appliance status --json` exited {run.returncode}: {run.stderr[-300:]}"
        )
    cli = {g["index"]: g for g in json.loads(run.stdout)["gpus"]}
    m = metrics(ctx.daemon)
    bad, figures = [], {}
    for g in doc["gpus"]:
        s = ctx.nvml.sample(g["index"])
        bad += _judge_gpu(g, cli.get(g["index"], {}), m, s)
        figures[str(g["index"])] = {
            **{k: g.get(k) for k, *_ in RANGES},
            "memory_total_bytes": g.get("memory_total_bytes"),
            "utilization": g.get("utilization"),
            "throttle_reasons": g.get("throttle_reasons"),
            "mem_clock_mhz_nvml": s.mem_clock_mhz,
            "idle_power_w": ctx.before[g["index"]].power_w,
            "idle_temperature_c": ctx.before[g["index"]].temperature_c,
        }
    if len(doc["gpus"]) != ctx.nvml.count:
        bad.append(f"/admin/status shows {len(doc['gpus'])} GPU(s), NVML {ctx.nvml.count}")
    detail = "; ".join(bad) or "; ".join(_telemetry_figure(k, f) for k, f in figures.items())
    return Line("telemetry", not bad, f"{detail} (after {warmed:.0f} s of load)", {"gpus": figures})


def _telemetry_figure(idx: str, f: dict[str, Any]) -> str:
    return (
        f"GPU {idx} {f['temperature_c']:.0f} °C (idle {f['idle_temperature_c']:.0f}), "
        f"{f['power_w']:.0f} W (idle {f['idle_power_w'] or 0:.0f}) of {f['power_limit_w']:.0f} W, "
        f"SM {f['sm_clock_mhz']} MHz, mem clock {f['mem_clock_mhz_nvml'] or 'n/a'} MHz (NVML), "
        f"{gib(f['memory_used_bytes'])} used, reasons {f['throttle_reasons'] or 'none'}"
    )


def doctor(ctx: Ctx) -> Line:
    run = ctx.daemon.cli("doctor", "--json")
    try:
        checks = {c["name"]: c for c in json.loads(run.stdout)["checks"]}
    except (ValueError, KeyError) as exc:
        raise CheckFailed(
            f"`doctor --json` printed no report ({exc}): {run.stderr[-300:]}"
        ) from exc
    nv = checks.get("nvidia", {})
    bad, names = [], []
    if nv.get("status") != "ok" or not nv.get("data", {}).get("driver_version"):
        bad.append(f"nvidia: {nv.get('symbol')} {nv.get('detail')}")
    for s in ctx.before:
        line = checks.get(f"gpu{s.index}", {})
        if line.get("status") != "ok" or line.get("data", {}).get("name") != s.name:
            bad.append(
                f"gpu{s.index}: {line.get('symbol')} {line.get('detail')} {line.get('fix') or ''}"
            )
        names.append(f"gpu{s.index} {line.get('data', {}).get('name')}")
    driver = nv.get("data", {}).get("driver_version")
    foreign = [
        p for s in ctx.before for p in _data(checks, f"gpu{s.index}").get("foreign_processes", [])
    ]
    detail = "; ".join(bad) or f"driver {driver}, " + ", ".join(names)
    detail += f"; processes it took for strangers': {foreign}" if foreign else ""
    figures = {"driver_version": driver, "gpus": names, "foreign_processes": foreign}
    return Line("doctor", not bad, detail, figures)


def _data(checks: dict[str, Any], name: str) -> dict[str, Any]:
    data: dict[str, Any] = checks.get(name, {}).get("data") or {}
    return data
