"""PNG charts of the benchmarks' results, for docs/journal/ (drawn into docs/img/).

One function per chart; each takes the result a bench writes as JSON (the same dict)
and a path, and writes a PNG there:

- :func:`gateway_overhead`: the latency the gateway adds and its CPU µs per relayed
  chunk, against concurrency (unix and tcp side by side when both were measured);
- :func:`vs_nginx`: the appliance and nginx on the same engine: CPU µs per chunk,
  TTFT added and throughput × direct, against concurrency;
- :func:`heat_routing`: latency p50/p99 and throughput, heat-aware vs round-robin;
- :func:`heat_sim`: the heat simulator's day, per room: the upper GPU's temperature,
  the box's tokens/s and the upper GPU's throttle level under each policy;
- :func:`restart_under_load` and :func:`soak`: a timeline of the run (requests per
  second by outcome, per-second p99 latency, each engine's state, restarts and the
  events the bench caused).

matplotlib is a bench-only dependency (the ``bench`` extra), so it is imported inside
the functions: a bench without it still runs and prints its tables
(``bench._common.write_plot`` says in one line that no PNG was written). Figures are
drawn on matplotlib's Agg canvas, never through pyplot's global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 100
MODE_STYLE = {"unix": ("tab:blue", "o"), "tcp": ("tab:orange", "s"), "": ("tab:blue", "o")}
ROUTING_COLORS = {"heat-aware": "tab:green", "round-robin": "tab:gray"}
# Engine states, coloured from "serving" (green) through "going away" (amber) to "down".
STATE_COLORS = {
    "READY": "#4caf50",
    "SUSPECT": "#cddc39",
    "DRAINING": "#ffc107",
    "STOPPING": "#ff9800",
    "STARTING": "#64b5f6",
    "EXITED": "#e53935",
    "FAILED": "#7b1fa2",
    None: "#e0e0e0",  # no answer from /admin/status at that poll
}
OUTCOME_COLORS = {
    "ok": "tab:green",
    "failed": "tab:red",
    "refused": "tab:orange",
    "disconnected": "tab:gray",
    "lost": "tab:red",
}


def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")


def _levels_axis(ax: Axes, levels: Sequence[int]) -> None:
    """Concurrency on a log scale, ticked at the measured levels only."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(levels), [str(n) for n in levels])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)


# ---------------------------------------------------------------------------- gateway


