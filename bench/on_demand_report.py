"""``bench.on_demand``'s figures: the TTFT summary, the tables, and the chart (TTFT by the
model's state on a log scale, beside swaps per minute per slot with and without the
minimum residency). matplotlib is imported inside :func:`chart` (a bench-only extra, as
in bench/plots.py).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench._common import Table, header, module_argv
from bench.plots import _figure, _save

STATES = (
    "loaded",
    "asleep, slot free",
    "asleep, other model loaded",
    "unloaded, slot free",
    "unloaded, other model loaded",
)
COLUMNS = {
    "sleep": ("fake, swap = sleep", "tab:blue"),
    "stop": ("fake, swap = stop", "tab:orange"),
    "real": ("real vLLM (CPU), swap = stop", "tab:red"),
}


def ttft_summary(res: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per column, per state: median, min, max (s) and how many rounds."""
    return {
        column: {
            state: {
                "median_s": round(statistics.median(v), 3),
                "min_s": round(min(v), 3),
                "max_s": round(max(v), 3),
                "n": len(v),
            }
            for state, v in states.items()
        }
        for column, states in res.items()
    }


def ttft_table(summary: dict[str, dict[str, dict[str, float]]]) -> str:
    shown = [c for c in COLUMNS if c in summary]
    t = Table(["model's state", *(COLUMNS[c][0] + " (s)" for c in shown)])
    for state in STATES:
        cells = []
        for c in shown:
            f = summary[c].get(state)
            cells.append(
                "–" if f is None else f"{f['median_s']:.3f} ({f['min_s']:.3f}–{f['max_s']:.3f})"
            )
        if any(x != "–" for x in cells):
            t.add(state, *cells)
    return t.markdown()


def swap_table(figs: dict[str, dict[str, Any]]) -> str:
    t = Table(
        [
            "slot",
            "min_residency_s",
            "swaps / min",
            "answered a / b",
            "failed a / b",
            "wait p50 / p99 / max (s)",
        ]
    )
    for f in figs.values():
        a, b = f["models"]
        t.add(
            f"swap = {f['swap']}",
            f"{f['residency_s']:g}",
            f"{f['swaps_per_minute']:.1f} ({f['swaps']} in {f['minutes']:.1f} min)",
            f"{f['answered'][a]} / {f['answered'][b]}",
            f"{f['failed'][a]} / {f['failed'][b]}",
            f"{f['wait_p50_s']:.2f} / {f['wait_p99_s']:.2f} / {f['wait_max_s']:.2f}",
        )
    return t.markdown()


def report(args: argparse.Namespace, quiet: Any, result: dict[str, Any]) -> str:
    parts = [header("Models on demand", module_argv("bench.on_demand"), quiet)]
    parts.append(
        f"- setup: fake engines on fake GPUs, `--wake-delay-s {args.wake_delay_s:g}`, "
        f"`--token-delay-ms 5`; real vLLM: SmolLM2-135M on CPU, 1 engine; TTFT of a "
        f"4-token chat stream; {args.rounds} round(s) on fakes, {args.real_rounds} on "
        f"real vLLM; swaps: 2 closed-loop clients × {args.swap_rounds} round(s) of "
        f"{args.swap_round_s:g} s per slot\n"
    )
    if result.get("ttft"):
        parts.append(
            "TTFT by the model's state, median (min–max):\n\n" + ttft_table(result["ttft"]) + "\n"
        )
    if result.get("swaps"):
        parts.append(
            "Alternating two-model load on one slot:\n\n" + swap_table(result["swaps"]) + "\n"
        )
        parts += failure_lines(result["swaps"])
    return "\n".join(parts)


def failure_lines(figs: dict[str, dict[str, Any]]) -> list[str]:
    """One line per slot whose requests failed: per model, per status and code, how many
    and how long they had waited."""
    out = []
    for slot, f in figs.items():
        for model, kinds in f.get("failures", {}).items():
            for kind, waits in kinds.items():
                shown = ", ".join(f"{w:g}" for w in waits[:10]) + (", …" if len(waits) > 10 else "")
                out.append(f"- failed in {slot}: {model}: {len(waits)} × {kind} after {shown} s")
    return out


def chart(result: dict[str, Any], path: Path) -> None:
    fig = _figure(11, 4.2)
    left, right = fig.subplots(1, 2, width_ratios=[3, 2])
    _ttft_bars(left, result.get("ttft", {}))
    _swap_bars(right, result.get("swaps", {}))
    _save(fig, path)


def _ttft_bars(ax: Any, ttft: dict[str, Any]) -> None:
    shown = [c for c in COLUMNS if c in ttft]
    states = [s for s in STATES if any(s in ttft[c] for c in shown)]
    width = 0.8 / max(1, len(shown))
    for k, c in enumerate(shown):
        label, color = COLUMNS[c]
        xs = [i + (k - (len(shown) - 1) / 2) * width for i, s in enumerate(states) if s in ttft[c]]
        ys = [ttft[c][s]["median_s"] for s in states if s in ttft[c]]
        ax.bar(xs, ys, width, label=label, color=color)
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.2g}", (x, y), ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(states)), [s.replace(", ", ",\n") for s in states], fontsize=8)
    ax.set_ylabel("time to first token (s, median, log)")
    ax.set_title("Request to first token by the model's state")
    if shown:
        ax.legend(fontsize=8)


def _swap_bars(ax: Any, swaps: dict[str, Any]) -> None:
    kinds = sorted({f["swap"] for f in swaps.values()}, reverse=True)  # sleep, stop
    for f in swaps.values():
        i = kinds.index(f["swap"])
        on = f["residency_s"] > 0
        x = i + (0.2 if on else -0.2)
        label = f"min_residency_s = {f['residency_s']:g}"
        first = i == 0
        color = "tab:green" if on else "tab:gray"
        ax.bar(x, f["swaps_per_minute"], 0.4, color=color, label=label if first else None)
        ax.annotate(
            f"{f['swaps_per_minute']:g}", (x, f["swaps_per_minute"]), ha="center", va="bottom"
        )
    ax.set_xticks(range(len(kinds)), [f"swap = {k}" for k in kinds])
    ax.set_ylabel("swaps per minute")
    ax.set_title("Two models wanted in turn on one slot (fakes)")
    if swaps:
        ax.legend(fontsize=8)
