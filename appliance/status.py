"""`llm-appliance status`: what the running daemon is doing, as a table or JSON.

With several models (``[[models]]``) the engines table comes in one block per model, each
under a line saying whether the model is ready (some engine READY) or DOWN; each engine's
GPUs read "0,1" when it spans several (tensor parallel). ``--json`` prints the document.
The table is drawn in :mod:`appliance.status_table`.

It reads ``GET /admin/status`` (scope admin). The key comes from ``--key``, else
``$LLM_APPLIANCE_KEY``, else the ``admin.key`` that first start wrote beside the keys
file, else the first admin key the Ansible role made (:data:`ROLE_ADMIN_KEY_FILE`), so
``sudo llm-appliance status`` needs no flags on either kind of install. Refused (401 or
403), it says which key it sent, or every place it looked and why each gave no key.

Over HTTPS the admin key goes only to a server whose certificate checks out: the system's
CAs and the URL's host name by default, ``--cacert PATH`` to trust a CA or a self-signed
certificate instead, and ``--insecure`` (said out loud, with a warning) to skip the check.
Without ``--url`` the address is the config's own gateway, and the certificate it must
present is the config's own ``tls_cert`` (pinned: that exact certificate, whatever name
it was made for), so ``status`` on the box needs no flags with TLS either.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import ssl
import stat
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.config import load_config
from appliance.gateway.keys import parse_key_id
from appliance.status_table import render_table

ADMIN_KEY_MAX_BYTES = 4096
ROLE_ADMIN_KEY_FILE = Path("/root/llm-appliance-admin.key")
"""Where the Ansible role puts the first admin key: its ``llm_appliance_admin_key_file``
default (the role does not write it into the config). A role run with another path:
pass that key in ``LLM_APPLIANCE_KEY``."""
_PEM_CERT_RE = re.compile(
    r"-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]+-----END CERTIFICATE-----", re.ASCII
)


class TLSOptionError(ValueError):
    """--cacert or the configured certificate cannot be used; exit 2."""


@dataclass(frozen=True)
class Target:
    """Where status asks, and which certificate it accepts there."""

    url: str
    cacert: str | None = None  # trust these CAs (or this self-signed certificate)
    pinned_cert: str | None = None  # accept exactly this certificate (PEM), any name
    insecure: bool = False  # no certificate check at all


def _default_target(args: argparse.Namespace) -> Target:
    g = load_config(args.config).gateway
    host = "127.0.0.1" if g.host in ("0.0.0.0", "::") else g.host
    host = f"[{host}]" if ":" in host else host
    url = f"{'https' if g.tls_cert else 'http'}://{host}:{g.port}"
    return Target(url, pinned_cert=first_certificate(g.tls_cert) if g.tls_cert else None)


def first_certificate(path: str) -> str | None:
    """The first certificate of a PEM file (the server's own, before any chain); None when
    it cannot be read (then the usual checks apply)."""
    try:
        text = Path(path).read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    m = _PEM_CERT_RE.search(text)
    return m.group(0) if m else None


def ssl_context(target: Target) -> ssl.SSLContext | None:
    """The TLS settings for ``target``: None for http://. Certificates and host names are
    checked unless ``insecure``. TLSOptionError when --cacert cannot be loaded."""
    if not target.url.lower().startswith("https://"):
        return None
    if target.insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    if target.cacert:
        try:
            return ssl.create_default_context(cafile=target.cacert)
        except (OSError, ssl.SSLError) as exc:
            reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
            raise TLSOptionError(f"cannot load --cacert {target.cacert}: {reason}") from None
    if target.pinned_cert:
        # The only trust anchor is the gateway's own certificate, so only a server holding
        # its private key can answer; which name it was made for does not matter then
        # (the box's LAN name, while status asks 127.0.0.1). PARTIAL_CHAIN lets a
        # certificate that is not self-signed (one a CA issued) be that anchor.
        try:
            ctx = ssl.create_default_context(cadata=target.pinned_cert)
        except ssl.SSLError:
            return ssl.create_default_context()
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        ctx.check_hostname = False
        return ctx
    return ssl.create_default_context()


@dataclass(frozen=True)
class AdminKey:
    """The key status sends, where it came from, and where it was looked for in vain."""

    key: str | None
    source: str  # "--key", "$LLM_APPLIANCE_KEY" or a file; "" when no key was found
    misses: tuple[str, ...] = ()  # "PATH (why not)", in the order looked at

    @property
    def blocked(self) -> bool:
        """Some file that may hold the key is there but not readable by this user."""
        return any(m.endswith("(permission denied)") for m in self.misses)


def _read_admin_key(path: Path) -> tuple[str | None, str]:
    """(the key in ``path``, "") or (None, why not). The file may lie in the service
    account's directory, and whatever is read here is sent to the gateway: so never
    through a symlink (root must not be made to send /etc/shadow), only a small regular
    file, and only a well-formed key."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            _warn(f"ignoring {path}: it is a symbolic link")
            return None, "a symbolic link, ignored"
        return None, (exc.strerror or str(exc)).lower()
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            _warn(f"ignoring {path}: it is not a regular file")
            return None, "not a regular file"
        key = f.read(ADMIN_KEY_MAX_BYTES).decode("ascii", errors="replace").strip()
    if parse_key_id(key) is None:
        _warn(f"ignoring {path}: it does not hold an llm-appliance key")
        return None, "not an llm-appliance key"
    return key, ""


def find_admin_key(args: argparse.Namespace) -> AdminKey:
    """--key, else $LLM_APPLIANCE_KEY, else the first admin key file that holds a key:
    first start's admin.key beside the keys file, then the Ansible role's."""
    if args.key:
        return AdminKey(args.key, "--key")
    if os.environ.get("LLM_APPLIANCE_KEY"):
        return AdminKey(os.environ["LLM_APPLIANCE_KEY"], "$LLM_APPLIANCE_KEY")
    first_start = Path(load_config(args.config).gateway.keys_file).with_name("admin.key")
    misses: list[str] = []
    for path in (first_start, ROLE_ADMIN_KEY_FILE):
        key, why = _read_admin_key(path)
        if key is not None:
            return AdminKey(key, str(path), tuple(misses))
        misses.append(f"{path} ({why})")
    return AdminKey(None, "", tuple(misses))


def refusal_hint(code: int, found: AdminKey) -> str:
    """What to do when the gateway answered ``code`` to the key in ``found``."""
    send = "pass an admin key in LLM_APPLIANCE_KEY (or --key)"
    if code == 401 and found.key is None:
        todo = "run it with sudo, or " if found.blocked else ""
        return (
            f"no admin key: none in --key or $LLM_APPLIANCE_KEY, nor in "
            f"{', '.join(found.misses)}; {todo}{send}"
        )
    if code == 401:
        return (
            f"the admin key from {found.source} was refused (revoked, expired or mistyped); {send}"
        )
    if code == 403:
        return f"the key from {found.source} has no admin scope; {send}"
    return ""


def _warn(message: str) -> None:
    print(f"llm-appliance status: {message}", file=sys.stderr)


def fetch_status(
    url: str, key: str | None, timeout: float = 5.0, context: ssl.SSLContext | None = None
) -> dict[str, Any]:
    """GET /admin/status. ``context``: see :func:`ssl_context` (None for http://; for
    https:// None means the default checks)."""
    req = urllib.request.Request(
        url.rstrip("/") + "/admin/status", headers={"Authorization": f"Bearer {key}"} if key else {}
    )
    with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return data


def target_of(args: argparse.Namespace) -> Target:
    if args.url:
        return Target(args.url, cacert=args.cacert, insecure=args.insecure)
    default = _default_target(args)
    if args.cacert or args.insecure:
        return Target(default.url, cacert=args.cacert, insecure=args.insecure)
    return default


def unreachable_words(target: Target, exc: OSError | ValueError) -> str:
    """One line saying why ``target`` gave no answer, with what to do about it."""
    url, reason = target.url, getattr(exc, "reason", exc)
    if isinstance(reason, ssl.SSLCertVerificationError):
        why = (reason.verify_message or str(reason)).rstrip(".")
        if target.cacert:
            hint = f"check that {target.cacert} is the gateway's certificate or its CA"
            if "mismatch" in why:
                hint = "give --url the host name the certificate was made for"
        elif target.pinned_cert:
            hint = (
                "it is not the config's gateway.tls_cert, so this is not the gateway "
                "configured here (pass --url and --cacert to ask another)"
            )
        else:
            hint = (
                "pass --cacert PATH (the gateway's certificate or its CA), or --insecure to "
                "send the admin key without checking who receives it"
            )
        return f"{url}: the server's certificate is not trusted ({why}); {hint}"
    if isinstance(reason, ssl.SSLError):
        return f"{url}: TLS failed ({reason.reason or reason})"
    return f"cannot reach {url}: {reason} (is the daemon running? systemctl status llm-appliance)"


def cmd_status(args: argparse.Namespace) -> int:
    target = target_of(args)
    url = target.url
    try:
        context = ssl_context(target)
    except TLSOptionError as exc:
        _warn(str(exc))
        return 2
    if target.insecure and context is not None:
        _warn("--insecure: the certificate is not checked, so anyone in between gets the key")
    found = find_admin_key(args)
    try:
        doc = fetch_status(url, found.key, context=context)
    except urllib.error.HTTPError as exc:
        hint = refusal_hint(exc.code, found)
        _warn(f"{url} answered {exc.code}{': ' + hint if hint else ''}")
        return 1
    except (OSError, ValueError) as exc:
        _warn(unreachable_words(target, exc))
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
        help="an admin key (default: $LLM_APPLIANCE_KEY, else admin.key beside the keys "
        f"file, else {ROLE_ADMIN_KEY_FILE}, where the Ansible role puts it)",
    )
    tls = p.add_mutually_exclusive_group()
    tls.add_argument(
        "--cacert",
        metavar="PATH",
        help="https: trust the CA certificates in PATH (or this self-signed certificate) "
        "instead of the system's; the host name is still checked",
    )
    tls.add_argument(
        "--insecure",
        action="store_true",
        help="https: do not check the certificate at all (the admin key may reach an impostor)",
    )
    p.add_argument("--json", action="store_true", help="print /admin/status as JSON")
    p.set_defaults(func=cmd_status)