def _by_mode(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """gateway_overhead's JSON: ``{"unix": {level: figures}, "tcp": ...}`` with both
    listen modes, ``{level: figures}`` with one."""
    modes: dict[str, dict[str, Any]] = {m: result[m] for m in ("unix", "tcp") if m in result}
    return modes or {"": result}


def gateway_overhead(result: dict[str, Any], path: Path) -> None:
    """Left: the gateway's CPU µs per relayed chunk (raw and net of its background);
    right: latency it adds (gateway − direct p50, TTFT and whole stream), by concurrency."""
    fig = _figure(10, 3.8)
    cpu_ax, lat_ax = fig.subplots(1, 2)
    levels: list[int] = []
    for mode, figures in _by_mode(result).items():
        levels = sorted(int(k) for k in figures if k.isdigit())
        color, marker = MODE_STYLE[mode]
        label = f"{mode} " if mode else ""
        rows = [figures[str(n)] for n in levels]
        cpu_ax.plot(
            levels,
            [r["gw_cpu_us_per_chunk_raw"] for r in rows],
            color=color,
            marker=marker,
            label=f"{label}raw",
        )
        cpu_ax.plot(
            levels,
            [r["gw_cpu_us_per_chunk_net"] for r in rows],
            color=color,
            marker=marker,
            linestyle="--",
            label=f"{label}net of background",
        )
        for key, style, what in (("ttft_p50", "-", "TTFT"), ("lat_p50", ":", "whole stream")):
            lat_ax.plot(
                levels,
                [r[key][1] - r[key][0] for r in rows],
                color=color,
                marker=marker,
                linestyle=style,
                label=f"{label}{what} p50",
            )
    cpu_ax.set_title("Gateway CPU per relayed chunk")
    cpu_ax.set_ylabel("CPU µs per SSE chunk")
    cpu_ax.set_ylim(bottom=0)
    lat_ax.set_title("Latency added by the gateway (gateway − direct)")
    lat_ax.set_ylabel("ms")
    lat_ax.axhline(0, color="black", linewidth=0.8)
    for ax in (cpu_ax, lat_ax):
        _levels_axis(ax, levels)
        ax.set_xlabel("concurrent streams")
        ax.legend(fontsize=8)
    _save(fig, path)


# ---------------------------------------------------------------------------- heat


PROXY_STYLE = {
    "appliance": ("tab:blue", "o"),
    "nginx": ("tab:green", "s"),
    "pipe": ("tab:gray", "^"),
    "vllm-router": ("tab:orange", "D"),
    "aiohttp-relay": ("tab:purple", "v"),
    "raw-relay": ("tab:brown", "x"),
}


def vs_nginx(result: dict[str, Any], path: Path) -> None:
    """bench.vs_nginx: left, each proxy's CPU µs per relayed chunk (raw, and net of its
    background); middle, the TTFT it adds; right, its throughput × direct, by concurrency."""
    fig = _figure(13, 3.8)
    cpu_ax, ttft_ax, thr_ax = fig.subplots(1, 3)
    levels = sorted(int(k) for k in result)
    for proxy, (color, marker) in PROXY_STYLE.items():
        rows = [result[str(n)].get(proxy) for n in levels]
        if any(r is None for r in rows):
            continue
        cpu_ax.plot(
            levels,
            [r["cpu_us_per_chunk_raw"] for r in rows],
            color=color,
            marker=marker,
            label=f"{proxy} raw",
        )
        cpu_ax.plot(
            levels,
            [r["cpu_us_per_chunk_net"] for r in rows],
            color=color,
            marker=marker,
            linestyle="--",
            label=f"{proxy} net",
        )
        ttft_ax.plot(
            levels, [r["added_ttft_p50_ms"] for r in rows], color=color, marker=marker, label=proxy
        )
        thr_ax.plot(levels, [r["ratio"] for r in rows], color=color, marker=marker, label=proxy)
    cpu_ax.set_title("Proxy CPU per relayed chunk")
    cpu_ax.set_ylabel("CPU µs per SSE chunk")
    cpu_ax.set_ylim(bottom=0)
    ttft_ax.set_title("TTFT p50 added (proxy − direct)")
    ttft_ax.set_ylabel("ms")
    ttft_ax.axhline(0, color="black", linewidth=0.8)
    thr_ax.set_title("Throughput × direct")
    thr_ax.axhline(1, color="black", linewidth=0.8)
    for ax in (cpu_ax, ttft_ax, thr_ax):
        _levels_axis(ax, levels)
        ax.set_xlabel("concurrent streams")
        ax.legend(fontsize=8)
    _save(fig, path)


def heat_routing(result: dict[str, Any], path: Path) -> None:
    """Left: latency p50 (solid bar) and p99 (light bar behind it) per load and routing;
    right: requests per second."""
    fig = _figure(10, 3.8)
    lat_ax, thr_ax = fig.subplots(1, 2)
    levels = sorted(result["levels"], key=int)
    modes = list(ROUTING_COLORS)
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(levels))]
        rows = [result["levels"][n][mode] for n in levels]
        color = ROUTING_COLORS[mode]
        lat_ax.bar(xs, [r["lat_p99_ms"] for r in rows], width, color=color, alpha=0.35)
        lat_ax.bar(xs, [r["lat_p50_ms"] for r in rows], width, color=color, label=mode)
        thr_ax.bar(xs, [r["req_per_s"] for r in rows], width, color=color, label=mode)
    lat_ax.set_title("Request latency: p50 (solid), p99 (light)")
    lat_ax.set_ylabel("ms")
    thr_ax.set_title("Throughput")
    thr_ax.set_ylabel("requests/s")
    for ax in (lat_ax, thr_ax):
        ax.set_xticks(range(len(levels)), [str(n) for n in levels])
        ax.set_xlabel("closed-loop clients")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)


HEAT_SIM_POLICIES = {
    "none": "tab:gray",
    "stepped": "tab:orange",
    "predictive": "tab:green",
    "predictive+315W": "tab:blue",
    "dynamic_limit": "tab:purple",
}


