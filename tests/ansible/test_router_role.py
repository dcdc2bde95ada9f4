"""The Ansible role ``llm_appliance_router`` (ansible/front.yml): syntax, its variable
checks, and the router arguments it writes for an inventory of boxes, read back as
systemd reads them and parsed by the real vllm-router's own argument parser.

Render-and-lint here, with ansible-playbook (and, once, vllm-router installed from PyPI
into a cached venv); the checks of the role's files that need neither are
tests/unit/test_router_role_files.py. The converge itself, with the router running
under a real systemd, is tests/systemd/test_router_under_systemd.py. The whole ansible/
folder, this role included, is linted by tests/ansible/test_role_static.py.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.ansible.test_role_static import ANSIBLE_DIR, ANSIBLE_PLAYBOOK, _run
from tests.fakes.router_proc import install_router

pytestmark = pytest.mark.skipif(
    ANSIBLE_PLAYBOOK is None,
    reason="ansible-core is not installed (pip install -r ansible/requirements-dev.txt)",
)

ROLE = ANSIBLE_DIR / "roles" / "llm_appliance_router"
BOX2 = "llm_appliance_gateway_tls_cert=/etc/ssl/box.pem llm_appliance_gateway_port=8443"
INVENTORY = f"""\
[llm_appliance]
box1 ansible_host=192.0.2.10
box2 ansible_host=192.0.2.11 {BOX2}
box3 ansible_host=2001:db8::3 llm_appliance_router_worker_address=box3.lan

