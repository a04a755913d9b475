"""Throughput and the SLO rate against data-parallel replicas on this machine: one fresh
`qiao serve --data-parallel-size N` per setting (the demo model unless --model), an open-loop
`qiao bench serve` ladder against each, settings alternated over --rounds; per setting and rate
the median output token throughput and goodput, and the highest rate that met the SLO.

    .venv/bin/python scripts/bench_data_parallel.py --sizes 1,2 --rates 40,80,inf --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batch_online import _start


def _ladder(url: str, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    argv = [sys.executable, "-m", "qiao.cli", "bench", "serve", "--base-url", url]
    argv += ["--request-rates", args.rates, "--num-prompts", str(args.num_prompts)]
    argv += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    argv += ["--slo-ttft", str(args.slo_ttft), "--slo-itl", str(args.slo_itl)]
    argv += ["--no-progress", "--json", str(out)]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["rates"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,2", help="data-parallel sizes, e.g. 1,2")
    parser.add_argument("--rates", default="40,80,inf", help="request rates, req/s")
    parser.add_argument("--num-prompts", type=int, default=150)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--slo-ttft", type=float, default=0.5)
    parser.add_argument("--slo-itl", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", help="model directory (default: the demo model)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: dict[int, list[list[dict[str, Any]]]] = {n: [] for n in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for n in sizes:
                extra = ["--data-parallel-size", str(n)]
                if args.model:
                    extra += ["--model", args.model]
                base = Path(tmp) / f"dp{n}-{round_}"
                base.mkdir()
                process, url = _start(base / "data", base / "serve.log", 1.0, extra)
                try:
                    runs[n].append(_ladder(url, args, base / "bench.json"))
                finally:
                    process.terminate()
                    process.wait(timeout=60)
    report: dict[str, Any] = {"config": vars(args) | {"json": str(args.json)}, "sizes": {}}
    for n in sizes:
        rows = []
        for i, rate in enumerate(runs[n][0]):
            per_run = [run[i] for run in runs[n]]
            rows.append(
                {
                    "request_rate": rate["request_rate"],
                    "output_token_throughput": [r["output_token_throughput"] for r in per_run],
                    "goodput": [r["goodput"] for r in per_run],
                    "ttft_p50_s": [r["ttft_s"]["p50"] for r in per_run],
                    "median_output_token_throughput": statistics.median(
                        r["output_token_throughput"] for r in per_run
                    ),
                    "median_goodput": statistics.median(r["goodput"] for r in per_run),
                }
            )
        report["sizes"][str(n)] = rows
    base_rows = report["sizes"][str(sizes[0])]
    for n in sizes:
        print(f"data-parallel-size {n}")
        for row, base_row in zip(report["sizes"][str(n)], base_rows, strict=True):
            ratio = (
                row["median_output_token_throughput"] / base_row["median_output_token_throughput"]
            )
            print(
                f"  rate {row['request_rate']}: output {row['median_output_token_throughput']:.0f}"
                f" tok/s ({ratio:.2f}x of size {sizes[0]}), goodput {row['median_goodput']:.2f}"
                f" req/s, p50 TTFT {[round(t * 1000, 1) for t in row['ttft_p50_s']]} ms"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
