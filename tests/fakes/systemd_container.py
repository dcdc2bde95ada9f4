"""A real systemd, booted as PID 1 in a throw-away container, for tests of the unit.

The container is ``systemd-nspawn -b`` on an overlay of the host's own root file system
(nothing is downloaded): the lower layer is ``/``, the upper and work layers live on a
tmpfs mounted for this run only, so whatever a test installs or breaks vanishes with the
tmpfs. ``--private-network`` leaves only a loopback interface inside. Host services that
are enabled on the host (postgresql, ...) and every timer are masked on the kernel
command line so that only what a test starts runs.

Everything belonging to one run lives under ``RUN_BASE/<name>`` (``<name>`` is unique
per run and also names the container and its cgroup subtrees)::

    RUN_BASE/<name>/owner       "<pid> <start time>" of the process that booted it
    RUN_BASE/<name>/nspawn.pid  the systemd-nspawn process
    RUN_BASE/<name>/layers      the tmpfs: upper/ and work/ of the overlay
    RUN_BASE/<name>/root        the overlay, the container's root directory
    DISK_BASE/<name>/           disk-backed folders bound in (``disk_dirs``), if any

:meth:`SystemdContainer.shutdown` always cleans up: SIGTERM to nspawn (the container
powers off in about 2 s), SIGKILL after 5 s to nspawn, the container's PID 1 and
anything left in its cgroups, then the cgroup subtrees are removed depth first, nspawn's
leftovers in ``/run/systemd/nspawn`` removed, the overlay and the tmpfs unmounted and the
run directory deleted. :func:`cleanup_stale` does the same for runs whose owner died
without cleaning up (a crashed or killed pytest), and never touches a live run.

Commands run inside through ``nsenter -t LEADER -a`` (``machinectl`` and
``systemctl -M`` need a system bus that the host does not have). A process entered that
way is outside every unit's cgroup: start what systemd must supervise with
``systemctl``. Facts behind all this: ``shared/notes/systemd-in-tests.md``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fakes.appliance_proc import fake_engine_config, write_config
from tests.fakes.engine_proc import FAKE_ENGINE_PATH, FAKE_ENGINE_SIBLINGS

RUN_BASE = Path("/run/llm-appliance-systemd-test")
# Disk-backed folders bound into a container (``disk_dirs``), one subfolder per run:
# gigabytes (an engine venv) that should not sit in the tmpfs, i.e. in memory.
DISK_BASE = Path("/var/tmp/llm-appliance-systemd-test")
NAME_PREFIX = "llmsd-"
NSPAWN_RUN_DIR = Path("/run/systemd/nspawn")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Masked on top of every service and timer enabled on the host.
ALWAYS_MASKED = (
    "timers.target",
    "postgresql.service",
    "e2scrub_reap.service",
    "systemd-timesyncd.service",
    "apt-daily.service",
    "apt-daily-upgrade.service",
    "man-db.service",
)
TERM_GRACE_S = 5.0


class ContainerError(RuntimeError):
    """The container could not be booted or driven; the message says what happened."""


class Unavailable(ContainerError):
    """This machine lacks something the container needs (a test should skip)."""


# --------------------------------------------------------------------------- availability


def _run_quiet(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def _tail(text: str, n: int = 600) -> str:
    return text.strip()[-n:]


def unavailable_reason(install: bool = True) -> str | None:
    """Why a container cannot be booted here (None: it can).

    Installs ``systemd-container`` (systemd-nspawn) with apt when it is missing and
    ``install`` is true: a fresh machine does not have it.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "booting systemd in a container needs root (mounts, cgroups, nspawn)"
    if not Path("/lib/systemd/systemd").exists():
        return "no /lib/systemd/systemd on this host to boot"
    for tool in ("nsenter", "mount", "umount", "setsid"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if "overlay" not in Path("/proc/filesystems").read_text():
        _run_quiet(["modprobe", "overlay"], 30)
        if "overlay" not in Path("/proc/filesystems").read_text():
            return "the kernel has no overlay file system"
    if shutil.which("systemd-nspawn") is None:
        if not install:
            return "systemd-nspawn is not installed (apt-get install systemd-container)"
        if shutil.which("apt-get") is None:
            return "systemd-nspawn is missing and there is no apt-get to install it"
        try:
            r = _run_quiet(["apt-get", "install", "-y", "systemd-container"], 600)
            if r.returncode != 0:
                _run_quiet(["apt-get", "update"], 600)
                r = _run_quiet(["apt-get", "install", "-y", "systemd-container"], 600)
        except subprocess.TimeoutExpired:
            return "apt-get install systemd-container timed out"
        if r.returncode != 0 or shutil.which("systemd-nspawn") is None:
            return (
                "systemd-nspawn is missing and `apt-get install -y systemd-container` "
                f"failed: {_tail(r.stdout + r.stderr)}"
            )
    return None


# --------------------------------------------------------------------------- cgroups


def cgroup_hierarchies() -> list[Path]:
    """Where the container gets its own cgroup subtree: cgroup2, plus name=systemd if hybrid."""
    if not CGROUP_ROOT.is_dir():
        return []
    fs_type = _run_quiet(["stat", "-fc", "%T", str(CGROUP_ROOT)], 10).stdout.strip()
    if fs_type == "cgroup2fs":
        return [CGROUP_ROOT]
    return [p for p in (CGROUP_ROOT / "systemd", CGROUP_ROOT / "unified") if p.is_dir()]


def _cgroup_pids(top: Path) -> set[int]:
    pids: set[int] = set()
    if not top.is_dir():
        return pids
    for procs in top.rglob("cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            pids |= {int(x) for x in procs.read_text().split()}
    return pids


def _kill_cgroups(name: str) -> None:
    """SIGKILL everything in the run's cgroup subtrees until they are empty (<= 5 s)."""
    tops = [h / name for h in cgroup_hierarchies()]
    deadline = time.monotonic() + TERM_GRACE_S
    while True:
        pids = set().union(*(_cgroup_pids(t) for t in tops)) if tops else set()
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _remove_cgroups(name: str) -> list[str]:
    """rmdir the run's cgroup subtrees, deepest first; the paths that stayed."""
    left = []
    for hierarchy in cgroup_hierarchies():
        top = hierarchy / name
        if not top.is_dir():
            continue
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for d in [*dirs, top]:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY for a moment after the last process died
                    time.sleep(0.1)
            if d.exists():
                left.append(str(d))
    return left


# --------------------------------------------------------------------------- mounts


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` in this mount namespace, deepest first."""
    prefix = str(path).rstrip("/")
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(set(found), key=lambda p: -p.count("/"))


def _umount_all_under(path: Path) -> list[str]:
    """Unmount everything at or below ``path`` (lazily as a last resort); what stayed."""
    for _ in range(3):
        points = _mounts_under(path)
        if not points:
            return []
        for point in points:
            r = _run_quiet(["umount", point], 30)
            if r.returncode != 0:
                time.sleep(0.2)
                r = _run_quiet(["umount", point], 30)
            if r.returncode != 0:
                _run_quiet(["umount", "-l", point], 30)
    return _mounts_under(path)


# --------------------------------------------------------------------------- processes


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in ticks): tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    status = Path(f"/proc/{pid}/status")
    with contextlib.suppress(OSError):
        for line in status.read_text().splitlines():
            if line.startswith("State:"):
                return "Z" not in line.split()[1]
    return True


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _in_cgroup(pid: int, name: str) -> bool:
    """Whether ``pid`` lives in the run's cgroup subtree (never kill a reused pid)."""
    try:
        return f"/{name}/" in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            kids += [int(x) for x in (task / "children").read_text().split()]
    return kids


# --------------------------------------------------------------------------- teardown


def _teardown(run_dir: Path, nspawn_pid: int | None, leader: int | None) -> list[str]:
    """Stop the container of ``run_dir`` and remove every trace of it; what could not be."""
    name = run_dir.name
    problems: list[str] = []
    if nspawn_pid is not None and _alive(nspawn_pid) and name in " ".join(_cmdline(nspawn_pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(nspawn_pid, signal.SIGTERM)  # nspawn asks the container to power off
        deadline = time.monotonic() + TERM_GRACE_S
        while _alive(nspawn_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(nspawn_pid):
            problems.append(f"nspawn {nspawn_pid} ignored SIGTERM for {TERM_GRACE_S:g} s")
            with contextlib.suppress(ProcessLookupError):
                os.kill(nspawn_pid, signal.SIGKILL)
    # PID 1 of the container dies with nspawn; if nspawn was killed it may not have:
    # killing it ends its whole pid namespace.
    if leader is not None and _alive(leader) and _in_cgroup(leader, name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(leader, signal.SIGKILL)
    _kill_cgroups(name)
    problems += [f"cgroup {p} could not be removed" for p in _remove_cgroups(name)]
    propagate = NSPAWN_RUN_DIR / "propagate" / name
    _umount_all_under(propagate)
    shutil.rmtree(propagate, ignore_errors=True)
    with contextlib.suppress(OSError):
        (NSPAWN_RUN_DIR / "propagate").rmdir()  # only when no other container uses it
    with contextlib.suppress(OSError):
        if not (NSPAWN_RUN_DIR / "propagate").exists():
            shutil.rmtree(NSPAWN_RUN_DIR)
    problems += [f"mount {p} stayed" for p in _umount_all_under(run_dir)]
    # Before the run directory, so that a teardown cut short here is found again.
    problems += _remove_disk_dirs(name)
    if not _mounts_under(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)
    with contextlib.suppress(OSError):
        RUN_BASE.rmdir()
    return problems


def _remove_disk_dirs(name: str) -> list[str]:
    """Delete the run's disk-backed folders (bound only in the container's namespace)."""
    disk = DISK_BASE / name
    if not disk.exists():
        return []
    if _mounts_under(disk):
        return [f"{disk} still has mounts: {_mounts_under(disk)}"]
    shutil.rmtree(disk, ignore_errors=True)
    with contextlib.suppress(OSError):
        DISK_BASE.rmdir()
    return [f"{disk} could not be removed"] if disk.exists() else []


def cleanup_stale() -> list[str]:
    """Tear down containers of earlier runs whose owner process is gone; their names.

    A run whose owner still lives (a concurrent pytest) is left alone. Cgroup subtrees
    with this module's prefix but no run directory are removed too.
    """
    cleaned = []
    live = set()
    if RUN_BASE.is_dir():
        for run_dir in sorted(RUN_BASE.iterdir()):
            if not run_dir.name.startswith(NAME_PREFIX):
                continue
            owner = ""
            with contextlib.suppress(OSError):
                owner = (run_dir / "owner").read_text().strip()
            parts = owner.split()
            if len(parts) == 2 and parts[0].isdigit() and _start_time(int(parts[0])) == parts[1]:
                live.add(run_dir.name)
                continue
            _teardown(run_dir, _read_int(run_dir / "nspawn.pid"), _read_int(run_dir / "leader.pid"))
            cleaned.append(run_dir.name)
    for hierarchy in cgroup_hierarchies():
        for top in hierarchy.glob(f"{NAME_PREFIX}*"):
            if top.is_dir() and top.name not in live and top.name not in cleaned:
                _kill_cgroups(top.name)
                _remove_cgroups(top.name)
                cleaned.append(top.name)
    if DISK_BASE.is_dir():
        for disk in DISK_BASE.iterdir():
            # Only where its run directory is gone too: then nothing uses the folder.
            name = disk.name
            if name.startswith(NAME_PREFIX) and name not in live and not (RUN_BASE / name).exists():
                _remove_disk_dirs(name)
                if name not in cleaned:
                    cleaned.append(name)
    return cleaned


# --------------------------------------------------------------------------- the container


def host_enabled_units() -> list[str]:
    """Services and timers the host enables: booting them in the container is unwanted."""
    units = set()
    for wants in Path("/etc/systemd/system").glob("*.wants"):
        for link in wants.iterdir():
            if link.name.endswith((".service", ".timer", ".socket", ".path")):
                units.add(link.name)
    return sorted(units)


class SystemdContainer:
    """One booted container; build it with :meth:`boot`, always end it with :meth:`shutdown`.

    ``private_network=False`` shares the host's network namespace (pip reaches the
    package index from inside, and so does everything else: choose free ports).
    ``disk_dirs`` are absolute paths inside the container backed by empty folders on the
    host's disk (under ``DISK_BASE/<name>``, deleted at teardown) rather than by the
    tmpfs of the overlay.
    """

    def __init__(
        self, log_dir: Path, *, private_network: bool = True, disk_dirs: Sequence[str] = ()
    ) -> None:
        self.name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.run_dir = RUN_BASE / self.name
        self.layers = self.run_dir / "layers"
        self.root = self.run_dir / "root"
        self.log_dir = log_dir
        self.nspawn_log = log_dir / "nspawn.log"
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.leader: int | None = None
        self.boot_s: float | None = None
        self.private_network = private_network
        self.disk_dirs = {
            inside: DISK_BASE / self.name / inside.strip("/").replace("/", "__")
            for inside in disk_dirs
        }

    # -- life cycle -------------------------------------------------------------------

    def boot(self, timeout: float = 60.0) -> None:
        """Mount the layers, start nspawn and wait until systemd says running or degraded."""
        started = time.monotonic()
        self.run_dir.mkdir(parents=True)
        me = os.getpid()
        (self.run_dir / "owner").write_text(f"{me} {_start_time(me)}\n")
        self.layers.mkdir()
        self.root.mkdir()
        self._mount(["-t", "tmpfs", "-o", "mode=0755,size=8g", "tmpfs", str(self.layers)])
        (self.layers / "upper").mkdir()
        (self.layers / "work").mkdir()
        self._mount(
            [
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir=/,upperdir={self.layers}/upper,workdir={self.layers}/work",
                str(self.root),
            ]
        )
        procs = []
        for hierarchy in cgroup_hierarchies():
            (hierarchy / self.name).mkdir()
            procs.append(str(hierarchy / self.name / "cgroup.procs"))
        if not procs:
            raise ContainerError("no cgroup hierarchy found under /sys/fs/cgroup")
        binds = []
        for inside, host in self.disk_dirs.items():
            host.mkdir(parents=True, mode=0o700)
            binds.append(f"--bind={host}:{inside}")
        masked = sorted(set(host_enabled_units()) | set(ALWAYS_MASKED))
        nspawn = [
            "systemd-nspawn",
            "--directory",
            str(self.root),
            "--machine",
            self.name,
            "--boot",
            "--register=no",
            "--keep-unit",
            "--console=passive",
            *(["--private-network"] if self.private_network else []),
            *binds,
            "--",
            *(f"systemd.mask={unit}" for unit in masked),
        ]
        # The launching shell moves itself into the container's own cgroup subtrees
        # first (nspawn --keep-unit uses the cgroup it runs in), then becomes nspawn.
        script = 'for p in $CGROUP_PROCS; do echo $$ > "$p" || exit 97; done; exec "$@"'
        with open(self.nspawn_log, "wb") as log:
            self.nspawn = subprocess.Popen(
                ["sh", "-c", script, "sh", *nspawn],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": CONTAINER_PATH, "CGROUP_PROCS": " ".join(procs), "LANG": "C.UTF-8"},
            )
        (self.run_dir / "nspawn.pid").write_text(f"{self.nspawn.pid}\n")
        deadline = time.monotonic() + timeout
        while self.leader is None:
            if self.nspawn.poll() is not None:
                raise ContainerError(
                    f"systemd-nspawn exited with {self.nspawn.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ContainerError(f"no container PID 1 after {timeout:g} s:\n{self.log_tail()}")
            for kid in _children(self.nspawn.pid):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{kid}/comm").read_text().strip() == "systemd":
                        self.leader = kid
            if self.leader is None:
                time.sleep(0.05)
        (self.run_dir / "leader.pid").write_text(f"{self.leader}\n")
        state = ""
        while time.monotonic() < deadline:
            left = max(1.0, deadline - time.monotonic())
            r = self.run(["systemctl", "is-system-running", "--wait"], timeout=left)
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                break
            if self.nspawn.poll() is not None:
                break
            time.sleep(0.1)  # no bus yet ("Failed to connect to bus"): try again
        if state not in ("running", "degraded"):
            failed = self.run(["systemctl", "--failed", "--no-legend"], timeout=10).stdout
            raise ContainerError(
                f"systemd in the container did not finish booting (state {state!r}); "
                f"failed units:\n{failed}\n{self.log_tail()}"
            )
        self.boot_s = time.monotonic() - started

    def _mount(self, args: list[str]) -> None:
        r = _run_quiet(["mount", *args], 30)
        if r.returncode != 0:
            raise ContainerError(f"mount {' '.join(args)} failed: {_tail(r.stderr)}")

    def shutdown(self) -> list[str]:
        """Power off and remove everything (idempotent); problems met on the way."""
        with contextlib.suppress(Exception):
            if self.leader is not None and self.nspawn is not None and self.nspawn.poll() is None:
                journal = self.run(
                    ["journalctl", "--no-pager", "-o", "short-precise"], timeout=20
                ).stdout
                (self.log_dir / "journal.txt").write_text(journal)
        pid = self.nspawn.pid if self.nspawn is not None else None
        problems = _teardown(self.run_dir, pid, self.leader)
        if self.nspawn is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.nspawn.wait(timeout=5)
        self.leader = None
        return problems

    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.nspawn_log.read_text(errors="replace")[-n:]
        return ""

    # -- driving it -------------------------------------------------------------------

    def _nsenter(self, namespaces: Sequence[str]) -> list[str]:
        if self.leader is None:
            raise ContainerError("the container is not running")
        return ["nsenter", "-t", str(self.leader), *namespaces, "--"]

    @staticmethod
    def _env(extra: dict[str, str] | None) -> dict[str, str]:
        env = {
            "PATH": CONTAINER_PATH,
            "LANG": "C.UTF-8",
            "SYSTEMD_PAGER": "",
            "SYSTEMD_COLORS": "0",
            "TERM": "dumb",
        }
        env.update(extra or {})
        return env

    @staticmethod
    def _argv(cmd: str | Sequence[str]) -> list[str]:
        return ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        check: bool = False,
        timeout: float = 60.0,
        input: str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` (argv, or a string for ``sh -c``) in every namespace of the container."""
        argv = self._nsenter(["-a"]) + self._argv(cmd)
        r = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            env=self._env(env),
            check=False,
        )
        if check and r.returncode != 0:
            raise ContainerError(
                f"{cmd!r} exited with {r.returncode}:\n{_tail(r.stdout, 2000)}\n"
                f"{_tail(r.stderr, 2000)}"
            )
        return r

    def run_with_host_network(
        self, cmd: str | Sequence[str], *, timeout: float = 300.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Like :meth:`run` but in the host's network namespace (package downloads)."""
        argv = self._nsenter(["-m", "-u", "-i", "-p", "-C"]) + self._argv(cmd)
        passed = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
        passed.update(env or {})
        r = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=self._env(passed)
        )
        if r.returncode != 0:
            raise ContainerError(
                f"{cmd!r} exited with {r.returncode}:\n{_tail(r.stdout, 2000)}\n"
                f"{_tail(r.stderr, 2000)}"
            )
        return r

    def spawn(self, cmd: str | Sequence[str]) -> subprocess.Popen[str]:
        """Start ``cmd`` inside without waiting (stdout and stderr piped, text)."""
        return subprocess.Popen(
            self._nsenter(["-a"]) + self._argv(cmd),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=self._env(None),
        )

    def path(self, inside: str) -> Path:
        """The host path of ``inside`` (an absolute path in the container)."""
        return self.root / inside.lstrip("/")

    def write(self, inside: str, text: str, mode: int = 0o644) -> None:
        """Write a file into the container (root-owned)."""
        target = self.path(inside)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """``systemctl show -p ...`` as a dict."""
        r = self.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)], check=True)
        out = {}
        for line in r.stdout.splitlines():
            key, _, value = line.partition("=")
            out[key] = value
        return out

    def journal_cursor(self) -> str:
        """A cursor at the journal's current end, for :meth:`journal` ``after=``."""
        r = self.run(["journalctl", "--no-pager", "-n", "0", "--show-cursor", "-q"])
        for line in r.stdout.splitlines():
            if line.startswith("-- cursor:"):
                return line.split(":", 1)[1].strip()
        return ""

    def journal(self, *args: str, after: str = "") -> str:
        argv = ["journalctl", "--no-pager", *args]
        if after:
            argv.append(f"--after-cursor={after}")
        return self.run(argv, timeout=30).stdout


