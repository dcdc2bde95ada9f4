"""The check's lines (one per check, ✓ or ✗ and the figure it saw) and their figures."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 1024**3


def gib(n: float | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


@dataclass
class Line:
    name: str
    ok: bool
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        return f"{'✓' if self.ok else '✗'} {self.name}: {self.detail}"


@dataclass
class Report:
    head: str
    lines: list[Line] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    echo: Callable[[str], None] = print

    def say(self, text: str) -> None:
        self.echo(text)

    def add(self, line: Line) -> None:
        self.lines.append(line)
        self.echo(line.text())

    @property
    def ok(self) -> bool:
        return bool(self.lines) and all(line.ok for line in self.lines)

    def write(self, out: Path, elapsed_s: float, tail: str) -> None:
        text = [self.head, *(line.text() for line in self.lines), tail]
        (out / "gpu-check.txt").write_text("\n".join(text) + "\n")
        doc = {
            "ok": self.ok,
            "elapsed_s": round(elapsed_s, 1),
            **self.figures,
            "checks": {
                line.name: {"ok": line.ok, "detail": line.detail, **line.figures}
                for line in self.lines
            },
        }
        (out / "gpu-check.json").write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
