"""The tools developers point at the box, run for real against real vLLM on CPU (#22).

One daemon for the module: the packaged SmolLM2 as ``smollm2`` on one engine, with the
model's whole context (its ``max_position_embeddings``, 8192: a coding agent's request
is 4-80 KB) and vLLM's ``hermes`` tool-call parser (the agents send ``tools``, which
vLLM refuses without one). Each client is installed once into its own folder under
``~/.cache/llm-appliance/clients`` (tests/e2e/clients.py) and run as a user runs it,
pointed at a recording pass-through in front of the gateway (tests/e2e/tap.py), so the
test knows what the engine counted even where the client does not print it. The tap is
also every client's proxy and refuses the internet: with the documented switches set
(docs/connect-your-tools.md) no client may even try, and none needs a login.

Each test asserts what its user sees: the client exits 0 and shows the model's text,
and the key it used was charged exactly the engine's own counts (``/metrics``
``appliance_key_tokens_total`` for that key's id). A 135M model's answers are poor; the
words are not asserted, only that they came. No gateway change was needed for any of
these clients: each route and shape they use was already served.

What the module needs for that, and why:
- greedy sampling by default (``--override-generation-config``): coding agents send no
  temperature, and at vLLM's default of 1.0 this model sometimes rambles until its
  token limit, which Claude Code reports as an error: greedy makes each run the same;
- ``max_tokens_cap = 256``: an answer that runs to the cap on a shared 2-core machine
  takes minutes; Claude Code asks ``max_tokens = 32000`` unless told
  (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``, which its test leaves unset): the Messages route
  lowers it to the cap and says so (``X-Appliance-Max-Tokens``);
- no degradation restarts: other tests load the same cores, and a restart mid-answer
  breaks the client's stream (the clients under test, not the health policy, are the
  subject here).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from appliance import paths
from tests.e2e import clients
from tests.e2e.conftest import RealAppliance, missing_setup, real_home, serving
from tests.e2e.tap import Exchange, Tap, engine_usage, running_tap
from tests.fakes.appliance_proc import real_engine_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "smollm2"
CLIENT_TIMEOUT_S = 300
CAT_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
FINISHED = ("completed", "incomplete")
INSTALL_TIMES: dict[str, float] = {}


def model_context() -> int:
    """The converted SmolLM2's context, from its own config."""
    config = paths.packaged_model(real_home()) / "config.json"
    return int(json.loads(config.read_text())["max_position_embeddings"])