# --------------------------------------------------------------------------- the appliance in it

REPO = Path(__file__).resolve().parents[2]
UNIT_NAME = "llm-appliance.service"
UNIT_SOURCE = REPO / "systemd" / UNIT_NAME
VENV = "/opt/llm-appliance/venv"
CLI = f"{VENV}/bin/llm-appliance"
SRC = "/srv/llm-appliance-src"
FAKE_ENGINE = "/srv/fake_engine.py"
CONFIG = "/etc/llm-appliance/config.toml"
STATE = "/var/lib/llm-appliance"
DROP_IN = f"/etc/systemd/system/{UNIT_NAME}.d/test.conf"
GATEWAY_PORT = 8080
ENGINE_PORT_BASE = 8100
# The service cannot use a python under /root (ProtectHome=yes): a deployment's venv is
# made with the system's.
SYSTEM_PYTHON = "/usr/bin/python3"
STARTUP_DELAY_S = 1.5  # each fake engine "loads" this long: READY cannot come earlier

_HTTP_SCRIPT = """
import sys, urllib.request, urllib.error
url, key, body, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
h = {"Content-Type": "application/json"}
if key:
    h["Authorization"] = "Bearer " + key
req = urllib.request.Request(url, data=body.encode() if body else None, headers=h)
try:
    r = urllib.request.urlopen(req, timeout=timeout)
    code, out = r.status, r.read()
except urllib.error.HTTPError as e:
    code, out = e.code, e.read()
except OSError as e:
    code, out = 0, repr(e).encode()
print(code)
print(out.decode(errors="replace"))
"""


