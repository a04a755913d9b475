"""Summaries, the text tables and the plot of `qiao bench embeddings`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qiao.bench.common import ratio

if TYPE_CHECKING:
    from qiao.bench.embeddings import EmbeddingsBenchConfig, Level, Target
    from qiao.bench.embeddings_load import LevelRecorder

LATENCY_POINTS = ("p50", "p90", "p99")
# A level whose client used more CPU seconds per wall second than this was client-bound.
CLIENT_BOUND_CPU = 0.9


def latency_stats(seconds: list[float]) -> dict[str, float | None]:
    """mean, min, p50, p90, p99 and max in milliseconds (None for every one when empty)."""
    keys = ("mean", "min", *LATENCY_POINTS, "max")
    if not seconds:
        return dict.fromkeys(keys)
    ms = np.asarray(seconds) * 1e3
    points = np.percentile(ms, [50, 90, 99])
    values = [ms.mean(), ms.min(), *points, ms.max()]
    return {key: float(v) for key, v in zip(keys, values, strict=True)}


def summarize_level(
    level: Level, rec: LevelRecorder, seconds: float, client_cpu: float, cfg: EmbeddingsBenchConfig
) -> dict[str, Any]:
    """One level's figures. QPS divides the completed requests by the wall time from the start
    of sending to the last answer. The level met the SLO when every request succeeded and the
    p99 latency was below `p99_slo_ms`: an error is an answer later than any SLO. `client_cpu`:
    the busiest client process's CPU seconds per wall second."""
    seconds = max(seconds, 1e-9)
    num_completed = len(rec.latencies)
    latency = latency_stats(rec.latencies)
    p99 = latency["p99"]
    qps = num_completed / seconds
    lags = latency_stats(rec.send_lags) if rec.send_lags else None
    return {
        "concurrency": level.concurrency,
        "request_rate": level.request_rate,
        "num_requests": rec.num_requests,
        "num_completed": num_completed,
        "num_errors": rec.errors.total(),
        "errors": dict(rec.errors.most_common()),
        "first_error": rec.first_error,
        "duration_s": seconds,
        "qps": qps,
        "inputs_per_s": qps * cfg.inputs_per_request,
        "latency_ms": latency,
        "meets_slo": num_completed > 0
        and not rec.errors
        and p99 is not None
        and p99 < cfg.p99_slo_ms,
        # Open loop: how late requests left against their Poisson schedule (client health).
        "send_lag_ms": None if lags is None else {k: lags[k] for k in ("p50", "p99", "max")},
        "client_cpu": client_cpu,
        "dimensions": rec.dimensions,
        "num_verified": rec.num_verified,
    }


