"""Where the daemon's code reads each config key, found in its source (``ast``).

A key marked live is only really live when every read of it happens at the time of use,
through the config in force then: ``self.config.gateway.max_queue`` inside a method,
``g = self._config().gateway`` then ``g.max_queue``, or a function handed the config
(or one of its sections) by its caller. A read made once and kept (in ``__init__``,
stored on an attribute, at module or class level) outlives a reload, and the key would
be logged as applied while the old value stays in force.

The search follows names, not types: a *running-config expression* is ``<x>.config``,
``config()`` / ``_config()`` (a callable handed to e.g. Admission), or a name bound to
one; a *section* is ``<running-config>.<section>``, a name bound to one, or a
parameter annotated with the section's class. ``config.engine_of(model)`` is the
``[engine]`` section as one model sees it. The ``config`` package and ``reload.py``
define and merge keys and are not consumers.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import appliance
from appliance.config import SECTIONS

PACKAGE = Path(appliance.__file__).resolve().parent
NOT_CONSUMERS = frozenset({"reload.py"})
SECTION_OF_CLASS = {cls.__name__: name for name, cls in SECTIONS.items()}
FIELDS = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items()}
CONSTRUCTORS = frozenset({"__init__", "__post_init__", "__new__"})
RUNNING = "running config"
ARGUMENT = "handed by its caller"
WHOLE = "*"  # a binding to the whole Config rather than one section


@dataclass(frozen=True)
class Read:
    key: str  # "section.field"
    where: str  # "gateway/admission.py:Admission.acquire"
    line: int
    via: str  # RUNNING or ARGUMENT
    kept: str | None  # why the value outlives the call (a copy a reload cannot reach)

    def __str__(self) -> str:
        kept = f", KEPT: {self.kept}" if self.kept else ""
        return f"{self.where} (line {self.line}, {self.via}{kept})"


def _callee(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class _Finder(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.scope: list[str] = []
        self.functions: list[str] = []  # names of the enclosing functions, innermost last
        self.env: list[dict[str, tuple[str, str]]] = [{}]  # name -> (section | WHOLE, via)
        self.kept: str | None = None  # set while visiting the value of an attribute store
        self.reads: list[Read] = []

    # ---- what an expression is ----------------------------------------------------
    def _bound(self, name: str) -> tuple[str, str] | None:
        return self.env[-1].get(name)

    def _whole(self, node: ast.expr) -> str | None:
        """How a whole-Config expression gets its config, or None if it is not one."""
        if isinstance(node, ast.Attribute) and node.attr == "config":
            return RUNNING
        if (
            isinstance(node, ast.Call)
            and not node.args
            and _callee(node.func)
            in (
                "config",
                "_config",
            )
        ):
            return RUNNING
        if isinstance(node, ast.Name):
            bound = self._bound(node.id)
            if bound is not None:
                return bound[1] if bound[0] == WHOLE else None
            if node.id in ("config", "cfg"):
                return ARGUMENT
        return None

    def _section(self, node: ast.expr) -> tuple[str, str] | None:
        # config.engine_of(model): the [engine] keys in force for one model.
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "engine_of"
        ):
            via = self._whole(node.func.value)
            return ("engine", via) if via else None
        if isinstance(node, ast.Attribute) and node.attr in SECTIONS:
            via = self._whole(node.value)
            return (node.attr, via) if via else None
        if isinstance(node, ast.Name):
            bound = self._bound(node.id)
            if bound is not None and bound[0] != WHOLE:
                return bound
        return None

    def _binding(self, node: ast.expr) -> tuple[str, str] | None:
        section = self._section(node)
        if section is not None:
            return section
        via = self._whole(node)
        return (WHOLE, via) if via else None

    # ---- scopes ---------------------------------------------------------------------
    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        env = dict(self.env[-1])
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            env.pop(arg.arg, None)
            ann = ast.unparse(arg.annotation).strip("'\"") if arg.annotation else ""
            if ann == "Config":
                env[arg.arg] = (WHOLE, ARGUMENT)
            elif ann in SECTION_OF_CLASS:
                env[arg.arg] = (SECTION_OF_CLASS[ann], ARGUMENT)
        for default in [*args.defaults, *args.kw_defaults]:
            if default is not None:
                self.visit(default)
        self.scope.append(node.name)
        self.functions.append(node.name)
        self.env.append(env)
        for stmt in node.body:
            self.visit(stmt)
        self.env.pop()
        self.functions.pop()
        self.scope.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    # ---- bindings and stores ------------------------------------------------------
    def _bind(self, target: ast.expr, value: ast.expr | None) -> None:
        if isinstance(target, ast.Name):
            binding = self._binding(value) if value is not None else None
            if binding is None:
                self.env[-1].pop(target.id, None)
            else:
                self.env[-1][target.id] = binding
        elif isinstance(target, ast.Tuple | ast.List):
            values = value.elts if isinstance(value, ast.Tuple | ast.List) else None
            for i, t in enumerate(target.elts):
                self._bind(t, values[i] if values and len(values) == len(target.elts) else None)

    def _store(self, targets: list[ast.expr], value: ast.expr | None) -> None:
        if value is None:
            return
        # Onto an object (``self.limit = ...``, ``self.cache[k] = ...``): it outlives the
        # call. A local name or a local dict dies with it.
        stores = [
            t
            for t in targets
            if isinstance(t, ast.Attribute)
            or (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute))
        ]
        before = self.kept
        if stores:
            self.kept = f"stored in {ast.unparse(stores[0])}"
            section = self._section(value)
            if section is not None:  # a whole section kept: every key of it goes stale
                for name in sorted(FIELDS[section[0]]):
                    self._record(f"{section[0]}.{name}", value, section[1])
        self.visit(value)
        self.kept = before
        for t in targets:
            self._bind(t, value)

    def visit_Assign(self, node: ast.Assign) -> None:
        self._store(node.targets, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._store([node.target], node.value)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self._store([node.target], node.value)

    # ---- reads ----------------------------------------------------------------------
    def visit_Attribute(self, node: ast.Attribute) -> None:
        section = self._section(node.value)
        if section is not None and node.attr in FIELDS[section[0]]:
            self._record(f"{section[0]}.{node.attr}", node, section[1])
        self.generic_visit(node)

    def _record(self, key: str, node: ast.expr, via: str) -> None:
        where = f"{self.module}:{'.'.join(self.scope) or '<module>'}"
        self.reads.append(Read(key, where, node.lineno, via, self._kept()))

    def _kept(self) -> str | None:
        if self.kept:
            return self.kept
        if not self.functions:
            return "read once, at import (module or class level)"
        if self.functions[-1] in CONSTRUCTORS:
            return f"read once, in {self.functions[-1]}"
        return None


def reads_in(module: str, source: str) -> list[Read]:
    finder = _Finder(module)
    finder.visit(ast.parse(source))
    return finder.reads


def package_reads() -> Iterator[Read]:
    """Every read of a config key in the appliance package's consumers."""
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module in NOT_CONSUMERS or module.startswith("config/"):
            continue
        yield from reads_in(module, path.read_text(encoding="utf-8"))
