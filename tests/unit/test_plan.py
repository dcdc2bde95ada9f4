"""plan_engines: which engines run where, with what python, model, ports, keys and env."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from appliance import paths
from appliance.config import Config, parse_config
from appliance.engine_cpu import choose_cpu_dtype
from appliance.errors import ConfigError, EngineSetupError
from appliance.plan import (
    IOMP,
    TCMALLOC,
    EnginePlan,
    cpu_flags_of,
    cpu_preload_libs,
    plan_engines,
    read_cpu_flags,
)
from appliance.systemd import child_environment

SUPERVISOR_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "NOTIFY_SOCKET": "/run/systemd/notify",
    "WATCHDOG_USEC": "30000000",
    "WATCHDOG_PID": "1234",
}
BASE_ENV = child_environment(SUPERVISOR_ENV)
SOCKETS = Path("/run/llm-appliance")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An appliance home as set-up leaves it: engine venv python and the converted model."""
    python = paths.engine_python(tmp_path)
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    model = paths.packaged_model(tmp_path)
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    return tmp_path


def plan(
    raw: dict[str, Any],
    home: Path,
    *,
    gpus: int = 0,
    cores: list[int] | None = None,
    cpu_flags: frozenset[str] = frozenset({"avx2"}),
    preload: tuple[str, ...] = (),
) -> EnginePlan:
    return plan_engines(
        parse_config(raw),
        gpu_count=gpus,
        cores=list(range(4)) if cores is None else cores,
        home=home,
        base_env=BASE_ENV,
        socket_dir=SOCKETS,
        cpu_flags=cpu_flags,
        preload=preload,
    )


def option(argv: tuple[str, ...], name: str) -> str:
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(
    ("engine", "gpus", "expect_device", "expect_gpus", "binds"),
    [
        ({}, 0, "cpu", [None], ["0-3"]),
        ({"cpu_engines": 2}, 0, "cpu", [None, None], ["0-1", "2-3"]),
        ({"device": "cpu", "cpu_engines": 4}, 2, "cpu", [None] * 4, ["0", "1", "2", "3"]),
        ({}, 1, "cuda", [0], None),
        ({}, 2, "cuda", [0, 1], None),
        ({"device": "cuda"}, 2, "cuda", [0, 1], None),
        ({}, 12, "cuda", list(range(8)), None),  # at most 8 engines
        ({"gpus": [1]}, 2, "cuda", [1], None),
        ({"gpus": [1, 0]}, 2, "cuda", [1, 0], None),
        ({"gpus": [0, 1], "cpu_engines": 3}, 0, "cpu", [None] * 3, ["0-1", "2", "3"]),
    ],
)
def test_engines_per_device(
    home: Path,
    engine: dict[str, Any],
    gpus: int,
    expect_device: str,
    expect_gpus: list[int | None],
    binds: list[str] | None,
) -> None:
    p = plan({"engine": {**engine, "port_base": 9100}}, home, gpus=gpus)
    assert p.device == expect_device
    assert [s.gpu for s in p.specs] == expect_gpus
    assert [s.id for s in p.specs] == list(range(len(expect_gpus)))
    # The default: each engine on its own socket in the private directory, no TCP port.
    assert [s.address.uds for s in p.specs] == [
        str(SOCKETS / f"engine{i}.sock") for i in range(len(expect_gpus))
    ]
    assert [s.port for s in p.specs] == [None] * len(expect_gpus)
    for spec in p.specs:
        assert option(spec.argv, "--uds") == spec.address.uds
        assert "--port" not in spec.argv and "--host" not in spec.argv
        if expect_device == "cuda":
            assert spec.env["CUDA_VISIBLE_DEVICES"] == str(spec.gpu)
            assert "--gpu-memory-utilization" in spec.argv
            assert "--enforce-eager" not in spec.argv
        else:
            assert spec.env["CUDA_VISIBLE_DEVICES"] == ""
            assert "--enforce-eager" in spec.argv
            assert "--gpu-memory-utilization" not in spec.argv
    if binds is not None:
        assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in p.specs] == binds


