"""Online latency beside a running batch: p50 / p90 time to first token of streamed online
completions on an idle `qiao serve`, then while a /v1/batches job of --lines lines runs, for each
--batch-share given (one fresh server each, same flags otherwise). Also the batch's answered lines
per second while the online requests ran.

    .venv/bin/python scripts/bench_batch_online.py --lines 500 --shares 0.5,1.0 --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

LISTENING = re.compile(r"Uvicorn running on http://([\d.]+):(\d+)")


def _start(data_dir: Path, log: Path, share: float, extra: list[str]) -> tuple[Any, str]:
    argv = [sys.executable, "-m", "qiao.cli", "serve", "--port", "0", "--log-interval", "0"]
    argv += ["--data-dir", str(data_dir), "--batch-share", str(share), *extra]
    log_file = log.open("wb")
    process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        match = LISTENING.search(log.read_text(errors="replace"))
        if match:
            url = f"http://127.0.0.1:{match.group(2)}"
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        return process, url
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        if process.poll() is not None:
            break
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"qiao serve did not start:\n{log.read_text()[-2000:]}")


def _ttft(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"text"' in line:
                first = time.perf_counter() - start
                for _ in lines:  # the rest of the answer
                    pass
                return first
    raise RuntimeError("the stream carried no token")


def _online(client: httpx.Client, model: str, count: int) -> list[float]:
    return [_ttft(client, model, f"Online question {i}:", 16) for i in range(count)]


def _submit_batch(client: httpx.Client, model: str, lines: int, max_tokens: int) -> str:
    body = b"".join(
        json.dumps(
            {
                "custom_id": f"b{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": model,
                    "prompt": f"Batch story {i}:",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                },
            }
        ).encode()
        + b"\n"
        for i in range(lines)
    )
    upload = client.post("/v1/files", files={"file": ("b.jsonl", body)}, data={"purpose": "batch"})
    upload.raise_for_status()
    created = client.post(
        "/v1/batches",
        json={
            "input_file_id": upload.json()["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        },
    )
    created.raise_for_status()
    return created.json()["id"]


def _counts(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    return client.get(f"/v1/batches/{batch_id}").json()


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_ms": 1000 * statistics.median(ordered),
        "p90_ms": 1000 * ordered[int(0.9 * (len(ordered) - 1))],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=500, help="batch lines")
    parser.add_argument("--batch-max-tokens", type=int, default=64)
    parser.add_argument("--online", type=int, default=20, help="online requests per phase")
    parser.add_argument("--shares", default="0.5,1.0", help="--batch-share values to compare")
    parser.add_argument("--model-name", default="demo_model")
    parser.add_argument("--json", default=None)
    parser.add_argument("serve_args", nargs="*", help="more `qiao serve` flags (after --)")
    args = parser.parse_args()
    report: dict[str, Any] = {"lines": args.lines, "online": args.online, "runs": []}
    for share in [float(s) for s in args.shares.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            process, url = _start(folder / "data", folder / "serve.log", share, args.serve_args)
            try:
                with httpx.Client(base_url=url, timeout=120) as client:
                    _online(client, args.model_name, 3)  # warm-up
                    idle = _online(client, args.model_name, args.online)
                    batch_id = _submit_batch(
                        client, args.model_name, args.lines, args.batch_max_tokens
                    )
                    while _counts(client, batch_id)["request_counts"]["completed"] < 5:
                        time.sleep(0.1)
                    before = _counts(client, batch_id)["request_counts"]["completed"]
                    start = time.monotonic()
                    busy = _online(client, args.model_name, args.online)
                    elapsed = time.monotonic() - start
                    after = _counts(client, batch_id)
            finally:
                process.terminate()
                process.wait(60)
        run = {
            "batch_share": share,
            "idle": _summary(idle),
            "with_batch": _summary(busy),
            "batch_lines_per_s": (after["request_counts"]["completed"] - before) / elapsed,
            "batch_status_after": after["status"],
        }
        run["p50_ratio"] = run["with_batch"]["p50_ms"] / run["idle"]["p50_ms"]
        report["runs"].append(run)
        print(
            f"--batch-share {share}: online TTFT p50 {run['idle']['p50_ms']:.1f} ms idle, "
            f"{run['with_batch']['p50_ms']:.1f} ms beside the batch ({run['p50_ratio']:.2f}x); "
            f"p90 {run['idle']['p90_ms']:.1f} / {run['with_batch']['p90_ms']:.1f} ms; batch "
            f"{run['batch_lines_per_s']:.1f} lines/s meanwhile"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
