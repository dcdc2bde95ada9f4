"""The docs quote the product exactly: every error code the gateway answers is in
docs/api.md's table of codes (and nothing else is), and every journal line the docs
quote is a line the daemon logs.

Conventions the docs follow, so that this test can find what they quote:

- **Error codes**: docs/api.md has one table whose header starts ``| code |``; its first
  column holds each code in backticks. The codes in the source are the string values
  given to a ``code`` parameter (``GatewayError(..., code="...")``, ``error_response``,
  ``raw_error``, ``sse_error_event``), followed through helpers that pass a parameter on
  as the code (``_reject(status, message, reason, ...)``, ``fail_waiters(reason, ...)``).
  An f-string code (``f"rate_limit_{which}"``) is a pattern: some documented code must
  match it.
- **Journal lines**: a table whose header starts ``| journal line |`` (first column, in
  backticks), or a fenced block opened with `````journal``, in README.md or a page of
  docs/ (not its dated journal/ and decisions/).
  A quoted line is the message only (without systemd's and the logger's prefix), may be
  a part of a whole message, and shows ``…`` or an example value (``engine0``, ``87``)
  where the message has a placeholder (``%s``, ``%d``, ``%.0f``, an f-string's
  ``{...}``). It must occur in some string literal of appliance/.

Source only, no daemon: a few hundred milliseconds.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "appliance"
GATEWAY = PACKAGE / "gateway"
API_DOC = REPO / "docs" / "api.md"
# README and every page of docs/ but the journal and the decisions, which are dated
# records kept as they were written: a line quoted there may be one the daemon no longer logs.
DOCS_WITH_JOURNAL_LINES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ELLIPSIS = "…"
# printf-style conversions (%s, %d, %.0f, %04o, %r, ...) but not a literal "%%".
LIST_VALUE = re.compile(r"[^\s,]+(?:, [^\s,]+)+")
PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[sdifgeoxXrc]")


# --- error codes in the source ------------------------------------------------------------
@dataclass(frozen=True)
class CodeSink:
    """A callable whose parameter ``param`` ends up as an answer's ``error.code``."""

    param: str
    index: int | None  # its position among the positional arguments a caller passes


def _modules(root: Path) -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(encoding="utf-8"))) for p in sorted(root.rglob("*.py"))]


