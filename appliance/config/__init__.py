"""The appliance's configuration: TOML in, frozen dataclasses out, loaded once at the edge.

Every key is optional; the defaults are the contract's. Validation collects *every*
problem before failing, and each message names the key path, the value it saw and what
is allowed. One module per concern: ``sections`` (the tables and their fields),
``fields`` (checking a value against a field), ``models`` (``[[models]]`` and the served
models), ``checks`` / ``model_checks`` (rules across keys), ``document`` (the whole
config), ``load`` (where it comes from) and ``markdown`` (docs/configuration.md).
"""

from appliance.config.checks import config_warnings
from appliance.config.document import Config, parse_config
from appliance.config.load import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    load_config,
    resolve_config_path,
)
from appliance.config.markdown import config_markdown
from appliance.config.models import (
    MODEL_ENGINE_KEYS,
    ModelConfig,
    ServedModel,
    Task,
)
from appliance.config.sections import (
    COMMAND_PLACEHOLDERS,
    LIVE_KEYS,
    MAX_GPUS,
    RESERVED_ENGINE_ENV,
    SECTIONS,
    DegradationConfig,
    Device,
    EngineConfig,
    GatewayConfig,
    Governor,
    HealthConfig,
    Listen,
    RestartConfig,
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
