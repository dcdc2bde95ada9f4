"""The fields of a key: what each may hold, checked in one place with one message.

One validator per field, used by `keys create`, POST /admin/keys, DELETE /admin/keys/{id},
`keys revoke` and the keys file parser alike, so a field is refused in one place with one
message: a :class:`KeySpecError` naming the field (``param`` in an API error). The maxima
keep every stored value a finite JSON number that the rate limiter and the expiry
arithmetic can hold (10**400 rpm or 1e304 days would not be).

The fields only a file holds (the stored id, ``key_hash``, the times) have their
validator here too, so a hand-edited file is held to the same bounds, with the same
words. The scopes a key may have, and the scope each HTTP path needs, live here as well.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Literal, get_args

from appliance.gateway.keys.errors import KeySpecError

SCOPES = frozenset({"user", "metrics", "admin"})
DEFAULT_SCOPES = ("user",)
Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[str, ...] = get_args(Priority)

MAX_NAME_LEN = 64
MAX_RPM = 1_000_000  # requests per minute: far beyond what one box serves
MAX_TPM = 1_000_000_000  # tokens per minute: likewise
MAX_EXPIRES_DAYS = 36_500  # 100 years: a key that should outlive that needs no expiry
MAX_INFLIGHT = 100_000  # requests in flight per key: far beyond what one box runs at once
MAX_MODELS = 64  # models one key may name: far beyond what one box serves
MAX_MODEL_NAME_LEN = 256  # a model name (config names, aliases, adapters are shorter)
_LIMIT_MAXIMA = {"rpm": MAX_RPM, "tpm": MAX_TPM}
_SHOWN_MAX = 40
_ID_RE = re.compile(r"[0-9a-f]{8}")
_ID_INPUT_RE = re.compile(r"[0-9A-Fa-f]{8}")  # explicit ranges: never Unicode digits
_HASH_RE = re.compile(r"[0-9a-f]{64}")


# vLLM's routes outside /v1 that the gateway relays (tokenizer, scoring, Cohere's rerank).
USER_PATHS = frozenset(("/tokenize", "/detokenize", "/score", "/rerank"))
# Read-only routes under /admin that a `metrics` key may read: the status page's data
# (the page itself, /ui, needs no key; what it shows comes from here).
METRICS_READS = frozenset({"/admin/history"})


def required_scope(path: str) -> str | None:
    """The scope an HTTP path needs: /v1 (and /v2, and the relayed routes outside them)
    -> user, /metrics and the status page's data -> metrics, the rest of /admin -> admin;
    none for the probes and the page's own files."""
    if path in ("/v1", "/v2") or path.startswith(("/v1/", "/v2/")) or path in USER_PATHS:
        return "user"
    if path == "/metrics" or path in METRICS_READS:
        return "metrics"
    if path == "/admin" or path.startswith("/admin/"):
        return "admin"
    return None


def _show(value: object) -> str:
    """A bad value for a message, cut short: a refusal stays one short line."""
    try:
        text = repr(value)
    except ValueError:  # an int with more digits than Python will print
        return "a number with thousands of digits"
    return text if len(text) <= _SHOWN_MAX else text[: _SHOWN_MAX - 3] + "..."


# --- fields a user gives -----------------------------------------------------------------


def validate_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise KeySpecError("name", "must be a non-empty string")
    name = name.strip()
    if len(name) > MAX_NAME_LEN:
        raise KeySpecError("name", f"must be at most {MAX_NAME_LEN} characters, got {len(name)}")
    if any(not ch.isprintable() for ch in name):
        raise KeySpecError("name", "must not contain control characters")
    return name


def validate_scopes(scopes: object) -> frozenset[str]:
    """A list of scopes (a lone string counts as one); None: the default."""
    allowed = ", ".join(sorted(SCOPES))
    if scopes is None:
        return frozenset(DEFAULT_SCOPES)
    if isinstance(scopes, str):
        scopes = [scopes]
    if not isinstance(scopes, (list, tuple)):
        raise KeySpecError(
            "scopes", f"must be a list of scopes ({allowed}), got {type(scopes).__name__}"
        )
    bad = [s for s in scopes if not isinstance(s, str) or s not in SCOPES]
    if bad:
        shown = ", ".join(_show(s) for s in bad[:3]) + (", ..." if len(bad) > 3 else "")
        raise KeySpecError("scopes", f"unknown scope(s) {shown}; allowed: {allowed}")
    if not scopes:
        raise KeySpecError("scopes", f"at least one scope is needed: {allowed}")
    return frozenset(scopes)


