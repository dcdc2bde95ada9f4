"""The appliance's configuration: TOML in, frozen dataclasses out, loaded once at the edge.

Every key is optional; the defaults are the contract's. Validation collects *every*
problem before failing, and each message names the key path, the value it saw and what
is allowed. One module per concern, each importing the ones before it and none after:
``schema`` (every dataclass: the sections, the models, :class:`Config`), ``fields``
(checking a value against a field), ``checks`` (a package: the rules across keys, a
module per topic), ``model_tables`` (the ``[[models]]`` tables), ``parse`` (a TOML
document into a :class:`Config`, running the checks), ``host`` (what the checks read of
this host), ``load`` (where the config comes from) and ``markdown``
(docs/configuration.md).
"""

from appliance.config.checks.advice import config_warnings
from appliance.config.load import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    load_config,
    resolve_config_path,
)
from appliance.config.markdown import config_markdown
from appliance.config.parse import parse_config
from appliance.config.schema import (
    COMMAND_PLACEHOLDERS,
    LIVE_KEYS,
    MAX_GPUS,
    MODEL_ENGINE_KEYS,
    RESERVED_ENGINE_ENV,
    SECTIONS,
    Config,
    DegradationConfig,
    Device,
    EngineConfig,
    GatewayConfig,
    Governor,
    HealthConfig,
    Listen,
    ModelConfig,
    RestartConfig,
    ServedModel,
    Task,
    TelemetryConfig,
    ThermalConfig,
)

__all__ = [
    "COMMAND_PLACEHOLDERS",
    "CONFIG_ENV",
    "DEFAULT_CONFIG_PATH",
    "LIVE_KEYS",
    "MAX_GPUS",
    "MODEL_ENGINE_KEYS",
    "RESERVED_ENGINE_ENV",
    "SECTIONS",
    "Config",
    "DegradationConfig",
    "Device",
    "EngineConfig",
    "GatewayConfig",
    "Governor",
    "HealthConfig",
    "Listen",
    "ModelConfig",
    "RestartConfig",
    "ServedModel",
    "Task",
    "TelemetryConfig",
    "ThermalConfig",
    "config_markdown",
    "config_warnings",
    "load_config",
    "parse_config",
    "resolve_config_path",
]
