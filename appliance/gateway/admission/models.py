"""Which model a request names, whether it may take this route, and which engines serve it.

Several models share one box ([[models]]); each engine serves exactly one of them and
knows it by its canonical name only (vLLM's ``--served-model-name``). Clients may name a
model by an alias, so the gateway resolves the name once, refuses what no model serves
(404) or what the model does not do on this route (400), and from then on works with the
canonical name: admission, routing and failover stay within that model's engines.

A LoRA adapter (issue 23) is a model name of its own whose requests go to its base
model's engines: :func:`resolve_named` says which model serves a name and what the
engine is sent as ``model`` (the adapter's name: vLLM serves it under that name).

:func:`candidates` is the one place that says which engines may take a model's request,
so the fallback (issue 13: another model takes what its own engines cannot) has a single
seam to widen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from appliance.config import Config, ServedModel
from appliance.gateway.errors import GatewayError
from appliance.gateway.protocols import ALL, ROUTES, routes_of_task

# What each task serves (protocols/: each route says its tasks), by the relay's names.
ROUTES_OF_TASK: dict[str, tuple[str, ...]] = {
    task: tuple(r.name for r in routes_of_task(task)) for task in ("generate", "embed")
}
PATH_OF_ROUTE = {r.name: r.path for r in ALL}
UNKNOWN_MODEL = ""  # the metrics' model label before a request named a served model


class ServesModel(Protocol):
    """What candidate selection reads of an engine (an ``appliance.control.EngineStatus``)."""

    @property
    def model(self) -> str: ...


E = TypeVar("E", bound=ServesModel)


def candidates(model: str | None, engines: Iterable[E]) -> list[E]:
    """The engines that may take a request for ``model`` (its canonical name): its own,
    never another model's. ``None`` (no model named: unit tests' bare admission) is every
    engine."""
    if model is None:
        return list(engines)
    return [e for e in engines if e.model == model]


def model_list(
    served: Sequence[ServedModel], adapters: Mapping[str, str] | None = None
) -> list[str]:
    """Every name clients may send: each model's name, then its aliases, in config order;
    then the adapters (name -> base model)."""
    return [name for m in served for name in m.names] + list(adapters or ())


def model_cards(
    served: Sequence[ServedModel], adapters: Mapping[str, str], created: int
) -> list[dict[str, Any]]:
    """``GET /v1/models``' list: every name and alias, then every adapter as vLLM lists
    one, its base model as ``parent`` (``root``: its name; vLLM's is the adapter's
    folder, which a user's key is not shown)."""

    def card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "llm-appliance"}

    cards = [card(n) for n in model_list(served)]  # aliases as entries of their own
    return cards + [{**card(n), "root": n, "parent": m} for n, m in adapters.items()]


def resolve(
    config: Config, name: str, route: str, adapters: Mapping[str, str] | None = None
) -> ServedModel:
    """The served model a request's ``model`` names (by name, alias or adapter) and may
    take on ``route``; 404 ``model_not_found`` naming what exists, or 400
    ``model_wrong_route`` naming the routes the model serves."""
    return resolve_named(config, name, route, adapters)[0]


def resolve_named(
    config: Config, name: str, route: str, adapters: Mapping[str, str] | None = None
) -> tuple[ServedModel, str]:
    """:func:`resolve`, and the name its engines are sent: the adapter's when ``name`` is
    one (``adapters``: adapter name -> base model), else the model's canonical name."""
    found = config.model(name)
    sent = found.name if found is not None else name
    base = adapters.get(name) if adapters and found is None else None
    if base is not None:
        found = config.model(base)
    if found is None:
        shown = name if len(name) <= 64 else name[:61] + "..."
        raise GatewayError(
            404,
            f"The model '{shown}' does not exist; this server serves "
            f"{', '.join(model_list(config.served, adapters))} (GET /v1/models lists them)",
            param="model",
            code="model_not_found",
            reason="model_not_found",
        )
    routes = ROUTES_OF_TASK.get(found.task, ())
    if route not in routes:
        paths = [p for r in routes for p in ROUTES[r].client_paths]
        listed = " and ".join(paths)
        raise GatewayError(
            400,
            f"the model '{found.name}' is a{'n' if found.task == 'embed' else ''} "
            f"{found.task} model: it is served on {listed} only, not on {PATH_OF_ROUTE[route]}",
            param="model",
            code="model_wrong_route",
            reason="model_wrong_route",
        )
    return found, sent


def key_allows(
    config: Config, allowed: Sequence[str] | None, served: ServedModel, sent: str
) -> bool:
    """Whether a key limited to ``allowed`` (None: every model) may use ``served``, asked
    for as ``sent`` (an adapter's name, or the model's canonical name). A name the key
    holds stands for its model: the model's aliases and adapters follow it; an adapter
    the key names is allowed by itself (its base model is not)."""
    if allowed is None or sent in allowed:
        return True
    return any((m := config.model(n)) is not None and m.name == served.name for n in allowed)


def check_key_allows(
    config: Config, allowed: Sequence[str] | None, served: ServedModel, sent: str, asked: str
) -> None:
    """403 ``model_not_allowed`` when the key may not use the model ``asked`` names."""
    if key_allows(config, allowed, served, sent):
        return
    shown = asked if len(asked) <= 64 else asked[:61] + "..."
    raise GatewayError(
        403,
        f"this key may not use the model '{shown}'; it may use "
        f"{', '.join(allowed or ())} (GET /v1/models lists them)",
        param="model",
        code="model_not_allowed",
        reason="model_not_allowed",
    )


def visible_models(
    config: Config, adapters: Mapping[str, str], allowed: Sequence[str] | None
) -> tuple[list[ServedModel], dict[str, str]]:
    """The models and adapters (name -> base model) a key limited to ``allowed`` sees in
    ``GET /v1/models``: those it may use (:func:`key_allows`)."""
    served = [m for m in config.served if key_allows(config, allowed, m, m.name)]
    shown: dict[str, str] = {}
    for name, base in adapters.items():
        model = config.model(base)
        if model is not None and key_allows(config, allowed, model, name):
            shown[name] = base
    return served, shown
