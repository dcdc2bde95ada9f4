"""`llm-appliance keys create|list|revoke|usage`: the keys file edited directly.

These work whether the daemon runs or not: every change is a locked read-modify-write
of the keys file (see :mod:`appliance.gateway.keys`), and a running daemon puts it in
force within 2 s. A new key is printed once, alone on the first line of stdout, so
``KEY=$(llm-appliance keys create --name ci | head -1)`` works; everything else a
command says goes to stderr. ``create`` and ``revoke`` are recorded in the audit log
beside the keys file (:mod:`appliance.audit`), with the local user as the actor.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from appliance.audit import AuditLog, Outcome, audit_path, to_syslog
from appliance.config import load_config
from appliance.gateway.accounting.book import UsageFileError, read_usage, usage_path
from appliance.gateway.keys import (
    MAX_EXPIRES_DAYS,
    MAX_INFLIGHT,
    MAX_RPM,
    MAX_TPM,
    PRIORITIES,
    SCOPES,
    KeyRecord,
    KeysFileError,
    KeySpecError,
    KeyStore,
    validate_key_id,
)

# Explicit ASCII ranges (never \d, which takes any Unicode digit); longer numbers are out
# of every bound anyway.
_ASCII_NUMBER = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,6})?")
COLUMNS = (
    "ID",
    "NAME",
    "SCOPES",
    "RPM",
    "TPM",
    "PRIORITY",
    "FALLBACK",
    "INFLIGHT",  # the key's cap on requests in flight ("-": none)
    "MODELS",  # the models it may use ("all": every model)
    "EXPIRES",
    "CREATED",
    "STATUS",
)


def _number(text: str | None) -> int | float | str | None:
    """A number typed on the command line, read as JSON would give it to the admin API:
    ASCII digits make an int, with a decimal point a float. Anything else (``x``, ``-1``,
    ``1e3``, Unicode digits such as ``١٢`` that int() would take) goes to the field's
    validator as it is, which refuses it with the same message the admin API gives."""
    if text is None or not _ASCII_NUMBER.fullmatch(text):
        return text
    return float(text) if "." in text else int(text)


def _store(args: argparse.Namespace) -> KeyStore:
    config = load_config(getattr(args, "config", None))
    return KeyStore(Path(config.gateway.keys_file))


def _actor() -> str:
    """``cli:<user>``: the local account that ran the command (under sudo, root)."""
    try:
        return f"cli:{pwd.getpwuid(os.getuid()).pw_name}"
    except KeyError:
        return f"cli:uid={os.getuid()}"


def _audit(store: KeyStore, action: str, target: str, outcome: Outcome, **detail: object) -> None:
    # Who ran sudo, when someone did: the one name that tells the admins apart.
    sudo_user = os.environ.get("SUDO_USER")
    if sudo_user and os.getuid() == 0:
        detail["sudo_user"] = sudo_user
    log = AuditLog(audit_path(store.path), journal=to_syslog, one_shot=True)
    log.record(action, target, _actor(), outcome, **detail)


def _fail(message: object, code: int = 1) -> int:
    print(f"llm-appliance: {message}", file=sys.stderr)
    return code


def _when(ts: float | None, never: str = "never") -> str:
    if ts is None:
        return never
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%MZ")


def _status(record: KeyRecord, now: float) -> str:
    return "expired" if record.is_expired(now) else "active"


def cmd_create(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        # Every field is checked by keys/fields.py (as for POST /admin/keys), so a
        # bad value gets one line naming the field and exit 2, not argparse's own words.
        record, key = store.create(
            name=args.name,
            scopes=args.scope,
            rpm=_number(args.rpm),
            tpm=_number(args.tpm),
            priority=args.priority,
            expires_days=_number(args.expires_days),
            fallback=False if args.no_fallback else None,
            max_inflight=_number(args.max_inflight),
            models=args.model,
        )
    except KeySpecError as exc:
        _audit(store, "key.create", "key", "refused", param=exc.field)
        return _fail(exc, 2)
    except KeysFileError as exc:
        _audit(store, "key.create", "key", "error", code="keys_file_error")
        return _fail(exc)
    scopes = sorted(record.scopes)
    _audit(store, "key.create", f"key:{record.id}", "ok", name=record.name, scopes=scopes)
    sys.stdout.write(key + "\n")
    sys.stdout.flush()
    expires = _when(record.expires_at)
    print(
        f"created key {record.id} ({record.name}; scopes {','.join(sorted(record.scopes))}; "
        f"expires {expires}{'' if record.fallback else '; no fallback'}"
        f"{'' if record.models is None else '; models ' + ','.join(record.models)}) "
        f"in {store.path}.\n"
        "Store it now; it is not shown again.",
        file=sys.stderr,
    )
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        store.load()
    except KeysFileError as exc:
        return _fail(exc)
    now = time.time()
    records = store.records
    if args.json:
        out = [{**r.public_dict(), "status": _status(r, now)} for r in records]
        print(json.dumps(out, indent=2))
        return 0
    rows = [COLUMNS] + [
        (
            r.id,
            r.name,
            ",".join(sorted(r.scopes)),
            "-" if r.rpm is None else str(r.rpm),
            "-" if r.tpm is None else str(r.tpm),
            r.priority,
            "yes" if r.fallback else "no",  # no: always waits for the model it names
            "-" if not r.max_inflight else str(r.max_inflight),
            "all" if r.models is None else ",".join(r.models),
            _when(r.expires_at),
            _when(r.created_at),
            _status(r, now),
        )
        for r in records
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if not records:
        print(f"no keys in {store.path}", file=sys.stderr)
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    store = _store(args)
    target = "key:?"  # the id only once it is one: a secret pasted as an id stays out
    try:
        key_id = validate_key_id(args.id)
        target = f"key:{key_id}"
        removed = store.revoke(key_id)
    except KeySpecError as exc:
        _audit(store, "key.revoke", target, "refused", param=exc.field)
        return _fail(exc, 2)
    except KeysFileError as exc:
        _audit(store, "key.revoke", target, "error", code="keys_file_error")
        return _fail(exc)
    if removed:
        _audit(store, "key.revoke", target, "ok")
    else:
        _audit(store, "key.revoke", target, "refused", code="unknown_key")
    if not removed:
        return _fail(
            f"no key with id {args.id!r} in {store.path} (`llm-appliance keys list` shows the ids)"
        )
    print(f"revoked key {key_id}; a running daemon stops accepting it within 2 s")
    return 0


_DURATION = re.compile(r"([0-9]{1,6})([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
USAGE_COLUMNS = ("ID", "NAME", "PROMPT", "COMPLETION", "TOTAL", "ENERGY_WH")
J_PER_WH = 3600.0


def _duration(text: str) -> float:
    """``24h``, ``7d``, ``90m``, ``30s``: seconds (argparse's type)."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 24h, 7d or 90m")
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def cmd_usage(args: argparse.Namespace) -> int:
    """Tokens per key id, as the daemon last saved them (every 10 s, and on stop)."""
    store = _store(args)
    path = usage_path(store.path)
    try:
        counts = read_usage(path)
    except UsageFileError as exc:
        return _fail(f"{path} is not a usage file ({exc}); the daemon sets it aside at start")
    except OSError as exc:
        return _fail(f"cannot read {path} ({exc.strerror or exc})")
    start = None if args.since is None else time.time() - args.since
    per_key = counts.since(start) if counts is not None else {}
    energy = counts.energy_since(start) if counts is not None else {}
    rows = _usage_rows(per_key, _key_names(store), energy)
    if args.json:
        print(json.dumps({"since_seconds": args.since, "file": str(path), "keys": rows}, indent=2))
        return 0
    _print_usage_table(rows)
    if not rows:
        print(f"no usage recorded in {path}", file=sys.stderr)
    return 0


def _key_names(store: KeyStore) -> dict[str, str]:
    """Key id to name, for the keys the file still holds."""
    try:
        store.load()
    except KeysFileError:
        return {}  # names are a courtesy: the ids are what the file counts by
    return {r.id: r.name for r in store.records}


def _usage_rows(
    per_key: Mapping[str, tuple[int, int]],
    names: Mapping[str, str],
    energy: Mapping[str, float],
) -> list[dict[str, Any]]:
    """One row per key id, the heaviest user first. ``energy_wh``: the key's estimated
    share of its GPUs' energy (accounting/energy.py); None when none was ever charged to
    it (no energy telemetry: a CPU box, a card without the counter), which is not 0."""
    tokens = {k: per_key.get(k, (0, 0)) for k in per_key.keys() | energy.keys()}
    return [
        {
            "id": key_id,
            "name": names.get(key_id),
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "energy_wh": round(energy[key_id] / J_PER_WH, 6) if key_id in energy else None,
        }
        for key_id, (p, c) in sorted(tokens.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    ]


def _print_usage_table(rows: Sequence[Mapping[str, Any]]) -> None:
    table: list[tuple[str, ...]] = [USAGE_COLUMNS] + [
        (
            str(r["id"]),
            r["name"] or "(revoked)",
            str(r["prompt_tokens"]),
            str(r["completion_tokens"]),
            str(r["total_tokens"]),
            "-" if r["energy_wh"] is None else f"{r['energy_wh']:.3f}",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(USAGE_COLUMNS))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Add `keys` (create, list, revoke) to the top-level subcommands."""
    keys = sub.add_parser(
        "keys",
        parents=[common],
        help="create, list or revoke API keys",
        description="Manage API keys in the keys file (gateway.keys_file). "
        "A running daemon picks changes up within 2 s.",
    )
    ksub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    _add_create(ksub, common)
    p = ksub.add_parser("list", parents=[common], help="one row per key (never the secret)")
    p.add_argument("--json", action="store_true", help="a JSON list, for machines")
    p.set_defaults(func=cmd_list)
    _add_usage(ksub, common)
    p = ksub.add_parser("revoke", parents=[common], help="revoke a key by its id")
    p.add_argument("id", metavar="ID", help="the key's id, as `keys list` shows it")
    p.set_defaults(func=cmd_revoke)


def _add_create(
    ksub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    p = ksub.add_parser(
        "create",
        parents=[common],
        help="create a key and print it once",
        description="Create a key; it is printed once, alone on the first line of stdout.",
    )
    p.add_argument("--name", required=True, help="who or what the key is for (<= 64 chars)")
    # No argparse `type`/`choices` here: keys/fields.py validates every field (one message per
    # field, shared with the admin API); the metavars show what is allowed.
    p.add_argument(
        "--scope",
        action="append",
        metavar="{" + ",".join(sorted(SCOPES)) + "}",
        default=None,
        help="user (/v1), metrics (/metrics), admin (everything); repeatable; default: user",
    )
    p.add_argument("--rpm", metavar="N", help=f"requests per minute, 1..{MAX_RPM}")
    p.add_argument("--tpm", metavar="N", help=f"tokens per minute, 1..{MAX_TPM}")
    p.add_argument(
        "--priority",
        metavar="{" + ",".join(PRIORITIES) + "}",
        default="interactive",
        help="batch is shed first under pressure (default: interactive)",
    )
    p.add_argument(
        "--expires-days",
        metavar="N",
        help=f"the key stops working after N days, at most {MAX_EXPIRES_DAYS} (default: never)",
    )
    p.add_argument(
        "--no-fallback",
        action="store_true",
        help="this key's requests wait for the model they name, never go to its fallback model",
    )
    p.add_argument(
        "--max-inflight",
        metavar="N",
        help=f"at most N of this key's requests in flight at once; beyond, they wait in the "
        f"queue (not refused); 0..{MAX_INFLIGHT}, default: 0 (no cap)",
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        default=None,
        help="the key may use only this model (its aliases and adapters follow it); "
        "repeatable; default: every model",
    )
    p.set_defaults(func=cmd_create)


def _add_usage(
    ksub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    p = ksub.add_parser(
        "usage",
        parents=[common],
        help="tokens and energy used per key id",
        description="Prompt and completion tokens per key id, from the engines' own counts, "
        "and each key's estimated share of its GPUs' energy (by its tokens), as the daemon "
        "last saved them (usage.json beside the keys file; every 10 s and on stop).",
    )
    p.add_argument(
        "--since",
        type=_duration,
        metavar="DURATION",
        help="only the last DURATION (e.g. 24h, 7d; an hour's grain, 31 days at most); "
        "default: all time",
    )
    p.add_argument("--json", action="store_true", help="a JSON object, for machines")
    p.set_defaults(func=cmd_usage)
