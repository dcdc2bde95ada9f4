"""`models pull|list|remove` with the real huggingface_hub client against a local hub
(tests/fakes/fake_hub.py, HF_ENDPOINT): what is taken and what is not, progress, resume
after a dropped connection, a checksum mismatch refused with nothing left, a gated
repository without a token refused in words, a full disk refused before the first byte;
then the printed [[models]] lines, `models list` and `models remove`."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance import paths
from appliance.cli import main
from appliance.models_store import pull as pull_mod
from appliance.setup import ownership
from tests.fakes.fake_hub import FakeHub, FakeRepo, serve_hub, smollm_repo

pytest.importorskip("huggingface_hub")

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEIGHTS = bytes(range(256)) * 12_000  # 3 MB of "weights": enough to cut a download in two


def packaged_folder() -> Path:
    folder = paths.packaged_model(paths.appliance_home())
    if not (folder / "config.json").exists():
        pytest.skip("the packaged model is not prepared (scripts/setup)")
    return folder


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    source = packaged_folder()
    monkeypatch.setenv("LLM_APPLIANCE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_HUB_OFFLINE", "HF_TOKEN", "LLM_APPLIANCE_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    with serve_hub(FakeHub()) as h:
        h.add(smollm_repo(REPO, source, WEIGHTS))
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        yield h


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*argv, "--config", "/dev/null"])
    out, err = capsys.readouterr()
    return code, out, err


def store(tmp_path: Path) -> Path:
    return tmp_path / "home" / "models"


def test_pull_takes_what_vllm_needs_and_prints_the_lines(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "models", "pull", REPO)
    assert code == 0, err
    folder = store(tmp_path) / "smollm2-135m-instruct"
    assert out.splitlines() == [
        "[[models]]",
        'name = "smollm2-135m-instruct"',
        f'model = "{folder}"',
    ]
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    # Never pickles nor code unless asked; nothing of the client's resume state left.
    assert not (folder / "pytorch_model.bin").exists()
    assert not (folder / "modeling_custom.py").exists()
    assert not (folder / ".cache").exists()
    record = json.loads((folder / ".llm-appliance-pull.json").read_text())
    assert record["repo_id"] == REPO and record["files"]["model.safetensors"]["sha256"]
    # Progress: a line per file (the client's own bars show on a terminal); a summary.
    assert "model.safetensors: 2.9 MiB, checksum ok" in err
    assert "pulled HuggingFaceTB/SmolLM2-135M-Instruct@" in err
    # The folder is a model the check-config and fit checks take.
    code, _, _ = run(capsys, "models", "fit", str(folder), "--gpu-memory", "24GiB")
    assert code == 0
    # Again: everything is there and right, nothing is downloaded.
    before = len(hub.downloads)
    assert run(capsys, "models", "pull", REPO)[0] == 0
    assert len(hub.downloads) == before


def test_pull_resumes_a_file_whose_connection_dropped(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The client writes in 10 MiB chunks: a file of 24 MiB cut after 15 MiB has one
    # chunk on disk, and the rest is asked for with a Range.
    big = bytes(range(256)) * (96 * 1024)
    repo = hub.repos[REPO]
    repo.files["model.safetensors"] = big
    repo.drop_once["model.safetensors"] = 15 * 1024**2
    code, _, err = run(capsys, "models", "pull", REPO, "--name", "smol")
    assert code == 0, err
    assert (store(tmp_path) / "smol" / "model.safetensors").read_bytes() == big
    ranges = [r for _, f, r in hub.downloads if f == "model.safetensors"]
    assert ranges == ["", f"bytes={10 * 1024**2}-"]  # the rest only, not all again


def test_a_checksum_mismatch_is_refused_and_nothing_is_left(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.repos[REPO].corrupt.add("model.safetensors")
    code, out, err = run(capsys, "models", "pull", REPO)
    assert code == 1 and out == ""
    assert "model.safetensors: checksum mismatch (the hub says " in err
    assert "refused and removed" in err
    assert not (store(tmp_path) / "smollm2-135m-instruct").exists()


def test_a_gated_repository_needs_a_token_from_a_file(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.repos[REPO].gated_token = "hf_secret"
    code, out, err = run(capsys, "models", "pull", REPO)
    assert code == 1 and out == ""
    assert f"{REPO} is gated: it needs the token of an account that accepted its licence" in err
    assert "--token-file PATH" in err and "hf_secret" not in err
    assert hub.downloads == []
    token = tmp_path / "token"
    token.write_text("hf_secret\n")
    token.chmod(0o600)
    assert run(capsys, "models", "pull", REPO, "--token-file", str(token))[0] == 0


def test_a_full_disk_is_refused_before_the_first_byte(
    hub: FakeHub,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = shutil.disk_usage

    def almost_full(path: str) -> Any:
        return real(path)._replace(free=len(WEIGHTS))  # the weights, not the margin

    monkeypatch.setattr(pull_mod.shutil, "disk_usage", almost_full)
    code, _, err = run(capsys, "models", "pull", REPO)
    assert code == 1 and "not enough disk for the pull: 0.0 GiB to download and 0.5 GiB" in err
    assert hub.downloads == []


def test_pickles_and_code_only_when_asked(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(
        capsys, "models", "pull", REPO, "--allow-pickle", "--trust-remote-code", "--name", "all"
    )
    folder = store(tmp_path) / "all"
    assert code == 0
    assert (folder / "pytorch_model.bin").is_file() and (folder / "modeling_custom.py").is_file()
    assert 'extra_args = ["--trust-remote-code"]' in out
    # Weights only as pickles: refused without --allow-pickle.
    files = {k: v for k, v in hub.repos[REPO].files.items() if not k.endswith(".safetensors")}
    hub.add(FakeRepo("someone/pickled", files))
    code, _, err = run(capsys, "models", "pull", "someone/pickled")
    assert code == 1 and "its weights only as pickles (pytorch_model.bin)" in err


def test_list_and_remove(hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "models", "pull", REPO, "--name", "smol")[0] == 0
    code, out, _ = run(capsys, "models", "list", "--json")
    rows = {m["name"]: m for m in json.loads(out)}
    assert code == 0 and rows["smol"]["path"] == str(store(tmp_path) / "smol")
    assert rows["smol"]["bytes"] > len(WEIGHTS) and rows["smol"]["used_by"] == []
    assert rows["smol"]["source"].startswith(f"{REPO}@0123456789ab")
    # Named by the config: not removed.
    config = tmp_path / "c.toml"
    config.write_text(f'[[models]]\nname = "chat"\nmodel = "{store(tmp_path) / "smol"}"\n')
    capsys.readouterr()
    assert main(["models", "list", "--config", str(config)]) == 0
    assert "used by: chat" in capsys.readouterr().out
    assert main(["models", "remove", "smol", "--config", str(config)]) == 1
    assert "what the config's model(s) chat load" in capsys.readouterr().err
    assert (store(tmp_path) / "smol").is_dir()
    code, out, _ = run(capsys, "models", "remove", "smol")
    assert code == 0 and out.startswith(f"removed {store(tmp_path) / 'smol'}")
    assert not (store(tmp_path) / "smol").exists()
    assert run(capsys, "models", "remove", "smol")[0] == 1


# --- the store belongs to the service account, whoever pulls --------------------------------

SERVICE = (4242, 4343)  # the service account (uid, gid); no such account here


@pytest.fixture
def as_root_in_the_services_home(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[int, int]]:
    """`sudo llm-appliance models pull` into /var/lib/llm-appliance, which belongs to the
    service account, without root: this test's account plays root (what it makes is
    "root's"), the home is said to be the service account's, and every chown is recorded
    (path -> owner) instead of done."""
    monkeypatch.setattr(ownership, "ROOT", os.geteuid())
    monkeypatch.setattr(ownership, "home_owner", lambda home: SERVICE)
    given: dict[str, tuple[int, int]] = {}

    def fchown(fd: int, uid: int, gid: int) -> None:
        given[os.readlink(f"/proc/self/fd/{fd}")] = (uid, gid)

    def chown(name: str, uid: int, gid: int, *, dir_fd: int, follow_symlinks: bool) -> None:
        assert not follow_symlinks  # a link's own owner, never its target's
        given[os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)] = (uid, gid)

    monkeypatch.setattr(ownership.os, "fchown", fchown)
    monkeypatch.setattr(ownership.os, "chown", chown)
    return given


def entries(top: Path) -> set[str]:
    """``top`` and everything under it."""
    out = {str(top)}
    for root, dirs, files in os.walk(top):
        out |= {os.path.join(root, n) for n in (*dirs, *files)}
    return out


def test_a_pull_by_root_leaves_the_store_to_the_service_account(
    hub: FakeHub,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    as_root_in_the_services_home: dict[str, tuple[int, int]],
) -> None:
    code, _, err = run(capsys, "models", "pull", REPO, "--name", "smol")
    assert code == 0, err
    given = as_root_in_the_services_home
    # Every entry root made in the store, the store itself first made by this pull too.
    assert set(given) == entries(store(tmp_path)) and set(given.values()) == {SERVICE}
    assert f"{len(given)} entries of {store(tmp_path)} handed to 4242:4343, the owner of " in err


def test_a_pull_that_stops_half_way_leaves_its_files_to_the_service_account_too(
    hub: FakeHub,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    as_root_in_the_services_home: dict[str, tuple[int, int]],
) -> None:
    """The service account (or root again) resumes the pull: what root left is not root's."""
    real = pull_mod._download

    def second_file_fails(repo_id: str, commit: str, f: Any, folder: Path, token: Any) -> None:
        if any(folder.iterdir()):
            raise pull_mod.PullError(f"{f.name}: connection reset")
        real(repo_id, commit, f, folder, token)

    monkeypatch.setattr(pull_mod, "_download", second_file_fails)
    code, _, err = run(capsys, "models", "pull", REPO, "--name", "smol")
    assert code == 1 and "connection reset" in err
    made = entries(store(tmp_path))
    assert str(store(tmp_path) / "smol" / ".cache") in made  # the resume state is there
    assert set(as_root_in_the_services_home) == made


def test_without_root_nothing_changes_hands(
    hub: FakeHub,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not root (or root in its own home, as this test's home is when it runs as root):
    the files are already the account's that runs the daemon."""
    monkeypatch.setattr(ownership, "ROOT", os.geteuid() + 1)  # whoever runs this is not root
    monkeypatch.setattr(ownership, "home_owner", lambda home: SERVICE)
    code, _, err = run(capsys, "models", "pull", REPO)
    assert code == 0 and "handed to" not in err
