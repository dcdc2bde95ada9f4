"""plan_engines with ``[[models]]``: which engines each model gets, on which GPUs or cores,
and the command line and environment each engine starts with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from appliance import paths
from appliance.config import parse_config
from appliance.engine import EngineSpec
from appliance.errors import ConfigError, EngineSetupError
from appliance.plan import EnginePlan, plan_engines
from appliance.systemd import child_environment

BASE_ENV = child_environment({"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
SOCKETS = Path("/run/llm-appliance")
EMBED = "packaged:all-minilm-l6-v2"


def prepare(home: Path, name: str) -> Path:
    folder = paths.packaged_model(home, name)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An appliance home as set-up leaves it: engine python, SmolLM2 and MiniLM."""
    python = paths.engine_python(tmp_path)
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    prepare(tmp_path, paths.PACKAGED_MODEL_NAME)
    prepare(tmp_path, "all-minilm-l6-v2")
    return tmp_path


def plan(
    raw: dict[str, Any], home: Path, *, gpus: int = 0, cores: list[int] | None = None
) -> EnginePlan:
    return plan_engines(
        parse_config(raw),
        gpu_count=gpus,
        cores=list(range(4)) if cores is None else cores,
        home=home,
        base_env=BASE_ENV,
        socket_dir=SOCKETS,
        cpu_flags=frozenset({"avx2"}),
        preload=(),
    )


def option(argv: tuple[str, ...], name: str) -> str:
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


def where(spec: EngineSpec) -> tuple[int, str, tuple[int, ...], int | None, str]:
    return spec.id, spec.model, spec.gpus, spec.gpu, spec.task


def chat(**keys: Any) -> dict[str, Any]:
    return {"name": "chat", **keys}


def emb(**keys: Any) -> dict[str, Any]:
    return {"name": "emb", "model": EMBED, **keys}


# ---- 2 GPUs ------------------------------------------------------------------------


def test_two_models_one_gpu_each(home: Path) -> None:
    p = plan(
        {"models": [chat(gpus=[1]), {"name": "code", "model": "acme/coder", "gpus": [0]}]},
        home,
        gpus=2,
    )
    assert p.device == "cuda"
    # Engine ids run 0.. in config order, whatever the GPU numbers.
    assert [where(s) for s in p.specs] == [
        (0, "chat", (1,), 1, "generate"),
        (1, "code", (0,), 0, "generate"),
    ]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in p.specs] == ["1", "0"]
    assert [s.served_model_name for s in p.specs] == ["chat", "code"]
    assert option(p.specs[0].argv, "--model") == str(paths.packaged_model(home))
    assert option(p.specs[1].argv, "--model") == "acme/coder"
    assert [option(s.argv, "--served-model-name") for s in p.specs] == ["chat", "code"]
    for s in p.specs:
        assert "--tensor-parallel-size" not in s.argv
        assert "--runner" not in s.argv
        assert s.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert s.cpus is None
    assert p.model_paths == {"chat": str(paths.packaged_model(home)), "code": "acme/coder"}
    assert p.summary() == (
        f"'chat' on engine(s) 0 from {paths.packaged_model(home)}; "
        "'code' on engine(s) 1 from acme/coder"
    )


def test_one_model_across_two_gpus(home: Path) -> None:
    p = plan({"models": [chat(gpus=[0, 1], tensor_parallel_size=2)]}, home, gpus=2)
    (spec,) = p.specs
    assert where(spec) == (0, "chat", (0, 1), 0, "generate")
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert option(spec.argv, "--tensor-parallel-size") == "2"


def test_tensor_parallel_groups_take_consecutive_gpus(home: Path) -> None:
    p = plan(
        {"models": [chat(gpus=[3, 2, 1, 0], tensor_parallel_size=2)]},
        home,
        gpus=4,
    )
    assert [s.gpus for s in p.specs] == [(3, 2), (1, 0)]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in p.specs] == ["3,2", "1,0"]
    assert [s.gpu for s in p.specs] == [3, 1]


def test_one_table_without_gpus_and_engine_alone_take_every_gpu(home: Path) -> None:
    for raw in ({"models": [chat()]}, {}):
        p = plan(raw, home, gpus=2)
        assert [(s.id, s.gpus) for s in p.specs] == [(0, (0,)), (1, (1,))]