def validate_limit(field_name: str, value: object) -> int | None:
    """rpm or tpm: a whole number from 1 to its maximum, or None (no limit)."""
    maximum = _LIMIT_MAXIMA[field_name]
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= maximum:
        return value
    raise KeySpecError(
        field_name,
        f"must be a whole number from 1 to {maximum}, or unset for no limit; got {_show(value)}",
    )


def validate_priority(value: object) -> Priority:
    if value is None or value == "interactive":
        return "interactive"
    if value == "batch":
        return "batch"
    raise KeySpecError("priority", f"must be one of {', '.join(PRIORITIES)}, got {_show(value)}")


def validate_fallback(value: object) -> bool:
    """Whether the key's requests may go to their model's fallback model (issue 13):
    true or false; None: true (keys made before the field existed, and the default)."""
    if value is None:
        return True
    if isinstance(value, bool):
        return value
    raise KeySpecError("fallback", f"must be true or false, got {_show(value)}")


def validate_max_inflight(value: object) -> int:
    """The most requests the key has in flight at once (issue 35): beyond it its requests
    wait in the queue, they are not refused. A whole number from 0 (no cap) to
    MAX_INFLIGHT; None: 0 (keys made before the field existed, and the default)."""
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INFLIGHT:
        return value
    raise KeySpecError(
        "max_inflight",
        f"must be a whole number from 0 (no cap) to {MAX_INFLIGHT}; got {_show(value)}",
    )


def validate_models(value: object) -> tuple[str, ...] | None:
    """The models the key may use (issue 35), by name, alias or adapter name as the config
    and the adapters say them; a model's aliases and adapters follow it (checked at
    request time, :func:`appliance.gateway.admission.models.model_allowed`). None: every model
    (keys made before the field existed, and the default). Names are kept in the order
    given, duplicates dropped; whether a name is served is not checked here: `keys
    create` runs without the daemon, and a model may be added to the config later."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise KeySpecError("models", f"must be a list of model names, got {type(value).__name__}")
    if not value:
        raise KeySpecError("models", "at least one model is needed; leave it unset for every model")
    if len(value) > MAX_MODELS:
        raise KeySpecError("models", f"at most {MAX_MODELS} models, got {len(value)}")
    names: list[str] = []
    for item in value:
        if (
            not isinstance(item, str)
            or not item.strip()
            or len(item) > MAX_MODEL_NAME_LEN
            or any(not ch.isprintable() for ch in item)
        ):
            raise KeySpecError(
                "models",
                f"each model must be a non-empty printable name of at most "
                f"{MAX_MODEL_NAME_LEN} characters, got {_show(item)}",
            )
        if item.strip() not in names:
            names.append(item.strip())
    return tuple(names)


def validate_expires_days(value: object) -> float | None:
    """Days until the key expires: above 0, at most MAX_EXPIRES_DAYS; None: never."""
    if value is None:
        return None
    # Compared before any float(): a huge int would overflow it; NaN fails both bounds.
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= MAX_EXPIRES_DAYS
    ):
        raise KeySpecError(
            "expires_days",
            f"must be a number of days above 0 and at most {MAX_EXPIRES_DAYS}, or unset "
            f"for never; got {_show(value)}",
        )
    return float(value)


def validate_key_id(value: object) -> str:
    """A key's public id as `keys list` shows it (8 hex characters; ASCII only, case and
    surrounding spaces forgiven), in its stored lower-case form."""
    text = value.strip() if isinstance(value, str) else None
    if text is None or not _ID_INPUT_RE.fullmatch(text):
        raise KeySpecError(
            "id", f"must be a key id: 8 hex characters as `keys list` shows; got {_show(value)}"
        )
    return text.lower()


# --- fields only the keys file holds -----------------------------------------------------


def validate_stored_id(value: object) -> str:
    """A key id as the file stores it: exactly 8 lower-case hex characters."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise KeySpecError("id", f"must be 8 lower-case hex characters, got {_show(value)}")
    return value


def validate_stored_time(field_name: str, value: object) -> float:
    """A Unix time from the file (created_at, expires_at): a finite number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int too large for a float
            number = float(value)
            if math.isfinite(number):
                return number
    raise KeySpecError(field_name, f"must be a number (Unix time), got {_show(value)}")


def validate_key_hash(value: object) -> str:
    """The stored sha256 of a key: 64 lower-case hex characters."""
    if not isinstance(value, str) or not _HASH_RE.fullmatch(value):
        raise KeySpecError("key_hash", "must be 64 lower-case hex characters (sha256)")
    return value
