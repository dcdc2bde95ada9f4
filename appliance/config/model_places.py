"""Every file the engines load that the config names: each model (``engine.model``, every
``[[models]]`` table's ``model``, each speculative draft ``model``), the engine python and
the caches the engines read back; where each is on disk, whether it is there and looks
like what it should be, and whether only trusted accounts could change it.

``check-config`` (:func:`check_engine_files`), ``doctor`` (one line per model) and the
daemon's start (:func:`trust_problems`) share these rules, so a config that check-config
passes does not stop ``serve`` for a model folder that is missing, and a model folder
another local account could rewrite is refused everywhere, as an adapter folder is
(:mod:`appliance.config.lora_trust`: vLLM runs what it loads, and a model's folder can
carry code and tokenizer files as much as weights).

Models are never downloaded at run time (``HF_HUB_OFFLINE=1``): a model id is looked up
in the local Hugging Face hub caches only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance import paths
from appliance.config.lora_trust import untrusted
from appliance.config.schema import Config, ServedModel
from appliance.config.words import label

# What makes a folder a model vLLM can load: Hugging Face's config.json, or Mistral's
# params.json; a single GGUF file is a model too.
MODEL_MARKERS = ("config.json", "params.json")
SETUP_HINT = "run `llm-appliance setup` (or `scripts/setup` in a checkout)"
# A Hugging Face repository id as a config names one ("gpt2", "Qwen/Qwen2.5-7B-Instruct"):
# only such a value is repeated in the hint's command, anything else stands as REPO_ID.
_REPO_ID_RE = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
_MODEL = "the model"


@dataclass(frozen=True)
class NamedModel:
    """One model the engines load, as the config names it."""

    key: str  # the key path to fix: engine.model, models[1] ("embed").model, ...
    value: str  # as written; "" is the packaged SmolLM2
    served: str  # the served model's name it belongs to
    draft: bool = False  # a speculative draft model


@dataclass(frozen=True)
class Located:
    """Where a named model is: ``path`` (None: not found) and ``problem`` (None: there
    and a model). ``unprepared``: a packaged model set-up has not prepared yet."""

    path: Path | None
    problem: str | None
    how: str  # "the packaged model", "(cached)", ... for a person
    unprepared: bool = False


def looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~"))


def repo_id_in(model: str) -> str | None:
    """``model`` when it reads as a Hugging Face repository id, else None."""
    return model if _REPO_ID_RE.fullmatch(model) and ".." not in model else None


def pull_command(model: str) -> str:
    """The command that puts ``model`` on this machine: ``llm-appliance models pull`` with
    the repository id when ``model`` reads as one, else with REPO_ID to fill in."""
    return f"`llm-appliance models pull {repo_id_in(model) or 'REPO_ID'}`"


def pull_hint(model: str) -> str:
    """How to get a model that is not here, for check-config's and doctor's lines: the
    pull downloads it into the model store and prints the [[models]] lines to paste."""
    it = "it" if repo_id_in(model) else "a Hugging Face model"
    return (
        f"{pull_command(model)} downloads {it} into the model store and prints the "
        "[[models]] lines to use"
    )


def pull_fix(model: str, key: str) -> str:
    """doctor's fix for a model that is not here (the daemon never downloads one)."""
    return (
        f"{pull_command(model)}, then set {key} to the folder it prints (models are never "
        "downloaded at run time)"
    )


def _uses(served: ServedModel, placeholder: str) -> bool:
    command = served.engine.command
    return not command or any("{" + placeholder + "}" in a for a in command)


def _table_key(config: Config, i: int, served: ServedModel) -> str:
    if not config.models:
        return "engine.model"
    table = config.models[i]
    return f"{label(i, served.name)}.model" if table.model is not None else "engine.model"


def named_models(config: Config) -> list[NamedModel]:
    """Each model some engine loads, in config order (a model whose own ``command`` does
    not use ``{model}`` loads nothing the appliance knows of; one named twice once)."""
    out: list[NamedModel] = []
    seen: set[tuple[str, str]] = set()
    for i, served in enumerate(config.served):
        if _uses(served, "model"):
            key = _table_key(config, i, served)
            if (key, served.model) not in seen:
                seen.add((key, served.model))
                out.append(NamedModel(key, served.model, served.name))
        draft = served.speculative.get("model")
        if isinstance(draft, str) and draft:
            key = f"{label(i, served.name)}.speculative.model"
            out.append(NamedModel(key, draft, served.name, draft=True))
    return out