def best_level(levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The level with the highest QPS among those that met the SLO (None: none did)."""
    passing = [level for level in levels if level["meets_slo"]]
    return max(passing, key=lambda level: level["qps"]) if passing else None


def summarize_run(target: Target, levels: list[dict[str, Any]]) -> dict[str, Any]:
    best = best_level(levels)
    dims = [level["dimensions"] for level in levels if level["dimensions"] is not None]
    return {
        "label": target.label,
        "base_url": target.base_url,
        "model": target.model,
        "dimensions": dims[0] if dims else None,
        "levels": levels,
        "qps_at_slo": None if best is None else best["qps"],
        "best_level": None if best is None else _level_key(best),
        "num_completed": sum(level["num_completed"] for level in levels),
        "num_errors": sum(level["num_errors"] for level in levels),
    }


def compare_runs(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """base / compare QPS at the SLO; None without a second run."""
    if len(runs) < 2:
        return None
    base, other = runs[0], runs[1]
    return {
        "qps_at_slo": {base["label"]: base["qps_at_slo"], other["label"]: other["qps_at_slo"]},
        "qps_at_slo_ratio": ratio(base["qps_at_slo"], other["qps_at_slo"]),
    }


def _level_key(level: dict[str, Any]) -> dict[str, Any]:
    if level["concurrency"] is not None:
        return {"concurrency": level["concurrency"]}
    return {"request_rate": level["request_rate"]}


def _level_text(level: dict[str, Any]) -> str:
    if level["concurrency"] is not None:
        return str(level["concurrency"])
    return f"{level['request_rate']:g}"


def _level_name(level: dict[str, Any]) -> str:
    if level["concurrency"] is not None:
        return f"concurrency {level['concurrency']}"
    return f"{level['request_rate']:g} req/s"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _run_lines(run: dict[str, Any], slo_ms: float, level_header: str) -> list[str]:
    dims = f", {run['dimensions']}-dim vectors" if run["dimensions"] else ""
    lines = [
        f"[{run['label']}] {run['model']!r} at {run['base_url']}{dims}",
        f"{level_header:>6} {'reqs':>7} {'err':>5} {'QPS':>8} {'inputs/s':>9} "
        f"{'p50':>7} {'p90':>7} {'p99':>7} {'max ms':>7} {'SLO':>4} {'cpu':>5}",
    ]
    for level in run["levels"]:
        lat = level["latency_ms"]
        lines.append(
            f"{_level_text(level):>6} {level['num_requests']:>7} {level['num_errors']:>5} "
            f"{level['qps']:>8.1f} {level['inputs_per_s']:>9.1f} "
            + " ".join(f"{_num(lat[key]):>7}" for key in (*LATENCY_POINTS, "max"))
            + f" {'yes' if level['meets_slo'] else 'no':>4} {level['client_cpu']:>5.0%}"
        )
        if level["errors"]:
            counts = ", ".join(f"{kind} x{n}" for kind, n in level["errors"].items())
            lines.append(f"{'':>6} errors: {counts}; first: {level['first_error']}")
    lines.append(f"QPS at p99 < {slo_ms:g} ms: {_best_text(run)}")
    busy = [_level_name(lv) for lv in run["levels"] if lv["client_cpu"] > CLIENT_BOUND_CPU]
    if busy:
        lines.append(
            f"note: the load generator was CPU-bound at {', '.join(busy)}; "
            "those figures measure the client as much as the server"
        )
    return lines


def _best_text(run: dict[str, Any]) -> str:
    if run["qps_at_slo"] is None:
        return "none (no level met the SLO)"
    level = next(lv for lv in run["levels"] if lv["meets_slo"] and lv["qps"] == run["qps_at_slo"])
    return f"{run['qps_at_slo']:.1f} ({_level_name(level)})"


def _side_by_side(report: dict[str, Any], level_header: str) -> list[str]:
    base, other = report["runs"]
    lines = [
        "side by side:",
        f"{level_header:>6} {'base QPS':>10} {'p99 ms':>8} {'compare QPS':>12} {'p99 ms':>8} "
        f"{'QPS ratio':>10}",
    ]
    for a, b in zip(base["levels"], other["levels"], strict=True):
        qps_ratio = ratio(a["qps"], b["qps"])
        lines.append(
            f"{_level_text(a):>6} {a['qps']:>10.1f} {_num(a['latency_ms']['p99']):>8} "
            f"{b['qps']:>12.1f} {_num(b['latency_ms']['p99']):>8} "
            f"{'-' if qps_ratio is None else f'{qps_ratio:.2f}x':>10}"
        )
    comparison = report["comparison"]
    slo = report["config"]["p99_slo_ms"]
    r = comparison["qps_at_slo_ratio"]
    lines.append(
        f"QPS at p99 < {slo:g} ms: base {_best_text(base)} vs compare {_best_text(other)}: "
        + ("no ratio (a side met the SLO at no level)" if r is None else f"{r:.2f}x")
    )
    return lines


def format_embeddings(report: dict[str, Any]) -> str:
    c = report["config"]
    per_level = f"{c['num_requests']} requests" if c["num_requests"] else f"{c['duration']:g} s"
    load = "open loop (Poisson)" if c["load"] == "open" else "closed loop"
    level_header = "req/s" if c["load"] == "open" else "conc"
    lines = [
        f"embeddings: {load}, {per_level} per level, {c['inputs_per_request']} input(s) of "
        f"{c['input_len']} words per request ({c['encoding_format']}); "
        f"SLO p99 < {c['p99_slo_ms']:g} ms"
    ]
    for run in report["runs"]:
        lines.extend(_run_lines(run, c["p99_slo_ms"], level_header))
    if report["comparison"] is not None:
        lines.extend(_side_by_side(report, level_header))
    return "\n".join(lines)


def plot_embeddings(report: dict[str, Any], path: str | Path) -> None:
    """p99 (solid) and p50 (dotted) latency against achieved QPS, one line per server, with the
    SLO as a dashed line; each point is labelled with its level. Written as a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in report["runs"]:
        levels = run["levels"]
        qps = [level["qps"] for level in levels]
        p99 = [_nan(level["latency_ms"]["p99"]) for level in levels]
        p50 = [_nan(level["latency_ms"]["p50"]) for level in levels]
        (line,) = ax.plot(qps, p99, marker="o", label=f"{run['label']} p99: {run['model']}")
        ax.plot(qps, p50, marker=".", linestyle=":", color=line.get_color(), label="p50")
        for level, x, y in zip(levels, qps, p99, strict=True):
            if not math.isnan(y):
                ax.annotate(_level_text(level), (x, y), textcoords="offset points", xytext=(4, 4))
    slo = report["config"]["p99_slo_ms"]
    ax.axhline(slo, color="gray", linestyle="--", label=f"SLO {slo:g} ms")
    ax.set_xlabel("completed requests/s (QPS)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    # Plain numbers (20, 50, 200) on the log axis rather than powers of ten.
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    load = "concurrency" if report["config"]["load"] == "closed" else "offered req/s"
    ax.set_title(f"/v1/embeddings latency vs QPS (points: {load})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _nan(value: float | None) -> float:
    return math.nan if value is None else value
