"""The table `llm-appliance status` prints: the appliance's line, the engines, the GPUs.

Pure functions from the ``GET /admin/status`` document to text; no I/O. Whether the box
and each model are ready is /readyz's verdict, which the document carries (``ready``,
``readiness``): the table never says ready where /readyz says 503, nor DOWN for a model
on demand put away. With several models the engines come in one block per model, under
a line with the model's word; a daemon older than models (no ``model``, only ``gpu``)
still gets a table. A model whose engines run its repository's own Python
(``trust_remote_code``: vLLM's --trust-remote-code) gets a line that says so.
"""

from __future__ import annotations

import time
from typing import Any


def _fmt(value: Any, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}{suffix}" if value < 10 else f"{value:.0f}{suffix}"
    return f"{value}{suffix}"


ENGINE_COLUMNS = (
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


def engine_model(e: dict[str, Any]) -> str:
    """The model an engine serves; "" from a daemon older than models (no ``model``)."""
    return str(e.get("model") or e.get("served_model_name") or "")


def engine_gpus(e: dict[str, Any]) -> str:
    """Its GPUs as "0,1" (tensor parallel), "0", or "-" on CPU. A daemon older than
    models sends only ``gpu``, the first one."""
    gpus = e.get("gpus")
    if gpus:
        return ",".join(str(g) for g in gpus)
    return _fmt(e.get("gpu"))


def group_by_model(engines: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Engines per model, models in the order their first engine comes (the config's)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in engines:
        groups.setdefault(engine_model(e), []).append(e)
    return groups


PUT_AWAY_NOTE = {
    "unloaded": "put away, its next request loads it",
    "sleeping": "asleep, its next request wakes it",
    "loading": "loading",
    "unloading": "being put away",
}


def model_word(name: str, engines: list[dict[str, Any]], doc: dict[str, Any]) -> str:
    """A model's word as /readyz says it (``readiness.models``: ready, down, unloaded,
    sleeping, loading, unloading); a daemon older than that: ready while some engine
    is READY, else down."""
    words = (doc.get("readiness") or {}).get("models") or {}
    if name in words:
        return str(words[name])
    return "ready" if any(e["state"] == "READY" for e in engines) else "down"


def model_heading(name: str, engines: list[dict[str, Any]], word: str | None = None) -> str:
    """``model chat: ready, 1/2 engines READY``: /readyz's word for the model (``word``;
    None: ready while some engine is READY). Down is DOWN (its requests get 503 or go to
    its fallback); a model on demand put away says so, and that its next request loads
    it: it is not down."""
    n_ready = sum(e["state"] == "READY" for e in engines)
    if word is None:
        word = "ready" if n_ready else "down"
    shown = "DOWN" if word == "down" else word
    if word in PUT_AWAY_NOTE and word != "loading":
        shown += f" ({PUT_AWAY_NOTE[word]})"
    return f"model {name}: {shown}, {n_ready}/{len(engines)} engines READY"


def _engine_row(e: dict[str, Any]) -> tuple[str, ...]:
    return (
        str(e["id"]),
        engine_gpus(e),
        _fmt(e.get("port")),  # null when the engine listens on a Unix socket
        e["state"],
        str(e["inflight"]),
        str(e["throttle_level"]),
        _fmt(e["temperature_c"], "C"),
        _fmt(e.get("kv_cache_usage")),
        str(e["restarts"]),
        e["last_restart_reason"] or "-",
    )


def _engine_lines(doc: dict[str, Any]) -> list[str]:
    """The engines table; with several models, one block per model under its heading
    (columns aligned across the blocks). One model: a single table, as before models."""
    rows = [_engine_row(e) for e in doc["engines"]]
    widths = [max(len(r[i]) for r in [ENGINE_COLUMNS, *rows]) for i in range(len(ENGINE_COLUMNS))]

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()

    groups = group_by_model(doc["engines"])
    if len(groups) <= 1:
        return [line(ENGINE_COLUMNS), *(line(r) for r in rows)]
    out: list[str] = []
    for name, engines in groups.items():
        if out:
            out.append("")
        heading = model_heading(name or "(unnamed)", engines, model_word(name, engines, doc))
        out += [heading, line(ENGINE_COLUMNS)]
        out += [line(_engine_row(e)) for e in engines]
    return out


def _engine_notes(engines: list[dict[str, Any]]) -> list[str]:
    """After the table, one line per engine that has more to say: speculative decoding's
    acceptance over the last minute, and why a FAILED engine's process exited."""
    notes = []
    for e in engines:
        rate, length = e.get("spec_acceptance_rate"), e.get("spec_mean_accepted_length")
        if rate is not None or length is not None:
            shown_rate = "-" if rate is None else f"{rate:.0%}"
            shown_len = "-" if length is None else f"{length:.2f}"
            notes.append(
                f"engine {e['id']} speculation (last minute): acceptance {shown_rate}, "
                f"mean accepted length {shown_len}"
            )
        if e["state"] == "FAILED" and e.get("last_exit"):
            notes.append(f"engine {e['id']} FAILED: {e['last_exit']}")
    return ["", *notes] if notes else []


def _trust_lines(models: list[dict[str, Any]]) -> list[str]:
    """One line per model whose engines run its repository's own Python (vLLM's
    --trust-remote-code): that code runs with the service's rights, so it is said."""
    lines = [
        f"model {m['name']}: trusts remote code (--trust-remote-code): its engines run the "
        "Python code that came with the model"
        for m in models
        if m.get("trust_remote_code")
    ]
    return ["", *lines] if lines else []


def _key_lines(keys: list[dict[str, Any]]) -> list[str]:
    """The keys holding the box now: requests in flight per key, most first (the
    document's ``keys_inflight``, at most its top ten), so an operator sees who fills it."""
    if not keys:
        return []
    out = ["", "KEY                  NAME                 INFLIGHT"]
    for k in keys:
        out.append(f"{k['id']:<20} {k.get('name') or '-':<20} {k['inflight']}")
    return out


def _model_lines(models: list[dict[str, Any]]) -> list[str]:
    """Models on demand: each model's load state and its last request (shown only when
    some model loads on demand: otherwise every model is simply always loaded)."""
    if not any(m.get("load") == "on_demand" for m in models):
        return []
    out = ["", "MODEL                LOAD       STATE      LAST USED"]
    now = time.time()
    for m in models:
        used = m.get("last_used")
        ago = "-" if used is None else f"{max(0.0, now - used):.0f} s ago"
        state = m["state"] + (f" ({m['detail']})" if m.get("detail") else "")
        out.append(f"{m['name']:<20} {m['load']:<10} {state:<10} {ago}")
    return out


def _verdict(doc: dict[str, Any]) -> tuple[str, list[str]]:
    """The head's word and the lines that say why it is not ready: /readyz's verdict
    (``ready`` and ``readiness`` carry it), so the two never disagree."""
    readiness = doc.get("readiness") or {}
    if doc["ready"]:
        return "ready", []
    why = readiness.get("status")
    word = "NOT READY" + (f" ({why})" if why and why != "stopping" else "")
    reasons = readiness.get("reasons") or {}
    lines = [f"engine {e}: {reason}" for e, reason in sorted(reasons.items(), key=_engine_key)]
    return word, lines


def _engine_key(item: tuple[str, Any]) -> tuple[int, str]:
    return (int(item[0]) if str(item[0]).isdigit() else 1 << 30, str(item[0]))


def render_table(doc: dict[str, Any]) -> str:
    word, why = _verdict(doc)
    head = (
        f"llm-appliance {doc['version']} on {doc['device']}: {word}"
        f"{'' if doc['accepting'] else ' (stopping)'}, queue {doc['queue_depth']}, "
        f"up {doc['uptime_s']:.0f} s"
    )
    out = [head, *why, "", *_engine_lines(doc), *_engine_notes(doc["engines"])]
    out += _trust_lines(doc.get("models") or [])
    out += _model_lines(doc.get("models") or [])
    out += _key_lines(doc.get("keys_inflight") or [])
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
