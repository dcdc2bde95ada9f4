"""The Grafana dashboard, monitoring/grafana/llm-appliance.json, as Grafana imports it.

Importable: the Prometheus datasource is an ``__inputs`` entry that every panel and query
uses, constants asked at import are declared, the schema is current. Readable: every
panel has a unit, a description and a legend for every query, rows in the expected
order, nothing overlapping. Whether the queries return data from a real daemon is
tests/integration/test_monitoring.py's job.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "monitoring" / "grafana" / "llm-appliance.json"
DS_INPUT = "${DS_PROMETHEUS}"
SCHEMA_VERSION = 41  # what Grafana 12 exports
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"}


def _dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return doc


def _panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def test_the_datasource_is_an_import_input_and_the_schema_is_current() -> None:
    doc = _dashboard()
    inputs = {i["name"]: i for i in doc["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    assert doc["schemaVersion"] == SCHEMA_VERSION
    assert doc["id"] is None and doc["uid"] == "llm-appliance"


def test_every_panel_and_query_uses_the_datasource_input() -> None:
    for panel in _panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": DS_INPUT}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
    for var in _dashboard()["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"]["uid"] == DS_INPUT, var["name"]


def test_every_panel_has_a_unit_a_description_and_a_legend_per_query() -> None:
    titles = [p["title"] for p in _panels()]
    assert len(titles) == len(set(titles)), "panel titles must be unique (tests name them)"
    for panel in _panels():
        title = panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), title
        assert panel.get("description"), title
        assert panel["options"]["legend"]["showLegend"] is True, title
        for target in panel["targets"]:
            assert target["expr"].strip(), title
            legend = target.get("legendFormat", "")
            assert legend and legend != "__auto", f"{title} {target['refId']}: no legend"


def test_rows_are_service_engines_gpus_keys_and_nothing_overlaps() -> None:
    panels = _dashboard()["panels"]
    assert [p["title"] for p in panels if p["type"] == "row"] == [
        "Service",
        "Engines",
        "GPUs",
        "Keys",
    ]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        cells = {(x, y) for x in xs for y in ys}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells


def test_every_variable_in_a_query_is_defined_and_every_import_constant_is_used() -> None:
    doc = _dashboard()
    text = DASHBOARD.read_text(encoding="utf-8")
    defined = {v["name"] for v in doc["templating"]["list"]} | GRAFANA_BUILTINS
    exprs = [t["expr"] for p in _panels() for t in p["targets"]]
    exprs += [a["expr"] for a in doc["annotations"]["list"] if "expr" in a]
    used = {m for e in exprs for m in re.findall(r"\$(\w+)", e)}
    assert used - defined == set()
    constants = {i["name"] for i in doc["__inputs"] if i["type"] == "constant"}
    assert constants, "the thermal limits are asked at import"
    for name in constants:
        assert "${" + name + "}" in text, name
    assert set(re.findall(r"\$\{((?:DS|VAR)_\w+)\}", text)) == {i["name"] for i in doc["__inputs"]}
