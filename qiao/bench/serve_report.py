"""Summaries, the text table and the plot of `qiao bench serve`."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from qiao.bench.serve import RequestResult

PERCENTILES = (50, 90, 99)
_METRICS = (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "E2E"))
# A run's scalars that repeats of a rate report the median of.
_PER_RUN = (
    "duration_s",
    "num_output_tokens",
    "num_prompt_tokens",
    "request_throughput",
    "output_token_throughput",
    "total_token_throughput",
    "goodput",
)


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    points = np.percentile(np.asarray(values), PERCENTILES)
    return {
        "mean": float(np.mean(values)),
        **{f"p{p}": float(x) for p, x in zip(PERCENTILES, points, strict=True)},
    }


def _mean_itl(result: RequestResult) -> float:
    return sum(result.itls) / len(result.itls) if result.itls else 0.0


def summarize(
    rate: float, results: list[RequestResult], seconds: float, slo_ttft: float, slo_itl: float
) -> dict[str, Any]:
    """One rate's figures. Throughputs divide by the wall time from the first arrival to the
    last completion. Goodput counts the completed requests whose TTFT <= slo_ttft and whose
    mean ITL (time per output token after the first) <= slo_itl."""
    ok = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if not r.ok)
    good = [r for r in ok if r.ttft is not None and r.ttft <= slo_ttft and _mean_itl(r) <= slo_itl]
    num_output = sum(r.num_output_tokens for r in ok)
    prompt_counts = [r.num_prompt_tokens for r in ok]
    num_prompt = None if None in prompt_counts else sum(prompt_counts)
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_errors": len(results) - len(ok),
        "errors": dict(errors.most_common(5)),
        "duration_s": seconds,
        "num_output_tokens": num_output,
        "num_prompt_tokens": num_prompt,
        "request_throughput": len(ok) / seconds,
        "output_token_throughput": num_output / seconds,
        "total_token_throughput": None
        if num_prompt is None
        else (num_prompt + num_output) / seconds,
        "goodput": len(good) / seconds,
        "slo": {"ttft_s": slo_ttft, "itl_s": slo_itl},
        "ttft_s": _stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": _stats([x for r in ok for x in r.itls]),
        "e2e_s": _stats([r.e2e for r in ok if r.e2e is not None]),
    }


def median_of_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One rate's figures over repeated runs (each its own arrivals and prompts): the median of
    every throughput and percentile, counts and errors summed, the runs themselves under "runs".
    A p99 over 300 requests is the third-worst of them, so one burst of arrivals moves it by
    seconds; the median of a few runs is what a rate holds."""

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return float(np.median(known)) if len(known) == len(values) else None

    errors: Counter[str] = Counter()
    for run in runs:
        errors.update(run["errors"])
    out: dict[str, Any] = {"request_rate": runs[0]["request_rate"], "num_runs": len(runs)}
    for key in ("num_requests", "num_completed", "num_errors"):
        out[key] = sum(run[key] for run in runs)
    out["errors"] = dict(errors.most_common(5))
    for key in _PER_RUN:
        out[key] = median([run[key] for run in runs])
    out["slo"] = runs[0]["slo"]
    for key, _ in _METRICS:
        out[key] = {stat: median([run[key][stat] for run in runs]) for stat in runs[0][key]}
    out["runs"] = runs
    return out


def meets_p99_slo(rate: dict[str, Any]) -> bool:
    """Whether a rate's run held the SLO at the tail: every request completed, p99 TTFT <= the
    TTFT SLO and p99 inter-token latency <= the ITL SLO."""
    slo = rate["slo"]
    ttft, itl = rate["ttft_s"]["p99"], rate["itl_s"]["p99"]
    return (
        rate["num_errors"] == 0
        and ttft is not None
        and itl is not None
        and ttft <= slo["ttft_s"]
        and itl <= slo["itl_s"]
    )


def max_rate_within_p99_slo(report: dict[str, Any]) -> dict[str, Any] | None:
    """The highest offered rate whose run (with repeats: whose medians) met the SLO at p99
    (None: no rate did)."""
    passing = [r for r in report["rates"] if meets_p99_slo(r)]
    if not passing:
        return None
    return max(passing, key=lambda r: math.inf if r["request_rate"] == "inf" else r["request_rate"])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def format_serve(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"serve: {c['base_url']} model {report['model']!r}, /{c['endpoint']}, input "
        f"{c['input_len']} words, output {c['output_len']} tokens; "
        f"SLO TTFT <= {c['slo_ttft']} s, mean ITL <= {c['slo_itl']} s"
        + (f"; medians of {c['repeat']} runs per rate" if c.get("repeat", 1) > 1 else ""),
    ]
    lines.extend(_rate_lines(report["rates"]))
    lines.append(_best_line(report))
    if "with_batch" in report:
        lines.extend(_beside_batch_lines(report["with_batch"]))
    return "\n".join(lines)


