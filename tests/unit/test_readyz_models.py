"""/readyz's word for each model, and when a box with nothing admitting is still ready
(models on demand, issue 23): :func:`appliance.gateway.observe.probes.model_word` and
:func:`~appliance.gateway.observe.probes.loadable`, as tables."""

from __future__ import annotations

import pytest

from appliance.engine import EngineState
from appliance.gateway.observe.probes import loadable, model_word

E = EngineState

WORDS = [
    # (why, admits, its engines' states, on-demand lifecycle name or None, word)
    ("always, an engine admits", True, [E.READY], None, "ready"),
    ("always, none admits", False, [E.STARTING], None, "down"),
    ("always, FAILED", False, [E.FAILED], None, "down"),
    ("on demand, loaded and admitting", True, [E.READY], "loaded", "ready"),
    ("on demand, loaded but hot or suspect", False, [E.SUSPECT], "loaded", "down"),
    ("on demand, never loaded", False, [E.EXITED], "unloaded", "unloaded"),
    ("on demand, asleep", False, [E.SLEEPING], "sleeping", "sleeping"),
    ("on demand, loading", False, [E.STARTING], "loading", "loading"),
    ("on demand, drained for a swap", False, [E.DRAINING], "draining", "unloading"),
    ("on demand, being stopped", False, [E.STOPPING], "unloading", "unloading"),
    (
        "on demand, every engine FAILED: no request can load it",
        False,
        [E.FAILED],
        "unloaded",
        "down",
    ),
    ("on demand, one engine of two FAILED", False, [E.FAILED, E.EXITED], "unloaded", "unloaded"),
]


@pytest.mark.parametrize(
    ("why", "admits", "engines", "on_demand", "word"), WORDS, ids=[w[0] for w in WORDS]
)
def test_model_word(
    why: str, admits: bool, engines: list[EngineState], on_demand: str | None, word: str
) -> None:
    assert model_word(admits, engines, on_demand) == word


LOADABLE = [
    # (why, models' words, ready with nothing admitting)
    (
        "only on-demand models, none loaded: a request loads one",
        {"a": "unloaded", "b": "sleeping"},
        True,
    ),
    ("one loading, one put away", {"a": "loading", "b": "unloaded"}, True),
    ("a swap under way", {"a": "unloading", "b": "loading"}, True),
    ("an always model down beside put-away ones", {"chat": "down", "a": "unloaded"}, False),
    ("an on-demand model whose engines all FAILED", {"a": "down", "b": "unloaded"}, False),
    ("no model at all", {}, False),
]


@pytest.mark.parametrize(("why", "models", "ready"), LOADABLE, ids=[c[0] for c in LOADABLE])
def test_loadable(why: str, models: dict[str, str], ready: bool) -> None:
    assert loadable(models) is ready
