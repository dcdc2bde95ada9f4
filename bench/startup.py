"""Time from `llm-appliance serve` to ready, cold and warm, on the default engine.

    .venv/bin/python -m bench.startup --runs 3 [--engines 1] [--cold]

Each run starts a real daemon with the built-in defaults (the packaged model on the
set-up's engine venv; on a machine without a GPU, vLLM on CPU), with only the gateway
port and keys file moved into a temporary folder, and measures:

- ``listening``: the gateway answers ``/healthz``;
- ``ready``: ``/readyz`` is 200 (an engine answered a real completion);
- ``first token``: a chat completion through the gateway returns;

then stops it with SIGTERM and times the stop. ``--cold`` drops the page cache before
the first run (root only), so the first run reads the venv and model from disk the way
the first start after a reboot does; later runs are warm.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from appliance import paths
from tests.fakes.appliance_proc import get_json, run_appliance
from tests.fakes.engine_proc import free_port


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def one_run(engines: int) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="startup-"))
    # Engines on their default Unix sockets (in the daemon's runtime directory): no port
    # to pick.
    cfg: dict[str, dict[str, Any]] = {
        "gateway": {"port": free_port(), "keys_file": str(tmp / "keys.json")},
        "engine": {"cpu_engines": engines},
    }
    env = {"LLM_APPLIANCE_HOME": str(paths.appliance_home())}
    out: dict[str, float] = {}
    started = time.monotonic()
    with run_appliance(tmp, cfg, env=env) as app:
        app.wait_for(lambda: get_json(app.url + "/healthz")[0] == 200, 60, "listening")
        out["listening_s"] = time.monotonic() - started
        app.wait_ready(600)
        out["ready_s"] = time.monotonic() - started
        key = (tmp / "admin.key").read_text().strip()
        body = json.dumps(
            {
                "model": paths.PACKAGED_MODEL_NAME,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "Hi"}],
            }
        ).encode()
        req = urllib.request.Request(
            app.url + "/v1/chat/completions",
            data=body,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=120).read()
        out["first_token_s"] = time.monotonic() - started
        stop = time.monotonic()
        app.signal(signal.SIGTERM)
        assert app.wait_exit(120) == 0
        out["stop_s"] = time.monotonic() - stop
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engines", type=int, default=1, help="cpu_engines (default: 1)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache first (root)")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for i in range(args.runs):
        cold = args.cold and i == 0 and drop_caches()
        times = one_run(args.engines)
        rows.append({"run": i + 1, "cache": "cold" if cold else "warm", **times})
        print(json.dumps(rows[-1]), flush=True)
    print(
        f"\n{'run':>3}  {'cache':5}  {'listening':>9}  {'ready':>7}  {'1st token':>9}  "
        f"{'stop':>6}   (seconds; {args.engines} CPU engine(s), {os.cpu_count()} cores)"
    )
    for r in rows:
        print(
            f"{r['run']:>3}  {r['cache']:5}  {r['listening_s']:9.2f}  {r['ready_s']:7.1f}  "
            f"{r['first_token_s']:9.1f}  {r['stop_s']:6.1f}"
        )


if __name__ == "__main__":
    main()