def _best_line(report: dict[str, Any]) -> str:
    best = max_rate_within_p99_slo(report)
    return "highest rate with p99 TTFT and p99 ITL within the SLO: " + (
        "none"
        if best is None
        else f"{best['request_rate']} req/s ({best['output_token_throughput']:.1f} output tok/s)"
    )


def _rate_lines(rates: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{'rate':>6} {'done':>5} {'err':>4} {'req/s':>7} {'tok/s':>8} {'good/s':>7}  "
        + "  ".join(f"{name + ' p50/p90/p99 ms':>24}" for _, name in _METRICS)
    ]
    for r in rates:
        cells = ["/".join(_ms(r[key][f"p{p}"]) for p in PERCENTILES) for key, _ in _METRICS]
        lines.append(
            f"{r['request_rate']!s:>6} {r['num_completed']:>5} {r['num_errors']:>4} "
            f"{r['request_throughput']:>7.2f} {r['output_token_throughput']:>8.1f} "
            f"{r['goodput']:>7.2f}  " + "  ".join(f"{cell:>24}" for cell in cells)
        )
        if "runs" in r:
            tails = ", ".join(
                f"{_ms(run['ttft_s']['p99'])}/{_ms(run['itl_s']['p99'])}" for run in r["runs"]
            )
            lines.append(f"       runs' p99 TTFT/ITL ms: {tails}")
        lines.extend(f"       error x{n}: {msg}" for msg, n in r["errors"].items())
    return lines


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _beside_batch_lines(beside: dict[str, Any]) -> list[str]:
    batch, comparison = beside["batch"], beside["comparison"]
    lines = [
        f"beside batch {batch['id']} ({batch['total_lines']} lines):",
        *_rate_lines(beside["rates"]),
    ]
    lines.append(_best_line(beside))
    lines.append(
        f"the batch meanwhile: {batch['lines_during_ladder']} lines, "
        f"{batch['lines_per_s']:.2f} lines/s, ~{batch['output_tokens_per_s']:.0f} output tok/s; "
        f"{batch['status_after']} at the end"
        + ("" if batch["ran_throughout"] else " (it ended early: later rates ran alone)")
    )
    lines.append("beside the batch / alone, per rate: goodput, p50 TTFT, p50 ITL")
    lines.extend(
        f"{r['request_rate']!s:>6}  {_ratio(r['goodput_ratio']):>7} "
        f"{_ratio(r['ttft_p50_ratio']):>7} {_ratio(r['itl_p50_ratio']):>7}"
        for r in comparison["rates"]
    )
    lines.append(
        f"SLO rate: {comparison['slo_rate_alone']} req/s alone, "
        f"{comparison['slo_rate_beside_batch']} req/s beside the batch "
        f"({_ratio(comparison['slo_rate_ratio'])})"
    )
    return lines


def plot_serve(report: dict[str, Any], path: str | Path) -> None:
    """Latency percentiles (TTFT, ITL, E2E) against the offered request rate, as a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = report["rates"]
    # Categorical x positions: an infinite rate ("inf") has no place on a numeric axis.
    x = list(range(len(rates)))
    fig, axes = plt.subplots(1, len(_METRICS), figsize=(5 * len(_METRICS), 4), squeeze=False)
    for ax, (key, name) in zip(axes[0], _METRICS, strict=True):
        for p in PERCENTILES:
            y = [r[key][f"p{p}"] for r in rates]
            y = [math.nan if v is None else v * 1e3 for v in y]
            ax.plot(x, y, marker="o", label=f"p{p}")
        if key in rates[0]["slo"]:  # TTFT and ITL have an SLO line
            ax.axhline(rates[0]["slo"][key] * 1e3, color="gray", linestyle="--", label="SLO")
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel("request rate (req/s)")
        ax.set_xticks(x, [str(r["request_rate"]) for r in rates])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['model']} at {report['config']['base_url']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
