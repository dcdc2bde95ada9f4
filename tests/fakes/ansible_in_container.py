"""Run one of the project's playbooks inside a systemd container, and read its output.

``ansible-playbook`` runs inside the container as root with ``connection: local``, the
way an admin runs it on the host itself, from a snapshot of the checkout copied in
(:func:`copy_checkout`), so that edits to the working tree during a run cannot make a
second converge report changes. The controller is the ``ansible-playbook`` beside this
test run's python (the container sees the host's files through its overlay).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

from tests.fakes import systemd_container as sc

SRC = "/srv/llm-appliance-src"  # the snapshot of the checkout, inside the container
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
COPIED = ("pyproject.toml", "README.md", "appliance", "systemd", "ansible")
RECAP = re.compile(
    r"^localhost\s*:\s*ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=(?P<unreachable>\d+)"
    r"\s+failed=(?P<failed>\d+)",
    re.MULTILINE,
)
TASK_LINE = re.compile(r"^(?:TASK|RUNNING HANDLER) \[(?P<name>.*?)\]")
ENV = {
    "HOME": "/root",
    "ANSIBLE_NOCOLOR": "1",
    "ANSIBLE_FORCE_COLOR": "0",
    "ANSIBLE_RETRY_FILES_ENABLED": "0",
    "PYTHONUNBUFFERED": "1",
}


def unavailable_reason() -> str | None:
    """Why ansible-playbook cannot run inside a container here (None: it can)."""
    if not ANSIBLE_PLAYBOOK.exists():
        return f"no ansible-playbook beside {sys.executable} (pip install ansible-core)"
    if str(ANSIBLE_PLAYBOOK).startswith("/tmp/"):
        # nspawn mounts a fresh tmpfs over /tmp inside the container: a controller
        # venv under /tmp is invisible there (the converge would fail with rc 127).
        return f"{ANSIBLE_PLAYBOOK} is under /tmp, which the container cannot see"
    if not Path(sc.SYSTEM_PYTHON).exists():
        return f"no {sc.SYSTEM_PYTHON}: the roles build their venvs with the system python"
    return None


def copy_checkout(box: sc.SystemdContainer) -> None:
    """Snapshot the parts of the checkout the roles read into the container."""
    dest = box.path(SRC)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ansible", "inventory.ini")
    for name in COPIED:
        source = sc.REPO / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore, dirs_exist_ok=True)
        elif source.exists():
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def playbook(
    box: sc.SystemdContainer,
    play: str,
    inventory: str,
    extra_vars: dict[str, object],
    *,
    log: str,
    timeout: float,
    args: tuple[str, ...] = (),
    host_network: bool = False,
) -> tuple[int, str, float]:
    """Run ``ansible/<play>`` inside the container: (exit status, output, seconds).

    ``host_network``: in the host's network namespace (pip reaching the package index
    from a container that has only a loopback of its own).
    """
    argv = [str(ANSIBLE_PLAYBOOK), "-i", inventory, play, "-e", json.dumps(extra_vars), *args]
    # `cd` so that ansible/ansible.cfg (roles_path) applies.
    cmd = ["sh", "-c", f'cd {SRC}/ansible && exec "$@"', "sh", *argv]
    started = time.monotonic()
    if host_network:
        try:
            r = box.run_with_host_network(cmd, timeout=timeout, env=ENV)
            rc, stdout, stderr = r.returncode, r.stdout, r.stderr
        except sc.ContainerError as exc:  # it raises on a non-zero exit: keep the output
            rc, stdout, stderr = 1, str(exc), ""
    else:
        r = box.run(cmd, timeout=timeout, env=ENV)
        rc, stdout, stderr = r.returncode, r.stdout, r.stderr
    took = time.monotonic() - started
    out = stdout + ("\n--- stderr ---\n" + stderr if stderr.strip() else "")
    (box.log_dir / log).write_text(out)
    return rc, out, took


def recap(out: str) -> dict[str, int]:
    m = RECAP.search(out)
    assert m, f"no PLAY RECAP line for localhost in the output:\n{out[-4000:]}"
    return {k: int(v) for k, v in m.groupdict().items()}


def changed_tasks(out: str) -> list[str]:
    """The tasks (and handlers) that reported a change, in order."""
    names, task = [], "?"
    for line in out.splitlines():
        m = TASK_LINE.match(line)
        if m:
            task = m.group("name")
        elif line.startswith("changed:"):
            names.append(f"{task}: {line}")
    return names


def failed_tasks(out: str) -> str:
    """The task headers and failure lines, for a readable assertion message."""
    lines, task = [], ""
    for line in out.splitlines():
        m = TASK_LINE.match(line)
        if m:
            task = line
        elif line.startswith(("fatal:", "failed:")) or "FAILED!" in line:
            lines += [task, line[:2000]]
    return "\n".join(lines) or out[-4000:]
