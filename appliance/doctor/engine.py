"""The engine side: its venv imports vLLM, its model is there and fits, and its sockets or
ports are the engines' own.

This module holds the two checks that judge paths against the systemd unit (which hides
:data:`HIDDEN_BY_UNIT`): the engine venv and the model. Their parts live beside it and
are re-exported here: :mod:`~appliance.doctor.venv_probe` (running the engine python on
a tiny script), :mod:`~appliance.doctor.model_files` (finding and reading the model on
disk) and :mod:`~appliance.doctor.engine_sockets` (the sockets' directory, the ports).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config import Config
from appliance.config.model_places import (
    Located,
    NamedModel,
    cache_dirs,
    cache_problems,
    engine_env,
    model_trust_problem,
    named_models,
    pull_fix,
    python_trust_problem,
)
from appliance.doctor.engine_sockets import (
    RUNTIME_DIR_ENV,
    UNIT_RUNTIME_DIR,
    check_ports,
    check_socket_dir,
    runtime_dir,
)
from appliance.doctor.model_files import (
    WEIGHT_SUFFIXES,
    find_cached_model,
    hf_cache_dirs,
    locate_model,
    may,
    model_size,
    unreadable,
)
from appliance.doctor.result import Account, Result, fail, gib, na, ok
from appliance.doctor.venv_probe import (
    ENGINE_PROBE_TIMEOUT_S,
    MARKER,
    PROBE,
    Run,
    VenvProbe,
    probe_venv,
    vllm_build,
)
from appliance.fit.check import GpuMemory, Settings, judge
from appliance.fit.check import summary as fit_summary
from appliance.fit.sources import FitSourceError, model_files

__all__ = [
    "ENGINE_PROBE_TIMEOUT_S",
    "HIDDEN_BY_UNIT",
    "MARKER",
    "PROBE",
    "RUNTIME_DIR_ENV",
    "UNIT_RUNTIME_DIR",
    "WEIGHT_SUFFIXES",
    "Run",
    "VenvProbe",
    "check_caches",
    "check_engine_venv",
    "check_model",
    "check_models",
    "check_ports",
    "check_socket_dir",
    "find_cached_model",
    "hf_cache_dirs",
    "locate_model",
    "may",
    "model_size",
    "probe_venv",
    "runtime_dir",
    "setup_fix",
    "unreadable",
    "vllm_build",
]

# Where engine.python and engine.model may not point under the unit (ProtectHome=yes).
HIDDEN_BY_UNIT = ("/home", "/root", "/run/user")


def setup_fix(device: str) -> str:
    return (
        f"run `llm-appliance setup --device {device}` as the service user "
        "(or re-run the Ansible role; `scripts/setup` in a checkout)"
    )


def _uses(config: Config, placeholder: str) -> bool:
    e = config.engine
    return not e.command or any("{" + placeholder + "}" in a for a in e.command)


def _hidden(path: str) -> str | None:
    for top in HIDDEN_BY_UNIT:
        if path == top or path.startswith(top + "/"):
            return top
    return None


# --- the engine venv ---------------------------------------------------------------------


def check_engine_venv(
    config: Config,
    home: Path,
    *,
    device: str,
    probe: Callable[[str], VenvProbe],
    under_unit: bool = False,
) -> Result:
    """The engine venv exists and imports vLLM, built for ``device`` ("cuda" or "cpu").
    ``under_unit``: the systemd unit runs the daemon, so paths it hides cannot work."""
    e = config.engine
    if not _uses(config, "python"):
        return na("engine venv", "engine.command does not use {python}")
    python = e.python or str(paths.engine_python(home))
    where = f"engine.python = {e.python!r}" if e.python else f"the engine venv ({python})"
    fix = (
        setup_fix(device)
        if not e.python
        else 'fix engine.python, or set it to "" and ' + (setup_fix(device))
    )
    if not Path(python).exists():
        return fail("engine venv", f"{where} does not exist", fix, python=python)
    top = _hidden(str(Path(python).absolute()))
    if under_unit and top is not None:
        return fail(
            "engine venv",
            f"{where} is under {top}, which the unit hides (ProtectHome=yes)",
            "make the engine venv elsewhere (`llm-appliance setup --home /var/lib/llm-appliance`)"
            " and point engine.python there, or leave it empty",
            python=python,
        )
    unsafe = python_trust_problem(Path(python))
    if unsafe is not None:
        return fail("engine venv", f"{where}: {unsafe}", unsafe.rsplit("; ", 1)[-1], python=python)
    return _judge_venv_answer(python, probe(python), device, fix)


def check_caches(config: Config, env: Mapping[str, str]) -> Result:
    """The caches the engines read back (compiled graphs and kernels, hub files): only
    trusted accounts may change them, as for the models (what is in them runs)."""
    eenv = engine_env(config, env)
    found = cache_dirs(eenv)
    if not found:
        return na("caches", "no engine cache yet (the engines make them as they start)")
    problems = cache_problems(eenv)
    if problems:
        return fail("caches", "\n".join(problems), problems[0].rsplit("; ", 1)[-1])
    return ok("caches", ", ".join(f"{n} ({p})" for n, p in found))


def _judge_venv_answer(python: str, answer: VenvProbe, device: str, fix: str) -> Result:
    """The line for what the engine python said: no answer, no vLLM, or the build."""
    if answer.answer is None:
        return fail(
            "engine venv",
            f"{python} could not answer: {answer.problem}",
            f"run `{python} -c 'import vllm'` to see why; then {fix}",
            python=python,
        )
    a = answer.answer
    if "error" in a:
        return fail("engine venv", f"{python} cannot import vllm: {a['error']}", fix, python=python)
    build = vllm_build(a)
    dists = "/".join(a.get("distributions", ())) or "vllm"
    detail = f"vLLM {a.get('version')} ({dists}, {build.upper()} build"
    detail += f"; torch {a['torch']})" if a.get("torch") else ")"
    data = {
        "python": python,
        "vllm_version": a.get("version"),
        "build": build,
        "torch": a.get("torch"),
    }
    if build not in (device, "unknown"):
        return fail(
            "engine venv",
            f"{detail} in {python}, but the engines run on {device.upper()}",
            setup_fix(device) + " to install the right build",
            **data,
        )
    return ok("engine venv", f"{detail} in {python}", **data)


# --- the model ---------------------------------------------------------------------------


def check_models(
    config: Config,
    home: Path,
    *,
    device: str,
    account: Account,
    env: Mapping[str, str],
    gpu_totals: Sequence[int] = (),
    under_unit: bool = False,
    gpu_memory: Mapping[int, int] | None = None,
) -> list[Result]:
    """One line per model the config names (every ``[[models]]`` table's, each
    speculative draft): there, a model, readable by ``account``, changeable by trusted
    accounts only, and (on GPU) whether its weights and one sequence of its context fit
    each of its GPUs (:mod:`appliance.fit`; ``gpu_memory``: each GPU's memory by index,
    else ``gpu_totals`` in order). Without ``[[models]]`` the one line is named
    ``model``; with them ``model NAME`` (``draft model NAME``)."""
    named = named_models(config)
    if not named:
        return [na("model", "engine.command does not use {model}")]
    eenv = engine_env(config, env)
    by_name = {m.name: m for m in config.served}
    out = []
    for n in named:
        line = "model" if not config.models else f"model {n.served}"
        line = f"draft {line}" if n.draft else line
        served = by_name[n.served]
        memory = dict(gpu_memory) if gpu_memory is not None else dict(enumerate(gpu_totals))
        where = _Where(line, n, served.engine.gpu_memory_utilization, Settings.of_model(served))
        out.append(_check_one(where, home, device, account, eenv, gpu_totals, under_unit, memory))
    return out


def check_model(
    config: Config,
    home: Path,
    *,
    device: str,
    account: Account,
    env: Mapping[str, str],
    gpu_totals: Sequence[int] = (),
    under_unit: bool = False,
    gpu_memory: Mapping[int, int] | None = None,
) -> Result:
    """The first model's line (a config without ``[[models]]`` has one model)."""
    return check_models(
        config,
        home,
        device=device,
        account=account,
        env=env,
        gpu_totals=gpu_totals,
        under_unit=under_unit,
        gpu_memory=gpu_memory,
    )[0]


