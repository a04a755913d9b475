"""The response cache's benchmark: one workload with repeats, against `qiao serve` with the cache
off and on, side by side in one run.

    qiao bench cache --requests 200 --repeat-share 0.5 \\
        --json docs/results/response_cache.json [-- extra qiao serve flags]

Each mode starts its own `qiao serve` (the built-in demo model unless `--model`), sends the same
sequence of greedy completions from `--concurrency` closed-loop clients, and records each
request's latency and its `X-Qiao-Cache` header. A request repeats an earlier prompt with
probability `--repeat-share` (drawn uniformly from the prompts sent before), else asks a new one,
so the best possible hit rate is close to the repeat share. Latency is from sending the request
to the last byte of its body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from qiao.bench.common import WORDS
from qiao.profile import cpu_model

_LISTENING = re.compile(r"Uvicorn running on http://[^\s:]+:(\d+)")


def workload(num_requests: int, repeat_share: float, prompt_words: int, seed: int) -> list[str]:
    """The prompts in sending order: a repeat of an earlier one with probability repeat_share."""
    rng = random.Random(seed)
    sent: list[str] = []
    for _ in range(num_requests):
        if sent and rng.random() < repeat_share:
            sent.append(rng.choice(sent))
        else:
            sent.append(" ".join(rng.choice(WORDS) for _ in range(prompt_words)))
    return sent


def start_server(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    qiao = Path(sys.executable).with_name("qiao")
    command = [str(qiao)] if qiao.exists() else [sys.executable, "-m", "qiao.cli"]
    out = log.open("wb")
    proc = subprocess.Popen(
        [*command, "serve", "--port", "0", "--log-interval", "0", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        match = _LISTENING.search(log.read_text(errors="replace"))
        if match:
            url = f"http://127.0.0.1:{match.group(1)}"
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health/ready", timeout=5).status_code == 200:
                        return proc, url
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"qiao serve did not start:\n{log.read_text(errors='replace')[-2000:]}")


async def run_workload(
    url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int
) -> list[tuple[float, str]]:
    """(latency seconds, X-Qiao-Cache or "") per request, in sending order."""
    results: list[tuple[float, str]] = [(0.0, "")] * len(prompts)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens}
            start = time.perf_counter()
            response = await http.post("/v1/completions", json={**body, "temperature": 0})
            response.raise_for_status()
            results[i] = (time.perf_counter() - start, response.headers.get("x-qiao-cache", ""))

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return results


def summary(results: list[tuple[float, str]], wall: float) -> dict[str, Any]:
    def quantiles(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"p50_ms": None, "p99_ms": None}
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        return {"p50_ms": statistics.median(ordered) * 1e3, "p99_ms": p99 * 1e3}

    hits = [latency for latency, status in results if status == "hit"]
    others = [latency for latency, status in results if status != "hit"]
    return {
        "requests": len(results),
        "hit_rate": len(hits) / len(results),
        "requests_per_s": len(results) / wall,
        "all": quantiles([latency for latency, _ in results]),
        "hits": quantiles(hits),
        "misses": quantiles(others),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qiao bench cache")
    parser.add_argument("--model", help="checkpoint to serve (default: the built-in demo)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--repeat-share", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("serve_args", nargs="*", help="more qiao serve flags (after --)")
    args = parser.parse_args(argv)
    prompts = workload(args.requests, args.repeat_share, args.prompt_words, args.seed)
    serve = (["--model", args.model] if args.model else []) + args.serve_args
    model = Path(args.model).name if args.model else "demo_model"
    report: dict[str, Any] = {
        "workload": {
            "requests": args.requests,
            "repeat_share": args.repeat_share,
            "distinct_prompts": len(set(prompts)),
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words,
            "model": model,
            "serve_args": serve,
        },
        "machine": {"platform": platform.platform(), "cpu": cpu_model(), "cores": os.cpu_count()},
        "modes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mode, flags in (("cache_off", []), ("cache_on", ["--response-cache"])):
            proc, url = start_server([*serve, *flags], Path(tmp) / f"{mode}.log")
            try:
                # One request first, so neither mode pays the first request's warm-up.
                asyncio.run(run_workload(url, model, ["warm up"], args.max_tokens, 1))
                start = time.perf_counter()
                results = asyncio.run(
                    run_workload(url, model, prompts, args.max_tokens, args.concurrency)
                )
                report["modes"][mode] = summary(results, time.perf_counter() - start)
            finally:
                proc.terminate()
                proc.wait(60)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
