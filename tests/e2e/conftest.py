"""One real `llm-appliance serve` with two real vLLM engines on CPU, shared by a module.

A real engine takes 30-40 s to load and about 3.8 GB, so the e2e module starts the
daemon once and its tests run against it in file order (the last one stops it).
Nothing here sets ``engine.command``: the real vLLM command line is what is tested.

Every engine process inherits a per-run marker in its environment (the daemon passes
its own environment on to its engines), so teardown can find and kill whatever is left
of this run — API servers, orphaned ``VLLM::EngineCore`` children, workers — without
touching processes that other test runs on the same machine started.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from appliance import paths
from tests.fakes.appliance_proc import (
    Appliance,
    get_json,
    real_engine_config,
    run_appliance,
)

RUN_MARKER = "LLM_APPLIANCE_E2E_RUN"
SETUP_HINT = "run `scripts/setup` (or `llm-appliance setup`) first"
READY_TIMEOUT_S = 420.0  # 30-40 s on a quiet box; a loaded one has taken 230


def real_home() -> Path:
    """The set-up home as the daemon will resolve it (LLM_APPLIANCE_HOME unset)."""
    return paths.appliance_home()


def missing_setup() -> str | None:
    home = real_home()
    python = paths.engine_python(home)
    model = paths.packaged_model(home)
    if not python.exists():
        return f"no engine venv at {python}: {SETUP_HINT}"
    if not (model / "config.json").exists():
        return f"no converted model at {model}: {SETUP_HINT}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = missing_setup()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


def marked_processes(marker: str) -> list[psutil.Process]:
    """Every live process whose environment carries this run's marker.

    vLLM renames its children with setproctitle (``VLLM::EngineCore``,
    ``VLLM::Worker``), which blanks their /proc/PID/environ: they never show the marker.
    See :func:`run_processes` for those.
    """
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if proc.environ().get(RUN_MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def run_processes(marker: str, groups: set[int]) -> list[psutil.Process]:
    """This run's processes: the marked ones, and every member of an engine's group.

    Each engine is started in its own session (pgid = the API server's pid) and vLLM's
    children stay in it, so the group finds them even once the API server is gone.
    ``groups`` is updated with the engine groups seen now.
    """
    marked = marked_processes(marker)
    own = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    for proc in marked:
        with contextlib.suppress(OSError):
            # Only session leaders: the daemon itself shares pytest's group.
            if os.getpgid(proc.pid) == proc.pid:
                groups.add(proc.pid)
    groups.discard(os.getpgrp())
    found = {p.pid: p for p in marked}
    for proc in psutil.process_iter(["pid"]):
        if proc.pid in found or proc.pid in own:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) in groups and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc
    return list(found.values())


def kill_run(marker: str, groups: set[int]) -> list[int]:
    """SIGKILL what is left of this run; the pids that were still alive to be killed."""
    procs = run_processes(marker, groups)
    # run_appliance has just SIGKILLed the daemon and its descendants: let those go first.
    _, procs = psutil.wait_procs(procs, timeout=2)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)
    return [p.pid for p in procs]


class RealAppliance:
    """The running daemon plus what the tests need to talk to it."""

    def __init__(self, app: Appliance, marker: str, tmp: Path) -> None:
        self.app = app
        self.marker = marker
        self.tmp = tmp
        self.admin_key = ""
        self.timings: dict[str, float] = {}
        self.groups: set[int] = set()  # process groups of every engine seen (pgid = pid)

    @property
    def url(self) -> str:
        return self.app.url

    @property
    def cfg_path(self) -> Path:
        return self.tmp / "config.toml"

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        code, body = get_json(self.url + "/admin/status", timeout, self.admin_headers())
        assert code == 200, (code, body)
        assert isinstance(body, dict)
        self.groups |= {e["pid"] for e in body["engines"] if e.get("pid")}
        return body

    def states(self) -> list[str] | None:
        """Each engine's state, or None while /admin/status does not answer."""
        try:
            return [e["state"] for e in self.status()["engines"]]
        except AssertionError:
            return None

    def processes(self) -> list[psutil.Process]:
        """Every process of this run's engines that is alive now."""
        return run_processes(self.marker, self.groups)

    def engine(self, i: int) -> dict[str, Any]:
        engines = self.status()["engines"]
        return next(e for e in engines if e["id"] == i)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealAppliance]:
    reason = missing_setup()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("e2e")
    with serving(tmp, real_engine_config(tmp, 2), engines=2) as real:
        print(
            f"\n[e2e] readyz 200 after {real.timings['ready_s']:.1f} s, "
            f"both engines READY after {real.timings['all_ready_s']:.1f} s"
        )
        yield real


@contextlib.contextmanager
def serving(tmp: Path, cfg: dict[str, Any], engines: int) -> Iterator[RealAppliance]:
    """A daemon with real engines from ``cfg``, every one of its ``engines`` READY, and
    its admin key; whatever is left of its engines is killed afterwards."""
    marker = secrets.token_hex(8)
    groups: set[int] = set()
    env = {"LLM_APPLIANCE_HOME": str(real_home()), RUN_MARKER: marker}
    try:
        with run_appliance(tmp, cfg, env=env) as app:
            real = RealAppliance(app, marker, tmp)
            real.groups = groups
            started = time.monotonic()
            try:
                app.wait_ready(READY_TIMEOUT_S)  # /readyz: 200 with the first READY engine
                real.timings["ready_s"] = time.monotonic() - started
                app.wait_for((tmp / "admin.key").exists, 10, "admin.key written")
                real.admin_key = (tmp / "admin.key").read_text().strip()
                app.wait_for(
                    lambda: real.states() == ["READY"] * engines,
                    READY_TIMEOUT_S - real.timings["ready_s"],
                    f"{engines} engine(s) READY",
                )
                real.timings["all_ready_s"] = time.monotonic() - started
                yield real
            finally:
                print(f"\n[e2e] daemon log: {app.log_path}")
    finally:
        leftovers = kill_run(marker, groups)
        if leftovers:
            print(f"\n[e2e] teardown killed leftover processes of this run: {leftovers}")
