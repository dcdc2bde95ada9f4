"""How a config field is declared: its default, its doc sentence, bounds and liveness.

Every section of the schema (:mod:`appliance.config.schema`) declares its fields with
:func:`config_field`; the docs and the checks read the metadata.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def config_field(
    default: Any,
    doc: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    live: bool = False,
) -> Any:
    """A config field: its default, the sentence that documents it, numeric bounds, and
    ``live``: a SIGHUP puts a new value in force in the running daemon.

    Mark a field live only when every use of it reads the running config at the time of
    use (never a copy made at start-up): tests/unit/test_live_keys.py checks each one.
    """
    meta = {"doc": doc, "lo": lo, "hi": hi, "lo_open": lo_open, "live": live}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
