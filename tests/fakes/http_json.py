"""One HTTP call to a daemon under test, with a key, as the integration tests make them:
the status and the body (JSON when it is JSON, else its text), errors included."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def call_json(
    url: str, key: str, method: str, path: str, body: Any = None, timeout: float = 60
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, raw.decode(errors="replace")
