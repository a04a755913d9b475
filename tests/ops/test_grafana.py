"""The shipped Grafana dashboard (deploy/grafana/qiao-dashboard.json) against qiao itself.

Every query (panel targets and template variables) reads only series a real `qiao serve`
exports (`qiao_series.py`: scraped from the demo model's server; the GPU series, which exist
only where NVML finds a device, from `qiao.api.gpu_metrics.GPU_SERIES`), follows the model and
version variables wherever the series has those labels, and parses as PromQL (promtool).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .promql_names import metric_names, selectors
from .qiao_series import exported_series, series_labels

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "qiao-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's template-variable query functions (not PromQL): label_values(expr, label) and
# query_result(expr) read an expression; label_values(label), label_names() and metrics(re) none.
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$", re.DOTALL)
_QUERY_RESULT = re.compile(r"^\s*query_result\((.*)\)\s*$", re.DOTALL)
# What Grafana puts in place of its variables, for promtool.
_SUBSTITUTES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _targets() -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target."""
    return [
        (panel["title"], target["expr"])
        for panel in _panels(_dashboard()["panels"])
        for target in panel.get("targets", [])
    ]


def _variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in _dashboard()["templating"]["list"]}


def _variable_expr(variable: dict[str, Any]) -> str:
    """The PromQL inside a query variable's Grafana query ('' where it reads none)."""
    query = variable["query"]
    text = query["query"] if isinstance(query, dict) else query
    for pattern in (_LABEL_VALUES, _QUERY_RESULT):
        match = pattern.match(text)
        if match:
            return match.group(1)
    return ""


def _queries() -> list[tuple[str, str]]:
    """(where, expr) of every query of the dashboard: targets and template variables."""
    variables = [
        (f"variable {name}", _variable_expr(v))
        for name, v in _variables().items()
        if v["type"] == "query"
    ]
    return _targets() + variables


def test_the_dashboard_has_its_datasource_and_model_variables() -> None:
    variables = _variables()
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model_name", "version"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == DATASOURCE
        assert variables[name]["includeAll"] and variables[name]["multi"], name
        assert metric_names(_variable_expr(variables[name])), name
    assert '"$model_name"' in _variable_expr(variables["version"])  # versions of chosen models


def test_every_panel_queries_the_datasource_variable() -> None:
    panels = [p for p in _panels(_dashboard()["panels"]) if p["type"] != "row"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids repeat"
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_every_query_reads_only_series_qiao_exports() -> None:
    exported = exported_series()
    read: set[str] = set()
    for where, expr in _queries():
        names = metric_names(expr)
        assert names, f"{where}: no series in {expr!r}"
        assert names <= exported, f"{where} reads unknown series {names - exported}"
        read |= names
    # The panels the operators asked for are there (a few names of each group).
    for name in (
        "qiao:http_requests_total",
        "qiao:time_to_first_token_seconds_bucket",
        "qiao:inter_token_latency_seconds_bucket",
        "qiao:e2e_request_latency_seconds_bucket",
        "qiao:generation_tokens_total",
        "qiao:num_requests_waiting",
        "qiao:kv_cache_usage_perc",
        "qiao:prefix_cache_hits_total",
        "qiao:num_preemptions_total",
        "qiao:engine_restarts_total",
        "qiao:circuit_breaker_state",
        "qiao:batch_jobs",
        "qiao:batch_size_bucket",
        "qiao:api_key_requests_total",
        "qiao:gpu_utilization_perc",
        "qiao:gpu_memory_used_bytes",
        "process_resident_memory_bytes",
    ):
        assert name in read, name


def test_model_series_follow_the_model_and_version_variables() -> None:
    """A selector of a series labelled by model (as the scrape shows its samples) filters on the
    variables: `model_name` for qiao's series, `model` for Triton's."""
    labels = series_labels()
    for where, expr in _queries():
        if where.startswith("variable"):
            continue
        for name, matchers in selectors(expr):
            carried = labels.get(name, frozenset())
            model_label = "model_name" if "model_name" in carried else "model"
            if model_label not in carried:
                continue
            assert (model_label, "=~", "$model_name") in matchers, (where, name)
            assert ("version", "=~", "$version") in matchers, (where, name)


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not installed (Debian: apt-get install prometheus; ./dev setup does as root)",
)
def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    """promtool parses each query as a recording rule's expression, variables substituted."""
    rules = []
    for i, (where, expr) in enumerate(_queries()):
        for variable, value in _SUBSTITUTES.items():
            expr = expr.replace(variable, value)
        expr = re.sub(r"\$\{?[A-Za-z_]+\}?", ".*", expr)  # $model_name, ${version}: regex values
        rules.append({"record": f"dashboard:query_{i}", "expr": expr, "labels": {"at": where}})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
