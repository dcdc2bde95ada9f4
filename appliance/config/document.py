"""The whole config: every section, the models, and the function that validates a parsed
TOML document into it, naming every problem at once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from appliance.config.checks import _cross_check
from appliance.config.fields import _build_section, _unknown
from appliance.config.model_checks import check_models
from appliance.config.models import ModelConfig, ServedModel, parse_models, serve
from appliance.config.sections import (
    SECTIONS,
    DegradationConfig,
    EngineConfig,
    GatewayConfig,
    HealthConfig,
    RestartConfig,
    TelemetryConfig,
    ThermalConfig,
)
from appliance.errors import ConfigError


@dataclass(frozen=True)
class Config:
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    thermal: ThermalConfig = field(default_factory=ThermalConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    degradation: DegradationConfig = field(default_factory=DegradationConfig)
    models: tuple[ModelConfig, ...] = ()  # the [[models]] tables as written
    source: str = field(default="", metadata={"internal": True})
    # What is served: the tables merged over [engine] (or [engine] alone). Derived once
    # here, so every reader (and a reload's dataclasses.replace) sees the same merge.
    served: tuple[ServedModel, ...] = field(
        init=False, repr=False, compare=False, metadata={"internal": True}
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "served", serve(self.engine, self.models))

    def model(self, name: str) -> ServedModel | None:
        """The served model called ``name`` (its name or an alias), or None."""
        for m in self.served:
            if name in m.names:
                return m
        return None

    def engine_of(self, model: str) -> EngineConfig:
        """The [engine] keys in force for ``model`` (its overrides applied)."""
        found = self.model(model)
        return self.engine if found is None else found.engine

    def summary(self) -> str:
        e, g = self.engine, self.gateway
        scheme = "https" if g.tls_cert else "http"
        if self.models:
            what = "models: " + "; ".join(_model_summary(m, e.device) for m in self.served)
        else:
            engines = (
                f"{e.cpu_engines} cpu engine(s)"
                if e.device == "cpu"
                else f"gpus={e.gpus if e.gpus == 'auto' else ','.join(map(str, e.gpus))}"
            )
            what = f"{engines} model={e.model or 'packaged SmolLM2-135M-Instruct'}"
        return (
            f"config ok ({self.source or 'built-in defaults'}): device={e.device} {what} "
            f"gateway={scheme}://{g.host}:{g.port} telemetry={self.telemetry.source}"
        )


def _model_summary(m: ServedModel, device: str) -> str:
    where = (
        f"{m.cpu_engines} cpu engine(s)"
        if device == "cpu"
        else f"gpus={'auto' if m.gpus is None else ','.join(map(str, m.gpus))}"
    )
    tp = f" tp={m.tensor_parallel_size}" if m.tensor_parallel_size > 1 else ""
    model = m.model or "packaged SmolLM2-135M-Instruct"
    return f"model {m.name} ({m.task}): {where}{tp} model={model}"


def parse_config(raw: Mapping[str, Any], source: str = "") -> Config:
    """Validate a parsed TOML document; raise ConfigError naming every problem."""
    problems: list[str] = []
    sections: dict[str, Any] = {}
    models: tuple[ModelConfig, ...] = ()
    for name, value in raw.items():
        if name == "models":
            models = parse_models(value, problems)
            continue
        if name not in SECTIONS:
            allowed = [f"[{s}]" for s in SECTIONS] + ["[[models]]"]
            problems.append(_unknown("", name, allowed).replace(f"{name}:", f"[{name}]:", 1))
            continue
        sections[name] = _build_section(name, SECTIONS[name], value, problems)
    cfg = Config(**sections, models=models, source=source)
    _cross_check(cfg, problems)
    check_models(cfg, problems)
    if problems:
        raise ConfigError(problems, source)
    return cfg