def test_default_plan_uses_what_setup_made(home: Path) -> None:
    p = plan({}, home)
    (spec,) = p.specs
    assert p.python == str(paths.engine_python(home))
    assert p.model_paths == {"smollm2-135m-instruct": str(paths.packaged_model(home))}
    assert spec.argv[0] == p.python
    assert option(spec.argv, "--model") == str(paths.packaged_model(home))
    assert paths.PACKAGED_MODEL_NAME == "smollm2-135m-instruct"
    assert option(spec.argv, "--served-model-name") == paths.PACKAGED_MODEL_NAME
    assert spec.served_model_name == paths.PACKAGED_MODEL_NAME
    assert spec.env["HF_HUB_OFFLINE"] == "1"


def test_served_model_name_override(home: Path) -> None:
    p = plan({"engine": {"served_model_name": "chat"}}, home)
    assert p.specs[0].served_model_name == "chat"
    assert option(p.specs[0].argv, "--served-model-name") == "chat"


@pytest.mark.parametrize(
    ("engine", "gpus", "fragment"),
    [
        ({"gpus": [3]}, 2, "engine.gpus = [3]: GPU(s) [3] not present (NVML sees 2: 0..1)"),
        ({"gpus": [0, 2]}, 2, "engine.gpus = [0, 2]: GPU(s) [2] not present"),
        ({"device": "cuda"}, 0, 'engine.device = "cuda": no NVIDIA GPU found'),
        ({"device": "cuda", "gpus": [0]}, 0, 'engine.device = "cuda"'),
    ],
)
def test_gpus_that_are_not_there_are_a_config_error(
    home: Path, engine: dict[str, Any], gpus: int, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        plan({"engine": engine}, home, gpus=gpus)
    assert info.value.exit_code == 2
    (msg,) = info.value.problems
    assert msg.startswith(fragment) or fragment in msg, msg


def test_missing_engine_venv_says_to_run_setup(home: Path) -> None:
    paths.engine_python(home).unlink()
    with pytest.raises(EngineSetupError) as info:
        plan({}, home)
    msg = str(info.value)
    assert "llm-appliance setup" in msg
    assert str(paths.engine_python(home)) in msg
    assert info.value.exit_code == 3


def test_missing_model_says_to_run_setup(home: Path) -> None:
    (paths.packaged_model(home) / "config.json").unlink()
    with pytest.raises(EngineSetupError) as info:
        plan({}, home)
    msg = str(info.value)
    assert "llm-appliance setup" in msg
    assert "config.json" in msg


def test_missing_explicit_python_names_the_key(home: Path, tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "python")
    with pytest.raises(EngineSetupError) as info:
        plan({"engine": {"python": missing}}, home)
    msg = str(info.value)
    assert msg.startswith(f"engine.python = {missing!r} does not exist")
    assert "llm-appliance setup" in msg


def test_explicit_python_is_used(home: Path, tmp_path: Path) -> None:
    python = tmp_path / "other-python"
    python.write_text("")
    p = plan({"engine": {"python": str(python)}}, home)
    assert p.specs[0].argv[0] == str(python)


def test_missing_explicit_model_folder_names_the_key(home: Path, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-model")
    with pytest.raises(EngineSetupError, match=r"engine\.model = .*no such folder"):
        plan({"engine": {"model": missing}}, home)


def test_explicit_model_folder_and_model_id(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / "Qwen2.5-0.5B-Instruct"
    folder.mkdir()
    p = plan({"engine": {"model": str(folder)}}, home)
    assert option(p.specs[0].argv, "--model") == str(folder)
    assert p.specs[0].served_model_name == "qwen2.5-0.5b-instruct"
    # A model id is left to vLLM's local cache (offline); it is not checked here.
    p = plan({"engine": {"model": "Org/Some-Model"}}, home)
    assert option(p.specs[0].argv, "--model") == "Org/Some-Model"
    assert p.specs[0].served_model_name == "some-model"


def test_model_path_with_tilde_reaches_vllm_expanded(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "mymodel").mkdir()
    p = plan({"engine": {"model": "~/mymodel"}}, home)
    assert option(p.specs[0].argv, "--model") == str(tmp_path / "mymodel")


def test_listen_tcp_puts_engine_i_on_port_base_plus_i(home: Path) -> None:
    p = plan({"engine": {"listen": "tcp", "port_base": 9100}}, home, gpus=2)
    assert [s.port for s in p.specs] == [9100, 9101]
    for spec in p.specs:
        assert spec.address.uds is None
        assert option(spec.argv, "--port") == str(spec.port)
        assert option(spec.argv, "--host") == "127.0.0.1"
        assert "--uds" not in spec.argv


@pytest.mark.parametrize(
    "command",
    [
        ["/usr/bin/my-server", "--port", "{port}", "--key", "{api_key}"],
        ["/usr/bin/my-server", "--model", "{model}", "--port", "{port}"],
    ],
)
def test_command_override_without_python_needs_no_venv(home: Path, command: list[str]) -> None:
    paths.engine_python(home).unlink()
    p = plan({"engine": {"command": command, "listen": "tcp"}}, home, gpus=2)
    assert [s.argv[0] for s in p.specs] == ["/usr/bin/my-server"] * 2
    assert [option(s.argv, "--port") for s in p.specs] == ["8100", "8101"]


def test_command_override_without_model_needs_no_model(home: Path) -> None:
    (paths.packaged_model(home) / "config.json").unlink()
    p = plan({"engine": {"command": ["{python}", "fake.py", "{uds}"]}}, home)
    assert p.specs[0].argv == (
        str(paths.engine_python(home)),
        "fake.py",
        str(SOCKETS / "engine0.sock"),
    )


def test_command_override_with_python_still_needs_the_venv(home: Path) -> None:
    paths.engine_python(home).unlink()
    with pytest.raises(EngineSetupError, match="llm-appliance setup"):
        plan({"engine": {"command": ["{python}", "fake.py", "{uds}"]}}, home)


@pytest.mark.parametrize(
    ("raw", "gpus"),
    [
        ({}, 2),
        ({"engine": {"device": "cpu", "cpu_engines": 3}}, 0),
        ({"engine": {"command": ["{python}", "x", "--api-key", "{api_key}", "{uds}"]}}, 2),
    ],
)
def test_the_engine_key_is_given_at_spawn_in_the_environment_not_argv(
    home: Path, raw: dict[str, Any], gpus: int
) -> None:
    """The plan holds no key (each spawn makes one); a spawn puts it in the environment,
    and on the command line only where a `command` override asks for {api_key}."""
    p = plan(raw, home, gpus=gpus)
    for spec in p.specs:
        assert "VLLM_API_KEY" not in spec.env
        key = f"eng-spawn-key-{spec.id}"
        assert spec.env_with_key(key)["VLLM_API_KEY"] == key
        assert (key in spec.argv_with_key(key)) == ("{api_key}" in str(raw))
        assert not any(key in a for a in spec.argv)


def test_children_get_no_systemd_variables_and_a_tag(home: Path) -> None:
    assert "NOTIFY_SOCKET" not in BASE_ENV
    p = plan({"engine": {"env": {"EXTRA": "1"}}}, home, gpus=2)
    tags = [s.tag for s in p.specs]
    assert len(set(tags)) == len(tags)
    for spec in p.specs:
        assert "NOTIFY_SOCKET" not in spec.env
        assert "WATCHDOG_USEC" not in spec.env
        assert "WATCHDOG_PID" not in spec.env
        assert spec.env["PATH"] == SUPERVISOR_ENV["PATH"]
        assert spec.env["EXTRA"] == "1"
        assert spec.env["LLM_APPLIANCE_ENGINE"] == spec.tag
        assert spec.tag.startswith(p.boot_id)


def test_plan_is_pure_given_its_inputs(home: Path) -> None:
    cfg = Config()
    p = plan_engines(
        cfg,
        gpu_count=0,
        cores=[0, 1],
        home=home,
        base_env=BASE_ENV,
        socket_dir=SOCKETS,
        cpu_flags=frozenset({"avx2"}),
        preload=(),
    )
    assert p.device == "cpu"
    assert child_environment(SUPERVISOR_ENV) == BASE_ENV  # not modified


@pytest.mark.parametrize(
    ("engine", "gpus", "cores", "expect"),
    [
        ({"cpu_engines": 2}, 0, [0, 1, 2, 3], [(0, 1), (2, 3)]),
        ({"cpu_engines": 2}, 0, [0, 1], [(0,), (1,)]),
        ({"cpu_engines": 3}, 0, [0, 1], [(0,), (1,), (0,)]),
        # No cores known: nothing to pin to.
        ({"cpu_engines": 2}, 0, [], [None, None]),
        # GPU engines are not pinned.
        ({}, 2, [0, 1, 2, 3], [None, None]),
        # The admin's own OpenMP binding wins: no pinning that could contradict it.
        (
            {"cpu_engines": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}},
            0,
            [0, 1],
            [None, None],
        ),
    ],
)
def test_cpu_engines_are_pinned_to_their_own_cores(
    home: Path,
    engine: dict[str, Any],
    gpus: int,
    cores: list[int],
    expect: list[tuple[int, ...] | None],
) -> None:
    p = plan({"engine": engine}, home, gpus=gpus, cores=cores)
    assert [s.cpus for s in p.specs] == expect
    for spec in p.specs:
        if spec.cpus:
            # The pinned cores and vLLM's OpenMP binding name the same cores.
            assert expand(spec.env["VLLM_CPU_OMP_THREADS_BIND"]) == spec.cpus


def expand(bind: str) -> tuple[int, ...]:
    """ "0-1,4" -> (0, 1, 4)"""
    out: list[int] = []
    for part in bind.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return tuple(out)


# ---------------------------------------------------------------------------------------
# CPU engines: dtype from the processor, libraries to preload
# ---------------------------------------------------------------------------------------

BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
LIBS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/venv/lib/libiomp5.so")


@pytest.mark.parametrize(("flags", "dtype"), [(frozenset({"avx2"}), "float32"), (BF16, "bfloat16")])
def test_cpu_plan_carries_the_dtype_it_put_on_every_command_line(
    home: Path, flags: frozenset[str], dtype: str
) -> None:
    p = plan({"engine": {"cpu_engines": 2}}, home, cpu_flags=flags)
    assert p.cpu_dtype is not None
    assert p.cpu_dtype.dtype == dtype
    assert p.cpu_dtype.as_json() == {"dtype": dtype, "reason": p.cpu_dtype.reason}
    assert [option(s.argv, "--dtype") for s in p.specs] == [dtype, dtype]


def test_cpu_plan_reports_an_explicit_dtype(home: Path) -> None:
    p = plan({"engine": {"extra_args": ["--dtype", "bfloat16"]}}, home)
    assert p.cpu_dtype is not None
    assert (p.cpu_dtype.dtype, p.cpu_dtype.explicit) == ("bfloat16", True)
    assert option(p.specs[0].argv, "--dtype") == "bfloat16"


@pytest.mark.parametrize(
    ("raw", "gpus"),
    [({}, 2), ({"engine": {"command": ["{python}", "fake.py", "{uds}"]}}, 0)],
    ids=["gpu", "command-override"],
)
def test_no_cpu_dtype_or_preload_where_we_do_not_write_the_vllm_command(
    home: Path, raw: dict[str, Any], gpus: int
) -> None:
    p = plan(raw, home, gpus=gpus, cpu_flags=BF16, preload=LIBS)
    assert p.cpu_dtype is None and p.preload == ()
    assert all("LD_PRELOAD" not in s.env and "--dtype" not in s.argv for s in p.specs)


def test_cpu_engines_preload_what_was_found(home: Path) -> None:
    p = plan({"engine": {"cpu_engines": 2}}, home, preload=LIBS)
    assert p.preload == LIBS
    assert [s.env["LD_PRELOAD"] for s in p.specs] == [":".join(LIBS)] * 2


def test_engine_env_ld_preload_replaces_the_plan_s(home: Path) -> None:
    p = plan({"engine": {"env": {"LD_PRELOAD": ""}}}, home, preload=LIBS)
    assert p.preload == ()  # what the log and status say we preload: nothing
    assert p.specs[0].env["LD_PRELOAD"] == ""


def test_preload_libs_found_where_installed(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    libdir = tmp_path / "usr-lib"
    other = tmp_path / "usr-lib64"
    for d in (python.parent, libdir, other, python.parent.parent / "lib"):
        d.mkdir(parents=True)
    # Absent everywhere: nothing.
    assert cpu_preload_libs(str(python), [libdir, other]) == ()
    # tcmalloc in the second directory, Intel OpenMP in the venv's lib/.
    (other / TCMALLOC).write_bytes(b"\x7fELF")
    (python.parent.parent / "lib" / IOMP).write_bytes(b"\x7fELF")
    assert cpu_preload_libs(str(python), [libdir, other]) == (
        str(other / TCMALLOC),
        str(python.parent.parent / "lib" / IOMP),
    )
    # A folder of that name is not a library: the next directory's file is taken.
    (libdir / TCMALLOC).mkdir()
    assert cpu_preload_libs(str(python), [libdir, other])[0] == str(other / TCMALLOC)
    # The first directory that has it wins.
    first = tmp_path / "usr-local-lib"
    first.mkdir()
    (first / TCMALLOC).write_bytes(b"\x7fELF")
    assert cpu_preload_libs(str(python), [first, other])[0] == str(first / TCMALLOC)


def test_preload_looks_in_the_venv_a_linked_python_belongs_to(tmp_path: Path) -> None:
    """A venv's python is a link to the base interpreter; the venv's lib/ is next to bin/."""
    base = tmp_path / "base" / "bin" / "python3"
    base.parent.mkdir(parents=True)
    base.write_text("")
    venv_python = tmp_path / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(base)
    (tmp_path / "venv" / "lib").mkdir()
    (tmp_path / "venv" / "lib" / IOMP).write_bytes(b"")
    assert cpu_preload_libs(str(venv_python), []) == (str(tmp_path / "venv" / "lib" / IOMP),)


X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_tile
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu sse2
"""
ARM_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        (X86_CPUINFO, {"fpu", "sse2", "avx", "avx2", "avx512f", "avx512_bf16", "amx_tile"}),
        (ARM_CPUINFO, {"fp", "asimd", "bf16", "sve"}),
        ("", set()),
    ],
    ids=["x86", "arm", "empty"],
)
def test_cpu_flags_of_cpuinfo(text: str, expect: set[str]) -> None:
    assert cpu_flags_of(text) == expect


def test_unreadable_cpuinfo_means_no_flags_and_float32(tmp_path: Path) -> None:
    assert read_cpu_flags(tmp_path / "missing") == frozenset()
    assert choose_cpu_dtype(frozenset(), Config().engine.extra_args).dtype == "float32"
    (tmp_path / "cpuinfo").write_text(X86_CPUINFO)
    assert choose_cpu_dtype(read_cpu_flags(tmp_path / "cpuinfo"), ()).dtype == "bfloat16"


@pytest.mark.parametrize(
    ("env", "preload", "shown"),
    [
        ({}, LIBS, "LD_PRELOAD: libtcmalloc_minimal.so.4, libiomp5.so"),
        ({}, (), "LD_PRELOAD: none"),
        ({"LD_PRELOAD": "/opt/mine.so"}, LIBS, "LD_PRELOAD: mine.so"),
    ],
)
def test_start_log_line_says_dtype_why_and_what_is_preloaded(
    home: Path, env: dict[str, str], preload: tuple[str, ...], shown: str
) -> None:
    note = plan({"engine": {"env": env}}, home, preload=preload).cpu_note
    assert note.startswith("CPU engines use --dtype float32 (the CPU has neither avx512_bf16")
    assert note.endswith(shown)
    assert "\n" not in note


def test_no_cpu_line_in_the_start_log_on_gpu(home: Path) -> None:
    assert plan({}, home, gpus=1, preload=LIBS).cpu_note == ""