def hf_cache_dirs(env: Mapping[str, str]) -> list[Path]:
    """Where a model id may already be cached (never downloaded: HF_HUB_OFFLINE=1)."""
    dirs = []
    if env.get("HF_HUB_CACHE"):
        dirs.append(Path(env["HF_HUB_CACHE"]))
    if env.get("HF_HOME"):
        dirs.append(Path(env["HF_HOME"]) / "hub")
    if env.get("XDG_CACHE_HOME"):
        dirs.append(Path(env["XDG_CACHE_HOME"]) / "huggingface" / "hub")
    # The unit's XDG_CACHE_HOME, and the usual default.
    dirs.append(Path("/var/cache/llm-appliance/huggingface/hub"))
    dirs.append(Path(env.get("HOME", "/")) / ".cache" / "huggingface" / "hub")
    return list(dict.fromkeys(dirs))


def find_cached_model(model_id: str, caches: Sequence[Path]) -> Path | None:
    """The snapshot folder of ``model_id`` in a Hugging Face hub cache, if any."""
    folder = "models--" + model_id.replace("/", "--")
    for cache in caches:
        snapshots = cache / folder / "snapshots"
        ref = cache / folder / "refs" / "main"
        try:
            if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
                return snapshots / ref.read_text().strip()
            found = sorted(p for p in snapshots.iterdir() if p.is_dir())
        except OSError:
            continue
        if found:
            return found[-1]
    return None


def not_a_model(path: Path) -> str | None:
    """Why ``path`` (which exists) is not something vLLM loads as a model, or None."""
    if path.is_file():
        return None if path.suffix == ".gguf" else f"{path} is a file, not a model folder"
    if not any((path / f).is_file() for f in MODEL_MARKERS):
        return f"{path} has no config.json (not a Hugging Face model folder)"
    return None


def locate(model: str, home: Path, env: Mapping[str, str]) -> Located:
    """Where ``model`` (as a config writes it) is on this machine, and what is wrong."""
    packaged = paths.packaged_name(model)
    if not model or packaged is not None:
        name = packaged or paths.PACKAGED_MODEL_NAME
        folder = paths.packaged_model(home, name)
        how = f"packaged:{name}" if model else "the packaged model"
        if not (folder / "config.json").exists():
            problem = f"{how} is not prepared (expected {folder}/config.json): {SETUP_HINT}"
            return Located(folder, problem, how, unprepared=True)
        return Located(folder, None, how)
    if looks_like_path(model):
        path = Path(model).expanduser()
        if not path.exists():
            home_of = _setup_home_of(path)
            if home_of is not None:
                # What set-up makes in an engine home of its own (the Ansible role writes
                # this path, and check-configs it, before set-up runs there).
                problem = (
                    f"{path} is not prepared yet: `llm-appliance setup --home {home_of}` makes it"
                )
                return Located(path, problem, "folder", unprepared=True)
            problem = (
                f"{path}: no such folder (models are never downloaded at run time; "
                f"{pull_hint(model)}, or copy the model's folder there)"
            )
            return Located(path, problem, "folder")
        return Located(path, not_a_model(path), "folder")
    caches = hf_cache_dirs(env)
    cached = find_cached_model(model, caches)
    if cached is None:
        where = ", ".join(str(c) for c in caches)
        problem = (
            f"not in the local Hugging Face cache ({where}); models are never downloaded at "
            f"run time: {pull_hint(model)}, or name a local folder"
        )
        return Located(None, problem, "model id")
    return Located(cached, not_a_model(cached), "cached")


def _setup_home_of(path: Path) -> Path | None:
    """The home whose set-up puts a packaged model at ``path``, or None."""
    for packaged in paths.PACKAGED_MODELS.values():
        parts = packaged.folder.parts
        if path.parts[-len(parts) :] == parts:
            return Path(*path.parts[: -len(parts)])
    return None


def engine_env(config: Config, env: Mapping[str, str]) -> dict[str, str]:
    """The environment the engines see, as far as where they find models and caches."""
    return {**env, **config.engine.env}


def cache_problems(env: Mapping[str, str]) -> list[str]:
    """Each engine cache another local account could change (``env``: the engines')."""
    out = []
    for name, folder in cache_dirs(env):
        problem = _trust(folder, "what the engines read back from their cache")
        if problem is not None:
            out.append(f"the engines' cache {name} ({folder}): {problem}")
    return out


