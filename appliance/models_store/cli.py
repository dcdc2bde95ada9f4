"""`llm-appliance models pull|list|remove`: the model store from the command line.

``pull`` prints the ``[[models]]`` lines that serve what it pulled; ``list`` shows each
folder of the store (name, size, source, revision, which of the config's models use it;
``--json`` for scripts); ``remove`` deletes one, refused while the config names it.
Exit 1 with one line on anything that did not happen.
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import json
import os
import pwd
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config import load_config
from appliance.models_store.pull import PullError, pull, read_token
from appliance.models_store.store import (
    check_name,
    default_name,
    read_record,
    store_dir,
    stored_models,
)
from appliance.setup import ownership


def _fail(args: argparse.Namespace, message: str) -> int:
    print(f"llm-appliance models {args.action}: {message}", file=sys.stderr)
    return 1


def models_lines(name: str, folder: str, trust_remote_code: bool) -> list[str]:
    """The [[models]] table that serves a pulled model."""
    lines = ["[[models]]", f'name = "{name}"', f'model = "{folder}"']
    if trust_remote_code:
        lines.append('extra_args = ["--trust-remote-code"]  # the repository runs its own code')
    return lines


def cmd_pull(args: argparse.Namespace) -> int:
    load_config(args.config)  # a bad config is exit 2 before anything is fetched
    name = args.name or default_name(args.repo_id)
    if (why := check_name(name)) is not None:
        return _fail(args, why)
    home = paths.appliance_home()
    folder = store_dir(home) / name
    record = read_record(folder)
    if record is not None and record.get("repo_id") != args.repo_id:
        return _fail(
            args,
            f"{folder} holds {record.get('repo_id')} already: pass --name for another folder",
        )
    try:
        token = read_token(args.token_file)
        done = pull(
            args.repo_id,
            folder,
            revision=args.revision,
            token=token,
            allow_pickle=args.allow_pickle,
            trust_remote_code=args.trust_remote_code,
        )
    except PullError as exc:
        return _fail(args, str(exc))
    finally:
        # Done or not (a half pull is resumed later, maybe by the service account).
        _give_store_back(home)
    gib = done.bytes / 1024**3
    print(
        f"pulled {args.repo_id}@{done.commit[:12]}: {len(done.files)} files, {gib:.1f} GiB "
        f"in {done.folder}; to serve it, add to the config (then `llm-appliance models fit "
        f"{name}` and restart):",
        file=sys.stderr,
    )
    print("\n".join(models_lines(name, str(done.folder), args.trust_remote_code)))
    return 0


def _give_store_back(home: Path) -> None:
    """Run as root into a home that is another account's (``sudo llm-appliance models
    pull`` into the service's /var/lib/llm-appliance): hand what root made in the store
    to that account, as set-up does, so the service owns its models (it may read, update
    and remove them; the model trust rule takes its files as it takes root's)."""
    handed = ownership.give_back(home, under=store_dir(home))
    if handed is None or not (handed.count or handed.left):
        return
    uid, gid = handed.owner
    print(
        f"{handed.count} entries of {store_dir(home)} handed to {_name(pwd.getpwuid, uid)}:"
        f"{_name(grp.getgrgid, gid)}, the owner of {home}",
        file=sys.stderr,
    )
    for entry in handed.left:
        print(f"left to root: {entry}", file=sys.stderr)


def _name(lookup: Callable[[int], Any], number: int) -> str:
    with contextlib.suppress(KeyError):
        return str(lookup(number)[0])
    return str(number)


def cmd_list(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    found = stored_models(config, paths.appliance_home(), os.environ)
    if args.json:
        print(json.dumps([m.as_json() for m in found], indent=2))
        return 0
    if not found:
        print(f"no models in {store_dir(paths.appliance_home())}")
        return 0
    width = max(len(m.name) for m in found)
    for m in found:
        used = ", ".join(m.used_by) or "-"
        print(f"{m.name:<{width}}  {m.bytes / 1024**3:7.2f} GiB  used by: {used}  {m.source}")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    home = paths.appliance_home()
    found = {m.name: m for m in stored_models(config, home, os.environ)}
    m = found.get(args.name)
    if m is None:
        return _fail(args, f"no model {args.name!r} in {store_dir(home)} (`models list`)")
    if m.used_by:
        return _fail(
            args,
            f"{m.path} is what the config's model(s) {', '.join(m.used_by)} load: take it out "
            "of the config first (and restart)",
        )
    if m.source.startswith("packaged:"):
        return _fail(args, f"{m.path} is a packaged model (`llm-appliance setup` made it)")
    shutil.rmtree(m.path)
    print(f"removed {m.path} ({m.bytes / 1024**3:.1f} GiB)")
    return 0


def add_store_parsers(actions: Any, common: argparse.ArgumentParser) -> None:
    """`models pull`, `models list` and `models remove` under the ``models`` command."""
    p = actions.add_parser(
        "pull", parents=[common], help="download a Hugging Face model into the model store"
    )
    p.add_argument("repo_id", metavar="REPO_ID", help="e.g. Qwen/Qwen2.5-Coder-7B-Instruct")
    p.add_argument("--revision", metavar="REV", help="a branch, tag or commit (default: main)")
    p.add_argument("--name", help="the store folder's name (default: from REPO_ID)")
    p.add_argument(
        "--token-file",
        metavar="PATH",
        help="a file holding a Hugging Face token (gated or private repositories; default: "
        "Hugging Face's own token file or $HF_TOKEN)",
    )
    p.add_argument(
        "--allow-pickle", action="store_true", help="also take *.bin/*.pt weights (pickles)"
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="also take the repository's *.py files (they run in the engine)",
    )
    p.set_defaults(func=cmd_pull)
    p = actions.add_parser("list", parents=[common], help="the models in the model store")
    p.add_argument("--json", action="store_true", help="a JSON list: name, path, bytes, ...")
    p.set_defaults(func=cmd_list)
    p = actions.add_parser(
        "remove", parents=[common], help="delete a model of the store no model of the config uses"
    )
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=cmd_remove)