def test_chat_and_embed_on_two_gpus(home: Path) -> None:
    p = plan({"models": [chat(gpus=[0]), emb(gpus=[1])]}, home, gpus=2)
    assert [where(s) for s in p.specs] == [
        (0, "chat", (0,), 0, "generate"),
        (1, "emb", (1,), 1, "embed"),
    ]
    chat_argv, emb_argv = (s.argv for s in p.specs)
    assert option(emb_argv, "--runner") == "pooling"
    assert "--runner" not in chat_argv
    assert option(emb_argv, "--model") == str(paths.packaged_model(home, "all-minilm-l6-v2"))
    # The embedding model's context: 256 tokens, not [engine]'s 4096.
    assert option(emb_argv, "--max-model-len") == "256"
    assert option(chat_argv, "--max-model-len") == "4096"


# ---- CPU ---------------------------------------------------------------------------


def test_cpu_cores_split_between_all_engines_of_all_models(home: Path) -> None:
    p = plan(
        {"engine": {"device": "cpu"}, "models": [chat(cpu_engines=2), emb(cpu_engines=1)]},
        home,
        gpus=2,  # device = "cpu" never uses them
        cores=list(range(6)),
    )
    assert p.device == "cpu"
    assert [where(s) for s in p.specs] == [
        (0, "chat", (), None, "generate"),
        (1, "chat", (), None, "generate"),
        (2, "emb", (), None, "embed"),
    ]
    assert [s.cpus for s in p.specs] == [(0, 1), (2, 3), (4, 5)]
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in p.specs] == ["0-1", "2-3", "4-5"]
    for s in p.specs:
        assert s.env["CUDA_VISIBLE_DEVICES"] == ""
        assert "--enforce-eager" in s.argv
    assert option(p.specs[2].argv, "--runner") == "pooling"


def test_cpu_models_take_engine_cpu_engines_unless_they_set_theirs(home: Path) -> None:
    p = plan(
        {"engine": {"device": "cpu", "cpu_engines": 2}, "models": [chat(), emb(cpu_engines=1)]},
        home,
        cores=[0, 1, 2],
    )
    assert [s.model for s in p.specs] == ["chat", "chat", "emb"]
    assert [s.cpus for s in p.specs] == [(0,), (1,), (2,)]


def test_auto_without_gpus_runs_the_models_on_cpu(home: Path) -> None:
    p = plan({"models": [chat(gpus=[0]), emb(gpus=[1])]}, home, gpus=0)
    assert p.device == "cpu"
    assert [(s.model, s.gpus) for s in p.specs] == [("chat", ()), ("emb", ())]


# ---- each model's own keys on its command line ----------------------------------------


def test_per_model_overrides_reach_only_that_models_engines(home: Path) -> None:
    p = plan(
        {
            "engine": {"max_model_len": 2048, "extra_args": ["--seed", "7"]},
            "models": [
                chat(gpus=[0], max_model_len=1024, gpu_memory_utilization=0.5),
                {"name": "code", "model": "acme/code", "gpus": [1], "env": {"MY_FLAG": "1"}},
            ],
        },
        home,
        gpus=2,
    )
    a, b = (s.argv for s in p.specs)
    assert option(a, "--max-model-len") == "1024"
    assert option(b, "--max-model-len") == "2048"
    assert option(a, "--gpu-memory-utilization") == "0.5"
    assert option(b, "--gpu-memory-utilization") == "0.9"
    assert option(a, "--seed") == option(b, "--seed") == "7"
    assert "MY_FLAG" not in p.specs[0].env
    assert p.specs[1].env["MY_FLAG"] == "1"