def heat_sim(result: dict[str, Any], path: Path) -> None:
    """One column per room: the upper GPU's temperature (the soft limit dashed), the
    box's tokens/s (10-minute means) and the upper GPU's throttle level, per policy."""
    rooms = list(result["traces"])
    fig = _figure(6 * len(rooms), 8)
    axes = fig.subplots(3, len(rooms), sharex=True, squeeze=False, height_ratios=[2, 2, 1])
    soft = float(result["model"]["thermal"]["soft_limit_c"])
    gpus = sum(
        1 for k in next(iter(result["traces"][rooms[0]].values()))["series"] if k.endswith("_c")
    )
    upper = f"gpu{gpus - 1}"
    for col, room in enumerate(rooms):
        temp_ax, tok_ax, lvl_ax = axes[0][col], axes[1][col], axes[2][col]
        for name, color in HEAT_SIM_POLICIES.items():
            row = result["traces"][room].get(name)
            if row is None:
                continue
            series = row["series"]
            hours = [m / 60 for m in series["minute"]]
            temp_ax.plot(hours, series[f"{upper}_c"], color=color, lw=1, label=name)
            mean = _window_mean(series["tokens_per_s"], 10)
            tok_ax.plot(hours, mean, color=color, lw=1, label=name)
            lvl_ax.step(hours, series[f"{upper}_level"], color=color, lw=1, where="post")
        temp_ax.axhline(soft, color="tab:red", ls="--", lw=0.8)
        air = result["model"]["rooms"][room]
        temp_ax.set_title(f"{room} ({air:g} °C room): upper GPU ({upper})")
        temp_ax.set_ylabel("°C")
        tok_ax.set_ylabel("tokens/s (10-min mean)")
        lvl_ax.set_ylabel("level")
        lvl_ax.set_xlabel("hours into the day")
        for ax in (temp_ax, tok_ax, lvl_ax):
            ax.grid(True, alpha=0.3)
        temp_ax.legend(fontsize=7, loc="lower right")
    _save(fig, path)


