"""The appliance's error hierarchy, and the exit status each fatal error carries.

::

    ApplianceError                  base; ``exit_code`` says how ``serve`` ends
    ├── ConfigError                 bad or missing config (exit 2); lists every problem
    ├── EngineSetupError            engine venv or model missing (exit 3); names the fix
    ├── NoEngineError               no engine could be started / all failed (exit 3)
    └── IllegalTransition           a lifecycle bug: raised, never handled

Per-request failures (a bad body, an engine that drops a stream) are not exceptions of
this tree: the gateway turns them into OpenAI-shaped HTTP errors where they happen.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_NO_ENGINE = 3


class ApplianceError(Exception):
    exit_code = 1


class ConfigError(ApplianceError):
    """Every problem found in a config, each naming the key, the value and what is allowed."""

    exit_code = EXIT_CONFIG

    def __init__(self, problems: list[str], source: str = "") -> None:
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        listing = "\n  ".join(self.problems)
        super().__init__(f"{len(self.problems)} config problem(s){where}:\n  {listing}")


class EngineSetupError(ApplianceError):
    exit_code = EXIT_NO_ENGINE


class NoEngineError(ApplianceError):
    exit_code = EXIT_NO_ENGINE


class IllegalTransition(ApplianceError):
    """An engine was asked to move between lifecycle states that do not connect: a bug."""