[llm_appliance_router]
localhost ansible_connection=local
"""
# The front host is one of the boxes.
ONE_HOST = (
    "[llm_appliance]\nlocalhost ansible_connection=local llm_appliance_gateway_port=8443\n\n"
    "[llm_appliance_router]\nlocalhost ansible_connection=local\n"
)
WORKERS = ["http://192.0.2.10:8080", "https://192.0.2.11:8443", "http://box3.lan:8080"]


def _inventory(tmp: Path, text: str = INVENTORY) -> Path:
    path = tmp / "inventory.ini"
    path.write_text(text, encoding="utf-8")
    return path


def _playbook(tmp: Path, plays: list[dict[str, Any]]) -> Path:
    path = tmp / "play.yml"
    path.write_text(json.dumps(plays), encoding="utf-8")  # JSON is YAML
    return path


def _render(
    tmp: Path, extra: dict[str, Any] | None = None, template: str = "vllm-router.env.j2"
) -> str:
    """One of the role's templates for INVENTORY, rendered on the controller."""
    assert ANSIBLE_PLAYBOOK is not None
    out = tmp / template.removesuffix(".j2")
    play = {
        "name": "Render the router's arguments",
        "hosts": "llm_appliance_router",
        "gather_facts": False,
        "vars_files": [str(ROLE / "defaults/main.yml"), str(ROLE / "vars/main.yml")],
        "tasks": [
            {
                "name": "Write the environment file",
                "ansible.builtin.template": {
                    "src": str(ROLE / "templates" / template),
                    "dest": str(out),
                    "mode": "0644",
                },
            }
        ],
    }
    args = [ANSIBLE_PLAYBOOK, "-i", str(_inventory(tmp)), str(_playbook(tmp, [play]))]
    args += ["-e", json.dumps({"ansible_python_interpreter": sys.executable, **(extra or {})})]
    proc = _run(args, ANSIBLE_DIR, tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out.read_text(encoding="utf-8")


def _router_args(env_text: str) -> list[str]:
    """VLLM_ROUTER_ARGS as the unit's ExecStart gets it: unquoted, split at spaces."""
    for line in env_text.splitlines():
        if line.startswith("VLLM_ROUTER_ARGS="):
            return shlex.split(line.partition("=")[2])[0].split()
    raise AssertionError(env_text)


def test_front_playbook_syntax(tmp_path: Path) -> None:
    assert ANSIBLE_PLAYBOOK is not None
    proc = _run(
        [ANSIBLE_PLAYBOOK, "--syntax-check", "-i", str(_inventory(tmp_path)), "front.yml"],
        ANSIBLE_DIR,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_workers_are_the_boxes_gateways(tmp_path: Path) -> None:
    args = _router_args(_render(tmp_path))
    start = args.index("--worker-urls") + 1
    assert args[start : start + 3] == WORKERS
    assert args[args.index("--health-check-endpoint") + 1] == "/readyz"
    assert args[args.index("--policy") + 1] == "cache_aware"


def test_workers_given_outright_and_a_private_ca(tmp_path: Path) -> None:
    text = _render(
        tmp_path,
        {
            "llm_appliance_router_workers": ["https://a.lan:8443"],
            "llm_appliance_router_ca_file": "/etc/ssl/team-ca.pem",
        },
    )
    args = _router_args(text)
    assert args[args.index("--worker-urls") + 1 : args.index("--policy")] == ["https://a.lan:8443"]
    assert "SSL_CERT_FILE=/etc/ssl/team-ca.pem" in text.splitlines()


def test_the_real_router_accepts_the_arguments(tmp_path: Path) -> None:
    """Parsed and validated by vllm-router's own parser: a misspelt flag fails here."""
    exe = install_router()
    if isinstance(exe, str):
        pytest.skip(f"no vllm-router: {exe}")
    args = _router_args(_render(tmp_path))
    code = (
        "import sys; from vllm_router.launch_router import parse_router_args; "
        "a = parse_router_args(sys.argv[1:]); a._validate_router_args(); "
        "print(a.worker_urls, a.policy, a.health_check_endpoint)"
    )
    python = exe.parent / "python"
    done = subprocess.run(
        [str(python), "-c", code, *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{WORKERS} cache_aware /readyz"


def test_access_table_lets_only_the_callers_connect_and_the_router_answer(
    tmp_path: Path,
) -> None:
    """The nftables table vllm-router-access.service loads: the uids the configure tasks
    look up (root and the callers; the router's own account) and the router's port."""
    text = _render(
        tmp_path,
        {
            "llm_appliance_router_port": 8090,
            "llm_appliance_router__caller_uids": [0, 997],
            "llm_appliance_router__uid": 998,
        },
        template="access.nft.j2",
    )
    rules = [
        line.strip()
        for line in text.splitlines()
        if line.strip().startswith(("elem", "oif", "tcp"))
    ]
    assert rules == [
        "elements = { 0, 997 }",
        'oifname "lo" tcp dport 8090 meta skuid != @callers reject with tcp reset',
        "tcp sport 8090 meta skuid != 998 drop",
    ]
    # Replaced whole, in one transaction: a reload never leaves the port open.
    assert text.index("delete table inet vllm_router_access") < text.index("set callers")


@pytest.mark.parametrize(
    ("given", "callers"),
    [(["caddy"], ["caddy"]), ("caddy, www-data", ["caddy", "www-data"]), ([], [])],
    ids=["list", "string from an INI group's vars", "none"],
)
def test_local_callers_as_a_list_or_a_string(tmp_path: Path, given: Any, callers: Any) -> None:
    """[group:vars] in an INI inventory gives a string, which the specs accept unconverted."""
    assert ANSIBLE_PLAYBOOK is not None
    out = tmp_path / "callers.json"
    play = {
        "name": "Write the callers the role uses",
        "hosts": "llm_appliance_router",
        "gather_facts": False,
        "vars_files": [str(ROLE / "defaults/main.yml"), str(ROLE / "vars/main.yml")],
        "tasks": [
            {
                "name": "Write them",
                "ansible.builtin.copy": {
                    "content": "{{ llm_appliance_router__local_callers | to_json }}",
                    "dest": str(out),
                    "mode": "0644",
                },
            }
        ],
    }
    extra = {
        "ansible_python_interpreter": sys.executable,
        "llm_appliance_router_local_callers": given,
    }
    args = [ANSIBLE_PLAYBOOK, "-i", str(_inventory(tmp_path)), str(_playbook(tmp_path, [play]))]
    proc = _run([*args, "-e", json.dumps(extra)], ANSIBLE_DIR, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(out.read_text()) == callers


def _validate(tmp: Path, extra: dict[str, Any], inventory: str = INVENTORY) -> str:
    assert ANSIBLE_PLAYBOOK is not None
    play = {
        "name": "Check the router's variables only",
        "hosts": "llm_appliance_router",
        "gather_facts": False,
        "become": False,
        "roles": [{"role": "llm_appliance_router"}],
    }
    args = [ANSIBLE_PLAYBOOK, "-i", str(_inventory(tmp, inventory)), str(_playbook(tmp, [play]))]
    args += ["--tags", "llm_appliance_router_validate"]
    args += ["-e", json.dumps({"ansible_python_interpreter": sys.executable, **extra})]
    proc = _run(args, ANSIBLE_DIR, tmp)
    return ("ok " if proc.returncode == 0 else "failed ") + proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("extra", "inventory"),
    [
        ({}, INVENTORY),
        (
            {"llm_appliance_router_host": "0.0.0.0", "llm_appliance_router_allow_lan": True},
            INVENTORY,
        ),
        ({}, ONE_HOST),
    ],
    ids=["defaults", "LAN said explicitly", "front host is a box on another port"],
)
def test_good_variables_pass(tmp_path: Path, extra: dict[str, Any], inventory: str) -> None:
    out = _validate(tmp_path, extra, inventory)
    assert out.startswith("ok "), out[-2000:]


@pytest.mark.parametrize(
    ("extra", "inventory", "said"),
    [
        ({"llm_appliance_router_policy": "fastest"}, INVENTORY, "llm_appliance_router_policy"),
        ({"llm_appliance_router_port": 70000}, INVENTORY, "llm_appliance_router_port = 70000"),
        ({"llm_appliance_router_extra_args": ["--x y"]}, INVENTORY, "must be one word"),
        ({}, "[llm_appliance_router]\nlocalhost ansible_connection=local\n", "no boxes"),
        ({"llm_appliance_router_host": "0.0.0.0"}, INVENTORY, "admin routes"),
        ({"llm_appliance_router_port": 8443}, ONE_HOST, "this host is also a box"),
    ],
    ids=[
        "policy",
        "port",
        "argument with a space",
        "no boxes",
        "LAN without allow_lan",
        "the port of this host's own gateway",
    ],
)
def test_bad_variables_fail_with_the_variable_named(
    tmp_path: Path, extra: dict[str, Any], inventory: str, said: str
) -> None:
    out = _validate(tmp_path, extra, inventory)
    assert out.startswith("failed "), out[-2000:]
    assert said in out, out[-2000:]
