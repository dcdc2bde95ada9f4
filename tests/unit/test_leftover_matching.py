"""Which processes a new life of the supervisor takes for its previous life's leftovers.

The rule (``leftovers.is_leftover``) is a pure function of what a process shows (uid,
the appliance's variables in its environment, its command line, whether its supervisor
still runs) and who we are; these cases pin it down, the conservative side above all.
"""

from __future__ import annotations

import pytest

from appliance.engine import INSTANCE_ENV, SUPERVISOR_ENV, instance_id, lineage_env
from appliance.proctree import TAG_ENV
from appliance.supervisor.leftovers import Candidate, Ours, is_leftover

OURS = Ours(
    uid=1000,
    instance="0123456789abcdef",
    ports=frozenset({8100, 8101}),
    sockets=frozenset({"/run/llm-appliance/engine0.sock"}),
    models=frozenset({"smollm2-135m-instruct"}),
)
NEW = {TAG_ENV: "a1b2c3d4-0", INSTANCE_ENV: OURS.instance, SUPERVISOR_ENV: "4242@1700000000.00"}
OLD = {TAG_ENV: "a1b2c3d4-1"}
OLD_TCP_ARGV = (
    "python",
    "-m",
    "vllm",
    "--port",
    "8101",
    "--served-model-name",
    "smollm2-135m-instruct",
)
OLD_UDS_ARGV = (
    "python",
    "--uds=/run/llm-appliance/engine0.sock",
    "--served-model-name=smollm2-135m-instruct",
)


def cand(env: dict[str, str], argv: tuple[str, ...] = (), **kw: object) -> Candidate:
    fields: dict[str, object] = {"pid": 99, "uid": 1000, "env": env, "argv": argv}
    fields.update(kw)
    return Candidate(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("proc", "ours", "why"),
    [
        (cand(NEW), True, "this version, our instance, its supervisor gone"),
        (cand(NEW, OLD_TCP_ARGV), True, "the command line does not matter with an instance"),
        (cand(OLD, OLD_TCP_ARGV), True, "older version on our TCP port serving our model"),
        (cand(OLD, OLD_UDS_ARGV), True, "older version on our socket serving our model"),
    ],
)
def test_ours(proc: Candidate, ours: bool, why: str) -> None:
    assert is_leftover(proc, OURS) is ours, why


@pytest.mark.parametrize(
    ("proc", "why"),
    [
        (cand(NEW, uid=1001), "another user's, even with our instance"),
        (cand({**NEW, INSTANCE_ENV: "fedcba9876543210"}), "another appliance instance"),
        (cand({}), "no tag: not an engine of any appliance"),
        (cand({INSTANCE_ENV: OURS.instance}), "our instance but no engine tag"),
        (cand(NEW, supervised=True), "its supervisor still runs (a second serve, say)"),
        (cand(OLD, OLD_TCP_ARGV, supervised=True), "older version under a live supervisor"),
        (cand(OLD), "older version that names no address of ours"),
        (
            cand(OLD, ("python", "--port", "9999", "--served-model-name", "smollm2-135m-instruct")),
            "older version on another port",
        ),
        (
            cand(OLD, ("python", "--port", "8101", "--served-model-name", "other")),
            "older version on our port but serving another model",
        ),
        (
            cand(
                OLD,
                (
                    "python",
                    "--uds",
                    "/tmp/llm-appliance-x/engine0.sock",
                    "--served-model-name",
                    "smollm2-135m-instruct",
                ),
            ),
            "older version on a socket of the same name elsewhere",
        ),
        (cand({TAG_ENV: "not-an-old-tag"}, OLD_TCP_ARGV), "a tag of a form we never wrote"),
        (cand(OLD, OLD_TCP_ARGV, uid=0), "older version, another user"),
    ],
)
def test_not_ours(proc: Candidate, why: str) -> None:
    assert is_leftover(proc, OURS) is False, why


def test_instance_is_the_keys_files_path_whatever_spelling(tmp_path: object) -> None:
    # The same keys file named two ways is one appliance; another file is another one.
    assert instance_id("/var/lib/llm-appliance/keys.json") == instance_id(
        "/var/lib/llm-appliance/../llm-appliance/keys.json"
    )
    assert instance_id("/var/lib/llm-appliance/keys.json") != instance_id("/srv/b/keys.json")


def test_lineage_names_the_instance_and_the_supervisor_with_its_start() -> None:
    assert lineage_env("abc", 42, 1700000000.123) == {
        INSTANCE_ENV: "abc",
        SUPERVISOR_ENV: "42@1700000000.12",
    }
