"""`qiao bench soak`: a steady mixed load for a long time, and a verdict on memory leaks.

Closed-loop workers send a mix of requests for `duration` seconds: completions, chat, streams
read to the end, streams dropped after their first chunk (a client that goes away), and
embeddings when the server has an embedding model. Every `sample_interval` seconds the server's
`/metrics` are read: the API process's resident memory (`process_resident_memory_bytes`), each
engine process's (`qiao:engine_resident_memory_bytes`, summed, and each process on its own) and
the load gauges.

The verdict: after a warm-up (caches filling, pools faulting in), a least-squares line through
each memory series; a slope above `max_slope` MiB per minute is a leak. A leak makes the command
exit 1, so a soak can gate a release.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from qiao.bench.common import WORDS
from qiao.errors import ConfigError

KINDS = ("completion", "chat", "stream", "disconnect", "embedding")
MEMORY_SERIES = {
    "api_rss_bytes": "process_resident_memory_bytes",
    "engine_rss_bytes": "qiao:engine_resident_memory_bytes",
}
GAUGES = ("qiao:num_requests_running", "qiao:num_requests_waiting", "qiao:kv_cache_usage_perc")


@dataclass
class SoakConfig:
    base_url: str
    duration: float = 60.0  # seconds of load
    concurrency: int = 4
    sample_interval: float = 5.0
    warmup: float = 0.2  # share of the duration left out of the verdict
    max_slope: float = 1.0  # MiB per minute; a steeper memory line is a leak
    model: str | None = None  # None: the first generative model of /v1/models
    embedding_model: str | None = None  # None: the first embedding model, if any
    max_tokens: int = 32
    api_key: str | None = None
    request_timeout: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration <= 0 or self.sample_interval <= 0:
            raise ConfigError("duration and sample_interval must be > 0 seconds")
        if not 0 <= self.warmup < 1:
            raise ConfigError("warmup is a share of the duration in [0, 1)")
        if self.concurrency < 1:
            raise ConfigError("concurrency must be >= 1")


@dataclass
class SoakReport:
    config: dict[str, Any]
    samples: list[dict[str, float]] = field(default_factory=list)
    requests: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> status -> count
    slopes: dict[str, float] = field(default_factory=dict)  # series -> MiB per minute
    leak: bool = False
    verdict: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "samples": self.samples,
            "requests": self.requests,
            "slopes_mib_per_min": self.slopes,
            "leak": self.leak,
            "verdict": self.verdict,
        }


def run_soak(cfg: SoakConfig, progress: bool = True) -> SoakReport:
    return asyncio.run(_soak(cfg, progress))


async def _soak(cfg: SoakConfig, progress: bool) -> SoakReport:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 2)
    async with httpx.AsyncClient(
        base_url=cfg.base_url, headers=headers, timeout=cfg.request_timeout, limits=limits
    ) as client:
        model, embedder = await _models(client, cfg)
        kinds = [k for k in KINDS if k != "embedding" or embedder is not None]
        report = SoakReport(
            config={**cfg.__dict__, "api_key": None, "model": model, "embedding_model": embedder}
        )
        report.requests = {k: {} for k in kinds}
        started = time.monotonic()
        end = started + cfg.duration
        rng = random.Random(cfg.seed)
        workers = [
            asyncio.ensure_future(_worker(client, cfg, model, embedder, kinds, end, rng, report))
            for _ in range(cfg.concurrency)
        ]
        while time.monotonic() < end:
            report.samples.append(await _sample(client, time.monotonic() - started))
            if progress:
                print(_progress_line(report), flush=True)
            await asyncio.sleep(min(cfg.sample_interval, max(end - time.monotonic(), 0.0)))
        await asyncio.gather(*workers)
        report.samples.append(await _sample(client, time.monotonic() - started))
    _judge(report, cfg)
    return report


async def _models(client: httpx.AsyncClient, cfg: SoakConfig) -> tuple[str, str | None]:
    cards = (await client.get("/v1/models")).raise_for_status().json()["data"]
    generative = [c["id"] for c in cards if c.get("max_model_len") is not None]
    embedders = [c["id"] for c in cards if c.get("max_model_len") is None]
    model = cfg.model or (generative[0] if generative else None)
    if model is None:
        raise ConfigError("the server lists no generative model; pass --model")
    return model, cfg.embedding_model or (embedders[0] if embedders else None)


async def _worker(
    client: httpx.AsyncClient,
    cfg: SoakConfig,
    model: str,
    embedder: str | None,
    kinds: list[str],
    end: float,
    rng: random.Random,
    report: SoakReport,
) -> None:
    for n in itertools.count():
        if time.monotonic() >= end:
            return
        kind = kinds[(n + rng.randrange(len(kinds))) % len(kinds)]
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 48)))
        try:
            status = await _one(client, cfg, kind, model, embedder, prompt)
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        counts = report.requests[kind]
        counts[str(status)] = counts.get(str(status), 0) + 1


async def _one(
    client: httpx.AsyncClient,
    cfg: SoakConfig,
    kind: str,
    model: str,
    embedder: str | None,
    prompt: str,
) -> int:
    if kind == "embedding":
        body = {"model": embedder, "input": [prompt, prompt[::-1]]}
        return (await client.post("/v1/embeddings", json=body)).status_code
    if kind == "chat":
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": cfg.max_tokens,
        }
        return (await client.post("/v1/chat/completions", json=body)).status_code
    body = {"model": model, "prompt": prompt, "max_tokens": cfg.max_tokens}
    if kind == "completion":
        return (await client.post("/v1/completions", json=body)).status_code
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        async for _ in resp.aiter_lines():
            if kind == "disconnect":
                break  # leave mid-stream: the server must abort and free the request
        return resp.status_code


async def _sample(client: httpx.AsyncClient, elapsed: float) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    sample: dict[str, float] = {"t": elapsed}
    text = (await client.get("/metrics")).text
    wanted = {**{v: k for k, v in MEMORY_SERIES.items()}, **{g: g for g in GAUGES}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = wanted.get(s.name)
            if key is not None:
                sample[key] = sample.get(key, 0.0) + s.value
            if key == "engine_rss_bytes":
                # Each engine process on its own too: one that grows shows, whatever the rest do.
                name = f"engine_rss_bytes[{s.labels.get('model_name')}@{s.labels.get('version')}]"
                sample[name] = sample.get(name, 0.0) + s.value
    return sample


def memory_keys(samples: list[dict[str, float]]) -> list[str]:
    """The memory series the samples hold: the API process, the engines summed, and each
    engine process (`engine_rss_bytes[model@version]`)."""
    keys = [k for k in MEMORY_SERIES if any(k in s for s in samples)]
    per_engine = sorted({k for s in samples for k in s if k.startswith("engine_rss_bytes[")})
    return keys + per_engine


def _judge(report: SoakReport, cfg: SoakConfig) -> None:
    kept = [s for s in report.samples if s["t"] >= cfg.warmup * cfg.duration]
    leaks = []
    for series in memory_keys(kept):
        points = [(s["t"], s[series]) for s in kept if series in s]
        if len(points) < 3:
            continue
        slope = _slope(points) * 60 / 2**20  # bytes/s -> MiB/min
        report.slopes[series] = round(slope, 3)
        if slope > cfg.max_slope:
            leaks.append(f"{series} grows {slope:.2f} MiB/min (limit {cfg.max_slope})")
    if not report.slopes:
        report.verdict = "no verdict: too few memory samples (run longer or sample more often)"
        return
    report.leak = bool(leaks)
    report.verdict = (
        "LEAK: " + "; ".join(leaks)
        if leaks
        else "no leak: " + ", ".join(f"{k} {v:+.2f} MiB/min" for k, v in report.slopes.items())
    )


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var


def _progress_line(report: SoakReport) -> str:
    last = report.samples[-1]
    done = sum(sum(c.values()) for c in report.requests.values())
    memory = ", ".join(f"{k} {last[k] / 2**20:.1f} MiB" for k in MEMORY_SERIES if k in last)
    return f"[soak] t={last['t']:.0f}s requests={done} {memory}"


def format_soak(report: SoakReport) -> str:
    lines = [f"soak against {report.config['base_url']} for {report.config['duration']:.0f} s"]
    for kind, counts in report.requests.items():
        lines.append(f"  {kind:<11} " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    first, last = report.samples[0], report.samples[-1]
    for series in memory_keys(report.samples):
        if series in first and series in last:
            lines.append(
                f"  {series}: {first[series] / 2**20:.1f} -> {last[series] / 2**20:.1f} MiB, "
                f"slope after warm-up {report.slopes.get(series, float('nan')):+.2f} MiB/min"
            )
    lines.append(report.verdict)
    return "\n".join(lines)


def write_report(path: str | None, report: SoakReport) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
