"""Parsing a TOML document (already read) into a :class:`~appliance.config.schema.Config`,
naming every problem at once: each section's fields (:mod:`appliance.config.fields`),
the ``[[models]]`` tables (:mod:`appliance.config.model_tables`), then every rule across
keys (:mod:`appliance.config.checks`).

Parsing reads no file: the checks that need the host (its RAM, model and adapter
folders) are given its facts by the caller (:func:`appliance.config.load.load_config`
gives this host's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.config import checks
from appliance.config.checks.facts import HostFacts
from appliance.config.fields import build_section, unknown_key
from appliance.config.model_tables import parse_models
from appliance.config.schema import SECTIONS, Config, ModelConfig
from appliance.errors import ConfigError


def parse_config(raw: Mapping[str, Any], source: str = "", host: HostFacts | None = None) -> Config:
    """Validate a parsed TOML document; raise ConfigError naming every problem. ``host``:
    what the host-dependent checks read (None: those checks are skipped)."""
    problems: list[str] = []
    sections: dict[str, Any] = {}
    models: tuple[ModelConfig, ...] = ()
    for name, value in raw.items():
        if name == "models":
            models = parse_models(value, problems)
            continue
        if name not in SECTIONS:
            allowed = [f"[{s}]" for s in SECTIONS] + ["[[models]]"]
            problems.append(unknown_key("", name, allowed).replace(f"{name}:", f"[{name}]:", 1))
            continue
        sections[name] = build_section(name, SECTIONS[name], value, problems)
    cfg = Config(**sections, models=models, source=source)
    checks.check(cfg, problems, host)
    if problems:
        raise ConfigError(problems, source)
    return cfg
