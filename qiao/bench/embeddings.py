"""`qiao bench embeddings`: load on any OpenAI-compatible `/v1/embeddings` endpoint.

Levels run one at a time, in one of two load shapes:

    closed loop  C clients, each sending its next request as soon as its last one returns: the
                 server never holds more than C requests, so QPS <= C / latency
    open loop    requests arrive as a Poisson process at R requests/s whatever the server's
                 pace: a server slower than R faces a growing queue, as in production

Per level: completed requests/s (QPS), inputs/s, latency percentiles, errors by kind and whether
p99 latency stayed under the SLO; per server, the highest QPS of a level that met it ("QPS at
P99 < 200 ms"). With a second server or model (`compare_url`, `compare_model`) the same levels,
bodies and arrival times run against both, level by level, and the report gives the ratio of
their QPS at the SLO: how dynamic batching is measured against its absence.

The generator is kept cheap, so that the client measures the server and not itself: request
bodies are encoded to bytes before timing, each worker keeps one keep-alive connection pool per
server, answers are checked by a byte count rather than parsed (`embeddings_load` says what is
verified), and `workers` processes can share each level. Each level records the busiest
worker's CPU seconds per wall second: near 1.0 that worker had no time left and the level's
figures are client-bound.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import random
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from qiao.bench.common import WORDS, LengthSpec
from qiao.bench.embeddings_load import (
    LevelRecorder,
    LoadWorkers,
    Share,
    closed_loop,
    make_client,
    stop_rule,
)
from qiao.errors import ConfigError

# Distinct request bodies built per run (cycled when a level sends more): enough variety for
# servers that would notice repeats, little memory and build time.
MAX_DISTINCT_BODIES = 512
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingsBenchConfig:
    base_url: str
    model: str
    api_key: str | None = None  # sent to both servers; never written to a report
    concurrencies: tuple[int, ...] = (1, 8, 32, 64)  # closed-loop levels
    rates: tuple[float, ...] | None = None  # open-loop levels, requests/s; replace concurrencies
    duration: float = 10.0  # seconds per level (of sending; in-flight requests then finish)
    num_requests: int | None = None  # requests per level instead of a duration
    inputs_per_request: int = 1
    input_len: LengthSpec = field(default_factory=lambda: LengthSpec(32, 32))  # words per input
    encoding_format: str = "float"
    p99_slo_ms: float = 200.0
    warmup: int = 16  # requests per server before the first level, not recorded
    request_timeout: float = 30.0
    seed: int = 0
    compare_url: str | None = None
    compare_model: str | None = None
    workers: int = 1  # processes sharing each level's load
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ConfigError(f"--concurrency: need positive integers, got {self.concurrencies}")
        if self.rates is not None and not all(0 < r < math.inf for r in self.rates):
            raise ConfigError(f"--rate: need finite rates > 0 (requests/s), got {self.rates}")
        if self.rates == ():
            raise ConfigError("--rate: give at least one rate")
        checks = {
            "--duration": self.duration > 0,
            "--num-requests": self.num_requests is None or self.num_requests >= 1,
            "--inputs-per-request": self.inputs_per_request >= 1,
            "--p99-slo-ms": self.p99_slo_ms > 0,
            "--warmup": self.warmup >= 0,
            "--request-timeout": self.request_timeout > 0,
            "--workers": self.workers >= 1,
        }
        for flag, ok in checks.items():
            if not ok:
                raise ConfigError(f"{flag}: out of range")
        if self.encoding_format not in ENCODING_FORMATS:
            raise ConfigError(f"--encoding-format: one of {ENCODING_FORMATS}")

    @property
    def is_open_loop(self) -> bool:
        return self.rates is not None

    def levels(self) -> list[Level]:
        if self.rates is not None:
            return [Level(request_rate=rate) for rate in self.rates]
        return [Level(concurrency=c) for c in self.concurrencies]

    def targets(self) -> list[Target]:
        """The server under test, then the one to compare with (if any)."""
        targets = [Target("base", _normalize(self.base_url), self.model, "--base-url")]
        if self.compare_url is not None or self.compare_model is not None:
            url = _normalize(self.compare_url or self.base_url)
            model = self.compare_model or self.model
            flag = "--compare-url" if self.compare_url is not None else "--base-url"
            targets.append(Target("compare", url, model, flag))
        return targets


@dataclass(frozen=True)
class Level:
    """One load level: a closed-loop concurrency or an open-loop request rate."""

    concurrency: int | None = None
    request_rate: float | None = None

    def __str__(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return f"{self.request_rate:g} req/s"


@dataclass(frozen=True)
class Target:
    label: str  # "base" or "compare"
    base_url: str  # without a trailing / or /v1
    model: str
    flag: str  # the flag naming base_url, for error messages

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/embeddings"


def _normalize(base_url: str) -> str:
    # Accept http://host:port, .../ and .../v1 alike.
    return base_url.rstrip("/").removesuffix("/v1")


# --- workload ---------------------------------------------------------------------------------


def make_inputs(cfg: EmbeddingsBenchConfig) -> list[list[str]]:
    """The texts of each distinct request body: `inputs_per_request` texts of `input_len`
    random words each, deterministic by seed."""
    rng = random.Random(cfg.seed)
    num_bodies = min(cfg.num_requests or MAX_DISTINCT_BODIES, MAX_DISTINCT_BODIES)
    inputs = []
    for _ in range(num_bodies):
        lengths = cfg.input_len.sample(rng, cfg.inputs_per_request)
        inputs.append([" ".join(rng.choices(WORDS, k=n)) for n in lengths])
    return inputs


def encode_bodies(inputs: list[list[str]], model: str, encoding_format: str) -> list[bytes]:
    """Request bodies as bytes, ready to send. One input goes as a string, several as a list."""
    return [
        json.dumps(
            {
                "model": model,
                "input": texts[0] if len(texts) == 1 else texts,
                "encoding_format": encoding_format,
            }
        ).encode()
        for texts in inputs
    ]


def poisson_arrivals(
    rate: float, duration: float, num_requests: int | None, seed: int | str
) -> list[float]:
    """Arrival times (seconds after the level starts) with exponential gaps of mean 1/rate, the
    first at 0: `num_requests` of them, or as many as fall within `duration`."""
    rng = random.Random(seed)
    arrivals: list[float] = []
    now = 0.0
    while len(arrivals) < num_requests if num_requests is not None else now < duration:
        arrivals.append(now)
        now += rng.expovariate(rate)
    return arrivals


# --- a run ------------------------------------------------------------------------------------


def level_shares(
    cfg: EmbeddingsBenchConfig, index: int, level: Level, url: str, bodies: list[bytes]
) -> list[Share]:
    """Level `index` cut into one share per worker (some idle when there is too little to
    share). A closed loop's clients split as evenly as they go, and its request count over the
    workers with clients. An open loop's rate splits into independent Poisson streams of
    rate/workers each, whose superposition is a Poisson stream of the full rate."""
    n = cfg.workers
    if level.request_rate is not None:
        counts = [None] * n if cfg.num_requests is None else _split(cfg.num_requests, n)
        rate = level.request_rate / n
        return [
            Share(url, bodies, 0, None, poisson_arrivals(rate, cfg.duration, count, seed), cfg)
            for seed, count in ((f"{cfg.seed}/{index}/{w}", k) for w, k in enumerate(counts))
        ]
    assert level.concurrency is not None
    clients = _split(level.concurrency, n)
    busy = min(n, level.concurrency)
    counts = [None] * n if cfg.num_requests is None else _split(cfg.num_requests, busy)
    counts += [0] * (n - len(counts))
    return [Share(url, bodies, c, k, None, cfg) for c, k in zip(clients, counts, strict=True)]


def _split(total: int, parts: int) -> list[int]:
    # E.g. 10 over 4 -> [3, 3, 2, 2].
    return [total // parts + (i < total % parts) for i in range(parts)]


def _run_level(
    workers: LoadWorkers,
    target: Target,
    shares: list[Share],
    level: Level,
    cfg: EmbeddingsBenchConfig,
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from qiao.bench.embeddings_report import summarize_level

    bar = tqdm(
        total=_num_to_send(shares),
        desc=f"{target.label} {level}",
        unit="req",
        disable=not cfg.show_progress,
    )
    try:
        results = workers.run(shares, bar.update)
    finally:
        bar.close()
    assert results, "every level gives at least one worker something to send"
    rec = LevelRecorder.merged([r.rec for r in results])
    seconds = max(r.end for r in results) - min(r.start for r in results)
    # The busiest worker's CPU seconds per wall second: near 1.0 it was client-bound.
    client_cpu = max(r.cpu_seconds / max(r.end - r.start, 1e-9) for r in results)
    return summarize_level(level, rec, seconds, client_cpu, cfg)


def _num_to_send(shares: list[Share]) -> int | None:
    """Requests a level will send; None for a closed loop that runs for a duration."""
    total = 0
    for share in shares:
        if share.arrivals is not None:
            total += len(share.arrivals)
        elif share.num_requests is None:
            return None
        else:
            total += share.num_requests
    return total


async def _warm_up(target: Target, bodies: list[bytes], cfg: EmbeddingsBenchConfig) -> None:
    """Check that `target` can be reached (a ConfigError naming its flag when not), then send
    the rest of `cfg.warmup` requests, up to 8 at a time. Nothing here is recorded."""
    async with make_client(cfg, 8) as client:
        try:
            await client.post(target.url, content=bodies[0])
        except httpx.HTTPError as e:
            detail = f"{type(e).__name__}: {e or 'no detail'}"
            raise ConfigError(f"{target.flag}: no answer from {target.url} ({detail})") from None
        rest = cfg.warmup - 1
        if rest > 0:
            stop = stop_rule(rest, math.inf)
            rec = LevelRecorder(cfg.inputs_per_request)
            await closed_loop(
                client, target.url, bodies, min(rest, 8), stop, rec, cfg.request_timeout
            )


def run_embeddings(cfg: EmbeddingsBenchConfig) -> dict[str, Any]:
    """Run every level against every target; return the report (as written by `--out`)."""
    from qiao.bench.embeddings_report import compare_runs, summarize_run

    targets = cfg.targets()
    inputs = make_inputs(cfg)
    bodies = {t.label: encode_bodies(inputs, t.model, cfg.encoding_format) for t in targets}
    for target in targets:
        asyncio.run(_warm_up(target, bodies[target.label], cfg))
    per_target: dict[str, list[dict[str, Any]]] = {t.label: [] for t in targets}
    with LoadWorkers(cfg.workers, barrier_timeout=cfg.request_timeout + 60) as workers:
        # Level by level, every target in turn: both see the same bodies and arrival times.
        for index, level in enumerate(cfg.levels()):
            for target in targets:
                shares = level_shares(cfg, index, level, target.url, bodies[target.label])
                summary = _run_level(workers, target, shares, level, cfg)
                per_target[target.label].append(summary)
    runs = [summarize_run(t, per_target[t.label]) for t in targets]
    return {
        "config": _config_dict(cfg),
        "client_machine": client_machine(),
        "runs": runs,
        "comparison": compare_runs(runs),
    }


def client_machine() -> dict[str, Any]:
    """Facts about the machine the load came from (the server may run elsewhere)."""
    from qiao.profile import cpu_model
    from qiao.version import __version__

    cpus = (
        os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    )
    return {
        "cpu_model": cpu_model(),
        "num_cpus": len(cpus),
        "python": platform.python_version(),
        "httpx": httpx.__version__,
        "qiao": __version__,
    }


def _config_dict(cfg: EmbeddingsBenchConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d.pop("api_key")  # never write a secret into a report
    d["input_len"] = str(cfg.input_len)
    d["load"] = "open" if cfg.is_open_loop else "closed"
    if cfg.is_open_loop:
        d["concurrencies"] = None  # the rates set the levels
    if cfg.num_requests is not None:
        d["duration"] = None  # a request count bounded each level instead
    return d
