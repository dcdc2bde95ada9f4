"""LoRA adapters against another local account (issue 23 review): a folder that account
could change between the appliance's check and vLLM's load is refused, with a sentence
naming the path and the fix; and what an engine is given never lets a client's ``model``
name a folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from appliance.config import parse_config
from appliance.config.host import LocalHost
from appliance.config.lora import AdapterError, UnsafeAdapter, adapter_rank, with_lora
from appliance.config.lora_trust import trusted_owners, untrusted
from appliance.errors import ConfigError
from tests.fakes.lora_files import fake_adapter

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making files of another account")
OTHER_UID = 54321  # no account on the box: shown as "uid 54321"


def _private(tmp: Path) -> Path:
    """A folder only this account can change (pytest's tmp_path may be group-writable)."""
    base = tmp / "private"
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    return base


def test_a_folder_only_trusted_accounts_can_change_is_an_adapter(tmp_path: Path) -> None:
    folder = fake_adapter(_private(tmp_path) / "sql")
    assert untrusted(str(folder)) is None
    assert adapter_rank(str(folder)) == 8
    assert {0, os.geteuid()} <= trusted_owners()


@pytest.mark.parametrize(
    ("what", "mode", "who"),
    [
        ("folder", 0o777, "every account"),
        ("folder", 0o775, "the group"),
        ("folder", 0o1777, "every account"),  # sticky: anyone may still add a weights file
        ("weights", 0o666, "every account"),
        ("config", 0o664, "the group"),
        ("parent", 0o777, "every account"),
    ],
)
def test_a_folder_writable_by_others_is_refused_naming_the_path_and_the_fix(
    tmp_path: Path, what: str, mode: int, who: str
) -> None:
    folder = fake_adapter(_private(tmp_path) / "sql")
    target = {
        "folder": folder,
        "weights": folder / "adapter_model.safetensors",
        "config": folder / "adapter_config.json",
        "parent": folder.parent,
    }[what]
    os.chmod(target, mode)
    with pytest.raises(UnsafeAdapter) as caught:
        adapter_rank(str(folder))
    said = str(caught.value)
    assert f"{target} is writable by {who}" in said
    assert f"chmod go-w {target}" in said
    assert "between the appliance's check and the engine's load" in said


def test_a_sticky_directory_on_the_way_is_fine(tmp_path: Path) -> None:
    # /tmp-like: writable by all, but nobody renames what is not theirs.
    shared = _private(tmp_path) / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    assert adapter_rank(str(fake_adapter(shared / "sql"))) == 8


@as_root
@pytest.mark.parametrize("what", ["folder", "weights", "parent"])
def test_a_folder_another_account_owns_is_refused(tmp_path: Path, what: str) -> None:
    folder = fake_adapter(_private(tmp_path) / "sql")
    target = {
        "folder": folder,
        "weights": folder / "adapter_model.safetensors",
        "parent": folder.parent,
    }[what]
    os.chown(target, OTHER_UID, -1)
    with pytest.raises(UnsafeAdapter, match=f"{target} belongs to uid {OTHER_UID}, who could"):
        adapter_rank(str(folder))


@as_root
def test_a_symlink_another_account_planted_is_refused(tmp_path: Path) -> None:
    base = _private(tmp_path)
    real = fake_adapter(base / "real")
    # Their own folder, world-readable: they may point the link anywhere at any time.
    theirs = base / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, -1)
    (theirs / "sql").symlink_to(real)
    with pytest.raises(UnsafeAdapter, match=f"{theirs} belongs to uid {OTHER_UID}"):
        adapter_rank(str(theirs / "sql"))
    # A link in a trusted folder is followed, and where it leads is judged too.
    (base / "link").symlink_to(real)
    assert adapter_rank(str(base / "link")) == 8
    os.chmod(real, 0o777)
    with pytest.raises(UnsafeAdapter, match=f"{real} is writable"):
        adapter_rank(str(base / "link"))


