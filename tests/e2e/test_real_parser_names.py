"""The parser names check-config accepts (``tool_call_parser``, ``reasoning_parser``) are
the installed vLLM's: read from its registries by the engine venv's Python, which
imports the real vLLM (tens of seconds on CPU; no engine is started). What check-config
says about them: tests/unit/test_tool_parsers.py.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from appliance import paths
from appliance.config.checks.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

pytestmark = pytest.mark.e2e

LIST_REGISTRIES = """
import json
from vllm.tool_parsers import ToolParserManager
from vllm.reasoning import ReasoningParserManager
r = ReasoningParserManager
print(json.dumps([ToolParserManager.list_registered(),
                  sorted(set(r.reasoning_parsers) | set(r.lazy_parsers))]))
"""


def test_the_names_are_the_installed_vllms() -> None:
    python = paths.engine_python(paths.appliance_home())
    if not python.exists():
        pytest.skip(f"no engine venv at {python}: run `scripts/setup` to compare with vLLM")
    out = subprocess.run(
        [str(python), "-c", LIST_REGISTRIES],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    tools, reasoning = json.loads(out.strip().splitlines()[-1])
    assert sorted(TOOL_CALL_PARSERS) == tools
    assert sorted(REASONING_PARSERS) == reasoning
