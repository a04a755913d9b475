"""The `qiao tune` summary: each choice, the measurements behind it, where the profile went."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qiao.bench.tune_sweeps import ITL_STEP_SHARE
from qiao.profile import Profile

# A 1-minute load average above this when tuning started: other work skewed the figures.
BUSY_LOAD = 0.5


def format_tune(profile: Profile, path: Path) -> str:
    """A summary: the choices, the measurements behind them, and where the profile went."""
    m, s = profile.measurements, profile.settings
    budgets = m["max_num_batched_tokens"]
    itl = "itl_slo_s" in budgets  # the budget came from `--itl-slo`, not the prefill sweep
    lines = [
        f"qiao tune: {profile.model.describe()} on {profile.machine.describe()} "
        f"({m['seconds']:.1f} s{', quick' if profile.quick else ''})",
        _sweep_line("num_threads", s.num_threads, m["num_threads"], "num_threads", "decode_tok_s"),
        _sweep_line(
            "max_num_seqs", s.max_num_seqs, m["max_num_seqs"], "batch_size", "decode_tok_s"
        ),
        _sweep_line(
            "max_num_batched_tokens",
            s.max_num_batched_tokens,
            budgets,
            "max_num_batched_tokens",
            "step_ms" if itl else "prefill_tok_s",
        ),
        _kv_line(s.num_kv_blocks, m["num_kv_blocks"]),
        f"profile written to {path}",
    ]
    if itl and not budgets["feasible"]:
        lines.append(
            f"warning: even a {budgets['chosen']}-token step takes more than "
            f"{ITL_STEP_SHARE:.0%} of the {budgets['itl_slo_s'] * 1e3:.0f} ms ITL SLO here; "
            "expect to miss it"
        )
    load = m.get("load_average_before")
    if load is not None and load >= BUSY_LOAD:
        lines.append(
            f"warning: load average {load} when tuning started: other work on the CPUs "
            "skews these figures; rerun `qiao tune` on an idle machine"
        )
    return "\n".join(lines)


def _sweep_line(name: str, chosen: int, sweep: dict[str, Any], key: str, metric: str) -> str:
    figures = ", ".join(f"{r[key]}: {r[metric]:.1f}" for r in sweep["candidates"])
    return f"{name:<23} {chosen:>7}   {sweep['metric']}: {figures}"


def _kv_line(chosen: int, kv: dict[str, Any]) -> str:
    lowered = " (max_num_seqs lowered to fit)" if kv["max_num_seqs_lowered"] else ""
    return (
        f"{'num_kv_blocks':<23} {chosen:>7}   {kv['kv_bytes'] / 2**20:.1f} MiB of KV "
        f"({kv['budget']}), {kv['kv_bytes_per_block']} bytes per {kv['block_size']}-token block, "
        f"{kv['seqs_of_useful_len']} sequences of {kv['useful_len']} tokens{lowered}"
    )
