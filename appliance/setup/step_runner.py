"""How set-up runs a command: :class:`SetupError` and the command :class:`Runner`.

A step's subprocess writes its output to a log file, so a failure can name the step and
show the log tail without a Python traceback. Also home to :func:`write_json_atomic`,
which every set-up step uses for its stamp or marker file.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from appliance.errors import ApplianceError

# A quick query (log=False) that takes longer than this is taken as hung.
QUERY_TIMEOUT_S = 120


class SetupError(ApplianceError):
    """An expected set-up failure: names the step, says why, and carries the log tail."""

    exit_code = 1

    def __init__(self, step: str, message: str, log_tail: str = "", log_path: Path | None = None):
        self.step = step
        self.message = message
        self.log_tail = log_tail
        self.log_path = log_path
        super().__init__(f"{step}: {message}")

    def render(self) -> str:
        lines = [f"set-up failed at step '{self.step}': {self.message}"]
        if self.log_path is not None:
            lines.append(f"full log: {self.log_path}")
        if self.log_tail.strip():
            lines.append("--- last lines of the log ---")
            lines.extend("  " + ln for ln in self.log_tail.rstrip().splitlines())
        return "\n".join(lines)


class Runner(Protocol):
    """Runs one command for a named step; returns its combined output or raises SetupError."""

    def __call__(
        self,
        argv: Sequence[str],
        *,
        step: str,
        env: Mapping[str, str] | None = None,
        log: bool = True,
    ) -> str: ...


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


_NETWORK_HINTS = (
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Could not fetch URL",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "No matching distribution found",
    "Could not find a version that satisfies",
)


def failure_hint(output: str) -> str:
    if any(h in output for h in _NETWORK_HINTS):
        return " (is the package index reachable? pip could not fetch a package)"
    if "No space left on device" in output:
        return " (the disk is full)"
    return ""


@dataclass
class SubprocessRunner:
    """Real runner: output streams to ``log_dir/<step>.log`` (appended), echo optional."""

    log_dir: Path
    calls: list[list[str]] = field(default_factory=list)

    def __call__(
        self,
        argv: Sequence[str],
        *,
        step: str,
        env: Mapping[str, str] | None = None,
        log: bool = True,
    ) -> str:
        """``log=False``: a quick query; output kept in memory, no log file touched."""
        argv = [str(a) for a in argv]
        self.calls.append(argv)
        full_env = _child_env(env)
        if not log:
            return _run_query(argv, step, full_env)
        return self._run_logged(argv, step, full_env)

    def _run_logged(self, argv: list[str], step: str, env: dict[str, str]) -> str:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{_slug(step)}.log"
        with log_path.open("a+", encoding="utf-8", errors="replace") as fh:
            fh.write(f"\n$ {' '.join(argv)}\n")
            fh.flush()
            start = fh.tell()
            try:
                done = subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=env,
                    check=False,
                )
            except OSError as exc:
                raise SetupError(step, f"cannot run {argv[0]}: {exc}", log_path=log_path) from None
            fh.flush()
            fh.seek(start)
            output = fh.read()
        if done.returncode != 0:
            raise SetupError(
                step,
                f"`{_short(argv)}` exited with status {done.returncode}{failure_hint(output)}",
                tail(output),
                log_path,
            )
        return output


def _child_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    full_env = dict(os.environ)
    if extra:
        full_env.update(extra)
    # Never let the appliance venv leak into the engine's interpreter.
    full_env.pop("PYTHONPATH", None)
    full_env.pop("VIRTUAL_ENV", None)
    return full_env


def _run_query(argv: list[str], step: str, env: dict[str, str]) -> str:
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            env=env,
            check=False,
            timeout=QUERY_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(step, f"cannot run {argv[0]}: {exc}") from None
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SetupError(
            step, f"`{_short(argv)}` exited with status {proc.returncode}", tail(output)
        )
    return output


def _slug(step: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in step.lower()).strip("-") or "step"


def _short(argv: Sequence[str]) -> str:
    text = " ".join(argv)
    return text if len(text) <= 160 else text[:157] + "..."


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
