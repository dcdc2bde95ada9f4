"""bench.vs_nginx's pure parts: the rotation of paths, the CPU per chunk (raw and net of
the proxy's background), the figures and table, nginx's configuration, and the chart."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import nginx, plots
from bench._common import Result
from bench.vs_nginx import Acc, cpu_per_chunk, figures, rotation, table


def results(n: int, ttft: float, total: float, events: int = 66) -> list[Result]:
    return [Result(True, 0.0, ttft, total, events) for _ in range(n)]


def accs() -> dict[tuple[int, str], Acc]:
    # 1 stream, 10 requests each; the daemon busy 0.1 s/s in the background.
    return {
        (1, "direct"): Acc(results(10, 0.010, 0.140), 10.0, {"appliance": 1.0, "nginx": 0.0}),
        (1, "appliance"): Acc(results(10, 0.011, 0.142), 10.0, {"appliance": 1.66, "nginx": 0.0}),
        (1, "nginx"): Acc(results(10, 0.0102, 0.1401), 10.0, {"appliance": 1.0, "nginx": 0.33}),
    }


def test_each_path_runs_first_in_turn() -> None:
    paths = ["direct", "appliance", "nginx"]
    assert [rotation(paths, r)[0] for r in range(4)] == ["direct", "appliance", "nginx", "direct"]
    assert sorted(rotation(paths, 1)) == sorted(paths)


def test_cpu_per_chunk_raw_and_net_of_the_background() -> None:
    raw, net = cpu_per_chunk(accs(), 1, "appliance")
    assert round(raw, 1) == round(1.66 / 660 * 1e6, 1)  # 2515.2 µs per chunk
    assert round(net, 1) == round((1.66 - 0.1 * 10.0) / 660 * 1e6, 1)  # 1000.0
    assert cpu_per_chunk(accs(), 1, "nginx") == (0.33 / 660 * 1e6, 0.33 / 660 * 1e6)


def test_figures_and_table_put_the_appliance_beside_nginx() -> None:
    args = argparse.Namespace(levels=[1])
    figs = figures(args, accs(), ["appliance", "nginx"])
    row = figs["1"]
    assert row["appliance"]["added_ttft_p50_ms"] == 1.0
    assert row["appliance"]["ratio"] == 1.0
    assert row["cpu_vs_nginx_raw"] == round(1.66 / 0.33, 3)
    text = table(args, figs, ["appliance", "nginx"]).markdown()
    assert "| 1       | appliance |" in text and "5.03×" in text


def test_nginx_is_a_plain_unbuffered_keep_alive_proxy_to_the_socket(tmp_path: Path) -> None:
    conf = nginx.CONFIG.format(user="", tmp=tmp_path, socket="/run/e0.sock", port=8123)
    for line in (
        "worker_processes 1;",
        "server unix:/run/e0.sock;",
        "keepalive 64;",
        "proxy_buffering off;",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "listen 127.0.0.1:8123;",
    ):
        assert line in conf


def test_chart_of_both_proxies(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) is missing")
    figs = figures(argparse.Namespace(levels=[1]), accs(), ["appliance", "nginx"])
    out = tmp_path / "vs.png"
    plots.vs_nginx(figs, out)
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_without_nginx_and_without_root_it_says_why_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nginx, "nginx_binary", lambda: None)
    monkeypatch.setattr(nginx.os, "geteuid", lambda: 1000)
    exe, why = nginx.ensure_nginx()
    assert exe is None
    assert why == "nginx is not installed, and apt-get as root is not available here"
