"""Checking one TOML table against its section's dataclass: types, bounds, unknown keys.

Every problem is collected, not just the first, and each message names the key path, the
value seen and what is allowed: the reader is an admin at a terminal (or Ansible's
``validate:``), not a developer. Unknown keys are errors too: a typo such as
``max_infligth`` must not silently leave the default in force.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin

from appliance.config.schema import SECTIONS
from appliance.config.words import show


def describe(tp: Any) -> str:
    """What a type allows, in the words of a TOML user."""
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(show(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {describe(get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a table of string values"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in get_args(tp))
    return str(tp)


def coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, converted) for a TOML value against a field type; no implicit string parsing."""
    origin = get_origin(tp)
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        # TOML integers are unbounded; one too big for a float is just out of range.
        ok = ok and abs(value) <= sys.float_info.max and math.isfinite(value)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    if origin is Literal:
        return value in get_args(tp) and isinstance(value, str | int), value
    if origin is list:
        (item,) = get_args(tp)
        if not isinstance(value, list):
            return False, value
        out = []
        for v in value:
            ok, c = coerce(v, item)
            if not ok:
                return False, value
            out.append(c)
        return True, out
    if origin is dict:
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        )
        return ok, dict(value) if ok else value
    if origin in (typing.Union, types.UnionType):
        for alt in get_args(tp):
            ok, c = coerce(value, alt)
            if ok:
                return True, c
        return False, value
    raise TypeError(f"unsupported config type {tp!r}")  # a bug in this module, not in input


def unknown_key(path: str, key: str, allowed: list[str], here: str = "") -> str:
    """An unknown key's message: the section it belongs in when it is another
    section's key (``max_tokens_cap`` under [engine] is a [gateway] key, not a misspelt
    ``max_inflight_tokens``), else the nearest allowed key, and every allowed key.
    ``here``: the section it was found in (not named as its home)."""
    homes = [name for name, cls in SECTIONS.items() if name != here and _has(cls, key)]
    if homes:
        where = " or ".join(f"[{h}]" for h in homes)
        hint = f" here; it belongs in {where} ({' or '.join(f'{h}.{key}' for h in homes)})"
        return f"{path}{key}: unknown key{hint}; allowed keys here: {', '.join(allowed)}"
    near = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return f"{path}{key}: unknown key{hint}; allowed keys: {', '.join(allowed)}"


def _has(cls: type[Any], key: str) -> bool:
    return any(f.name == key for f in dataclasses.fields(cls))


def check_bounds(value: Any, meta: Mapping[str, Any]) -> str | None:
    """What a number breaks of a field's bounds ("> 0 and <= 1"), or None when it fits."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    lo, hi, lo_open = meta.get("lo"), meta.get("hi"), meta.get("lo_open")
    if lo is not None and (value <= lo if lo_open else value < lo):
        return f"{'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
    if hi is not None and value > hi:
        low = f"{'>' if lo_open else '>='} {lo:g} and " if lo is not None else ""
        return f"{low}<= {hi:g}"
    return None


def build_section(name: str, cls: type[Any], raw: Any, problems: list[str]) -> Any:
    if not isinstance(raw, dict):
        problems.append(f"[{name}]: must be a table, got {show(raw)}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            problems.append(unknown_key(f"{name}.", key, list(fields), here=name))
            continue
        tp, meta = hints[key], fields[key].metadata
        ok, converted = coerce(value, tp)
        if not ok:
            problems.append(f"{name}.{key} = {show(value)}: must be {describe(tp)}")
            continue
        bad = check_bounds(converted, meta)
        if bad:
            problems.append(f"{name}.{key} = {show(value)}: must be {bad}")
            continue
        values[key] = converted
    return cls(**values)
