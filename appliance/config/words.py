"""How a config message names what it is about: a value as TOML writes it, and a
``[[models]]`` table by its index and name (``models[1] ("embed")``).

One place for both, so every message (parsing, checks, check-config's model files) calls
a value and a table the same way.
"""

from __future__ import annotations

from typing import Any


def show(value: Any) -> str:
    """A value as the admin wrote it in TOML: strings quoted, booleans lower case."""
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def label(i: int, name: str) -> str:
    """The ``[[models]]`` table at index ``i``, called ``name``: ``models[1] ("embed")``."""
    return f'models[{i}] ("{name}")'
