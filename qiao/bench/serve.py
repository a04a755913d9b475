"""`qiao bench serve`: an open-loop load generator for any OpenAI-compatible server.

Requests arrive as a Poisson process at each request rate, independent of how fast the server
answers (open loop: a slow server faces a growing queue, as it would in production). Every
request streams; the client stamps each content chunk as it arrives:

    TTFT = first content chunk - request sent      ITL = gap between consecutive chunks
    E2E  = last byte - request sent

A server that packs several tokens into one chunk shows fewer, longer ITLs; output token
counts come from the server's `usage` when it sends one (`stream_options.include_usage`).
Errors (non-200 replies, broken streams, timeouts) are counted per rate, never fatal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from qiao.bench.common import WORDS, LengthSpec
from qiao.errors import ConfigError


@dataclass
class ServeConfig:
    base_url: str
    model: str | None = None  # None: the first of /v1/models
    endpoint: str = "completions"  # or "chat"
    request_rates: tuple[float, ...] = (math.inf,)
    num_prompts: int = 100
    duration: float | None = None  # seconds of arrivals per rate; overrides num_prompts
    input_len: LengthSpec = field(default_factory=lambda: LengthSpec(128, 128))
    output_len: LengthSpec = field(default_factory=lambda: LengthSpec(128, 128))
    api_key: str | None = None
    request_timeout: float = 120.0
    max_concurrency: int | None = None
    # Sent with every request; None sends none (the server's default sampling).
    temperature: float | None = None
    slo_ttft: float = 2.0
    slo_itl: float = 0.25
    seed: int = 0
    # Runs per rate, each with its own seed; the report gives each rate's medians.
    repeat: int = 1
    show_progress: bool = True
    # Lines of a /v1/batches job to run the ladder beside, after running it alone (None: no).
    with_batch: int | None = None
    # Arrival shape (vLLM's --burstiness): gamma-distributed gaps of mean 1/rate and shape
    # `burstiness`; 1.0 is a Poisson process, below 1 requests come in bursts and lulls.
    burstiness: float = 1.0


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None  # from the server's usage, when sent


@dataclass(frozen=True)
class Job:
    arrival: float  # seconds after the rate's start
    prompt: str
    max_tokens: int


def make_jobs(cfg: ServeConfig, rate: float, seed: int) -> list[Job]:
    """`num_prompts` requests, or as many as arrive within `duration` seconds, with seeded
    random prompts and output lengths."""
    rng = random.Random(seed)
    jobs = []
    for arrival in _arrivals(cfg, rate, rng):
        num_words = cfg.input_len.sample(rng, 1)[0]
        prompt = " ".join(rng.choice(WORDS) for _ in range(num_words))
        jobs.append(Job(arrival, prompt, cfg.output_len.sample(rng, 1)[0]))
    return jobs


def _arrivals(cfg: ServeConfig, rate: float, rng: random.Random) -> list[float]:
    """Gaps of mean 1/rate, the first request at 0: exponential (a Poisson process), or gamma
    of shape `burstiness` (the same mean; below 1: bursts and lulls)."""
    if math.isinf(rate):
        # Everything at once; without gaps a duration cannot bound the count, num_prompts does.
        return [0.0] * cfg.num_prompts
    arrivals: list[float] = []
    now = 0.0
    while len(arrivals) < cfg.num_prompts if cfg.duration is None else now < cfg.duration:
        arrivals.append(now)
        if cfg.burstiness == 1.0:
            now += rng.expovariate(rate)
        else:
            now += rng.gammavariate(cfg.burstiness, 1.0 / (rate * cfg.burstiness))
    return arrivals


async def resolve_model(client: httpx.AsyncClient, cfg: ServeConfig) -> str:
    """`--model`, else the first id /v1/models lists; ConfigError when the server can't say."""
    if cfg.model:
        return cfg.model
    url = f"{cfg.base_url}/v1/models"
    try:
        response = await client.get(url)
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise ConfigError(f"--base-url: cannot list models at {url} ({e}); is it up?") from None
    if not models:
        raise ConfigError(f"--model: {url} lists no model; name one")
    return models[0]["id"]


