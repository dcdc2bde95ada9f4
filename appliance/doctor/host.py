"""The host around the daemon: its files and their modes, the systemd unit, free disk,
whose a process is, and whether the gateway answers."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import ssl
import stat
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from appliance.config import GatewayConfig
from appliance.doctor.result import Account, Result, fail, gib, na, octal_mode, ok
from appliance.gateway.keys import ADMIN_KEY_FILE, KeysFileError, parse_keys_document
from appliance.proctree import TAG_ENV
from appliance.status import Target, first_certificate, ssl_context

UNIT = "llm-appliance"
UNIT_PROPERTIES = ("LoadState", "UnitFileState", "ActiveState", "Result", "ExecMainStatus", "User")
JOURNAL = "journalctl -u llm-appliance -n 50"
MIN_FREE_BYTES = 1 << 30  # caches, logs, keys: the daemon's own needs
SETUP_FREE_BYTES = 10 * 10**9  # set-up: the engine venv alone is several GB


# --- whose is a process -----------------------------------------------------------------


def is_appliance_process(pid: int, *, max_depth: int = 8) -> bool:
    """One of ours: in the llm-appliance unit's cgroup, or it or an ancestor carries the
    engine tag (vLLM renames EngineCore and workers, which blanks their environment, so
    the API server above them is what carries it)."""
    with contextlib.suppress(OSError):
        if f"/{UNIT}.service" in Path(f"/proc/{pid}/cgroup").read_text():
            return True
    try:
        proc: psutil.Process | None = psutil.Process(pid)
        for _ in range(max_depth):
            if proc is None or proc.pid <= 1:
                return False
            with contextlib.suppress(psutil.Error, OSError):
                if TAG_ENV in proc.environ():
                    return True
            proc = proc.parent()
    except psutil.Error:
        pass
    return False


def describe_pid(pid: int) -> tuple[str, bool]:
    """("NAME (pid N)", ours) for the report."""
    try:
        name = psutil.Process(pid).name()
    except psutil.Error:
        name = "?"
    return f"{name} (pid {pid})", is_appliance_process(pid)


# --- files --------------------------------------------------------------------------------


def _owner_mode(
    path: Path, st: os.stat_result, account: Account, allowed: int
) -> tuple[list[str], list[str]]:
    """(what is wrong with ``path``'s owner and mode, the commands that fix it)."""
    problems, commands = [], []
    if st.st_uid != account.uid:
        problems.append(f"{path} is owned by {account.owner_name(st.st_uid)}, not {account.name}")
        commands.append(f"chown {account.chown_spec} {path}")
    if st.st_mode & 0o777 & ~allowed:
        problems.append(f"{path} has mode {octal_mode(st.st_mode)}, not {allowed:04o}")
        commands.append(f"chmod {allowed:o} {path}")
    return problems, commands


def check_state_dir(path: Path, account: Account) -> Result:
    """The state directory (engine venv, model; keys and admin.key under systemd): the
    account's, and writable by it alone. Others may read it: set-up makes it with the
    usual 0755 (in a checkout, ``~/.local/share/llm-appliance`` holds only the venv and
    the models), the unit's StateDirectoryMode makes it 0700, and where the keys file
    lives in it, the keys file's check holds its directory to 0700."""
    name = "state dir"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return fail(
            name,
            f"{path} does not exist",
            "run `llm-appliance setup` (the Ansible role does) to create it",
            path=str(path),
        )
    if not stat.S_ISDIR(st.st_mode):
        return fail(
            name,
            f"{path} is not a directory (or is a symbolic link)",
            f"fix {path}",
            path=str(path),
        )
    problems, commands = _owner_mode(path, st, account, 0o7777)
    if st.st_mode & 0o022:
        problems.append(
            f"{path} has mode {octal_mode(st.st_mode)}: writable by others than {account.name}"
        )
        commands.append(f"chmod go-w {path}")
    if problems:
        return fail(name, "; ".join(problems), " && ".join(commands), path=str(path))
    return ok(name, f"{path}: {account.name}, {octal_mode(st.st_mode)}", path=str(path))


def _read_no_follow(path: Path) -> tuple[os.stat_result, bytes]:
    """lstat + content, never through a symlink nor blocking on a FIFO (root may run this
    in the service account's directory)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        data = f.read(1 << 24) if stat.S_ISREG(st.st_mode) else b""
    return st, data


def check_keys_file(path: Path, account: Account) -> Result:
    """The keys file (and admin.key beside it): a plain file, the account's, 0600,
    parseable; its directory 0700."""
    name = "keys file"
    try:
        st, data = _read_no_follow(path)
    except FileNotFoundError:
        return na(name, f"{path} is not there yet: `serve` creates it with one admin key")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return fail(name, f"{path} is a symbolic link", "remove it: the appliance refuses it")
        return fail(name, f"{path}: {exc.strerror}", f"check {path} and its directory")
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return fail(name, f"{path} is not a plain file", f"remove {path} and restore the keys")
    problems, commands = _owner_mode(path, st, account, 0o600)
    # admin.key holds a usable secret; the directory guards both files.
    admin = path.with_name(ADMIN_KEY_FILE)
    for other, allowed in ((admin, 0o600), (path.parent, 0o700)):
        with contextlib.suppress(OSError):
            more = _owner_mode(other, os.lstat(other), account, allowed)
            problems += more[0]
            commands += more[1]
    if problems:
        return fail(name, "; ".join(problems), " && ".join(commands))
    try:
        keys = parse_keys_document(data, str(path))
    except KeysFileError as exc:
        return fail(
            name,
            str(exc),
            "restore the file from a backup, or move it away and create keys anew "
            "(`llm-appliance keys create --name admin --scope admin`)",
        )
    admins = sum(1 for k in keys.values() if k.allows("admin"))
    return ok(
        name,
        f"{path}: {account.name}, {octal_mode(st.st_mode)}, {len(keys)} key(s), {admins} admin",
        keys=len(keys),
    )


def check_disk(
    path: Path,
    *,
    setup_done: bool,
    usage: Callable[[str], Any] = shutil.disk_usage,
) -> Result:
    """Free space on the state directory's file system."""
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    u = usage(str(where))
    detail = f"{gib(u.free)} free of {gib(u.total)} on {where}"
    data = {"path": str(where), "free_bytes": int(u.free), "total_bytes": int(u.total)}
    if u.free < MIN_FREE_BYTES:
        return fail(
            "disk",
            detail,
            "free some space there: the daemon, vLLM's caches and the keys need at least "
            f"{gib(MIN_FREE_BYTES)}",
            **data,
        )
    if not setup_done and u.free < SETUP_FREE_BYTES:
        return fail(
            "disk",
            detail + "; set-up has not run yet",
            f"set-up needs about {SETUP_FREE_BYTES / 1e9:.0f} GB (the engine venv alone is "
            "several GB): free some space",
            **data,
        )
    return ok("disk", detail, **data)


# --- systemd ------------------------------------------------------------------------------


def read_unit(
    *,
    systemctl: str | None = None,
    pid1: Path = Path("/proc/1/comm"),
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> dict[str, str] | str:
    """The unit's properties, or why they cannot be read (no systemd here)."""
    systemctl = systemctl or shutil.which("systemctl")
    try:
        init = pid1.read_text().strip()
    except OSError:
        init = "?"
    if init != "systemd":
        return f"systemd is not PID 1 here (PID 1 is {init})"
    if systemctl is None:
        return "systemctl is not installed"
    try:
        proc = run(
            [systemctl, "show", UNIT, "-p", ",".join(UNIT_PROPERTIES)],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"systemctl show failed ({exc})"
    props = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    return props if props else f"systemctl show said nothing ({proc.stderr.strip()})"


# Result= values (systemd.exec: "$SERVICE_RESULT") and what they mean here.
_RESULTS = {
    "exit-code": "exited with a failure status",
    "signal": "was killed by a signal",
    "core-dump": "crashed (core dump)",
    "watchdog": "missed its watchdog ping (the main loop stalled)",
    "timeout": "did not start or stop in time",
    "start-limit-hit": "was restarted too often and systemd gave up "
    "(`systemctl reset-failed llm-appliance`)",
    "oom-kill": "was killed for lack of memory",
    "resources": "could not be started (resources)",
}
_EXIT_STATUSES = {
    "2": "exit 2: bad config (`llm-appliance check-config` names every problem)",
    "3": "exit 3: no engine could be started",
}


def last_exit(props: Mapping[str, str]) -> str:
    result = props.get("Result", "")
    status = props.get("ExecMainStatus", "0")
    if result in ("", "success") and status in ("", "0"):
        return "last exit: clean"
    why = _EXIT_STATUSES.get(status) or _RESULTS.get(result, f"result {result}")
    return f"last exit: {why} (Result={result}, ExecMainStatus={status})"


def check_systemd(props: Mapping[str, str] | str) -> Result:
    """The unit is installed, enabled and active; the line says how it last ended."""
    name = "systemd unit"
    if isinstance(props, str):
        return na(name, props)
    data = {k: props.get(k) for k in UNIT_PROPERTIES}
    if props.get("LoadState") != "loaded":
        return fail(
            name,
            f"{UNIT}.service is not installed (LoadState={props.get('LoadState')})",
            "run the Ansible role (it installs systemd/llm-appliance.service), or copy that "
            "file to /etc/systemd/system/ and `systemctl daemon-reload`",
            **data,
        )
    enabled = props.get("UnitFileState", "?")
    active = props.get("ActiveState", "?")
    detail = f"{enabled}, {active}; {last_exit(props)}"
    if active in ("failed", "inactive", "deactivating"):
        return fail(
            name,
            detail,
            f"read `{JOURNAL}`, fix what it names, then `systemctl restart {UNIT}`",
            **data,
        )
    if enabled not in ("enabled", "enabled-runtime", "static"):
        return fail(name, detail, f"`systemctl enable {UNIT}` so it starts at boot", **data)
    return ok(name, detail, **data)


# --- the gateway --------------------------------------------------------------------------


def gateway_target(g: GatewayConfig) -> Target:
    """The config's own gateway, with the certificate check `llm-appliance status` makes:
    the config's tls_cert pinned."""
    host = "127.0.0.1" if g.host in ("0.0.0.0", "::", "") else g.host
    host = f"[{host}]" if ":" in host else host
    url = f"{'https' if g.tls_cert else 'http'}://{host}:{g.port}"
    return Target(url, pinned_cert=first_certificate(g.tls_cert) if g.tls_cert else None)


def check_gateway(
    g: GatewayConfig,
    *,
    timeout_s: float = 3.0,
    opener: Callable[..., Any] = urllib.request.urlopen,
) -> Result:
    """GET /readyz on the configured gateway: 200 when an engine can take requests."""
    name = "gateway"
    target = gateway_target(g)
    url = target.url + "/readyz"
    try:
        context = ssl_context(target)
        with opener(url, timeout=timeout_s, context=context) as resp:
            code, body = resp.status, resp.read(65536)
    except urllib.error.HTTPError as exc:
        code, body = exc.code, exc.read(65536) if exc.fp is not None else b""
    except (OSError, ValueError) as exc:
        return _unreachable(name, url, exc)
    return _judge_readyz(name, url, code, body)


def _unreachable(name: str, url: str, exc: OSError | ValueError) -> Result:
    """No HTTP answer: a TLS handshake that failed, or nothing listening there."""
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, ssl.SSLError):
        return fail(
            name,
            f"{url}: TLS failed ({reason})",
            "the server there is not the gateway this config describes (gateway.tls_cert)",
            url=url,
        )
    return fail(
        name,
        f"cannot reach {url}: {reason}",
        f"is the service running? `systemctl status {UNIT}` (in a checkout: `llm-appliance serve`)",
        url=url,
    )


def _judge_readyz(name: str, url: str, code: int, body: bytes) -> Result:
    """What /readyz answered: 200 ready, 503 no engine ready, anything else not ours."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = {}
    said = doc.get("status", "") if isinstance(doc, dict) else ""
    ready = doc.get("engines_ready") if isinstance(doc, dict) else None
    data = {"url": url, "http_status": code, "readyz": doc}
    if code == 200:
        return ok(name, f"{url}: 200 {said}, engines ready: {ready}", **data)
    if code == 503:
        return fail(
            name,
            f"{url}: 503 {said}",
            "no engine can take requests: `llm-appliance status` shows each engine's "
            f"state, `{JOURNAL}` says why",
            **data,
        )
    return fail(
        name,
        f"{url}: answered {code}",
        "something else listens there: check gateway.host and gateway.port",
        **data,
    )