def cache_dirs(env: Mapping[str, str]) -> list[tuple[str, Path]]:
    """(how it is named, folder) of the caches an engine reads back (compiled kernels and
    graphs, hub files), where they exist: what is in them runs in the engine."""
    named: list[tuple[str, Path]] = []
    if env.get("XDG_CACHE_HOME"):
        named.append(("$XDG_CACHE_HOME", Path(env["XDG_CACHE_HOME"])))
    elif env.get("HOME"):
        named.append(("~/.cache", Path(env["HOME"]) / ".cache"))
    for var in ("VLLM_CACHE_ROOT", "HF_HOME", "HF_HUB_CACHE", "TRITON_CACHE_DIR"):
        if env.get(var):
            named.append((f"${var}", Path(env[var])))
    return [(n, p) for n, p in named if p.is_absolute() and _exists(p) and p.is_dir()]


def python_needed(config: Config) -> bool:
    return any(_uses(m, "python") for m in config.served)


def _trust(path: Path, what: str) -> str | None:
    try:
        return untrusted(str(path.absolute()), what=what)
    except OSError as exc:
        return f"{path} cannot be looked at ({exc.strerror or exc})"


def model_trust_problem(located: Located) -> str | None:
    """Why another account could change a located model, or None."""
    if located.path is None or located.problem is not None:
        return None
    return _trust(located.path, _MODEL)


def trust_problems(config: Config, home: Path, env: Mapping[str, str]) -> list[str]:
    """Each model, the engine python and the caches another local account could change,
    one sentence each naming the key and the fix (what the daemon refuses at start)."""
    out: list[str] = []
    eenv = engine_env(config, env)
    for named in named_models(config):
        try:
            located = locate(named.value, home, eenv)
        except OSError:
            continue  # cannot be looked at by this user: check-config says so
        problem = model_trust_problem(located)
        if problem is not None:
            out.append(f"{named.key} = {named.value!r}: {problem}")
    if python_needed(config):
        python = Path(config.engine.python or paths.engine_python(home))
        if _exists(python):
            problem = python_trust_problem(python)
            if problem is not None:
                key = "engine.python" if config.engine.python else "the engine venv"
                out.append(f"{key} = {str(python)!r}: {problem}")
    return out + cache_problems(eenv)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:
        return False


def python_trust_problem(python: Path) -> str | None:
    """The python itself and, in a venv, the venv's folder with its entries (whoever can
    write its site-packages runs code in every engine)."""
    what = "the engine python"
    problem = _trust(python, what)
    venv = python.parent.parent
    if problem is None and (venv / "pyvenv.cfg").is_file():
        problem = _trust(venv, what)
    return problem


def check_engine_files(
    config: Config, home: Path, env: Mapping[str, str]
) -> tuple[list[str], list[str]]:
    """check-config's look at every model the config names, the engine python and the
    caches: (problems, warnings). A packaged model not prepared yet is a warning (set-up
    prepares the ones a config names, after the config is written: the Ansible role
    does), as is a path this user may not look at (the daemon runs as the service user)."""
    problems: list[str] = []
    warnings: list[str] = []
    eenv = engine_env(config, env)
    for named in named_models(config):
        try:
            located = locate(named.value, home, eenv)
        except PermissionError as exc:
            warnings.append(f"{named.key} = {named.value!r}: cannot check it as this user ({exc})")
            continue
        if located.problem is not None:
            line = f"{named.key} = {named.value!r}: {located.problem}"
            (warnings if located.unprepared else problems).append(line)
    python = config.engine.python
    if python_needed(config) and python and not _exists(Path(python)):
        # A warning, not a refusal: the Ansible role writes (and check-configs) the
        # config before set-up makes the venv in its own engine home, where this path
        # points. serve and doctor still refuse a python that is not there.
        warnings.append(
            f"engine.python = {python!r} does not exist (yet): fix the path, or make "
            f"that venv with `llm-appliance setup --home DIR`; serve will not start "
            "without it"
        )
    elif python_needed(config) and not python and not _exists(paths.engine_python(home)):
        warnings.append(
            f"the engine venv ({paths.engine_python(home)}) is not made yet: {SETUP_HINT}"
        )
    problems += trust_problems(config, home, env)
    return problems, warnings
