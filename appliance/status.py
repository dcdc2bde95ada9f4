"""`llm-appliance status`: what the running daemon is doing, as a table or JSON.

It reads ``GET /admin/status`` (scope admin). The key comes from ``--key``, else
``$LLM_APPLIANCE_KEY``, else the ``admin.key`` that first start wrote beside the keys
file, so an admin on the box needs no flags.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from appliance.config import load_config


def _default_url(args: argparse.Namespace) -> str:
    g = load_config(args.config).gateway
    host = "127.0.0.1" if g.host in ("0.0.0.0", "::") else g.host
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if g.tls_cert else 'http'}://{host}:{g.port}"


def _default_key(args: argparse.Namespace) -> str | None:
    if os.environ.get("LLM_APPLIANCE_KEY"):
        return os.environ["LLM_APPLIANCE_KEY"]
    admin_key = Path(load_config(args.config).gateway.keys_file).with_name("admin.key")
    try:
        return admin_key.read_text().strip() or None
    except OSError:
        return None


def fetch_status(url: str, key: str | None, timeout: float = 5.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url.rstrip("/") + "/admin/status", headers={"Authorization": f"Bearer {key}"} if key else {}
    )
    ctx = None
    if url.startswith("https://"):
        # The appliance usually has a self-signed certificate; status is read-only.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return data


def _fmt(value: Any, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}{suffix}" if value < 10 else f"{value:.0f}{suffix}"
    return f"{value}{suffix}"


def render_table(doc: dict[str, Any]) -> str:
    rows = [
        (
            "ENGINE",
            "GPU",
            "PORT",
            "STATE",
            "INFLIGHT",
            "THROTTLE",
            "TEMP",
            "KV",
            "RESTARTS",
            "LAST RESTART",
        )
    ]
    for e in doc["engines"]:
        rows.append(
            (
                str(e["id"]),
                _fmt(e["gpu"]),
                str(e["port"]),
                e["state"],
                str(e["inflight"]),
                str(e["throttle_level"]),
                _fmt(e["temperature_c"], "C"),
                _fmt(e.get("kv_cache_usage")),
                str(e["restarts"]),
                e["last_restart_reason"] or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    head = (
        f"llm-appliance {doc['version']} on {doc['device']}: "
        f"{'ready' if doc['ready'] else 'NOT READY'}"
        f"{'' if doc['accepting'] else ' (stopping)'}, queue {doc['queue_depth']}, "
        f"up {doc['uptime_s']:.0f} s"
    )
    out = [head, "", *lines]
    if doc["gpus"]:
        out += ["", "GPU  TEMP  POWER       MEM USED  UTIL  LEVEL  CLOCK EVENTS"]
        for g in doc["gpus"]:
            power = f"{_fmt(g['power_w'])}/{_fmt(g['power_limit_w'])}W"
            mem = (
                "-"
                if g["memory_used_bytes"] is None
                else f"{g['memory_used_bytes'] / 2**30:.1f}GiB"
            )
            out.append(
                f"{g['index']:<4} {_fmt(g['temperature_c'], 'C'):<5} {power:<11} "
                f"{mem:<9} {_fmt(g['utilization']):<5} {g['throttle_level']:<6} "
                f"{','.join(g['throttle_reasons']) or '-'}"
            )
    return "\n".join(out)


def cmd_status(args: argparse.Namespace) -> int:
    url = args.url or _default_url(args)
    key = args.key or _default_key(args)
    try:
        doc = fetch_status(url, key)
    except urllib.error.HTTPError as exc:
        hint = (
            " (pass --key with an admin key, or set LLM_APPLIANCE_KEY)"
            if exc.code in (401, 403)
            else ""
        )
        print(f"llm-appliance status: {url} answered {exc.code}{hint}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        print(
            f"llm-appliance status: cannot reach {url}: {reason} (is the daemon running? "
            "systemctl status llm-appliance)",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(doc, indent=2) if args.json else render_table(doc))
    return 0


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "status",
        parents=[common],
        help="engines, GPUs, temperatures, throttle levels, in-flight work",
    )
    p.add_argument("--url", help="gateway URL (default: from the config)")
    p.add_argument(
        "--key",
        help="an admin key (default: $LLM_APPLIANCE_KEY, else admin.key beside the keys file)",
    )
    p.add_argument("--json", action="store_true", help="print /admin/status as JSON")
    p.set_defaults(func=cmd_status)