def _request_body(cfg: ServeConfig, model: str, job: Job) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": job.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Not OpenAI's, but qiao, vLLM and llama.cpp's server honour it: fixed output lengths.
        "ignore_eos": True,
    }
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": job.prompt}]
        return f"{cfg.base_url}/v1/chat/completions", body
    body["prompt"] = job.prompt
    return f"{cfg.base_url}/v1/completions", body


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient, cfg: ServeConfig, model: str, job: Job
) -> RequestResult:
    url, body = _request_body(cfg, model, job)
    result = RequestResult(ok=False)
    begin = time.perf_counter()
    last = begin
    num_chunks = 0
    usage: dict[str, Any] | None = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return RequestResult(ok=False, error=f"HTTP {response.status_code}: {text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                result.ok = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return RequestResult(ok=False, error=f"stream error: {str(chunk['error'])[:200]}")
            usage = chunk.get("usage") or usage
            if _chunk_text(chunk):
                now = time.perf_counter()
                if num_chunks == 0:
                    result.ttft = now - begin
                else:
                    result.itls.append(now - last)
                last = now
                num_chunks += 1
    result.e2e = time.perf_counter() - begin
    if not result.ok:
        result.error = "stream ended without [DONE]"
    result.num_output_tokens = (usage or {}).get("completion_tokens") or num_chunks
    result.num_prompt_tokens = (usage or {}).get("prompt_tokens")
    return result


async def _guarded(
    client: httpx.AsyncClient, cfg: ServeConfig, model: str, job: Job, gate: asyncio.Semaphore
) -> RequestResult:
    """One request with an overall deadline; any failure becomes an error result."""
    async with gate:
        try:
            return await asyncio.wait_for(
                send_request(client, cfg, model, job), timeout=cfg.request_timeout
            )
        except TimeoutError:
            return RequestResult(ok=False, error=f"timeout after {cfg.request_timeout:.0f} s")
        except Exception as e:
            # Whatever a server or the network does to one request is a data point: record it
            # and keep the run going.
            return RequestResult(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")


async def run_rate(
    client: httpx.AsyncClient,
    cfg: ServeConfig,
    model: str,
    rate: float,
    jobs: list[Job],
    label: str = "",
) -> tuple[list[RequestResult], float]:
    """Fire `jobs` at their arrival times; return the results and the wall time to the last
    completion."""
    from tqdm.auto import tqdm

    gate = asyncio.Semaphore(cfg.max_concurrency or len(jobs) or 1)
    start = time.perf_counter()
    desc = f"rate {rate:g} req/s{label}"
    bar = tqdm(total=len(jobs), desc=desc, disable=not cfg.show_progress)

    async def fire(job: Job) -> RequestResult:
        await asyncio.sleep(max(0.0, start + job.arrival - time.perf_counter()))
        result = await _guarded(client, cfg, model, job, gate)
        bar.update(1)
        return result

    try:
        results = await asyncio.gather(*(fire(job) for job in jobs))
    finally:
        bar.close()
    return list(results), time.perf_counter() - start


def _client(cfg: ServeConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = httpx.Timeout(cfg.request_timeout, connect=min(10.0, cfg.request_timeout))
    # No pool limit: a pool that queues requests would hide the server's own queueing.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits)


async def _ladder(
    client: httpx.AsyncClient, cfg: ServeConfig, model: str, label: str = ""
) -> list[dict[str, Any]]:
    """Every rate, `repeat` times; each rate's figures (with repeats: their medians)."""
    from qiao.bench.serve_report import median_of_runs, summarize

    rates = cfg.request_rates
    runs: list[list[dict[str, Any]]] = [[] for _ in rates]
    # Round by round (every rate once, then again), so a drift in the server's speed touches
    # every rate alike. Seeds: rate i of round k takes seed + i + k * len(rates), so round 0 is
    # what a single run sends.
    for k in range(cfg.repeat):
        run_label = label + (f", run {k + 1}/{cfg.repeat}" if cfg.repeat > 1 else "")
        for index, rate in enumerate(rates):
            jobs = make_jobs(cfg, rate, cfg.seed + index + k * len(rates))
            results, seconds = await run_rate(client, cfg, model, rate, jobs, run_label)
            runs[index].append(summarize(rate, results, seconds, cfg.slo_ttft, cfg.slo_itl))
    return [r[0] if cfg.repeat == 1 else median_of_runs(r) for r in runs]


async def run_serve_async(cfg: ServeConfig) -> dict[str, Any]:
    # Accept http://host:port, .../ and .../v1 alike.
    cfg = dataclasses.replace(cfg, base_url=cfg.base_url.rstrip("/").removesuffix("/v1"))
    async with _client(cfg) as client:
        model = await resolve_model(client, cfg)
        report = {"config": _config_dict(cfg), "model": model}
        report["rates"] = await _ladder(client, cfg, model)
        if cfg.with_batch:
            report["with_batch"] = await _beside_batch(client, cfg, model, report)
    return report


async def _beside_batch(
    client: httpx.AsyncClient, cfg: ServeConfig, model: str, alone: dict[str, Any]
) -> dict[str, Any]:
    """The ladder again while a batch of `cfg.with_batch` lines runs; the batch is cancelled
    afterwards whatever happened."""
    from qiao.bench.serve_batch import BackgroundBatch, batch_progress, compare

    assert cfg.with_batch is not None
    batch = BackgroundBatch(client, cfg, model)
    try:
        before = await batch.start(cfg.with_batch)
        start = time.perf_counter()
        rates = await _ladder(client, cfg, model, label=", beside a batch")
        seconds = time.perf_counter() - start
        after = await batch.retrieve()
    finally:
        await batch.cancel()
    lo, hi = cfg.output_len.lo, cfg.output_len.hi
    out = {"rates": rates, "batch": batch_progress(before, after, seconds, (lo + hi) / 2)}
    out["comparison"] = compare(alone, out)
    return out


def run_serve(cfg: ServeConfig) -> dict[str, Any]:
    """Run every rate; return the report (as written by `--json`)."""
    return asyncio.run(run_serve_async(cfg))


def _config_dict(cfg: ServeConfig) -> dict[str, Any]:
    d = dict(vars(cfg))
    d.pop("api_key")  # never write a secret into a report
    d["input_len"] = str(cfg.input_len)
    d["output_len"] = str(cfg.output_len)
    d["request_rates"] = [r if math.isfinite(r) else "inf" for r in cfg.request_rates]
    return d