@dataclass
class Box:
    real: RealAppliance
    tap: Tap
    tmp: Path

    def new_key(self, name: str) -> tuple[str, str]:
        """A fresh user key (secret, id): each client's usage is its own key's."""
        body = json.dumps({"name": name, "scopes": ["user"]}).encode()
        req = urllib.request.Request(
            self.real.url + "/admin/keys",
            data=body,
            headers={**self.real.admin_headers(), "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            made = json.loads(r.read())
        return made["key"], made["id"]

    def key_tokens(self, key_id: str) -> tuple[int, int]:
        """The key's (prompt, completion) tokens as the gateway counted them."""
        code, text = _get_text(self.real.url + "/metrics", self.real.admin_headers())
        assert code == 200, text
        found = []
        for kind in ("prompt", "completion"):
            m = re.search(
                rf'appliance_key_tokens_total{{key="{key_id}",kind="{kind}"}} (\S+)', text
            )
            found.append(int(float(m[1])) if m else 0)
        return found[0], found[1]

    def run(
        self, what: str, argv: list[str], env: dict[str, str], cwd: Path | None = None
    ) -> tuple[subprocess.CompletedProcess[str], list[Exchange]]:
        """Run a client to its end; what it printed and what it exchanged."""
        start, outside = self.tap.mark(), len(self.tap.outside)
        began = time.monotonic()
        done = subprocess.run(
            argv,
            env={**self.env(), **env},
            cwd=cwd or self.tmp,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        seen = self.tap.since(start)
        sizes = ", ".join(f"{ex.path} {len(ex.request) / 1024:.1f} KB {ex.status}" for ex in seen)
        print(f"\n[clients] {what}: {time.monotonic() - began:.1f} s; requests: {sizes}")
        # Every documented switch that keeps the client offline is set: it must not try.
        assert self.tap.outside[outside:] == [], f"{what} reached for the internet"
        assert done.returncode == 0, f"{what} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done, seen

    def env(self) -> dict[str, str]:
        """The test's environment without anything that would send a client elsewhere,
        and the tap as every client's proxy: the internet is closed to them (tap.py)."""
        drop = ("OPENAI_", "ANTHROPIC_", "CLAUDE_", "CODEX_", "LLM_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
            env[name] = env[name.lower()] = self.tap.url
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        return env

    def assert_charged(self, key_id: str, seen: list[Exchange]) -> tuple[int, int]:
        """The key was charged exactly what the engine counted in the answers."""
        counted = engine_usage(seen)
        assert counted[0] > 0 and counted[1] > 0, f"no engine counts in {len(seen)} answers"
        self.real.app.wait_for(
            lambda: self.key_tokens(key_id) == counted,
            30,
            f"key {key_id} charged the engine's counts {counted}",
        )
        print(f"[clients] engine counted (prompt, completion) = {counted}; the key was charged so")
        return counted


def _get_text(url: str, headers: dict[str, str]) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.read().decode()


def installed(kind: str, name: str) -> Path:
    began = time.monotonic()
    got = clients.python_client(name) if kind == "py" else clients.npm_client(name)
    INSTALL_TIMES[name] = time.monotonic() - began
    print(
        f"\n[clients] {name}: {'installed' if got.fresh else 'cached'}"
        f" in {INSTALL_TIMES[name]:.1f} s"
    )
    return got.path


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    reason = missing_setup()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("e2e-clients")
    cfg: dict[str, Any] = real_engine_config(
        tmp,
        1,
        gateway={"max_tokens_cap": 256},
        restart={"degradation_restart": False},
    )
    cfg["engine"]["max_model_len"] = model_context()
    model = {"name": MODEL, "model": "packaged:smollm2-135m-instruct"}
    # hermes: the agents send tool_choice "auto", which needs a tool-call parser.
    cfg["models"] = [model | {"tool_call_parser": "hermes", "extra_args": GREEDY}]
    with serving(tmp, cfg, engines=1) as real, running_tap(real.url) as tap:
        print(f"\n[clients] engine READY after {real.timings['all_ready_s']:.1f} s")
        yield Box(real, tap, tmp)
        # The figures for CI: a warm cache installs nothing.
        times = {name: round(s, 1) for name, s in INSTALL_TIMES.items()}
        print(f"\n[clients] install or cache lookup, s: {times}")


GREEDY = ["--override-generation-config", '{"temperature": 0}']


def client_env(box: Box, key: str) -> dict[str, str]:
    return {"APPLIANCE_URL": box.tap.url, "APPLIANCE_KEY": key, "APPLIANCE_MODEL": MODEL}


def sdk_output(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(lines[-1])
    print(f"[clients] the client got: {out}")
    return out


# ---- SDKs --------------------------------------------------------------------------------


def test_openai_sdk_responses_previous_response_and_json_schema(box: Box) -> None:
    python = installed("py", "openai")
    key, key_id = box.new_key("openai-sdk")
    env = {**client_env(box, key), "APPLIANCE_SCHEMA": json.dumps(CAT_SCHEMA)}
    done, seen = box.run("openai SDK", [str(python), str(clients.script("openai_sdk.py"))], env)
    out = sdk_output(done)
    assert out["first"].strip() and out["again"].strip() and out["streamed"].strip()
    # The stream's last event came (incomplete: it stopped at max_output_tokens).
    assert out["first_status"] in FINISHED and out["streamed_status"] in FINISHED
    # The continuation was rendered with the first exchange before it: the engine that
    # holds the stored response was the one asked.
    assert out["again_previous"]
    assert out["again_input_tokens"] > out["first_input_tokens"]
    jsonschema.validate(json.loads(out["chat_json"]), CAT_SCHEMA)
    assert [ex.path for ex in seen] == ["/v1/responses"] * 3 + ["/v1/chat/completions"]
    box.assert_charged(key_id, seen)


def test_anthropic_sdk_messages_and_count_tokens(box: Box) -> None:
    python = installed("py", "anthropic")
    key, key_id = box.new_key("anthropic-sdk")
    done, seen = box.run(
        "anthropic SDK",
        [str(python), str(clients.script("anthropic_sdk.py"))],
        client_env(box, key),
    )
    out = sdk_output(done)
    assert out["whole"].strip() and out["streamed"].strip()
    assert out["count_tokens"] == out["whole_input_tokens"] > 0
    # anthropic 2.x sends its api_key as "Authorization: Bearer" (Claude Code's
    # ANTHROPIC_API_KEY goes as x-api-key: its test checks that one).
    assert all("authorization" in ex.header_names for ex in seen)
    box.assert_charged(key_id, seen)


def test_openai_agents_sdk_runs_a_one_tool_agent(box: Box) -> None:
    python = installed("py", "openai-agents")
    key, key_id = box.new_key("openai-agents")
    env = {**client_env(box, key), "OPENAI_AGENTS_DISABLE_TRACING": "1"}
    done, seen = box.run(
        "openai-agents SDK", [str(python), str(clients.script("openai_agents.py"))], env
    )
    out = sdk_output(done)
    assert out["final_output"].strip()
    assert out["requests"] >= 1
    first = seen[0].json_request()
    assert [t["name"] for t in first["tools"]] == ["local_time"]
    counted = box.assert_charged(key_id, seen)
    assert (out["input_tokens"], out["output_tokens"]) == counted


# ---- CLIs --------------------------------------------------------------------------------


def test_llm_cli_with_the_appliance_as_an_openai_compatible_model(box: Box) -> None:
    python = installed("py", "llm")
    llm = python.parent / "llm"
    key, key_id = box.new_key("llm-cli")
    home = box.tmp / "llm-user"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: appliance\n  model_name: {MODEL}\n"
        f"  api_base: {box.tap.url}/v1\n  api_key_name: appliance\n"
    )
    env = {"LLM_USER_PATH": str(home)}
    keys = subprocess.run(
        [str(llm), "keys", "set", "appliance", "--value", key],
        env={**box.env(), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert keys.returncode == 0, keys.stderr
    done, seen = box.run("llm CLI", [str(llm), "-m", "appliance", "Say hello."], env)
    print(f"[clients] llm printed: {done.stdout.strip()!r}")
    assert done.stdout.strip()
    box.assert_charged(key_id, seen)


def test_codex_cli_exec_on_the_responses_api(box: Box) -> None:
    codex = installed("npm", "codex")
    key, key_id = box.new_key("codex")
    home = box.tmp / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(codex_config(box.tap.url))
    env = {"CODEX_HOME": str(home), "HOME": str(home), "APPLIANCE_KEY": key}
    done, seen = box.run(
        "codex exec",
        [
            str(codex),
            "exec",
            "--strict-config",
            "--skip-git-repo-check",
            "--ephemeral",
            "Say hello.",
        ],
        env,
    )
    print(f"[clients] codex printed: {done.stdout.strip()!r}")
    assert done.stdout.strip()
    assert {ex.path for ex in seen} == {"/v1/responses"}
    box.assert_charged(key_id, seen)


def codex_config(url: str) -> str:
    """Codex's config.toml for the appliance: what docs/connect-your-tools.md shows, with
    every documented switch that keeps it from calling OpenAI."""
    return f"""model = "{MODEL}"
model_provider = "appliance"
check_for_update_on_startup = false

[features]
plugins = false   # else it syncs plugin lists from github.com and chatgpt.com

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
trace_exporter = "none"
metrics_exporter = "none"

[model_providers.appliance]
name = "llm-appliance"
base_url = "{url}/v1"
env_key = "APPLIANCE_KEY"
wire_api = "responses"
"""


def test_claude_code_print_mode_on_the_messages_api(box: Box) -> None:
    claude = installed("npm", "claude")
    key, key_id = box.new_key("claude-code")
    home = box.tmp / "claude-home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": box.tap.url,
        "ANTHROPIC_API_KEY": key,
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    # --bare: Claude Code's minimal mode (no CLAUDE.md, skills, plugins or hooks; three
    # tools). The full prompt fits the context (about 3,000 tokens here: SmolLM2's chat
    # template drops tool definitions) but a 135M model cannot follow it: it writes to
    # the output limit, which Claude Code reports as an error (docs/connect-your-tools.md).
    done, seen = box.run("claude -p", [str(claude), "-p", "--bare", "Say hello."], env)
    print(f"[clients] claude printed: {done.stdout.strip()!r}")
    assert done.stdout.strip()
    assert {ex.path.split("?")[0] for ex in seen} == {"/v1/messages"}
    assert all("x-api-key" in ex.header_names for ex in seen)
    # No CLAUDE_CODE_MAX_OUTPUT_TOKENS: it asked its default, the box sent its cap.
    asked = {ex.json_request()["max_tokens"] for ex in seen}
    assert min(asked) > 256, asked
    assert {ex.answer_headers.get("x-appliance-max-tokens") for ex in seen} == {"256"}
    box.assert_charged(key_id, seen)
