"""`llm-appliance engines drain|resume|restart ID` and `models load|unload NAME`: the admin
API from the command line.

Each command is one request to the running gateway's ``/admin`` routes, found the way
``llm-appliance status`` finds it (:mod:`appliance.status`: the config's gateway, or
``--url``; the admin key from ``--key``, ``$LLM_APPLIANCE_KEY`` or the admin key files;
the same TLS checks), and prints what happened in one line on stdout. Anything else (an
unknown engine or model, no key, a key without admin scope, no daemon, a refusal) is one
line on stderr naming it and what to do, and exit 1 (2 for unusable TLS options, as for
``status``).

``--force``: a drain of the last engine serving stops the service, so the gateway refuses
it unless forced (``?force=true``). A restart of the last engine serving its model stops
that model until the engine is back; the gateway takes it, so the check is made here,
from ``/admin/status``, and ``--force`` passes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from appliance.status import (
    ROLE_ADMIN_KEY_FILE,
    AdminKey,
    Target,
    TLSOptionError,
    fetch_status,
    find_admin_key,
    refusal_hint,
    ssl_context,
    target_of,
    unreachable_words,
)

ADMIN_TIMEOUT_S = 15.0  # the gateway waits up to 10 s for an engine's runner to answer
EXIT_FAILED = 1
EXIT_OPTIONS = 2


class CommandFailed(Exception):
    """The one line to print on stderr; exit 1."""


@dataclass(frozen=True)
class Gateway:
    """Where the admin requests go, with what key and which TLS checks."""

    target: Target
    key: AdminKey
    context: Any  # ssl.SSLContext | None

    def post(self, path: str) -> tuple[int, dict[str, Any]]:
        """POST ``path``: (status, JSON body). CommandFailed when there is no answer, or
        when the key is refused (401, 403) or the route is not there (an older daemon)."""
        url = self.target.url.rstrip("/") + path
        headers = {"Authorization": f"Bearer {self.key.key}"} if self.key.key else {}
        req = urllib.request.Request(url, data=b"", headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=ADMIN_TIMEOUT_S, context=self.context) as r:
                return r.status, _json_object(r.read())
        except urllib.error.HTTPError as exc:
            code, body = exc.code, _json_object(exc.read())
        except (OSError, ValueError) as exc:
            raise CommandFailed(unreachable_words(self.target, exc)) from None
        if code in (401, 403):
            raise CommandFailed(
                f"{self.target.url} answered {code}: {refusal_hint(code, self.key)}"
            )
        return code, body

    def status(self) -> dict[str, Any]:
        try:
            return fetch_status(self.target.url, self.key.key, context=self.context)
        except urllib.error.HTTPError as exc:
            hint = refusal_hint(exc.code, self.key)
            raise CommandFailed(
                f"{self.target.url} answered {exc.code}{': ' + hint if hint else ''}"
            ) from None
        except (OSError, ValueError) as exc:
            raise CommandFailed(unreachable_words(self.target, exc)) from None


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def error_message(body: dict[str, Any]) -> str:
    """The message of an OpenAI-shaped error body ("" when it is not one). Hints written
    for HTTP callers are said the command line's way."""
    err = body.get("error")
    message = err.get("message") if isinstance(err, dict) else None
    if not isinstance(message, str):
        return ""
    return message.replace("add ?force=true", "add --force")


# ---- what each command asks and says ----------------------------------------------------


def engine_line(action: str, engine_id: int, body: dict[str, Any]) -> str:
    """The one line a done engine command prints."""
    if action == "restart":
        return (
            f"engine {engine_id}: restart asked for; it drains, then restarts "
            "(`llm-appliance status` shows it)"
        )
    state = body.get("state", "?")
    if action == "drain":
        return (
            f"engine {engine_id}: {state}: takes no new requests, those in flight finish "
            f"(`llm-appliance engines resume {engine_id}` to undo)"
        )
    return f"engine {engine_id}: {state}: takes requests again"


def model_line(action: str, name: str, body: dict[str, Any]) -> str:
    """The one line a model load or unload prints (the gateway answers once asked, with
    the state the model was in then; the work goes on in the background)."""
    was = str(body.get("state", "?"))
    done = "loaded" if action == "load" else "unloaded"
    if was == done:
        return f"model {name}: already {done}"
    doing = "loading" if action == "load" else "unloading (drained first)"
    return f"model {name}: {doing}, was {was}; `llm-appliance status` shows when it is {done}"


def last_serving(doc: dict[str, Any], engine_id: int) -> str | None:
    """The model that would have no engine READY if ``engine_id`` (READY now) went down,
    or None when another engine of its model is READY (or it serves nothing now)."""
    engines = [e for e in doc.get("engines", []) if isinstance(e, dict)]
    this = next((e for e in engines if e.get("id") == engine_id), None)
    if this is None or this.get("state") != "READY":
        return None
    model = this.get("model")
    others = [e for e in engines if e.get("id") != engine_id and e.get("model") == model]
    if any(e.get("state") == "READY" for e in others):
        return None
    return str(model) if model else "the service"