def test_speculative_config_is_vllm_json(home: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    p = plan({"models": [chat(gpus=[0], speculative=spec), emb(gpus=[1])]}, home, gpus=2)
    assert json.loads(option(p.specs[0].argv, "--speculative-config")) == spec
    assert "--speculative-config" not in p.specs[1].argv


def test_a_packaged_draft_model_is_given_as_its_folder(home: Path) -> None:
    spec = {
        "method": "draft_model",
        "model": "packaged:smollm2-135m-instruct",
        "num_speculative_tokens": 3,
    }
    p = plan({"models": [chat(model="acme/big", speculative=spec)]}, home, gpus=1)
    given = json.loads(option(p.specs[0].argv, "--speculative-config"))
    assert given == {**spec, "model": str(paths.packaged_model(home))}


def test_a_draft_model_folder_or_id_is_given_as_written(home: Path) -> None:
    spec = {"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}
    p = plan({"models": [chat(model="acme/big", speculative=spec)]}, home, gpus=1)
    given = json.loads(option(p.specs[0].argv, "--speculative-config"))
    assert given["model"] == "yuhuili/EAGLE-LLaMA3-Instruct-8B"


def test_a_draft_model_folder_has_its_tilde_expanded_and_must_exist(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "drafts" / "small").mkdir(parents=True)
    spec = {"method": "draft_model", "model": "~/drafts/small", "num_speculative_tokens": 3}
    p = plan({"models": [chat(model="acme/big", speculative=spec)]}, home, gpus=1)
    given = json.loads(option(p.specs[0].argv, "--speculative-config"))
    assert given["model"] == str(tmp_path / "drafts" / "small")  # vLLM gets no shell
    missing = {**spec, "model": "/nope/draft"}
    with pytest.raises(EngineSetupError) as info:
        plan({"models": [chat(model="acme/big", speculative=missing)]}, home, gpus=1)
    assert "models.chat.speculative.model = '/nope/draft': no such folder" in str(info.value)


def test_an_unprepared_packaged_draft_model_says_to_run_setup(home: Path) -> None:
    spec = {"method": "draft_model", "model": "packaged:all-minilm-l6-v2"}
    shutil.rmtree(paths.packaged_model(home, "all-minilm-l6-v2"))
    with pytest.raises(EngineSetupError) as info:
        plan({"models": [chat(model="acme/big", speculative=spec)]}, home, gpus=1)
    assert "models.chat.speculative.model = 'packaged:all-minilm-l6-v2' is not prepared" in str(
        info.value
    )
    assert "setup" in str(info.value)


def test_a_models_own_command(home: Path) -> None:
    command = [
        "{python}",
        "serve.py",
        "{model}",
        "--name",
        "{served_model_name}",
        "--uds",
        "{uds}",
        "--gpus",
        "{gpu}",
    ]
    p = plan(
        {
            "models": [
                chat(gpus=[0]),
                {"name": "big", "model": "acme/big", "gpus": [2, 3], "tensor_parallel_size": 2}
                | {"command": command},
            ]
        },
        home,
        gpus=4,
    )
    ours, theirs = p.specs
    assert ours.argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
    assert theirs.argv == (
        str(paths.engine_python(home)),
        "serve.py",
        "acme/big",
        "--name",
        "big",
        "--uds",
        str(SOCKETS / "engine1.sock"),
        "--gpus",
        "2,3",
    )
    assert theirs.env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_a_models_command_without_model_needs_no_prepared_model(home: Path) -> None:
    (paths.packaged_model(home, "all-minilm-l6-v2") / "config.json").unlink()
    p = plan(
        {"models": [emb(command=["my-embedder", "--uds", "{uds}"])]},
        home,
        gpus=1,
    )
    assert p.specs[0].argv == ("my-embedder", "--uds", str(SOCKETS / "engine0.sock"))


def test_listen_tcp_ports_run_on_across_models(home: Path) -> None:
    p = plan(
        {
            "engine": {"listen": "tcp", "port_base": 9000},
            "models": [chat(gpus=[0, 1]), emb(gpus=[2])],
        },
        home,
        gpus=3,
    )
    assert [(s.model, s.port) for s in p.specs] == [("chat", 9000), ("chat", 9001), ("emb", 9002)]
    assert [option(s.argv, "--port") for s in p.specs] == ["9000", "9001", "9002"]


# ---- what cannot be planned ----------------------------------------------------------


def test_unprepared_packaged_embedding_model_names_its_key_and_setup(home: Path) -> None:
    (paths.packaged_model(home, "all-minilm-l6-v2") / "config.json").unlink()
    with pytest.raises(EngineSetupError) as info:
        plan({"models": [chat(gpus=[0]), emb(gpus=[1])]}, home, gpus=2)
    message = str(info.value)
    assert f"models[1] (\"emb\").model = '{EMBED}' is not prepared" in message
    assert "llm-appliance setup" in message


def test_missing_model_folder_names_its_model(home: Path, tmp_path: Path) -> None:
    with pytest.raises(EngineSetupError) as info:
        plan({"models": [chat(gpus=[0]), {"name": "x", "model": "/nope/x", "gpus": [1]}]}, home)
    assert "models[1] (\"x\").model = '/nope/x': no such folder" in str(info.value)


def test_a_gpu_that_is_not_there_is_a_config_error(home: Path) -> None:
    with pytest.raises(ConfigError) as info:
        plan({"models": [chat(gpus=[0]), emb(gpus=[2])]}, home, gpus=2)
    (problem,) = info.value.problems
    assert problem.startswith('models[1] ("emb").gpus = [2]: GPU(s) [2] not present')
    assert "NVML sees 2: 0..1" in problem
