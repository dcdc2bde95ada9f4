"""What the soak's faults do to the box: a state disk that can be filled, a memory
cgroup that can be squeezed until the kernel's OOM killer acts (``bench.soak_faults``
says when and checks what the daemon did)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.soak_checks import state_file_problems
from tests.fakes.appliance_proc import alive

DISK_MIB = 4  # the state tmpfs: keys, usage, audit and admin.key take a few KiB
CGROUP_ROOT = Path("/sys/fs/cgroup")
MIB = 1 << 20


# ---- the state disk ------------------------------------------------------------------


@dataclass
class StateDisk:
    """The state directory: a small tmpfs of its own when it could be mounted."""

    path: Path
    mounted: bool
    why_not: str = ""  # when not mounted: why the disk-full fault is skipped

    @classmethod
    def make(cls, path: Path) -> StateDisk:
        path.mkdir(mode=0o700, exist_ok=True)
        if os.geteuid() != 0:
            return cls(path, False, "mounting a tmpfs for the state directory needs root")
        opts = f"size={DISK_MIB}m,mode=0700"
        run = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if run.returncode != 0:
            return cls(path, False, f"cannot mount a tmpfs here: {run.stderr.strip()}")
        return cls(path, True)

    @property
    def filler(self) -> Path:
        return self.path / "soak-filler"

    def fill(self) -> int:
        """Fill the file system to the last byte (in ever smaller writes); bytes written."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT, 0o600)
        written = 0
        try:
            for size in (1 << 16, 4096, 1):
                with contextlib.suppress(OSError):
                    while True:
                        written += os.write(fd, b"\0" * size)
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)

    def read(self, name: str) -> bytes | None:
        try:
            return (self.path / name).read_bytes()
        except OSError:
            return None

    def problems(self, keys_before: bytes) -> list[str]:
        return state_file_problems(
            self.read("usage.json"), self.read("audit.log"), self.read("keys.json"), keys_before
        )


# ---- the memory cgroup ---------------------------------------------------------------


@dataclass
class MemCage:
    """A child memory cgroup of ours, to put an engine's tree under a limit."""

    path: Path
    v2: bool

    def _file(self, v2: str, v1: str) -> Path:
        return self.path / (v2 if self.v2 else v1)

    def limit(self, n: int) -> None:
        self._file("memory.max", "memory.limit_in_bytes").write_text(str(n))

    def usage(self) -> int:
        return int(self._file("memory.current", "memory.usage_in_bytes").read_text())

    def oom_kills(self) -> int:
        text = self._file("memory.events", "memory.oom_control").read_text()
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
        return 0

    def add(self, pids: Sequence[int]) -> None:
        if not self.v2:  # v1: the pages it has go with it, so the limit can bite them
            with contextlib.suppress(OSError):
                (self.path / "memory.move_charge_at_immigrate").write_text("3")
        for pid in pids:
            with contextlib.suppress(OSError):  # a process that already ended
                (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> bool:
        with contextlib.suppress(OSError):
            self.path.rmdir()
        return not self.path.exists()


def _own_cgroups() -> tuple[str | None, str | None]:
    """Our cgroup's path in the v2 hierarchy and in v1's memory one (None: none)."""
    v2 = v1 = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                v2 = path.lstrip("/")
            elif "memory" in controllers.split(","):
                v1 = path.lstrip("/")
    return v2, v1


def make_cage(name: str) -> tuple[MemCage | None, str]:
    """A child memory cgroup of our own, v2 first: (it, "") or (None, why not)."""
    v2, v1 = _own_cgroups()
    why = []
    for mount in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        if v2 is None or not (mount / "cgroup.controllers").exists():
            continue
        if "memory" not in (mount / v2 / "cgroup.controllers").read_text().split():
            why.append(f"cgroup v2 at {mount} has no memory controller for us")
            continue
        cage, err = _mkdir(mount / v2 / name, "memory.max", True)
        if cage:
            return cage, ""
        why.append(err)
    if v1 is not None and (CGROUP_ROOT / "memory").is_dir():
        cage, err = _mkdir(CGROUP_ROOT / "memory" / v1 / name, "memory.limit_in_bytes", False)
        if cage:
            return cage, ""
        why.append(err)
    return None, "; ".join(why) or "no memory cgroup (v2 or v1) on this box"


def _mkdir(path: Path, limit_file: str, v2: bool) -> tuple[MemCage | None, str]:
    try:
        path.mkdir(exist_ok=True)
    except OSError as e:
        return None, f"cannot create {path}: {e.strerror}"
    if not (path / limit_file).exists():
        with contextlib.suppress(OSError):
            path.rmdir()
        return None, f"{path} has no {limit_file} (memory not delegated to it)"
    return MemCage(path, v2), ""


def tree_of(pid: int) -> list[int]:
    try:
        proc = psutil.Process(pid)
        return [pid, *(p.pid for p in proc.children(recursive=True))]
    except psutil.Error:
        return []


def squeeze(cage: MemCage, pids: Sequence[int], timeout_s: float) -> bool:
    """Lower the cage's limit to what its processes use, again and again, until the
    kernel's OOM killer takes one of them; whether it did within ``timeout_s``. (v1
    refuses a limit it cannot reclaim down to, with EBUSY, and keeps the last one: the
    next allocation past that meets the OOM killer; v2 kills at once.)"""
    before = cage.oom_kills()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cage.oom_kills() > before:
            return True
        if not alive(set(pids)):
            return cage.oom_kills() > before
        used = cage.usage()
        for target in (used - MIB, used):
            try:
                cage.limit(max(target, MIB))
                break
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
        time.sleep(0.2)
    return cage.oom_kills() > before