def test_a_link_inside_the_folder_is_judged_where_it_leads(tmp_path: Path) -> None:
    base = _private(tmp_path)
    folder = fake_adapter(base / "sql")
    blobs = base / "blobs"  # as a Hugging Face cache links snapshots to blobs
    blobs.mkdir()
    weights = folder / "adapter_model.safetensors"
    weights.rename(blobs / "w")
    weights.symlink_to("../blobs/w")
    assert adapter_rank(str(folder)) == 8
    os.chmod(blobs / "w", 0o666)
    with pytest.raises(UnsafeAdapter, match=f"{blobs / 'w'} is writable by every account"):
        adapter_rank(str(folder))


def test_check_config_names_an_unsafe_adapter_folder(tmp_path: Path) -> None:
    folder = fake_adapter(_private(tmp_path) / "sql")
    os.chmod(folder, 0o777)
    table = {"name": "chat", "adapters": [{"name": "sql", "path": str(folder)}]}
    with pytest.raises(ConfigError, match=rf"adapters\[0\]\.path = .*{folder} is writable"):
        parse_config({"engine": {"device": "cpu"}, "models": [table]}, host=LocalHost())


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/tmp/a\0b", "no NUL"),
        ("/" + "a" * 5000, "at most 4096 characters"),
    ],
)
def test_a_path_no_folder_can_have_is_refused_not_raised(path: str, error: str) -> None:
    with pytest.raises(AdapterError, match=error):
        adapter_rank(path)


def test_a_rank_pattern_that_is_not_an_object_is_named(tmp_path: Path) -> None:
    folder = fake_adapter(_private(tmp_path) / "sql", rank_pattern=[64])
    with pytest.raises(AdapterError, match="rank_pattern must be a JSON object"):
        adapter_rank(str(folder))


def _chat(tmp: Path, folders: dict[str, Path]) -> Any:
    adapters = [{"name": n, "path": str(p)} for n, p in folders.items()]
    table = {"name": "chat", "adapters": adapters}
    return parse_config({"engine": {"device": "cpu"}, "models": [table]}).served[0]


def test_an_adapter_path_with_a_comma_reaches_vllm_whole(tmp_path: Path) -> None:
    folder = fake_adapter(_private(tmp_path) / "sql,v2")
    argv, _ = with_lora(_chat(tmp_path, {"sql": folder}), ("vllm",), {})
    module = argv[argv.index("--lora-modules") + 1]
    # vLLM reads name=path as JSON when the path has a comma, and fails to start.
    assert json.loads(module) == {"name": "sql", "path": str(folder)}


def test_an_adapter_that_fails_the_checks_is_not_put_on_the_engines_command_line(
    tmp_path: Path,
) -> None:
    # vLLM stops at start when one of its --lora-modules cannot load: the engine would
    # never come up. Left off, the runner refuses it in the journal and the engine serves.
    good = fake_adapter(_private(tmp_path) / "good")
    bad = fake_adapter(tmp_path / "private" / "bad")
    served = _chat(tmp_path, {"good": good, "bad": bad})
    os.chmod(bad, 0o777)  # after check-config: the folder changed before a start
    argv, rank = with_lora(served, ("vllm",), {})
    modules = [json.loads(a)["name"] for a in argv if a.startswith("{")]
    assert (modules, rank) == (["good"], 8)


def test_no_lora_resolver_reaches_an_engine_that_serves_adapters(tmp_path: Path) -> None:
    folder = fake_adapter(_private(tmp_path) / "sql")
    env = {
        "VLLM_LORA_RESOLVER_CACHE_DIR": str(tmp_path),
        "VLLM_LORA_RESOLVER_HF_REPO_LIST": "someone/loras",
        "HOME": "/root",
    }
    _, rank = with_lora(_chat(tmp_path, {"sql": folder}), ("vllm",), env)
    assert rank == 8
    assert env == {"HOME": "/root", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
