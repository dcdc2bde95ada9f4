"""`llm-appliance gpu-power apply|restore`: the static power limit (``thermal.power_limit_w``).

Why a power limit: it is the cheap heat lever. Decode is memory-bound, so watts buy
little throughput near the top of the curve: published RTX 4090 figures give 93.4 % of
the tokens/s at 70 % of the limit (390 W -> 300 W, 72 -> 67 °C). Cutting admission, the
governor's lever, costs throughput about as fast as it saves heat.

Why a command of its own: setting a GPU's power limit needs root, and the daemon runs
unprivileged as the service account with no capability at all. The unit runs this
command, and only it, with full privileges (``ExecStartPre=-+... gpu-power apply`` and
``ExecStopPost=-+... gpu-power restore``; ``-``: a failure is in the journal but does
not stop the service), so the privileged step is one short process
that reads the config, talks to NVML and exits; nothing the daemon or a client sends
reaches it.

What it does:

- ``apply``: every GPU the appliance uses (``engine.gpus`` and each model's ``gpus``;
  none with ``engine.device = "cpu"``) gets ``power_limit_w``, clamped to the card's
  range (``nvmlDeviceGetPowerManagementLimitConstraints``; :func:`clamp_limit_mw`). With
  ``power_limit_w = 0`` no GPU is touched, except that a limit this command set earlier
  (see "the record") is put back to the card's default.
- ``restore``: every GPU this command set, and every GPU the config names when
  ``power_limit_w`` is set, goes back to the card's default
  (``nvmlDeviceGetPowerManagementDefaultLimit``). A GPU already at its default is left
  alone (and not audited).

The record: before a limit is set, the GPU's UUID is written to a root-owned file
(:data:`RECORD`, in /run: a limit does not outlive the driver, and /run does not outlive
a reboot). So whatever happens between apply and restore (a crash, a SIGKILL of
systemd, a config edited to ``power_limit_w = 0`` or to other GPUs), the next apply or
restore finds the GPUs it changed and puts them back. ``ExecStopPost=`` also runs after a
crash of the daemon or a failed start, so in the ordinary case the restore comes at once.

Each GPU changed is one audit line (:mod:`appliance.audit`: ``gpu.power_limit``, to the
audit trail beside the keys file and to the journal), with the watts asked, set and the
card's range. A GPU that refuses (``NoPermission``, ``NotSupported``: a card without
power management) or that NVML cannot reach is one line on stderr naming it and why; the
others are still done, and the command exits 1. Not root: exit 1 before NVML is touched.
A config that cannot be used: the GPUs in the record are still put back, then exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from appliance.audit import AuditLog, audit_path, to_syslog
from appliance.config import Config, load_config, parse_config
from appliance.errors import ApplianceError, ConfigError
from appliance.fsutil import SAFE_OPEN, atomic_write
from appliance.policy.power_limit import clamp_limit_mw

log = logging.getLogger(__name__)

# Root's record of the GPUs whose limit this command set (their UUIDs).
RECORD = Path("/run/llm-appliance-gpu-power.json")
RECORD_ENV = "LLM_APPLIANCE_GPU_POWER_RECORD"  # another place for it (tests)
_RECORD_MAX_BYTES = 64 * 1024
MAX_GPUS = 8  # as appliance.plan: "auto" means the first eight GPUs
# These NVML errors mean "no NVIDIA driver or library here": nothing to limit.
_NO_DRIVER = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")

EXIT_FAILED = 1
Action = Literal["apply", "restore"]


class GpuPowerError(ApplianceError):
    """NVML cannot be used at all: one line, exit 1."""


def used_gpus(config: Config, count: int) -> list[int]:
    """The GPUs the appliance's engines use, present ones only (as appliance.plan picks
    them; one that is named but absent is the daemon's config error to report)."""
    if config.engine.device == "cpu":
        return []
    wanted: set[int] = set()
    for m in config.served:
        wanted.update(range(min(count, MAX_GPUS)) if m.gpus is None else m.gpus)
    return sorted(g for g in wanted if g < count)


@dataclass(frozen=True)
class Change:
    """What happened to one GPU: ``outcome`` ok (set, or already right), refused (NVML
    said no), error (NVML could not reach it)."""

    gpu: str  # "gpu0 (GPU-uuid)"
    outcome: Literal["ok", "refused", "error"]
    line: str