@dataclass
class InstalledAppliance:
    """The appliance installed in a booted container, with helpers for the tests."""

    box: SystemdContainer
    install_s: float
    facts: dict[str, Any] = field(default_factory=dict)

    def write_config(self, sections: dict[str, dict[str, Any]]) -> None:
        """Write /etc/llm-appliance/config.toml and check it as the service user would."""
        host_path = self.box.path(CONFIG)
        host_path.parent.mkdir(parents=True, exist_ok=True)
        write_config(host_path, sections)
        host_path.chmod(0o644)
        self.box.run(
            ["runuser", "-u", "llm-appliance", "--", CLI, "check-config", "--config", CONFIG],
            check=True,
        )

    def use_fake_engines(self) -> InstalledAppliance:
        """Configure two fake engines (:func:`fake_config`) unless done; it may be stopped."""
        if self.facts.get("config") != "fake":
            self.box.run(["systemctl", "stop", UNIT_NAME], timeout=200)
            self.write_config(fake_config())
            self.facts["config"] = "fake"
        return self

    def set_drop_in(self, text: str | None) -> None:
        """Write (None: remove) the test drop-in, then daemon-reload."""
        path = self.box.path(DROP_IN)
        if text is None:
            path.unlink(missing_ok=True)
        else:
            self.box.write(DROP_IN, text)
        self.box.run(["systemctl", "daemon-reload"], check=True)

    def state(self) -> dict[str, str]:
        return self.box.show(
            UNIT_NAME, "ActiveState", "SubState", "MainPID", "NRestarts", "Result", "StatusText"
        )

    def admin_key(self) -> str:
        return self.box.run(["cat", f"{STATE}/admin.key"], check=True).stdout.strip()

    def http(
        self, path: str, key: str = "", body: str | None = None, timeout: float = 10.0
    ) -> tuple[int, str]:
        """One request to the gateway from inside the container: (status, body); 0: no answer."""
        url = f"http://127.0.0.1:{GATEWAY_PORT}{path}"
        r = self.box.run(
            [SYSTEM_PYTHON, "-c", _HTTP_SCRIPT, url, key, body or "", str(timeout)],
            timeout=timeout + 30,
        )
        code, _, out = r.stdout.partition("\n")
        return int(code or 0), out


