"""A model's ``speculative`` table: what check-config can know before vLLM sees it.

The table becomes vLLM's ``--speculative-config`` JSON as written (:func:`appliance.plan.
speculative_json`), so every value must be one JSON can carry: TOML dates and times, NaN
and infinities cannot. vLLM validates the rest at start-up (its refusal leaves the
engine FAILED with its own reason in ``status``); here: the method, and no negative
number anywhere (counts, lengths and thresholds are all non-negative).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from appliance.config.words import show

# vLLM 0.32's --speculative-config methods (vllm/config/speculative.py), plus its many
# "<family>_mtp" ones, matched by suffix.
SPECULATIVE_METHODS: frozenset[str] = frozenset(
    {
        "ngram",
        "ngram_gpu",
        "medusa",
        "mlp_speculator",
        "draft_model",
        "suffix",
        "custom_class",
        "eagle",
        "eagle3",
        "extract_hidden_states",
        "dflash",
        "dspark",
        "mtp",
    }
)
EXAMPLE = '{ method = "ngram", num_speculative_tokens = 4 }'


def speculative_problem(path: str, value: Any) -> str | None:
    """What is wrong with the table at ``path`` (None: nothing check-config can see)."""
    if not isinstance(value, dict):
        return f"{path} = {show(value)}: must be a table, e.g. {EXAMPLE}"
    if not value:
        return None  # no speculation
    method = value.get("method")
    if not isinstance(method, str) or not (
        method in SPECULATIVE_METHODS or method.endswith("_mtp")
    ):
        allowed = ", ".join(sorted(SPECULATIVE_METHODS))
        shown = show(method) if method is not None else "(missing)"
        return f"{path}.method = {shown}: must be one of vLLM's methods: {allowed}, or *_mtp"
    return next(_value_problems(path, value), None)


def _value_problems(path: str, value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, v in value.items():
            yield from _value_problems(f"{path}.{key}", v)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _value_problems(f"{path}[{i}]", v)
    elif isinstance(value, (bool, str)):
        return
    elif isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            yield f"{path} = {show(value)}: must be a finite number"
        elif value < 0:
            yield f"{path} = {show(value)}: must not be negative"
    else:
        yield (
            f"{path} = {show(value)}: must be a string, a number, true/false, a list or a "
            "table (vLLM reads the table as JSON)"
        )
