"""No import circle inside appliance/, and nothing but the composition builds on Gateway.

Every import statement counts, TYPE_CHECKING ones too: a circle hidden behind a type
hint is still two modules that cannot be read, tested or moved apart. The import-linter
contracts in pyproject.toml state the layers; this states what they cannot: no circle
at all, also inside one layer."""

from __future__ import annotations

import ast
from pathlib import Path

import appliance

PACKAGE = Path(appliance.__file__).resolve().parent
# Who may import the gateway's composition: the composition root and the gateway's own
# module that defines it.
GATEWAY_USERS = frozenset({"appliance.serve", "appliance.gateway.app"})


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("appliance", *path.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _graph() -> tuple[dict[str, set[str]], set[str]]:
    """module -> the appliance modules it imports; and the modules importing Gateway."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    gateway_users: set[str] = set()
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
                if base.startswith("appliance.gateway") and any(
                    a.name == "Gateway" for a in node.names
                ):
                    gateway_users.add(mod)
            for target in targets:
                while target and target not in mods:
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                if target and target != mod:
                    graph[mod].add(target)
    return graph, gateway_users


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_finder_sees_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package() -> None:
    graph, _ = _graph()
    assert len(graph) > 150  # the walk found the package
    assert circles(graph) == []


def test_only_the_composition_root_imports_the_gateway_object() -> None:
    _, users = _graph()
    assert users <= GATEWAY_USERS, sorted(users - GATEWAY_USERS)


def test_no_private_name_is_imported_across_modules() -> None:
    """A leading underscore says "this module's own": another module that needs it
    needs a public name (or the code moved to where it is used)."""
    taken = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("appliance"):
                taken += [
                    f"{mod} takes {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert taken == []