def run_engine(gw: Gateway, action: str, engine_id: int, force: bool) -> str:
    """Ask the gateway to drain, resume or restart engine ``engine_id``; its line."""
    if action == "restart" and not force:
        model = last_serving(gw.status(), engine_id)
        if model is not None:
            raise CommandFailed(
                f"engine {engine_id} is the last engine serving {model}: restarting it stops "
                f"{model} until it is back; add --force to restart it anyway"
            )
    query = "?force=true" if action == "drain" and force else ""
    code, body = gw.post(f"/admin/engines/{engine_id}/{action}{query}")
    if code in (200, 202):
        return engine_line(action, engine_id, body)
    why = error_message(body) or f"the gateway answered {code}"
    if code == 404:
        raise CommandFailed(f"{why} (`llm-appliance status` lists the engines)")
    raise CommandFailed(f"engine {engine_id}: {action} refused: {why}")


def run_model(gw: Gateway, action: str, name: str) -> str:
    """Ask the gateway to load or unload model ``name``; its line."""
    code, body = gw.post(f"/admin/models/{urllib.parse.quote(name, safe='')}/{action}")
    if code in (200, 202):
        return model_line(action, str(body.get("model") or name), body)
    why = error_message(body) or f"the gateway answered {code}"
    if code == 404:
        raise CommandFailed(
            f"model {name}: {why} (`llm-appliance status` lists the models, by name)"
        )
    raise CommandFailed(f"model {name}: {action} refused: {why}")


# ---- the command line ---------------------------------------------------------------------


def _gateway(args: argparse.Namespace) -> Gateway:
    target = target_of(args)
    context = ssl_context(target)
    if target.insecure and context is not None:
        _say(args, "--insecure: the certificate is not checked, so anyone in between gets the key")
    return Gateway(target, find_admin_key(args), context)


def _say(args: argparse.Namespace, line: str) -> None:
    print(f"llm-appliance {args.command}: {line}", file=sys.stderr)


def _run(args: argparse.Namespace, work: Callable[[Gateway], str]) -> int:
    try:
        gw = _gateway(args)
    except TLSOptionError as exc:
        _say(args, str(exc))
        return EXIT_OPTIONS
    try:
        line = work(gw)
    except CommandFailed as exc:
        _say(args, str(exc))
        return EXIT_FAILED
    print(line)
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    force = bool(getattr(args, "force", False))
    return _run(args, lambda gw: run_engine(gw, args.action, args.id, force))


def cmd_model(args: argparse.Namespace) -> int:
    return _run(args, lambda gw: run_model(gw, args.action, args.name))


def add_gateway_arguments(p: argparse.ArgumentParser) -> None:
    """--url, --key, --cacert, --insecure: as for ``status``."""
    p.add_argument("--url", help="gateway URL (default: from the config)")
    p.add_argument(
        "--key",
        help="an admin key (default: $LLM_APPLIANCE_KEY, else admin.key beside the keys "
        f"file, else {ROLE_ADMIN_KEY_FILE})",
    )
    tls = p.add_mutually_exclusive_group()
    tls.add_argument("--cacert", metavar="PATH", help="https: trust the CA certificates in PATH")
    tls.add_argument(
        "--insecure", action="store_true", help="https: do not check the certificate at all"
    )


def _engine_id(raw: str) -> int:
    if not raw.isascii() or not raw.isdigit():
        raise argparse.ArgumentTypeError(f"engine ids are whole numbers, got {raw!r}")
    return int(raw)


def add_engines_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "engines", parents=[common], help="drain, resume or restart an engine of the running daemon"
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    helps = {
        "drain": "no new requests to the engine; those in flight finish",
        "resume": "a drained engine takes requests again",
        "restart": "drain the engine, then restart it",
    }
    for action, text in helps.items():
        a = actions.add_parser(action, parents=[common], help=text)
        a.add_argument("id", type=_engine_id, metavar="ID", help="the engine's id (see status)")
        if action == "drain":
            a.add_argument(
                "--force",
                action="store_true",
                help="drain it even when it is the last engine serving (stops the service)",
            )
        elif action == "restart":
            a.add_argument(
                "--force",
                action="store_true",
                help="restart it even when it is the last engine serving its model",
            )
        add_gateway_arguments(a)
        a.set_defaults(func=cmd_engine)


def add_model_admin_parsers(actions: Any, common: argparse.ArgumentParser) -> None:
    """`models load NAME` and `models unload NAME` under the ``models`` command."""
    helps = {
        "load": "load a model served on demand now",
        "unload": "put a model served on demand away now (drained first)",
    }
    for action, text in helps.items():
        a = actions.add_parser(action, parents=[common], help=text)
        a.add_argument("name", metavar="NAME", help="the model's name (or an alias)")
        add_gateway_arguments(a)
        a.set_defaults(func=cmd_model)
