"""check-config names a layout whose sleeping weights cannot fit in host RAM (issue 23):
``swap = "sleep"`` keeps each sleeping engine's weights in host RAM, and every such model
can be asleep at once. The rule as a table (:func:`ram_problem`), the sizes it reads,
and ``check-config`` on a host whose RAM the weights exceed (sparse files: no disk used).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from appliance.cli import main
from appliance.config.checks.sleep_ram import GIB, ram_problem
from appliance.config.host import mem_total, model_folder, weights_bytes
from appliance.errors import EXIT_CONFIG

RAM = 64 * GIB

CASES = [
    # (why, asleep: (model, engines, bytes or None), RAM, parts of the message or None)
    ("one model that fits", [("a", 1, 40 * GIB)], RAM, None),
    ("two that fit together", [("a", 1, 30 * GIB), ("b", 1, 30 * GIB)], RAM, None),
    (
        "two that do not",
        [("a", 1, 40 * GIB), ("b", 1, 38 * GIB)],
        RAM,
        ['models ("a", "b")', "a 40.0 GiB + b 38.0 GiB = 78.0 GiB", "has 64.0 GiB"],
    ),
    (
        "each engine holds a copy",
        [("a", 2, 40 * GIB)],
        RAM,
        ["a 40.0 GiB × 2 engines = 80.0 GiB", 'swap = "stop"'],
    ),
    (
        "unknown sizes are not counted, and said",
        [("a", 1, 70 * GIB), ("b", 1, None)],
        RAM,
        ['models ("a")', "size unknown, not counted: b"],
    ),
    ("unknown sizes alone: no check", [("a", 1, None), ("b", 1, None)], RAM, None),
    ("RAM unknown: no check", [("a", 1, 900 * GIB)], None, None),
    ("exactly the RAM still fits", [("a", 1, RAM)], RAM, None),
]


@pytest.mark.parametrize(("why", "asleep", "ram", "parts"), CASES, ids=[c[0] for c in CASES])
def test_ram_problem(
    why: str, asleep: list[tuple[str, int, int | None]], ram: int | None, parts: list[str] | None
) -> None:
    problem = ram_problem(asleep, ram)
    if parts is None:
        assert problem is None
    else:
        assert problem is not None
        for part in parts:
            assert part in problem, problem


def sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        os.truncate(f.fileno(), size)


def test_weights_are_the_safetensors_else_the_bin_files(tmp_path: Path) -> None:
    both = tmp_path / "both"
    sparse(both / "model-00001-of-00002.safetensors", 3 * GIB)
    sparse(both / "model-00002-of-00002.safetensors", 2 * GIB)
    sparse(both / "pytorch_model.bin", 5 * GIB)  # the same weights again: vLLM skips them
    (both / "config.json").write_text("{}")
    assert weights_bytes(both) == 5 * GIB
    bins = tmp_path / "bins"
    sparse(bins / "pytorch_model.bin", 7 * GIB)
    assert weights_bytes(bins) == 7 * GIB
    (tmp_path / "none").mkdir()
    assert weights_bytes(tmp_path / "none") is None
    assert weights_bytes(None) is None


def test_a_model_id_has_no_folder_here(tmp_path: Path) -> None:
    assert model_folder("Qwen/Qwen2.5-7B-Instruct") is None
    assert model_folder(str(tmp_path)) == tmp_path


def test_mem_total_reads_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131841232 kB\nMemFree:        1000 kB\n")
    assert mem_total(meminfo) == 131841232 * 1024
    assert mem_total(tmp_path / "missing") is None
    host = mem_total()
    assert host is not None and host > 0


def test_check_config_names_sleeping_weights_larger_than_this_hosts_ram(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host = mem_total()
    assert host is not None
    big, small = tmp_path / "big", tmp_path / "small"
    sparse(big / "model.safetensors", host)  # alone it fits (just); with small it does not
    sparse(small / "model.safetensors", GIB)
    for folder in (big, small):  # model folders, as check-config wants them (item 13)
        (folder / "config.json").write_text("{}")
    config = tmp_path / "config.toml"
    common = 'load = "on_demand"\nswap = "sleep"\ngpus = [0]\n'
    config.write_text(
        f'[gateway]\nkeys_file = "{tmp_path / "keys.json"}"\n'
        f'[engine]\ndevice = "cuda"\n'
        f'[[models]]\nname = "big"\nmodel = "{big}"\n{common}'
        f'[[models]]\nname = "small"\nmodel = "{small}"\n{common}'
    )
    code = main(["check-config", "--config", str(config)])
    _, err = capsys.readouterr()
    assert code == EXIT_CONFIG
    assert 'models ("big", "small") with swap = "sleep"' in err
    assert f"this host has {host / GIB:.1f} GiB (MemTotal)" in err
    # The same models put away by stopping them hold no RAM asleep: no problem.
    config.write_text(config.read_text().replace('swap = "sleep"', 'swap = "stop"'))
    assert main(["check-config", "--config", str(config)]) == 0
