"""docs/grafana-dashboard.json imports cleanly and queries only what /metrics exports.

The schema check is Grafana's own dashboard model (grafana-foundation-sdk, the
Grafana 11.6 types): decoding and re-encoding the file must keep every key and value,
so a key the model does not know, or a panel or query of a shape it cannot decode,
fails. The rest are the dashboard JSON model's required fields and the PromQL of
every query, checked against this process's own exposition (`telemetry.prometheus`);
tests/integration/test_prometheus.py checks the same names against a real server.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.cog.runtime import Runtime
from grafana_foundation_sdk.models.dashboard import Dashboard

from telemetry import names
from telemetry.prometheus import metric_names, render

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_COLUMNS = 24

# PromQL functions and aggregations the dashboard may use.
FUNCTIONS = {"sum", "max", "min", "avg", "rate", "increase", "histogram_quantile",
             "label_values"}
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in data["panels"] if p["type"] != "row"]


def exprs(data: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in panels(data) for t in p["targets"]]
    out += [v["query"]["query"] for v in data["templating"]["list"] if v["type"] == "query"]
    return out


def parse(expr: str) -> tuple[set[str], set[str], set[str]]:
    """(metric names, functions, grouping labels) of one PromQL expression."""
    labels = {label.strip() for group in GROUPING.findall(expr) for label in group.split(",")}
    s = GROUPING.sub(" ", expr)
    s = re.sub(r'"[^"]*"', " ", s)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges
    functions = set(re.findall(r"([A-Za-z_]+)\s*\(", s))
    s = re.sub(r"[A-Za-z_]+\s*\(", "(", s)
    match = re.fullmatch(r"\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*([A-Za-z_]+)\s*\)", s.strip())
    if "label_values" in functions and match:  # label_values(metric, label)
        return {match.group(1)}, functions, labels | {match.group(2)}
    metrics = {m for m in IDENT.findall(s) if not re.fullmatch(r"[0-9.]+", m)}
    return metrics, functions, labels


def known_labels() -> set[str]:
    """Label names our series can carry: every span attribute as the exporter writes it,
    the model_id label, histogram buckets, and what Prometheus adds at scrape."""
    attrs = {getattr(names, n).replace(".", "_") for n in dir(names) if n.startswith("ATTR_")}
    return attrs | {names.LABEL_MODEL_ID, "le", "instance", "job"}


def dropped(original: Any, decoded: Any, path: str = "") -> list[str]:
    """Where `decoded` lost or changed something `original` has."""
    if isinstance(original, dict):
        if not isinstance(decoded, dict):
            return [f"{path}: decoded as {type(decoded).__name__}"]
        out = []
        for key, value in original.items():
            if key not in decoded:
                out.append(f"{path}/{key}: unknown to Grafana's model")
            else:
                out += dropped(value, decoded[key], f"{path}/{key}")
        return out
    if isinstance(original, list):
        if not isinstance(decoded, list) or len(original) != len(decoded):
            return [f"{path}: list changed"]
        return [m for i, (a, b) in enumerate(zip(original, decoded, strict=True))
                for m in dropped(a, b, f"{path}[{i}]")]
    return [] if original == decoded else [f"{path}: {original!r} became {decoded!r}"]


def test_round_trips_through_grafanas_dashboard_model():
    register_default_plugins()
    data = load()
    decoded = json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder))
    assert dropped(data, decoded) == []


def test_required_fields():
    data = load()
    assert isinstance(data["schemaVersion"], int) and data["schemaVersion"] >= 36
    assert data["uid"] and data["title"]
    assert "id" not in data  # an import assigns it
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_panels_are_known_types_on_the_grid_with_queries():
    register_default_plugins()
    known = set(Runtime().panelcfg_variants)
    cells: dict[tuple[int, int], int] = {}
    for p in load()["panels"]:
        assert p["title"], p["id"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh"), p["title"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= GRID_COLUMNS, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = p["id"]
        if p["type"] == "row":
            continue
        assert p["type"] in known, f"{p['title']}: unknown panel type {p['type']}"
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == DATASOURCE, p["title"]


@pytest.mark.parametrize("expr", exprs(load()))
def test_queries_use_known_functions_and_labels(expr):
    metrics, functions, labels = parse(expr)
    assert metrics, expr
    assert functions <= FUNCTIONS, expr
    assert labels <= known_labels(), expr
    for m in metrics:
        assert m.startswith("plimsoll_") or m.startswith("vllm:"), m


def test_every_queried_metric_is_exported():
    body, content_type = render()
    assert content_type.startswith("text/plain")
    exported = metric_names(body)
    queried = {m for e in exprs(load()) for m in parse(e)[0]}
    assert queried - exported == set()


def test_dashboard_shows_the_asked_for_figures():
    queried = {m for e in exprs(load()) for m in parse(e)[0]}
    for name in (names.METRIC_PRESSURE_LEVEL, names.METRIC_MEMORY_USAGE,
                 names.METRIC_SOFT_MARK, names.METRIC_HARD_MARK, names.METRIC_MEMORY_CEILING,
                 names.METRIC_EVICTIONS, names.METRIC_ABORTS, names.METRIC_ADMISSIONS,
                 names.METRIC_TOKENS_GENERATED, names.METRIC_TTFT + "_bucket",
                 names.VLLM_KV_CACHE_USAGE):
        assert name in queried, name
