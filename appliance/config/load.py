"""Where the config comes from (--config, $LLM_APPLIANCE_CONFIG, the default path) and
reading it: TOML in, a validated :class:`Config` out, once, at the edge. The checks that
need this host's facts (its RAM, model and adapter folders) get them here
(:class:`~appliance.config.host.LocalHost`)."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

from appliance.config.host import LocalHost
from appliance.config.parse import parse_config
from appliance.config.schema import Config
from appliance.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/llm-appliance/config.toml")
CONFIG_ENV = "LLM_APPLIANCE_CONFIG"


def resolve_config_path(
    explicit: str | None, env: Mapping[str, str] | None = None
) -> tuple[Path | None, bool]:
    """(path, must_exist): --config must exist; the env var and the default may be absent."""
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit), True
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]), False
    return DEFAULT_CONFIG_PATH, False


def load_config(
    explicit: str | None = None,
    env: Mapping[str, str] | None = None,
    *,
    require_file: bool = False,
) -> Config:
    """The config from --config, $LLM_APPLIANCE_CONFIG or the default path.

    A missing env/default file means the built-in defaults, except with ``require_file``
    (a reload of a daemon that runs from a file: a file renamed away by an editor or a
    half-finished deploy must not silently put every default back in force).
    """
    path, must_exist = resolve_config_path(explicit, env)
    if path is None or not path.exists():
        if must_exist:
            raise ConfigError([f"--config {path}: no such file"], str(path))
        if require_file:
            raise ConfigError([f"{path}: no such file (the running config came from a file)"])
        return Config()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot be read ({exc})"], str(path)) from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not valid TOML ({exc})"], str(path)) from None
    return parse_config(raw, str(path), LocalHost())
