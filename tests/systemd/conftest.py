"""Fixtures: a real systemd booted as PID 1 in a container, and the appliance installed in it.

``systemd_container`` (session) boots systemd-nspawn on an overlay of the host's root
(see :mod:`tests.fakes.systemd_container`) and always tears it down, failing the run if
anything of it stayed. It skips, with the reason, where that cannot work: not root, no
systemd-nspawn and apt cannot install it, no overlay file system, mounting forbidden.

``installed_appliance`` (session) installs the appliance inside it the way a deployment
does (:func:`tests.fakes.systemd_container.install_appliance`); tests then write the
config and drop-ins they need. ``fake_appliance`` configures it with two fake engines
(once per session, again after a test switched to another config).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.fakes import systemd_container as sc


@pytest.fixture(scope="session")
def systemd_container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sc.SystemdContainer]:
    """A booted systemd (PID 1) in a container with a private network; torn down always."""
    reason = sc.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    stale = sc.cleanup_stale()
    if stale:
        print(f"\n[systemd] removed leftovers of earlier runs: {', '.join(stale)}")
    box = sc.SystemdContainer(tmp_path_factory.mktemp("systemd-container"))
    try:
        try:
            box.boot()
        except sc.ContainerError as exc:
            if "mount -t tmpfs" in str(exc) and "ermission" in str(exc):
                pytest.skip(f"mounting is not permitted here: {exc}")
            raise
        print(f"\n[systemd] {box.name} booted in {box.boot_s:.2f} s (logs in {box.log_dir})")
        yield box
    finally:
        started = time.monotonic()
        problems = box.shutdown()
        print(f"\n[systemd] {box.name} torn down in {time.monotonic() - started:.2f} s")
        assert not problems, f"the container's teardown left things behind: {problems}"


@pytest.fixture(scope="session")
def installed_appliance(systemd_container: sc.SystemdContainer) -> sc.InstalledAppliance:
    """The appliance installed in the container: venv, user, unit, fake engine."""
    try:
        app = sc.install_appliance(systemd_container)
    except sc.Unavailable as exc:
        pytest.skip(str(exc))
    print(f"\n[systemd] appliance installed in {app.install_s:.1f} s")
    return app


@pytest.fixture
def fake_appliance(installed_appliance: sc.InstalledAppliance) -> sc.InstalledAppliance:
    """The installed appliance configured with two fake engines (each test may run alone)."""
    return installed_appliance.use_fake_engines()
