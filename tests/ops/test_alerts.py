"""The shipped alert rules (deploy/prometheus/qiao-alerts.yaml) and their promtool unit tests.

promtool checks the rules and runs the tests (Debian's `prometheus` package has it; `./dev
setup` installs it as root); those two tests skip without it. The rest reads the YAML: every
alert has a firing case and a quiet one in the test file, and every series a rule or a test
input names is one a real `qiao serve` exports (`qiao_series.py`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from qiao.api.gpu_metrics import GPU_SERIES
from qiao.api.gpu_metrics import LABELS as GPU_LABELS

from .promql_names import metric_names, selectors
from .qiao_series import exported_series, series_labels

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "qiao-alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "qiao-alerts.test.yaml"
SEVERITIES = {"warning", "critical"}

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not installed (Debian: apt-get install prometheus; ./dev setup does as root)",
)


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def _test_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULE_TESTS.read_text())["tests"]


def _seconds(duration: str) -> float:
    """A Prometheus duration: '90s', '10m', '1h30m' -> seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|[smhdwy])", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * units[u] for n, u in parts)


def _series_name(selector: str) -> str:
    """'qiao:engine_up{model_name="m"}' -> 'qiao:engine_up'."""
    return selector.split("{", 1)[0].strip()


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    result = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in result.stdout


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    result = subprocess.run(
        ["promtool", "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        cwd=RULE_TESTS.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_for_a_severity_and_its_annotations() -> None:
    alerts = _alerts()
    assert len({a["alert"] for a in alerts}) == len(alerts), "alert names repeat"
    for alert in alerts:
        name = alert["alert"]
        assert "for" in alert and _seconds(alert["for"]) > 0, name
        assert alert["labels"]["severity"] in SEVERITIES, name
        assert alert["annotations"]["summary"].strip(), name
        assert alert["annotations"]["description"].strip(), name


def test_every_alert_fires_on_a_breach_and_stays_quiet_just_below_it() -> None:
    """Each alert has a test case where it fires and one where it stays quiet, both evaluated
    after its `for:` has passed, in groups whose input carries the series the rule reads (a
    quiet case over no data would prove nothing)."""
    cases: dict[str, dict[str, int]] = {a["alert"]: {"firing": 0, "quiet": 0} for a in _alerts()}
    reads = {a["alert"]: metric_names(a["expr"]) for a in _alerts()}
    waits = {a["alert"]: _seconds(a["for"]) for a in _alerts()}
    for group in _test_groups():
        inputs = {_series_name(s["series"]) for s in group["input_series"]}
        for case in group.get("alert_rule_test", []):
            name = case["alertname"]
            assert name in cases, f"test group {group['name']!r} tests an unknown alert {name}"
            if _seconds(case["eval_time"]) < waits[name] or not inputs & reads[name]:
                continue
            cases[name]["firing" if case["exp_alerts"] else "quiet"] += 1
    missing = {name: kinds for name, kinds in cases.items() if not all(kinds.values())}
    assert not missing, f"alerts without a firing or a quiet case: {missing}"


def test_the_rules_read_only_series_qiao_exports() -> None:
    exported = exported_series()
    for alert in _alerts():
        names = metric_names(alert["expr"])
        assert names, alert["alert"]
        assert names <= exported, f"{alert['alert']} reads unknown series {names - exported}"


def test_the_unit_tests_feed_only_series_qiao_exports() -> None:
    """Names, and label names where the scrape shows them (GPU series: the collector's labels);
    `instance` and `job` are the target labels Prometheus adds."""
    exported, labels = exported_series(), series_labels()
    for group in _test_groups():
        for series in group["input_series"]:
            [(name, matchers)] = selectors(series["series"])
            assert name in exported, (group["name"], series["series"])
            real = set(GPU_LABELS) if name in GPU_SERIES else labels.get(name)
            if real is not None:
                fed = {label for label, _, _ in matchers} - {"instance", "job", "le"}
                assert fed == real, (group["name"], series["series"], real)