@dataclass(frozen=True)
class _Where:
    line: str  # the doctor line's name
    named: NamedModel
    gpu_memory_utilization: float
    settings: Settings  # how its engines run it: the fit check's input


def _check_one(
    where: _Where,
    home: Path,
    device: str,
    account: Account,
    env: Mapping[str, str],
    gpu_totals: Sequence[int],
    under_unit: bool,
    gpu_memory: Mapping[int, int],
) -> Result:
    located, label = locate_model(where.named, home, env)
    if located.path is None:
        return fail(
            where.line,
            f"{label}: {located.problem}",
            f"{pull_fix(where.named.value, where.named.key)}, or set it to a local folder",
        )
    problem = _model_place_problem(where, located, label, device, account, under_unit)
    if problem is not None:
        return problem
    return _model_fit(where, located.path, label, device, gpu_totals, gpu_memory)


def _model_place_problem(
    where: _Where, located: Located, label: str, device: str, account: Account, under_unit: bool
) -> Result | None:
    """The failed line when the model is missing, not a model folder, hidden, unreadable
    or changeable by an account the appliance does not trust."""
    path, name, key = located.path, where.line, where.named.key
    assert path is not None
    if located.problem is not None:
        if located.unprepared:
            fix = setup_fix(device)
        elif not path.exists():
            fix = f"fix {key}, or {pull_fix(where.named.value, key)}"
        else:
            fix = f"point {key} at the model's folder"
        return fail(name, f"{label}: {located.problem}", fix, path=str(path))
    top = _hidden(str(path.absolute()))
    if under_unit and top is not None:
        return fail(
            name,
            f"{label}: {path} is under {top}, which the unit hides (ProtectHome=yes)",
            f"move the model elsewhere (/var/lib/llm-appliance, /srv, /opt) and point {key} there",
            path=str(path),
        )
    bad = unreadable(path, account)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return fail(
            name,
            f"{label}: {account.name} cannot read " + ", ".join(bad[:3]) + more,
            f"chown -R {account.chown_spec} {path} (or make it world-readable)",
            path=str(path),
        )
    unsafe = model_trust_problem(located)
    if unsafe is not None:
        fix = unsafe.rsplit("; ", 1)[-1]
        return fail(name, f"{label}: {unsafe}", fix, path=str(path))
    return None