def _window_mean(values: Sequence[float], n: int) -> list[float]:
    """Trailing mean over ``n`` samples (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


# ---------------------------------------------------------------------------- timelines


def restart_under_load(result: dict[str, Any], path: Path) -> None:
    """Timeline of restart_under_load: requests/s ok and failed, per-second p99, engine
    states, with a marker at each event (admin restart, crash, hang, degradation)."""
    _timeline(result["timeline"], path, "Restart under load")


def soak(result: dict[str, Any], path: Path) -> None:
    """Timeline of the chaos soak: requests/s by outcome, per-second p99, engine states,
    restarts and a marker at each chaos event."""
    _timeline(result["timeline"], path, f"Chaos soak ({result.get('engines', '?')} engines)")


def _timeline(tl: dict[str, Any], path: Path, title: str) -> None:
    """``tl``: ``bin_s``, ``duration_s`` (optional), ``counts`` ({outcome: per-bin
    counts}, "ok" first), ``p99_ms`` (per bin, None where nothing ended OK), ``states``
    (``StatePoller.samples()`` of ``bench._common``) and ``markers`` ([{"at_s",
    "label"}])."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    states = tl["states"]
    n_engines = len(states["engines"])
    fig = _figure(11, 7)
    ok_ax, bad_ax, p99_ax, state_ax = fig.subplots(
        4, 1, sharex=True, height_ratios=[2.2, 1.3, 1.6, 0.4 + 0.4 * max(1, n_engines)]
    )
    fig.suptitle(title)
    bin_s = float(tl["bin_s"])
    counts: dict[str, list[int]] = tl["counts"]
    n_bins = max((len(c) for c in counts.values()), default=0)
    xs = [i * bin_s for i in range(n_bins)]
    # The last bin ends with the run, often part-way: its rate is over what it covered.
    widths = [bin_s] * n_bins
    if n_bins and "duration_s" in tl:
        widths[-1] = min(bin_s, max(0.1 * bin_s, float(tl["duration_s"]) - xs[-1]))

    def rate_of(per_bin: list[int]) -> list[float]:
        return [c / w for c, w in zip(per_bin, widths, strict=False)]

    ok_ax.plot(xs, rate_of(counts.get("ok", [])), color="tab:green", linewidth=1)
    ok_ax.set_ylabel("answered OK\n(requests/s)")
    ok_ax.set_ylim(bottom=0)
    # The other outcomes are a few per second against hundreds OK: their own panel,
    # stacked, so that one failure still shows.
    bottom = [0.0] * n_bins
    for outcome, per_bin in counts.items():
        if outcome == "ok":
            continue
        rate = rate_of(per_bin)
        bad_ax.bar(
            xs[: len(rate)],
            rate,
            width=bin_s,
            bottom=bottom[: len(rate)],
            align="edge",
            color=OUTCOME_COLORS.get(outcome, "tab:purple"),
            label=f"{outcome} ({sum(per_bin)})",
        )
        bottom = [b + r for b, r in zip(bottom, rate + [0.0] * (n_bins - len(rate)), strict=True)]
    bad_ax.set_ylabel("not OK\n(requests/s)")
    bad_ax.set_ylim(0, max(1.0, *bottom) * 1.15)
    bad_ax.legend(fontsize=8, loc="upper right", ncol=4)
    p99 = [float("nan") if v is None else v for v in tl["p99_ms"]]
    p99_ax.plot([i * bin_s for i in range(len(p99))], p99, color="tab:blue", linewidth=1)
    seen = [v for v in tl["p99_ms"] if v is not None]
    # A hang sends p99 from ~0.2 s to many seconds: a log scale then, else a plain one.
    if seen and max(seen) > 20 * min(seen):
        p99_ax.set_yscale("log")
        p99_ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        p99_ax.yaxis.set_major_formatter(ScalarFormatter())
        p99_ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        p99_ax.set_ylim(bottom=0)
    p99_ax.set_ylabel("p99 latency of\nOK answers (ms)")
    _state_strips(state_ax, states)
    for ax in (ok_ax, bad_ax, p99_ax, state_ax):
        ax.grid(True, axis="x", alpha=0.3)
        for m in tl["markers"]:
            ax.axvline(m["at_s"], color="black", linewidth=0.8, linestyle="--")
    for m in tl["markers"]:
        ok_ax.annotate(
            m["label"],
            (m["at_s"], 0.03),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize=7,
            va="bottom",
            ha="right",
        )
    state_ax.set_xlabel("seconds since the load started")
    _save(fig, path)


def _runs(
    t: Sequence[float], series: Sequence[str | None]
) -> list[tuple[str | None, float, float]]:
    """Consecutive polls in one state as (state, start, duration); the last poll lasts
    one polling step."""
    step = t[-1] - t[-2] if len(t) > 1 else 1.0
    runs: list[tuple[str | None, float, float]] = []
    for k, state in enumerate(series):
        end = t[k + 1] if k + 1 < len(t) else t[k] + step
        if runs and runs[-1][0] == state:
            runs[-1] = (state, runs[-1][1], end - runs[-1][1])
        else:
            runs.append((state, t[k], end - t[k]))
    return runs


def _state_strips(ax: Axes, states: dict[str, Any]) -> None:
    """One horizontal strip per engine, coloured by its state between polls; a triangle
    at each restart; the colours' legend below the figure."""
    from matplotlib.patches import Patch

    engines: list[list[str | None]] = states["engines"]
    seen: set[str | None] = set()
    for i, series in enumerate(engines):
        for state, start, length in _runs(states["t"], series):
            ax.broken_barh(
                [(start, length)], (i - 0.4, 0.8), color=STATE_COLORS.get(state, "black")
            )
            seen.add(state)
    handles: list[Any] = [
        Patch(color=c, label=s or "no answer") for s, c in STATE_COLORS.items() if s in seen
    ]
    restarts = states.get("restarts", [])
    if restarts:
        handles.append(
            ax.scatter(
                [r["at_s"] for r in restarts],
                [r["engine"] for r in restarts],
                marker="v",
                color="black",
                zorder=3,
                label="restart",
            )
        )
    ax.set_yticks(range(len(engines)), [f"engine {i}" for i in range(len(engines))])
    ax.set_ylim(-0.6, len(engines) - 0.4)
    ax.invert_yaxis()
    if handles:
        ax.figure.legend(handles=handles, fontsize=8, ncol=len(handles), loc="outside lower center")