def fake_config() -> dict[str, dict[str, Any]]:
    """The installed appliance's config with two fake engines (each with a child)."""
    cfg = fake_engine_config(Path(STATE), 2)
    cfg["gateway"].update({"port": GATEWAY_PORT, "keys_file": f"{STATE}/keys.json"})
    cfg["engine"].update(
        {
            "port_base": ENGINE_PORT_BASE,
            "command": [
                f"{VENV}/bin/python",
                FAKE_ENGINE,
                "--uds",
                "{uds}",
                "--api-key",
                "{api_key}",
                "--served-model-name",
                "{served_model_name}",
                "--spawn-child",
                "--startup-delay",
                str(STARTUP_DELAY_S),
                "--token-delay-ms",
                "5",
            ],
        }
    )
    return cfg


def install_appliance(box: SystemdContainer) -> InstalledAppliance:
    """Install the appliance in ``box`` as a deployment does; the unit is copied unchanged.

    The source is copied to /srv/llm-appliance-src and installed non-editable into a
    venv of the system python at /opt/llm-appliance/venv (pip runs in the container's
    file system but the host's network), the llm-appliance system user is created, the
    unit goes to /etc/systemd/system and the fake engine to /srv/fake_engine.py.
    """
    started = time.monotonic()
    src = box.path(SRC)
    shutil.copytree(
        REPO / "appliance", src / "appliance", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    for path in (FAKE_ENGINE_PATH, *FAKE_ENGINE_SIBLINGS):
        target = box.path(FAKE_ENGINE).with_name(Path(path).name)
        shutil.copy2(path, target)
        target.chmod(0o644)
    r = box.run([SYSTEM_PYTHON, "-c", "import ensurepip, venv"])
    if r.returncode != 0:
        raise Unavailable(f"{SYSTEM_PYTHON} cannot make a venv (python3-venv?): {r.stderr}")
    box.run([SYSTEM_PYTHON, "-m", "venv", VENV], check=True, timeout=120)
    box.run_with_host_network([f"{VENV}/bin/pip", "install", "--quiet", SRC], timeout=600)
    if box.run(["id", "-u", "llm-appliance"]).returncode != 0:
        box.run(
            [
                "useradd",
                "--system",
                "--user-group",
                "--home-dir",
                "/nonexistent",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "llm-appliance",
            ],
            check=True,
        )
    unit = box.path(f"/etc/systemd/system/{UNIT_NAME}")
    shutil.copyfile(UNIT_SOURCE, unit)
    unit.chmod(0o644)
    box.run(["systemctl", "daemon-reload"], check=True)
    return InstalledAppliance(box, time.monotonic() - started)