def _model_fit(
    where: _Where,
    path: Path,
    named: str,
    device: str,
    gpu_totals: Sequence[int],
    gpu_memory: Mapping[int, int],
) -> Result:
    """The line for the model's size, and on CUDA whether its weights and one sequence of
    its context fit each of its GPUs (the fit check of ``models fit``; a draft model
    shares its model's budget: said, not judged). A config.json the estimate cannot read
    falls back to the weights against the budget."""
    size = model_size(path)
    detail = f"{named}: {path}, {gib(size)} on disk"
    data: dict[str, Any] = {"path": str(path), "size_bytes": size}
    if where.named.draft:
        return ok(where.line, detail, **data)
    if device != "cuda":
        return ok(where.line, detail + "; fit check skipped: the engines run on the CPU", **data)
    if not gpu_memory:
        return ok(where.line, detail + "; fit check skipped: no GPU memory figures", **data)
    try:
        files = model_files(path)
    except FitSourceError:
        return _weights_fit(where, detail, data, gpu_totals or list(gpu_memory.values()))
    verdict = judge(files, where.settings, GpuMemory(found=gpu_memory))
    detail += f"; {fit_summary(verdict)}"
    if verdict.fit is not None:
        w = verdict.fit.worst
        data |= {"gpu_budget_bytes": w.budget, "kv_cache_tokens": w.kv_tokens}
        if not verdict.fit.fits:
            fix = "; or ".join(verdict.fit.suggestions)
            return fail(where.line, detail, f"{fix} (`llm-appliance models fit`)", **data)
    return ok(where.line, detail, **data)


def _weights_fit(
    where: _Where, detail: str, data: dict[str, Any], gpu_totals: Sequence[int]
) -> Result:
    """The weights on disk against the smallest GPU's budget (no shape to estimate from)."""
    size = int(data["size_bytes"])
    util = where.gpu_memory_utilization
    budget = min(gpu_totals) * util
    data["gpu_budget_bytes"] = int(budget)
    detail += f", GPU budget {gib(budget)} ({gib(min(gpu_totals))} × {util:g})"
    if size >= budget:
        return fail(
            where.line,
            detail + ": the weights alone do not fit",
            "use a smaller or quantized model, or raise engine.gpu_memory_utilization",
            **data,
        )
    detail += f", {gib(budget - size)} left for the KV cache"
    return ok(where.line, detail, **data)
