"""``[[models]]``: every new key and every cross-check, good and bad, and what is served.

What is asserted is what an admin reads in ``check-config``: the problem names the key
path (``models[1] ("embed").gpus``), the value it saw and what is allowed, once.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest

from appliance.config import Config, ServedModel, parse_config
from appliance.config.schema import PACKAGED_CONTEXT
from appliance.errors import ConfigError
from appliance.reload import changed_keys, merge_live

EMBED = "packaged:all-minilm-l6-v2"
CHAT = "packaged:smollm2-135m-instruct"
CPU = {"device": "cpu"}


def problems_of(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    return info.value.problems


def served(cfg: Config, name: str) -> ServedModel:
    found = cfg.model(name)
    assert found is not None, name
    return found


def chat(**keys: Any) -> dict[str, Any]:
    return {"name": "chat", **keys}


def models(*tables: dict[str, Any], engine: dict[str, Any] | None = None) -> dict[str, Any]:
    raw: dict[str, Any] = {"models": list(tables)}
    if engine is not None:
        raw["engine"] = engine
    return raw


# ---------------------------------------------------------------------------------------
# Bad: (id, config, what the one problem must say, each part verbatim)
# ---------------------------------------------------------------------------------------

BAD: list[tuple[str, dict[str, Any], list[str]]] = [
    # name
    ("name missing", models({"gpus": [0]}), ["models[0].name: missing"]),
    (
        "name upper case",
        models(chat(name="Chat")),
        ['models[0] ("Chat").name = "Chat"', "a-z 0-9 . _ -"],
    ),
    ("name not a string", models({"name": 3}), ["models[0].name = 3", "a-z 0-9"]),
    ("name empty", models({"name": ""}), ['models[0].name = ""', "1-64 characters"]),
    ("name too long", models({"name": "a" * 65}), ["models[0]", ".name = ", "1-64 characters"]),
    ("name with a space", models(chat(name="my chat")), ['.name = "my chat"']),
    # aliases
    ("aliases not a list", models(chat(aliases="gpt")), ['models[0] ("chat").aliases = "gpt"']),
    (
        "alias bad",
        models(chat(aliases=["ok", "GPT 4"])),
        ['models[0] ("chat").aliases: "GPT 4"', "a-z 0-9"],
    ),
    ("alias not a string", models(chat(aliases=[4])), ['models[0] ("chat").aliases: 4']),
    # uniqueness, across models and within one
    (
        "duplicate names",
        models(chat(gpus=[0]), chat(gpus=[1])),
        ['models[1] ("chat")', '"chat" is already the name of models[0] ("chat")', "unique"],
    ),
    (
        "alias is another model's name",
        models(chat(gpus=[0]), {"name": "code", "aliases": ["chat"], "gpus": [1]}),
        ['models[1] ("code")', '"chat" is already the name of models[0] ("chat")'],
    ),
    (
        "alias is another model's alias",
        models(chat(aliases=["gpt"], gpus=[0]), {"name": "code", "aliases": ["gpt"], "gpus": [1]}),
        ['models[1] ("code")', '"gpt" is already an alias of models[0] ("chat")'],
    ),
    (
        "name == own alias",
        models(chat(aliases=["chat"])),
        ['models[0] ("chat")', '"chat" is already the name of models[0]'],
    ),
    # GPUs
    (
        "a GPU given to two models",
        models(chat(gpus=[0, 1]), {"name": "code", "gpus": [1]}),
        ['models[1] ("code").gpus', "GPU 1", 'models[0] ("chat")', "no GPU belongs to two"],
    ),
    (
        "gpus not a multiple of tp",
        models(chat(gpus=[0, 1, 2], tensor_parallel_size=2)),
        ['models[0] ("chat").gpus = [0, 1, 2]', "not a multiple of tensor_parallel_size = 2"],
    ),
    (
        "tp > 1 on cpu",
        models(chat(tensor_parallel_size=2), engine=CPU),
        ['models[0] ("chat").tensor_parallel_size = 2', 'engine.device = "cpu"', "cpu_engines"],
    ),
    (
        "gpus with device cpu",
        models(chat(gpus=[0]), engine=CPU),
        ['models[0] ("chat").gpus', 'engine.device = "cuda" or "auto"', "cpu_engines"],
    ),
    (
        "tp > 1 without gpus on cuda",
        models(chat(tensor_parallel_size=2), engine={"device": "cuda"}),
        ['models[0] ("chat").tensor_parallel_size = 2', "gpus"],
    ),
    (
        "tp out of range",
        models(chat(tensor_parallel_size=0)),
        ['models[0] ("chat").tensor_parallel_size = 0', "integer from 1"],
    ),
    (
        "cpu_engines out of range",
        models(chat(cpu_engines=0), engine=CPU),
        ['models[0] ("chat").cpu_engines = 0', "integer from 1"],
    ),
    ("gpus empty", models(chat(gpus=[])), ['models[0] ("chat").gpus = []', "non-empty list"]),
    (
        "gpus repeated",
        models(chat(gpus=[1, 1])),
        ['models[0] ("chat").gpus = [1, 1]', "distinct"],
    ),
    ("gpus negative", models(chat(gpus=[-1])), ['models[0] ("chat").gpus = [-1]', "0..63"]),
    ("gpus not ints", models(chat(gpus=["0"])), ['models[0] ("chat").gpus = ', "GPU indices"]),
    # the model and its task
    (
        "unknown packaged model",
        models(chat(model="packaged:llama-9000")),
        ['models[0] ("chat").model = "packaged:llama-9000"', "no such packaged model", EMBED],
    ),
    (
        "unknown packaged model in [engine]",
        {"engine": {"model": "packaged:llama-9000"}},
        ['engine.model = "packaged:llama-9000"', "no such packaged model", CHAT],
    ),
    (
        "task mismatch with a packaged model",
        models(chat(model=EMBED, task="generate")),
        ['models[0] ("chat").task = "generate"', EMBED, "embed"],
    ),
    (
        "task mismatch with the packaged chat model",
        models({"name": "emb", "task": "embed"}),
        ['models[0] ("emb").task = "embed"', CHAT, 'task = "generate"'],
    ),
    ("task unknown", models(chat(task="chat")), ['models[0] ("chat").task = "chat"', "generate"]),
    ("model not a string", models(chat(model=1)), ['models[0] ("chat").model = 1', "string"]),
    # overrides of [engine] keys
    (
        "override key that does not exist",
        models(chat(max_inflght=8)),
        ['models[0] ("chat").max_inflght: unknown key', "did you mean 'max_inflight'?"],
    ),
    (
        "a key of no kind at all",
        models(chat(colour="red")),
        ['models[0] ("chat").colour: unknown key', "allowed keys: name, aliases"],
    ),
    (
        "engine.python per model",
        models(chat(python="/usr/bin/python3")),
        ['models[0] ("chat").python', "cannot set for itself", "engine.python"],
    ),
    (
        "engine.device per model",
        models(chat(device="cpu")),
        ['models[0] ("chat").device', "cannot set for itself", "engine.device"],
    ),
    (
        "engine.port_base per model",
        models(chat(port_base=9000)),
        ['models[0] ("chat").port_base', "cannot set for itself"],
    ),
    (
        "engine.served_model_name per model",
        models(chat(served_model_name="x")),
        ['models[0] ("chat").served_model_name', "cannot set for itself"],
    ),
    (
        "override below its bound",
        models(chat(max_inflight=0)),
        ['models[0] ("chat").max_inflight = 0', "must be >= 1"],
    ),
    (
        "override above its bound",
        models(chat(gpu_memory_utilization=1.5)),
        ['models[0] ("chat").gpu_memory_utilization = 1.5', "<= 1"],
    ),
    (
        "override of the wrong type",
        models(chat(max_model_len="long")),
        ['models[0] ("chat").max_model_len = "long"', "integer"],
    ),
    (
        "override extra_args not strings",
        models(chat(extra_args=[1])),
        ['models[0] ("chat").extra_args = [1]'],
    ),
    (
        "override env reserved",
        models(chat(env={"CUDA_VISIBLE_DEVICES": "3"})),
        ['models[0] ("chat").env.CUDA_VISIBLE_DEVICES', "set by the supervisor"],
    ),
    (
        "override command without where to listen",
        models(chat(command=["{python}", "-m", "server"])),
        ['models[0] ("chat").command', "{uds}"],
    ),
    (
        "override command with an unknown placeholder",
        models(chat(command=["serve", "--uds", "{uds}", "{gpus}"])),
        ['models[0] ("chat").command[3] = "{gpus}"', "unknown placeholder"],
    ),
    # [engine] keys that [[models]] replaces
    (
        "engine.gpus with [[models]]",
        models(chat(gpus=[0]), engine={"gpus": [0]}),
        ["engine.gpus", "each model has its own `gpus`"],
    ),
    (
        "engine.served_model_name with [[models]]",
        models(chat(), engine={"served_model_name": "x"}),
        ["engine.served_model_name", "remove engine.served_model_name"],
    ),
    # fallback
    (
        "fallback unknown",
        models(chat(fallback="big")),
        ['models[0] ("chat").fallback = "big"', "no model has that name", "models: chat"],
    ),
    (
        "fallback to itself",
        models(chat(fallback="chat")),
        ['models[0] ("chat").fallback = "chat"', "cannot fall back to itself"],
    ),
    (
        "fallback to its own alias",
        models(chat(aliases=["gpt"], fallback="gpt")),
        ['models[0] ("chat").fallback = "gpt"', "cannot fall back to itself"],
    ),
    (
        "fallback to a model of another task",
        models(chat(fallback="emb"), {"name": "emb", "model": EMBED}, engine=CPU),
        ['models[0] ("chat").fallback = "emb"', "emb serves embed", "same job"],
    ),
    (
        "fallback not a string",
        models(chat(fallback=1)),
        ['models[0] ("chat").fallback = 1', "a model's name"],
    ),
    # speculative
    (
        "speculative not a table",
        models(chat(speculative="ngram")),
        ['models[0] ("chat").speculative = "ngram"', "must be a table"],
    ),
    (
        "speculative unknown method",
        models(chat(speculative={"method": "magic"})),
        ['models[0] ("chat").speculative.method = "magic"', "ngram", "*_mtp"],
    ),
    (
        "speculative missing method",
        models(chat(speculative={"num_speculative_tokens": 4})),
        ['models[0] ("chat").speculative.method = (missing)'],
    ),
    (
        "speculative negative count",
        models(chat(speculative={"method": "ngram", "num_speculative_tokens": -1})),
        ['models[0] ("chat").speculative.num_speculative_tokens = -1', "not be negative"],
    ),
    (
        "speculative negative number in a nested table",
        models(chat(speculative={"method": "ngram", "opts": {"a": [1, -2]}})),
        ['models[0] ("chat").speculative.opts.a[1] = -2', "not be negative"],
    ),
    (
        "speculative NaN",
        models(chat(speculative={"method": "ngram", "prompt_lookup_min": float("nan")})),
        ['models[0] ("chat").speculative.prompt_lookup_min = nan', "finite number"],
    ),
    (
        "speculative TOML date (no JSON for it)",
        models(chat(speculative={"method": "ngram", "when": datetime.date(1979, 5, 27)})),
        ['models[0] ("chat").speculative.when = ', "vLLM reads the table as JSON"],
    ),
    (
        "speculative unknown packaged draft",
        models(chat(speculative={"method": "draft_model", "model": "packaged:nope"})),
        ['models[0] ("chat").speculative.model = "packaged:nope"', "no such packaged"],
    ),
    (
        "embed model with speculative",
        models({"name": "emb", "model": EMBED, "speculative": {"method": "ngram"}}),
        ['models[0] ("emb").speculative', "generate models, not embeddings"],
    ),
    # the array itself
    ("models = []", {"models": []}, ["models = []", "at least one [[models]] table"]),
    ("[models] as a table", {"models": {"name": "chat"}}, ["models: must be an array of tables"]),
]


@pytest.mark.parametrize(("raw", "parts"), [(r, p) for _, r, p in BAD], ids=[i for i, _, _ in BAD])
def test_each_bad_model_config_is_one_problem_naming_the_key(
    raw: dict[str, Any], parts: list[str]
) -> None:
    problems = problems_of(raw)
    assert len(problems) == 1, problems
    for part in parts:
        assert part in problems[0], (part, problems[0])


def test_several_models_on_a_gpu_box_each_need_gpus() -> None:
    for device in ("cuda", "auto"):
        problems = problems_of(models(chat(gpus=[0]), {"name": "code"}, engine={"device": device}))
        assert problems == [
            'models[1] ("code").gpus: missing; with several models each needs its GPUs, '
            'e.g. gpus = [0] (or set engine.device = "cpu")'
        ]


def test_a_fallback_cycle_is_named_on_both_models() -> None:
    problems = problems_of(
        models(chat(fallback="code"), {"name": "code", "fallback": "chat"}, engine=CPU)
    )
    assert len(problems) == 2, problems
    assert problems[0].startswith('models[0] ("chat").fallback = "code": ')
    assert problems[1].startswith('models[1] ("code").fallback = "chat": ')
    assert all("cycle" in p for p in problems)


def test_every_problem_of_every_model_at_once() -> None:
    problems = problems_of(
        models(
            chat(gpus=[0], max_inflight=0),
            {"name": "chat", "gpus": [0], "colour": 1},
            {"gpus": [1, 2, 3], "tensor_parallel_size": 2},
        )
    )
    said = "\n".join(problems)
    for part in (
        'models[0] ("chat").max_inflight = 0',
        'models[1] ("chat").colour: unknown key',
        "models[2].name: missing",
        '"chat" is already the name of models[0]',
        'models[1] ("chat").gpus: GPU 0 is already given to models[0]',
        "not a multiple of tensor_parallel_size = 2",
    ):
        assert part in said, (part, said)


# ---------------------------------------------------------------------------------------
# Good: what is served
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "name", "model"),
    [
        ({}, "smollm2-135m-instruct", ""),
        ({"served_model_name": "assistant"}, "assistant", ""),
        ({"model": "/srv/models/Qwen2.5-0.5B-Instruct/"}, "qwen2.5-0.5b-instruct", None),
        ({"model": "/m/x", "served_model_name": "x1"}, "x1", None),
        ({"model": CHAT}, "smollm2-135m-instruct", None),
        ({"model": EMBED}, "all-minilm-l6-v2", None),
    ],
)
def test_without_models_engine_alone_is_one_model_named_as_before(
    engine: dict[str, Any], name: str, model: str | None
) -> None:
    cfg = parse_config({"engine": {**engine, "gpus": [0, 1]}})
    (served,) = cfg.served
    assert served.name == name
    assert served.model == (engine["model"] if model is None else model)
    assert served.aliases == ()
    assert served.gpus == (0, 1)
    assert served.tensor_parallel_size == 1
    assert (served.fallback, dict(served.speculative)) == ("", {})
    assert cfg.model(name) is served


def test_without_models_auto_gpus_means_every_gpu_and_the_engine_keys() -> None:
    cfg = parse_config({"engine": {"max_inflight": 7, "cpu_engines": 3}})
    (served,) = cfg.served
    assert served.gpus is None
    assert served.cpu_engines == 3
    assert served.engine == cfg.engine
    assert served.task == "generate"


def test_a_models_table_merges_its_overrides_over_engine() -> None:
    cfg = parse_config(
        models(
            chat(gpus=[0], max_inflight=8, extra_args=["--seed", "1"], env={"A": "1"}),
            {"name": "code", "gpus": [1], "model": "/models/coder"},
            engine={"max_inflight": 32, "max_model_len": 2048, "env": {"B": "2"}},
        )
    )
    a, b = cfg.engine_of("chat"), cfg.engine_of("code")
    assert (a.max_inflight, a.max_model_len, a.extra_args, a.env) == (
        8,
        2048,
        ["--seed", "1"],
        {"A": "1"},  # a model's env replaces engine.env, as its other keys do
    )
    assert (b.max_inflight, b.max_model_len, b.env) == (32, 2048, {"B": "2"})
    assert b == cfg.engine  # no overrides: [engine] exactly
    assert cfg.engine.max_inflight == 32  # [engine] itself is untouched
    assert served(cfg, "code").model == "/models/coder"
    assert served(cfg, "chat").model == ""  # engine.model's default


def test_a_table_takes_engine_model_and_cpu_engines_unless_it_sets_them() -> None:
    cfg = parse_config(
        models(
            chat(),
            {"name": "big", "cpu_engines": 2, "model": "/m/big"},
            engine={"device": "cpu", "cpu_engines": 3, "model": "/m/default"},
        )
    )
    chat_m, big = cfg.served
    assert (chat_m.model, chat_m.cpu_engines) == ("/m/default", 3)
    assert (big.model, big.cpu_engines) == ("/m/big", 2)


def test_engine_of_an_unknown_model_is_engine() -> None:
    cfg = parse_config(models(chat(max_inflight=3)))
    assert cfg.engine_of("nope") == cfg.engine
    assert cfg.engine_of("chat").max_inflight == 3


def test_task_defaults_from_the_packaged_model_else_generate() -> None:
    cfg = parse_config(
        models(
            {"name": "emb", "model": EMBED},
            {"name": "chat", "model": CHAT},
            {"name": "own", "model": "/m/e5", "task": "embed"},
            {"name": "plain", "model": "/m/x"},
            engine=CPU,
        )
    )
    assert [m.task for m in cfg.served] == ["embed", "generate", "embed", "generate"]


def test_one_table_without_gpus_takes_every_gpu() -> None:
    (served,) = parse_config(models(chat(), engine={"device": "cuda"})).served
    assert served.gpus is None


def test_the_packaged_embedding_model_gets_its_context() -> None:
    assert PACKAGED_CONTEXT == {"all-minilm-l6-v2": 256}
    cfg = parse_config(
        models(
            {"name": "emb", "model": EMBED},
            {"name": "emb2", "model": EMBED, "max_model_len": 128},
            {"name": "emb3", "model": EMBED, "max_model_len": 512},
            chat(),
            engine={"device": "cpu", "max_model_len": 8192},
        )
    )
    assert [m.engine.max_model_len for m in cfg.served] == [256, 128, 512, 8192]
    # [engine] alone: the same clamp, and a smaller engine.max_model_len stays.
    assert parse_config({"engine": {"model": EMBED}}).served[0].engine.max_model_len == 256
    small = parse_config({"engine": {"model": EMBED, "max_model_len": 64}})
    assert small.served[0].engine.max_model_len == 64


def test_aliases_resolve_to_their_model() -> None:
    cfg = parse_config(
        models(
            chat(aliases=["gpt-4o-mini", "default"], gpus=[0]),
            {"name": "emb", "aliases": ["text-embedding-3-small"], "model": EMBED, "gpus": [1]},
        )
    )
    chat_m, emb = cfg.served
    assert cfg.model("gpt-4o-mini") is chat_m
    assert cfg.model("default") is chat_m
    assert cfg.model("text-embedding-3-small") is emb
    assert cfg.model("GPT-4O-MINI") is None  # names are exact
    assert cfg.model("nope") is None
    assert chat_m.names == ("chat", "gpt-4o-mini", "default")


def test_good_keys_are_kept_as_written() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    (m,) = parse_config(
        models(
            chat(
                aliases=["a.b_c-1"],
                gpus=[2, 3],
                tensor_parallel_size=2,
                speculative=spec,
                task="generate",
            )
        )
    ).served
    assert (m.aliases, m.gpus, m.tensor_parallel_size, dict(m.speculative)) == (
        ("a.b_c-1",),
        (2, 3),
        2,
        spec,
    )


def test_a_fallback_of_the_same_task_is_allowed_by_name_or_alias() -> None:
    cfg = parse_config(
        models(
            chat(fallback="small"),
            {"name": "tiny", "aliases": ["small"]},
            engine=CPU,
        )
    )
    assert cfg.served[0].fallback == "small"


def test_mtp_speculative_methods_and_empty_speculative_are_allowed() -> None:
    cfg = parse_config(
        models(chat(speculative={"method": "deepseek_mtp", "num_speculative_tokens": 1}))
    )
    assert cfg.served[0].speculative["method"] == "deepseek_mtp"
    assert dict(parse_config(models(chat(speculative={}))).served[0].speculative) == {}


def test_summary_names_every_model() -> None:
    cfg = parse_config(
        models(
            chat(gpus=[0, 1], tensor_parallel_size=2),
            {"name": "emb", "model": EMBED, "gpus": [2]},
        )
    )
    line = cfg.summary()
    assert "model chat (generate): gpus=0,1 tp=2 model=packaged SmolLM2-135M-Instruct" in line
    assert f"model emb (embed): gpus=2 model={EMBED}" in line
    cpu = parse_config(models(chat(cpu_engines=2), engine=CPU)).summary()
    assert "model chat (generate): 2 cpu engine(s)" in cpu
    # Without [[models]] the line is what it was.
    assert "models:" not in parse_config({}).summary()


# ---------------------------------------------------------------------------------------
# Reload (SIGHUP): a model's own keys need a restart, overrides of live keys apply live
# ---------------------------------------------------------------------------------------


def reload(old: dict[str, Any], new: dict[str, Any]) -> tuple[Config, list[str], list[str]]:
    a, b = parse_config(old), parse_config(new)
    merged, live, restart = merge_live(a, b)
    assert sorted(changed_keys(a, b)) == sorted(live + restart)
    return merged, live, restart


TWO = [chat(gpus=[0], max_inflight=8), {"name": "code", "gpus": [1]}]


def test_reload_applies_a_models_live_override() -> None:
    new = [chat(gpus=[0], max_inflight=4), {"name": "code", "gpus": [1], "max_inflight": 2}]
    merged, live, restart = reload(models(*TWO), models(*new))
    assert sorted(live) == ["models.chat.max_inflight", "models.code.max_inflight"]
    assert restart == []
    assert merged.engine_of("chat").max_inflight == 4
    assert merged.engine_of("code").max_inflight == 2


def test_reload_drops_a_removed_live_override_back_to_engine() -> None:
    new = [chat(gpus=[0]), {"name": "code", "gpus": [1]}]
    engine = {"max_inflight": 40}
    merged, live, restart = reload(models(*TWO, engine=engine), models(*new, engine=engine))
    assert (live, restart) == (["models.chat.max_inflight"], [])
    assert merged.engine_of("chat").max_inflight == 40


def test_reload_of_a_models_engine_baked_override_needs_a_restart() -> None:
    new = [chat(gpus=[0], max_inflight=8, max_model_len=1024), {"name": "code", "gpus": [1]}]
    merged, live, restart = reload(models(*TWO), models(*new))
    assert (live, restart) == ([], ["models.chat.max_model_len"])
    assert merged.engine_of("chat").max_model_len == 4096


def test_reload_of_a_models_gpus_needs_a_restart_and_keeps_the_old() -> None:
    new = [chat(gpus=[1], max_inflight=3), {"name": "code", "gpus": [0]}]
    merged, live, restart = reload(models(*TWO), models(*new))
    assert sorted(restart) == ["models.chat.gpus", "models.code.gpus"]
    assert live == ["models.chat.max_inflight"]
    assert served(merged, "chat").gpus == (0,)
    assert merged.engine_of("chat").max_inflight == 3


@pytest.mark.parametrize(
    "new",
    [
        [chat(gpus=[0], max_inflight=8), {"name": "coder", "gpus": [1]}],  # renamed
        [*TWO, {"name": "emb", "gpus": [2], "model": EMBED}],  # added
        [TWO[0]],  # removed
        [TWO[1], TWO[0]],  # reordered: engine ids follow config order
    ],
    ids=["renamed", "added", "removed", "reordered"],
)
def test_reload_with_other_models_needs_a_restart(new: list[dict[str, Any]]) -> None:
    old = parse_config(models(*TWO))
    merged, live, restart = reload(models(*TWO), models(*new))
    assert (live, restart) == ([], ["models"])
    assert merged.served == old.served


def test_reload_from_engine_alone_to_models_needs_a_restart() -> None:
    _, live, restart = reload({"engine": {"gpus": [0]}}, models(chat(gpus=[0])))
    assert "models" in restart
    assert "engine.gpus" in restart
    assert live == []


def test_reload_engine_live_key_reaches_models_without_their_own() -> None:
    merged, live, restart = reload(
        models(*TWO, engine={"max_inflight": 16}), models(*TWO, engine={"max_inflight": 20})
    )
    assert (live, restart) == (["engine.max_inflight"], [])
    assert merged.engine_of("code").max_inflight == 20
    assert merged.engine_of("chat").max_inflight == 8  # its own override still wins


def test_reload_merged_config_is_the_new_one_when_all_is_live() -> None:
    new = models(chat(gpus=[0], max_inflight=5), {"name": "code", "gpus": [1]})
    merged, _, _ = reload(models(*TWO), new)
    assert merged.models == parse_config(new).models
    assert dataclasses.replace(merged, source="") == parse_config(new)