def record_path(env: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    return Path(env[RECORD_ENV]) if env.get(RECORD_ENV) else RECORD


def read_record(path: Path) -> list[str]:
    """UUIDs of the GPUs whose limit we set; [] when there is none (or it is unreadable:
    then the config's GPUs are still restored)."""
    try:
        fd = os.open(path, os.O_RDONLY | SAFE_OPEN)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("gpu-power: cannot read %s (%s); going by the config", path, exc)
        return []
    try:
        with os.fdopen(fd, "rb") as f:
            data = json.loads(f.read(_RECORD_MAX_BYTES))
        uuids = data.get("set", []) if isinstance(data, dict) else []
        return [u for u in uuids if isinstance(u, str)]
    except (OSError, ValueError) as exc:
        log.warning("gpu-power: %s is not a record we wrote (%s); going by the config", path, exc)
        return []


def write_record(path: Path, uuids: list[str]) -> None:
    if not uuids:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    atomic_write(path, json.dumps({"set": sorted(set(uuids))}).encode(), 0o600)


class _Gpus:
    """NVML opened once; GPUs by index and UUID."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.error: type[BaseException] = nvml.NVMLError
        self.count = int(nvml.nvmlDeviceGetCount())

    def uuid(self, handle: Any) -> str:
        value = self.nvml.nvmlDeviceGetUUID(handle)
        return value.decode() if isinstance(value, bytes) else str(value)

    def handles(self) -> dict[str, tuple[int, Any]]:
        """UUID -> (index, handle) of every GPU that answers."""
        out: dict[str, tuple[int, Any]] = {}
        for i in range(self.count):
            try:
                h = self.nvml.nvmlDeviceGetHandleByIndex(i)
                out[self.uuid(h)] = (i, h)
            except self.error as exc:
                log.warning("gpu-power: GPU %d cannot be reached (%s)", i, exc)
        return out


def _why(exc: BaseException) -> str:
    name = type(exc).__name__
    if name.endswith("NoPermission"):
        return f"NVML refused ({exc}): setting a power limit needs root"
    if name.endswith("NotSupported"):
        return f"this card has no settable power limit ({exc})"
    return f"NVML: {exc}"


# (card's minimum, maximum, default) in mW -> (limit to set in mW, a note or "")
Target = Callable[[int, int, int], tuple[int, str]]


def _card_default(low: int, high: int, default: int) -> tuple[int, str]:
    return default, "the card's default"


def _set(
    gpus: _Gpus, index: int, handle: Any, uuid: str, target: Target
) -> tuple[Change, dict[str, object]]:
    """Set one GPU's limit to ``target(min, max, default)``: the change and its audit
    detail ({} when nothing was set)."""
    nvml, name = gpus.nvml, f"gpu{index} ({uuid})"
    try:
        low, high = (int(x) for x in nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle))
        default = int(nvml.nvmlDeviceGetPowerManagementDefaultLimit(handle))
        mw, note = target(low, high, default)
        before = int(nvml.nvmlDeviceGetPowerManagementLimit(handle))
        detail: dict[str, object] = {
            "gpu": index,
            "uuid": uuid,
            "before_w": before / 1000,
            "set_w": mw / 1000,
            "default_w": default / 1000,
            "min_w": low / 1000,
            "max_w": high / 1000,
        }
        if before == mw:
            return Change(name, "ok", f"{name}: already {mw / 1000:g} W"), {}
        nvml.nvmlDeviceSetPowerManagementLimit(handle, mw)
        enforced = int(nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    except gpus.error as exc:
        refused = type(exc).__name__.endswith(("NoPermission", "NotSupported"))
        detail = {"gpu": index, "uuid": uuid, "why": str(exc), "kind": type(exc).__name__}
        return Change(name, "refused" if refused else "error", f"{name}: {_why(exc)}"), detail
    detail["enforced_w"] = enforced / 1000
    line = f"{name}: power limit {before / 1000:g} W -> {mw / 1000:g} W"
    line += f" ({note})" if note else ""
    if enforced != mw:
        line += f"; the driver enforces {enforced / 1000:g} W"
    return Change(name, "ok", line), detail


def run_power(
    action: Action,
    config: Config,
    nvml: Any,
    record: Path,
    audit: AuditLog,
) -> list[Change]:
    """Apply or restore (see the module docstring); one Change per GPU looked at."""
    gpus = _Gpus(nvml)
    by_uuid = gpus.handles()
    set_before = read_record(record)
    wanted_w = config.thermal.power_limit_w
    configured = set(used_gpus(config, gpus.count)) if wanted_w else set()
    changes: list[Change] = []
    kept = [u for u in set_before if u not in by_uuid]  # gone for now: try again next time
    for uuid, (index, handle) in by_uuid.items():
        if action == "apply" and index in configured:
            # Recorded before it is set: a crash right after still leaves the record.
            kept.append(uuid)
            write_record(record, kept)

            def target(low: int, high: int, default: int) -> tuple[int, str]:
                return clamp_limit_mw(wanted_w, low, high)

            change, detail = _set(gpus, index, handle, uuid, target)
            if change.outcome == "refused":
                kept.remove(uuid)  # not changed: nothing to put back later
        elif uuid in set_before or index in configured:
            change, detail = _set(gpus, index, handle, uuid, _card_default)
            if change.outcome != "ok" and uuid in set_before:
                kept.append(uuid)  # still ours to put back: the next apply or restore tries
            elif change.outcome == "refused" and "NotSupported" in str(detail.get("kind")):
                # Never set by us and cannot be set at all: nothing to restore.
                change = Change(change.gpu, "ok", f"{change.gpu}: no settable power limit")
                detail = {}
        else:
            continue
        changes.append(change)
        if detail:
            audit.record(
                "gpu.power_limit",
                f"gpu:{index}",
                f"gpu-power {action}",
                change.outcome,
                **detail,
            )
    write_record(record, kept)
    return changes


def _open_nvml(config: Config) -> Any | None:
    """pynvml, initialised; None when there is no NVIDIA driver and nothing can be wanted
    of one. GpuPowerError when NVML is broken."""
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError as exc:
        raise GpuPowerError(f"NVML bindings are not installed (nvidia-ml-py): {exc}") from None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        if type(exc).__name__ in _NO_DRIVER and config.engine.device != "cuda":
            return None
        raise GpuPowerError(f"NVML cannot be used: {exc}") from None
    return nvml


def run(args: argparse.Namespace) -> int:
    action: Action = args.action
    record = record_path()
    try:
        config = load_config(args.config)
    except ConfigError:
        # A config that cannot be used asks for no limit, and what this command set earlier
        # needs none to be put back: a typo must not leave the GPUs limited while the
        # service is down. Then the problem is reported (exit 2).
        if read_record(record):
            # Where audit.log lives is the config's to say: the journal only, this time.
            _power(action, parse_config({}), record, audit_file=None)
        raise
    return _power(action, config, record, audit_path(Path(config.gateway.keys_file)))


def _power(action: Action, config: Config, record: Path, audit_file: Path | None) -> int:
    if config.thermal.power_limit_w == 0 and not read_record(record):
        # Nothing asked, nothing of ours to undo: NVML is not even opened (a CPU box).
        print(f"gpu-power {action}: thermal.power_limit_w = 0, no GPU limit of ours to undo")
        return 0
    if os.geteuid() != 0:
        print(
            f"llm-appliance: gpu-power {action} changes GPU settings and must run as root "
            "(the unit runs it with ExecStartPre=+ / ExecStopPost=+; by hand: sudo)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    nvml = _open_nvml(config)
    if nvml is None:
        print(f"gpu-power {action}: no NVIDIA driver here, no GPU to limit")
        return 0
    # Under systemd stderr is the journal; from a shell the journal line goes to syslog.
    journal = None if os.environ.get("JOURNAL_STREAM") else to_syslog
    audit = AuditLog(audit_file, journal=journal, one_shot=True)
    try:
        changes = run_power(action, config, nvml, record, audit)
    except nvml.NVMLError as exc:
        print(f"llm-appliance: gpu-power {action}: NVML: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
    for c in changes:
        print(c.line, file=sys.stdout if c.outcome == "ok" else sys.stderr)
    if not changes:
        print(f"gpu-power {action}: no GPU to change")
    return 0 if all(c.outcome == "ok" for c in changes) else EXIT_FAILED


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "gpu-power",
        parents=[common],
        help="as root: set thermal.power_limit_w on the GPUs (apply) or put back "
        "their default (restore); the unit runs it around the daemon",
    )
    p.add_argument("action", choices=["apply", "restore"])
    p.set_defaults(func=run)
