"""A small YAML emitter for the plain structures an export writes: mappings, lists,
strings, numbers, booleans and None.

Why not PyYAML: the appliance installs on a box with few dependencies, and the values
an export writes are simple. Every string is written double-quoted as JSON writes it
(YAML's double-quoted style is a superset of JSON's strings), so no value can be read
back as something else ("on", "1e3", "null", a leading "*" or "#"). Mappings and lists
are block style; empty ones are ``{}`` and ``[]``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Plain words YAML 1.1 readers (PyYAML, Helm's) take for booleans or null.
_WORDS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null"})


def dump(value: Mapping[str, Any], header: Sequence[str] = ()) -> str:
    """``value`` as a YAML document, after ``header`` lines written as comments."""
    lines = [f"# {h}" if h else "#" for h in header]
    lines += list(_mapping(value, 0))
    return "\n".join(lines) + "\n"


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r}: YAML export takes finite numbers only")
        text = repr(value)
        # YAML 1.1 readers (PyYAML, Helm's) take 1e-07 for a string: they want 1.0e-07.
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"{type(value).__name__}: not a plain value the export writes")


def _is_block(value: Any) -> bool:
    return isinstance(value, (Mapping, list, tuple)) and len(value) > 0


def _inline(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[]"
    return _scalar(value)


def _mapping(value: Mapping[str, Any], indent: int) -> Iterator[str]:
    pad = " " * indent
    for key, item in value.items():
        if not isinstance(key, str):
            raise TypeError(f"{key!r}: mapping keys are strings")
        name = key if _PLAIN_KEY.fullmatch(key) and key.lower() not in _WORDS else _scalar(key)
        if _is_block(item):
            yield f"{pad}{name}:"
            yield from _block(item, indent + 2)
        else:
            yield f"{pad}{name}: {_inline(item)}"


def _sequence(value: Sequence[Any], indent: int) -> Iterator[str]:
    pad = " " * indent
    for item in value:
        if isinstance(item, Mapping) and item:
            # The first key on the dash's line, the rest aligned under it.
            inner = list(_mapping(item, indent + 2))
            yield f"{pad}- {inner[0].lstrip()}"
            yield from inner[1:]
        elif _is_block(item):
            yield f"{pad}-"
            yield from _block(item, indent + 2)
        else:
            yield f"{pad}- {_inline(item)}"


def _block(value: Any, indent: int) -> Iterator[str]:
    if isinstance(value, Mapping):
        yield from _mapping(value, indent)
    else:
        yield from _sequence(value, indent)
