"""`llm-appliance status` with several models: engines grouped under a line per model that
says whether it is ready, each engine's GPUs, and a daemon older than models still read."""

from __future__ import annotations

from typing import Any

from appliance.status import render_table


def engine(
    id: int, state: str = "READY", *, model: str | None = None, gpus: list[int] | None = None
) -> dict[str, Any]:
    e: dict[str, Any] = {
        "id": id,
        "gpu": gpus[0] if gpus else None,
        "port": None,
        "state": state,
        "inflight": 0,
        "throttle_level": 0,
        "temperature_c": None,
        "kv_cache_usage": None,
        "restarts": 0,
        "last_restart_reason": None,
    }
    if model is not None:
        e["model"] = model
    if gpus is not None:
        e["gpus"] = gpus
    return e


def doc(*engines: dict[str, Any]) -> dict[str, Any]:
    return {
        "version": "test",
        "device": "cuda",
        "uptime_s": 5.0,
        "accepting": True,
        "ready": True,
        "queue_depth": 0,
        "engines": list(engines),
        "gpus": [],
    }


def cells(table: str, engine_id: int) -> list[str]:
    """The cells of an engine's row (ids are the rows' first cell)."""
    rows = [line.split() for line in table.splitlines() if line.split()[:1] == [str(engine_id)]]
    assert len(rows) == 1, table
    return rows[0]


def test_each_model_has_a_heading_saying_ready_or_down_above_its_engines() -> None:
    table = render_table(
        doc(
            engine(0, model="chat", gpus=[0]),
            engine(1, "STARTING", model="chat", gpus=[1]),
            engine(2, "FAILED", model="embed", gpus=[2]),
        )
    )
    lines = table.splitlines()
    chat = lines.index("model chat: ready, 1/2 engines READY")
    embed = lines.index("model embed: DOWN, 0/1 engines READY")
    assert chat < embed
    # Each engine's row sits in its own model's block.
    block_of = {
        n: ("chat" if chat < i < embed else "embed" if i > embed else None)
        for i, line in enumerate(lines)
        for n in (0, 1, 2)
        if line.split()[:1] == [str(n)]
    }
    assert block_of == {0: "chat", 1: "chat", 2: "embed"}
    assert lines[chat + 1].split()[:2] == ["ENGINE", "GPU"]


def test_a_tensor_parallel_engine_lists_all_its_gpus() -> None:
    table = render_table(
        doc(engine(0, model="big", gpus=[0, 1]), engine(1, model="embed", gpus=[2]))
    )
    assert cells(table, 0)[:3] == ["0", "0,1", "-"]
    assert cells(table, 1)[:3] == ["1", "2", "-"]


def test_columns_line_up_across_the_models_blocks() -> None:
    table = render_table(
        doc(engine(0, model="big", gpus=[0, 1, 2, 3]), engine(1, model="embed", gpus=[4]))
    )
    headers = [line for line in table.splitlines() if line.startswith("ENGINE")]
    assert len(headers) == 2 and headers[0] == headers[1]
    rows = [line for line in table.splitlines() if line[:1].isdigit()]
    assert rows[0].index("READY") == rows[1].index("READY") == headers[0].index("STATE")


def test_one_model_is_one_table_without_a_heading() -> None:
    table = render_table(doc(engine(0, model="chat", gpus=[0]), engine(1, model="chat", gpus=[1])))
    assert "model " not in table
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["ENGINE", "0", "1"]


def test_a_daemon_older_than_models_is_read_from_gpu_alone() -> None:
    """No "model", no "gpus": one table, the GPU column from "gpu"; the CPU's is "-"."""
    old = engine(0)
    old["gpu"] = 1
    table = render_table(doc(old, engine(1)))
    assert "model " not in table
    assert cells(table, 0)[:2] == ["0", "1"]
    assert cells(table, 1)[:2] == ["1", "-"]