def _callee(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _positional(fn: ast.FunctionDef | ast.AsyncFunctionDef, *, method: bool) -> list[str]:
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    return names[1:] if method and names and names[0] in ("self", "cls") else names


def _sink_for(fn: ast.FunctionDef | ast.AsyncFunctionDef, param: str, *, method: bool) -> CodeSink:
    names = _positional(fn, method=method)
    return CodeSink(param, names.index(param) if param in names else None)


def _functions(
    tree: ast.Module,
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
    """(name callers use, definition, is a method) for every function and class."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node, False
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    # A class is called by its name: its __init__'s parameters count.
                    yield (node.name if item.name == "__init__" else item.name), item, True


def _argument(call: ast.Call, sink: CodeSink) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == sink.param:
            return kw.value
    if sink.index is not None and sink.index < len(call.args):
        arg = call.args[sink.index]
        return None if isinstance(arg, ast.Starred) else arg
    return None


def _patterns(expr: ast.expr) -> list[str]:
    """Regexes for the string values expr can take; [] when it is not literal."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [re.escape(expr.value)]
    if isinstance(expr, ast.JoinedStr):
        parts = [
            re.escape(v.value)
            if isinstance(v, ast.Constant) and isinstance(v.value, str)
            else "[a-z0-9_]+"
            for v in expr.values
        ]
        return ["".join(parts)]
    if isinstance(expr, ast.IfExp):
        return _patterns(expr.body) + _patterns(expr.orelse)
    return []


@functools.cache
def source_codes() -> frozenset[str]:
    """Every error code the gateway can answer, as regexes (plain codes escaped)."""
    modules = _modules(GATEWAY)
    defs = [d for _, tree in modules for d in _functions(tree)]
    sinks: dict[str, CodeSink] = {
        name: _sink_for(fn, "code", method=method)
        for name, fn, method in defs
        if "code" in _positional(fn, method=method) + [a.arg for a in fn.args.kwonlyargs]
    }
    codes: set[str] = set()
    changed = True
    while changed:  # until no helper that passes a parameter on as the code is left
        changed = False
        for name, fn, method in defs:
            params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                sink = sinks.get(_callee(call) or "")
                arg = None if sink is None else _argument(call, sink)
                if arg is None:
                    continue
                codes.update(_patterns(arg))
                if (
                    isinstance(arg, ast.Name)
                    and arg.id in params
                    and arg.id not in ("code", "self")
                    and name not in sinks
                ):
                    sinks[name] = _sink_for(fn, arg.id, method=method)
                    changed = True
    # The supervisor's answers to an admin's adapter change carry the code the gateway
    # answers with (control.AdapterResult(status, message, code)).
    for call in ast.walk(ast.parse((PACKAGE / "supervisor" / "adapters.py").read_text())):
        if isinstance(call, ast.Call) and _callee(call) == "AdapterResult" and len(call.args) > 2:
            codes.update(_patterns(call.args[2]))
    return frozenset(codes)


# --- error codes in the docs --------------------------------------------------------------
def _tables(text: str, first_header: str) -> list[list[list[str]]]:
    """The rows (cells) of every Markdown table whose first header cell is first_header."""
    tables: list[list[list[str]]] = []
    rows: list[list[str]] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("|"):
            rows = None
            continue
        cells = [c.strip() for c in stripped.strip("|").split("|")]
        if rows is None:
            rows = [] if cells[0] == first_header else None
            if rows is not None:
                tables.append(rows)
        elif not re.fullmatch(r":?-+:?", cells[0]):
            rows.append(cells)
    return tables


def documented_codes() -> list[str]:
    tables = _tables(API_DOC.read_text(encoding="utf-8"), "code")
    assert len(tables) == 1, "docs/api.md: expected one table whose header starts '| code |'"
    codes = []
    for cells in tables[0]:
        found = re.findall(r"`([^`]+)`", cells[0])
        assert found, f"docs/api.md, table of codes: no code in backticks in {cells[0]!r}"
        codes += found
    return codes


def test_the_gateway_answers_the_codes_this_test_looks_for() -> None:
    """The source scan itself works: it finds codes given in each of the ways the gateway
    gives them (keyword, positional through helpers, f-string)."""
    codes = source_codes()
    for plain in ("invalid_api_key", "queue_full", "shutting_down", "header_timeout"):
        assert re.escape(plain) in codes, plain
    assert any(re.fullmatch(p, "rate_limit_rpm") for p in codes if "rate_limit" in p), codes


def test_every_code_the_gateway_answers_is_in_the_api_docs() -> None:
    documented = documented_codes()
    missing = sorted(p for p in source_codes() if not any(re.fullmatch(p, d) for d in documented))
    assert missing == [], (
        f"error codes the gateway answers but docs/api.md's table of codes lacks: {missing} "
        "(add a row: code, status, when, what to do)"
    )


def test_every_documented_code_is_one_the_gateway_answers() -> None:
    patterns = source_codes()
    stale = [d for d in documented_codes() if not any(re.fullmatch(p, d) for p in patterns)]
    assert stale == [], f"docs/api.md documents codes the gateway never answers: {stale}"


# --- journal lines ------------------------------------------------------------------------
LOG_METHODS = frozenset({"debug", "info", "warning", "error", "exception", "critical"})
WORD = re.compile(r"[A-Za-z]{3,}")


@dataclass(frozen=True)
class Template:
    """A string the daemon may log: literal pieces, None for each placeholder."""

    pieces: tuple[str | None, ...]
    logged: bool  # the format of a logging call (short formats like "%s: %s -> %s" count)

    @functools.cached_property
    def words(self) -> frozenset[str]:
        return frozenset(WORD.findall("".join(p for p in self.pieces if p is not None)))


def _merged(tokens: list[str | None]) -> tuple[str | None, ...]:
    """Without empty pieces, adjacent placeholders as one (a quote shows one value)."""
    out: list[str | None] = []
    for t in tokens:
        if t == "" or (t is None and out and out[-1] is None):
            continue
        out.append(t)
    return tuple(out)


def _pieces(node: ast.expr) -> tuple[str | None, ...] | None:
    """A string literal or f-string as pieces; None when node is neither."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        parts: list[str | None] = []
        pos = 0
        for m in PRINTF.finditer(node.value):
            parts += [node.value[pos : m.start()].replace("%%", "%"), None]
            pos = m.end()
        parts.append(node.value[pos:].replace("%%", "%"))
        return _merged(parts)
    if isinstance(node, ast.JoinedStr):
        return _merged(
            [
                v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else None
                for v in node.values
            ]
        )
    return None


def _log_format(call: ast.Call) -> ast.expr | None:
    """The format argument of ``log.warning(fmt, ...)`` or the gateway's throttled
    ``notes.note(key, level, fmt, ...)``."""
    if not isinstance(call.func, ast.Attribute):
        return None
    if call.func.attr in LOG_METHODS and call.args:
        return call.args[0]
    if call.func.attr == "note" and len(call.args) >= 3:
        return call.args[2]
    return None


@functools.cache
def source_templates() -> tuple[Template, ...]:
    """Every logging format, and every other string literal or f-string with a space in
    it (messages built elsewhere and logged through ``%s``), in appliance/."""
    out: list[Template] = []
    for _, tree in _modules(PACKAGE):
        formats = {
            id(fmt)
            for call in ast.walk(tree)
            if isinstance(call, ast.Call) and (fmt := _log_format(call)) is not None
        }
        inner = {
            id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values
        }
        for node in ast.walk(tree):
            if id(node) in inner or not isinstance(node, ast.expr):
                continue
            pieces = _pieces(node)
            if pieces is None or not any(p and " " in p for p in pieces):
                continue
            out.append(Template(pieces, id(node) in formats))
    return tuple(out)


def _value_like(text: str) -> bool:
    """Whether a quote's text may stand where the message has a placeholder: "…" (or text
    holding it), a value of one or two words, or a comma-separated list. Longer prose
    must be the message's own words, or any line would match ``%s: %s``."""
    return (
        ELLIPSIS in text
        or text.count(" ") <= 1
        or (text.count(" ") <= 3 and bool(LIST_VALUE.fullmatch(text)))
    )


def _matches(quote: str, template: tuple[str | None, ...]) -> bool:
    """Whether quote is a part of a message made from template: its text may start and end
    inside a literal piece; each placeholder stands for a value (see _value_like); and
    some of the quote is the template's own text, not only values and spaces."""

    @functools.cache
    def at(q: int, t: int, o: int, own: bool) -> bool:
        # q: position in quote; t: piece index; o: offset inside a literal piece;
        # own: some non-space character of the quote was matched by literal text.
        if q == len(quote):
            return own
        if t == len(template):
            return False
        piece = template[t]
        if piece is None:
            after = template[t + 1] if t + 1 < len(template) else None
            return any(
                (end == len(quote) or after is None or quote[end] == after[0])
                and _value_like(quote[q:end])
                and at(end, t + 1, 0, own)
                for end in range(len(quote), q, -1)
            )
        rest = piece[o:]
        n = min(len(rest), len(quote) - q)
        if quote[q : q + n] != rest[:n]:
            return False
        return at(q + n, t + 1, 0, own or bool(rest[:n].strip()))

    starts = [
        (t, o)
        for t, piece in enumerate(template)
        for o in (range(len(piece)) if piece is not None else (0,))
        if piece is None or piece[o] == quote[0]
    ]
    return any(at(0, t, o, False) for t, o in starts)


def quoted_line_exists(quote: str) -> bool:
    words = frozenset(WORD.findall(quote))
    # The templates sharing most words with the quote first: the right one is found early.
    candidates = sorted(
        (t for t in source_templates() if t.logged or t.words & words),
        key=lambda t: len(t.words & words),
        reverse=True,
    )
    return any(_matches(quote, t.pieces) for t in candidates)


def _fenced_journal_lines(text: str) -> Iterator[str]:
    inside = False
    for line in text.splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            inside = not inside and fence[3:].strip() == "journal"
            continue
        if inside and line.strip():
            yield line.strip()


def documented_journal_lines() -> list[tuple[str, str]]:
    """(doc, quoted line) for every journal line quoted in the docs."""
    out: list[tuple[str, str]] = []
    for doc in DOCS_WITH_JOURNAL_LINES:
        if not doc.exists():
            continue
        text = doc.read_text(encoding="utf-8")
        name = str(doc.relative_to(REPO))
        for table in _tables(text, "journal line"):
            for cells in table:
                quotes = re.findall(r"`([^`]+)`", cells[0])
                assert quotes, f"{name}: a journal-line row without a line in backticks: {cells}"
                out += [(name, q) for q in quotes]
        out += [(name, line) for line in _fenced_journal_lines(text)]
    return out


def test_the_docs_quote_journal_lines() -> None:
    """The runbook keeps its table of journal lines (so the next check has work)."""
    docs = {doc for doc, _ in documented_journal_lines()}
    assert "docs/runbook.md" in docs
    assert "docs/rehearse-heat.md" in docs


@pytest.mark.parametrize(
    ("quote", "exists"),
    [
        (
            "reload: these keys changed but need a restart (systemctl restart llm-appliance): …",
            True,
        ),
        ("engine0: GPU 0 at the hard limit for 30 s; restarting it", True),
        ("gpu0: throttle level 0 -> 1 (82°C)", True),
        ("restart not done: 4 planned restarts", True),
        ("reload: these keys need a restart", False),  # the line an old doc quoted
        ("gpu0: throttle level 0 to 1", False),
    ],
)
def test_the_matcher_takes_parts_and_example_values_but_not_other_words(
    quote: str, exists: bool
) -> None:
    assert quoted_line_exists(quote) is exists


def test_every_journal_line_the_docs_quote_is_logged_by_the_daemon() -> None:
    missing = [f"{doc}: {q}" for doc, q in documented_journal_lines() if not quoted_line_exists(q)]
    assert missing == [], (
        "journal lines quoted in the docs that no string in appliance/ produces "
        "(the message changed, or the quote has a typo):\n  " + "\n  ".join(missing)
    )
