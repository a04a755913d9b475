"""Adaptive batching against the best static budget `qiao tune` finds, side by side in one run.

For each load shape (steady: Poisson arrivals; bursty: gamma gaps, `--burstiness`) and each
server (static: `--max-num-batched-tokens` = the tuned budget; adaptive: the engine's full
budget with `--target-itl-ms`), a `qiao serve` subprocess faces the same `qiao bench serve`
rate ladder; the SLO-holding rate is the highest rate whose goodput (requests meeting the TTFT
and mean-ITL SLOs) is at least `--slo-share` of the requests sent. Run under
`flock /tmp/qiao-bench.lock`:

    qiao bench adaptive --model /work/shared/models/stories260K-hf \\
        --profile profile.json --json docs/results/adaptive_stories260k.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from qiao.bench.common import LengthSpec
from qiao.bench.serve import ServeConfig, run_serve
from qiao.profile import cpu_model

_LISTENING = re.compile(r"Uvicorn running on http://[^\s:]+:(\d+)")


def _start_server(model: str, args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    out = log.open("wb")
    cmd = [sys.executable, "-m", "qiao.cli", "serve", "--model", model, "--port", "0"]
    proc = subprocess.Popen([*cmd, "--log-interval", "0", *args], stdout=out, stderr=out)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        match = _LISTENING.search(log.read_text(errors="replace"))
        if match:
            url = f"http://127.0.0.1:{match.group(1)}"
            while httpx.get(f"{url}/health/ready").status_code != 200:
                time.sleep(0.1)
            return proc, url
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"qiao serve did not start: {log.read_text()[-2000:]}")


def _budget_range(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    values = re.findall(r"^qiao:adaptive_token_budget\{[^}]*\} (\S+)$", text, re.M)
    return {"adaptive_token_budget_at_end": float(values[0])} if values else {}


def _holding_rate(rates: list[dict[str, Any]], share: float) -> float | None:
    held = [
        r["request_rate"]
        for r in rates
        if r["num_requests"] and r["goodput"] * r["duration_s"] >= share * r["num_requests"]
    ]
    return max(held) if held else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="qiao bench adaptive", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint both servers serve")
    p.add_argument("--profile", required=True, help="a `qiao tune` profile (its budget)")
    p.add_argument("--full-budget", type=int, default=2048, help="the adaptive server's max")
    p.add_argument(
        "--target-itl-ms", type=float, default=20.0, help="the adaptive server's ITL target"
    )
    p.add_argument("--rates", default="8,16,32,64", help="request rates of the ladder (req/s)")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per rate")
    p.add_argument("--input-len", default="40:100", help="words (stories260K: 512 tokens)")
    p.add_argument("--output-len", default="16:48", help="output tokens per request (MIN:MAX)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="SLO: time to first token (s)")
    p.add_argument("--slo-itl", type=float, default=0.04, help="SLO: mean inter-token latency (s)")
    p.add_argument(
        "--slo-share", type=float, default=0.9, help="share of requests that must meet the SLO"
    )
    p.add_argument("--request-timeout", type=float, default=15.0, help="s (past it: an error)")
    p.add_argument(
        "--burstiness", type=float, default=0.25, help="bursty shape's gamma factor (1: Poisson)"
    )
    p.add_argument("--json", required=True, help="write the report as JSON to PATH")
    p.add_argument("--logs", default="/tmp", help="folder for the servers' logs")
    args = p.parse_args(argv)
    profile = json.loads(Path(args.profile).read_text())
    tuned = profile["settings"]["max_num_batched_tokens"]
    servers = {
        "static": ["--max-num-batched-tokens", str(tuned)],
        "adaptive": [
            "--max-num-batched-tokens",
            str(args.full_budget),
            "--target-itl-ms",
            str(args.target_itl_ms),
        ],
    }
    shapes = {"steady": 1.0, "bursty": args.burstiness}
    rates = tuple(float(r) for r in args.rates.split(","))
    report: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
        "model": args.model,
        "tuned_max_num_batched_tokens": tuned,
        "args": vars(args),
        "results": {},
    }
    for shape, burstiness in shapes.items():
        for name, server_args in servers.items():
            log = Path(args.logs) / f"adaptive-bench-{shape}-{name}.log"
            proc, url = _start_server(args.model, server_args, log)
            try:
                cfg = ServeConfig(
                    base_url=url,
                    request_rates=rates,
                    duration=args.duration,
                    input_len=LengthSpec.parse(args.input_len),
                    output_len=LengthSpec.parse(args.output_len),
                    temperature=0.0,
                    slo_ttft=args.slo_ttft,
                    slo_itl=args.slo_itl,
                    show_progress=False,
                    burstiness=burstiness,
                    request_timeout=args.request_timeout,
                )
                serve = run_serve(cfg)
                extra = _budget_range(url)
            finally:
                proc.terminate()
                proc.wait(30)
            rows = serve["rates"]
            report["results"][f"{shape}/{name}"] = {
                "server_args": server_args,
                "slo_holding_rate": _holding_rate(rows, args.slo_share),
                **extra,
                "rates": [
                    {
                        k: r[k]
                        for k in (
                            "request_rate",
                            "num_requests",
                            "num_errors",
                            "errors",
                            "goodput",
                            "duration_s",
                        )
                    }
                    | {"itl_s": r["itl_s"], "ttft_s": r["ttft_s"]}
                    for r in rows
                ],
            }
            summary = report["results"][f"{shape}/{name}"]
            print(shape, name, "SLO-holding rate:", summary["slo_holding_rate"], extra, flush=True)
            # Written after each server, so a run cut short keeps what it measured.
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
