"""The PromQL name extractor the rule and dashboard tests rely on."""

from __future__ import annotations

import pytest

from .promql_names import metric_names, selectors


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("qiao:engine_up == 0", {"qiao:engine_up"}),
        (
            "histogram_quantile(0.99, sum by (model_name, version, le) "
            '(rate(qiao:time_to_first_token_seconds_bucket{model_name=~"$model_name"}[5m])))',
            {"qiao:time_to_first_token_seconds_bucket"},
        ),
        (
            "sum without (route, status_code) (rate(a_total[5m])) / on(instance) "
            "group_left(pod) b offset 1h30m > bool 0.001",
            {"a_total", "b"},
        ),
        ("deriv(w[10m]) * 60 > 1 and min_over_time(w[10m:1m]) > 0", {"w"}),
        ('label_replace(up, "dst", "$1", "src", "(.*)") unless ignoring(le) x', {"up", "x"}),
        ('{__name__="qiao:batch_jobs", status="failed"} > 1e3', {"qiao:batch_jobs"}),
        ("sum(rate(x[$__rate_interval])) by (le) # a comment naming y", {"x"}),
        ("topk(5, sum by (key_name) (increase(k[${__range}])))", {"k"}),
        ("Inf > NaN or 0x1F < -.5e-3", set()),
    ],
)
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_selectors_keep_their_matchers() -> None:
    expr = (
        'sum by (le) (rate(qiao:ttft_bucket{model_name=~"$model_name", version!="2"}[5m]))'
        ' / ignoring(x) {__name__="qiao:batch_jobs", status="failed"} + up'
    )
    assert selectors(expr) == [
        ("qiao:ttft_bucket", [("model_name", "=~", "$model_name"), ("version", "!=", "2")]),
        ("qiao:batch_jobs", [("status", "=", "failed")]),
        ("up", []),
    ]