def test_models_on_demand_are_listed_with_their_state_and_last_use() -> None:
    d = doc(engine(0, model="chat"), engine(1, model="coder", state="EXITED"))
    d["models"] = [
        {"name": "chat", "load": "always", "state": "loaded", "last_used": None},
        {"name": "coder", "load": "on_demand", "state": "unloaded", "last_used": 0.0},
        {
            "name": "long",
            "load": "on_demand",
            "state": "loaded",
            "last_used": None,
            "detail": "draining",
        },
    ]
    lines = render_table(d).splitlines()
    at = lines.index("MODEL                LOAD       STATE      LAST USED")
    assert lines[at + 1].split() == ["chat", "always", "loaded", "-"]
    assert lines[at + 2].split()[:3] == ["coder", "on_demand", "unloaded"]
    assert lines[at + 2].endswith("s ago")
    assert lines[at + 3].split()[:4] == ["long", "on_demand", "loaded", "(draining)"]


def test_without_on_demand_models_there_is_no_models_table() -> None:
    d = doc(engine(0, model="chat"))
    d["models"] = [{"name": "chat", "load": "always", "state": "loaded", "last_used": None}]
    assert "MODEL " not in render_table(d)


def test_a_model_that_trusts_remote_code_is_marked() -> None:
    """A model served with --trust-remote-code (issue 36: `models pull --trust-remote-code`
    writes it into its extra_args) runs its repository's Python: status says so, one
    model or several, on demand or not; the others get no line."""
    note = (
        "model coder: trusts remote code (--trust-remote-code): its engines run the Python "
        "code that came with the model"
    )
    one = doc(engine(0, model="coder"))
    one["models"] = [
        {"name": "coder", "load": "always", "state": "loaded", "trust_remote_code": True}
    ]
    assert note in render_table(one).splitlines()
    two = doc(engine(0, model="chat"), engine(1, model="coder"))
    two["models"] = [
        {"name": "chat", "load": "always", "state": "loaded", "trust_remote_code": False},
        {"name": "coder", "load": "on_demand", "state": "unloaded", "trust_remote_code": True},
    ]
    table = render_table(two)
    assert note in table.splitlines()
    assert "model chat: trusts" not in table
    assert "remote code" not in render_table(doc(engine(0, model="chat")))


def test_the_verdict_is_readyz_s_own_a_model_put_away_is_not_down() -> None:
    """With ``readiness`` (/readyz's verdict, issue 33): each model's word is /readyz's,
    and a box that admits nothing says why, engine by engine."""
    d = doc(engine(0, model="chat"), engine(1, "EXITED", model="embed"))
    d["readiness"] = {
        "status": "ready",
        "models": {"chat": "ready", "embed": "unloaded"},
        "reasons": {},
    }
    lines = render_table(d).splitlines()
    assert "model embed: unloaded (put away, its next request loads it), 0/1 engines READY" in (
        lines
    )
    hot = doc(engine(0, model="chat"), engine(1, model="chat"))
    hot["ready"] = False
    hot["readiness"] = {
        "status": "not admitting",
        "models": {"chat": "down"},
        "reasons": {"1": "draining", "0": "throttled by heat (GPU at the hard limit)"},
    }
    lines = render_table(hot).splitlines()
    assert lines[0].startswith("llm-appliance test on cuda: NOT READY (not admitting), queue 0")
    assert lines[1:3] == [
        "engine 0: throttled by heat (GPU at the hard limit)",
        "engine 1: draining",
    ]


def test_the_keys_holding_the_box_are_listed_most_first() -> None:
    d = doc(engine(0, model="chat"))
    d["keys_inflight"] = [
        {"id": "k-eval", "name": "nightly eval", "inflight": 12},
        {"id": "k-alice", "name": None, "inflight": 1},
    ]
    lines = render_table(d).splitlines()
    head = lines.index("KEY                  NAME                 INFLIGHT")
    assert lines[head + 1].split() == ["k-eval", "nightly", "eval", "12"]
    assert lines[head + 2].split() == ["k-alice", "-", "1"]


def test_no_key_table_while_nothing_is_in_flight() -> None:
    d = doc(engine(0, model="chat"))
    d["keys_inflight"] = []
    assert not any(line.startswith("KEY ") for line in render_table(d).splitlines())
