"""Parsing a config reads no file: the checks that depend on the host (sleeping weights
against its RAM, LoRA adapter folders) ask the facts their caller gives. load_config
gives this host's (check-config's messages are unchanged: test_config_sleep_ram.py,
test_lora.py); a test gives a fake, and a caller that gives none gets those checks
skipped instead of a disk read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from appliance.config import parse_config
from appliance.config.checks.sleep_ram import GIB
from appliance.config.lora import AdapterError
from appliance.errors import ConfigError


@dataclass
class FakeHost:
    """A host with ``ram`` bytes, models of the given sizes and adapters of the given ranks
    (a path not in ``ranks``: no such folder); it records what it was asked."""

    ram: int | None
    sizes: dict[str, int] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)

    def mem_total(self) -> int | None:
        self.asked.append("mem_total")
        return self.ram

    def weights_bytes(self, model: str) -> int | None:
        self.asked.append(f"weights {model}")
        return self.sizes.get(model)

    def adapter_rank(self, path: str) -> int:
        self.asked.append(f"adapter {path}")
        if path not in self.ranks:
            raise AdapterError("no such folder")
        return self.ranks[path]


SLEEPERS: dict[str, Any] = {
    "engine": {"device": "cuda"},
    "models": [
        {"name": n, "model": f"/srv/{n}", "gpus": [0], "load": "on_demand", "swap": "sleep"}
        for n in ("big", "small")
    ],
}
ADAPTER: dict[str, Any] = {
    "models": [{"name": "chat", "adapters": [{"name": "sql", "path": "/srv/lora/sql"}]}]
}


def test_sleeping_weights_are_weighed_against_the_ram_the_host_facts_give() -> None:
    host = FakeHost(ram=16 * GIB, sizes={"/srv/big": 12 * GIB, "/srv/small": 6 * GIB})
    with pytest.raises(ConfigError) as info:
        parse_config(SLEEPERS, host=host)
    (problem,) = info.value.problems
    assert "big 12.0 GiB + small 6.0 GiB = 18.0 GiB" in problem
    assert "this host has 16.0 GiB (MemTotal)" in problem
    assert host.asked == ["weights /srv/big", "weights /srv/small", "mem_total"]
    # The same weights on a larger host fit.
    parse_config(SLEEPERS, host=FakeHost(ram=32 * GIB, sizes=host.sizes))


def test_an_adapter_folder_is_judged_by_the_host_facts() -> None:
    with pytest.raises(ConfigError, match=r'adapters\[0\]\.path = "/srv/lora/sql": no such'):
        parse_config(ADAPTER, host=FakeHost(ram=None))
    too_big = FakeHost(ram=None, ranks={"/srv/lora/sql": 1024})
    with pytest.raises(ConfigError, match="LoRA rank 1024 is above the largest vLLM serves"):
        parse_config(ADAPTER, host=too_big)
    parse_config(ADAPTER, host=FakeHost(ram=None, ranks={"/srv/lora/sql": 16}))


def test_without_host_facts_parsing_looks_at_no_folder_and_no_ram() -> None:
    """Neither /srv/... exists here: parsed alone, the config's own rules pass."""
    chat = {**ADAPTER["models"][0], "gpus": [1]}
    cfg = parse_config({**SLEEPERS, "models": [*SLEEPERS["models"], chat]})
    assert [m.name for m in cfg.served] == ["big", "small", "chat"]
