"""The benchmarks' charts: each chart function turns a result shaped like its bench's
JSON into a PNG file (skipped without matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import _common, plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def matplotlib() -> None:
    """Skips a test that draws when the bench extra is not installed (the unit layer runs
    with the dev extra alone; the benches themselves go on chartless without it)."""
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) is missing")


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), f"{path} is not a PNG"
    assert len(data) > 1000


def gateway_figures(scale: float) -> dict[str, Any]:
    return {
        str(n): {
            "ttft_p50": [3.0, 3.0 + scale * n / 16],
            "ttft_p99": [8.0, 9.0],
            "lat_p50": [140.0, 141.0 + scale],
            "lat_p99": [150.0, 152.0],
            "ratio": 0.99,
            "gw_cpu_us_per_chunk_raw": 70.0 * scale / n**0.5,
            "gw_cpu_us_per_chunk_net": 60.0 * scale / n**0.5,
            "busy": [0.1, 0.2],
            "sys_busy": [0.1, 0.2],
            "events_per_stream": 66.0,
            "events_per_s": [450.0 * n, 440.0 * n],
        }
        for n in (1, 16, 64, 256)
    }


def timeline(outcomes: list[str]) -> dict[str, Any]:
    n = 20
    return {
        "bin_s": 1.0,
        "counts": {o: [(i * 7 + k) % 5 for i in range(n)] for k, o in enumerate(outcomes)},
        "p99_ms": [None if i == 3 else 180.0 + i for i in range(n)],
        "states": {
            "t": [i * 0.5 for i in range(2 * n)],
            "engines": [
                ["READY"] * 10 + ["DRAINING", "STOPPING", "STARTING"] + ["READY"] * 27,
                ["READY"] * 20 + [None] + ["EXITED"] * 3 + ["READY"] * 16,
            ],
            "restarts": [{"at_s": 6.0, "engine": 0, "reason": "admin"}],
        },
        "markers": [{"at_s": 5.0, "label": "admin restart"}, {"at_s": 10.0, "label": "crash"}],
    }


@pytest.mark.usefixtures("matplotlib")
def test_gateway_overhead_chart_of_both_listen_modes(tmp_path: Path) -> None:
    result = {"unix": gateway_figures(1.0), "tcp": gateway_figures(1.3), "unix_vs_tcp": {}}
    plots.gateway_overhead(result, tmp_path / "gw.png")
    assert_png(tmp_path / "gw.png")


@pytest.mark.usefixtures("matplotlib")
def test_gateway_overhead_chart_of_one_listen_mode(tmp_path: Path) -> None:
    plots.gateway_overhead(gateway_figures(1.0), tmp_path / "gw.png")
    assert_png(tmp_path / "gw.png")


@pytest.mark.usefixtures("matplotlib")
def test_heat_routing_chart(tmp_path: Path) -> None:
    def row(p50: float, rate: float) -> dict[str, Any]:
        return {
            "requests": 100,
            "failed": 0,
            "lat_p50_ms": p50,
            "lat_p90_ms": p50 * 2,
            "lat_p99_ms": p50 * 3,
            "ttft_p99_ms": 20.0,
            "req_per_s": rate,
            "tokens_per_s": rate * 32,
            "share_hot": 0.16,
        }

    result = {
        "levels": {
            str(n): {"heat-aware": row(180.0, 90.0), "round-robin": row(300.0, 50.0)}
            for n in (16, 24, 32)
        }
    }
    plots.heat_routing(result, tmp_path / "heat.png")
    assert_png(tmp_path / "heat.png")


@pytest.mark.usefixtures("matplotlib")
def test_restart_under_load_timeline(tmp_path: Path) -> None:
    plots.restart_under_load({"timeline": timeline(["ok", "failed"])}, tmp_path / "r.png")
    assert_png(tmp_path / "r.png")


@pytest.mark.usefixtures("matplotlib")
def test_soak_timeline(tmp_path: Path) -> None:
    result = {"engines": "fake", "timeline": timeline(["ok", "refused", "disconnected", "lost"])}
    plots.soak(result, tmp_path / "soak.png")
    assert_png(tmp_path / "soak.png")


@pytest.mark.usefixtures("matplotlib")
def test_write_plot_creates_the_file_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sub" / "heat.png"
    _common.write_plot(plots.gateway_overhead, gateway_figures(1.0), str(path))
    assert_png(path)
    assert str(path) in capsys.readouterr().out


def test_write_plot_without_matplotlib_says_one_line_and_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def chart(data: dict[str, Any], path: Path) -> None:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    _common.write_plot(chart, {}, str(tmp_path / "x.png"))
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no PNG written" in out
    assert not (tmp_path / "x.png").exists()


def test_chart_goes_next_to_the_json_unless_told_where() -> None:
    assert _common.plot_path("", "/tmp/run.json") == "/tmp/run.png"
    assert _common.plot_path("/x/a.png", "/tmp/run.json") == "/x/a.png"
    assert _common.plot_path("", None) == ""


def test_per_second_counts_and_p99() -> None:
    assert _common.per_bin([0.1, 0.9, 1.5, 3.2, -1.0], 3.0) == [2, 1, 0, 1]
    assert _common.p99_per_bin([(0.5, 0.1), (2.5, 0.2)], 2.0) == [100.0, None, 200.0]
