"""The sending side of `qiao bench embeddings`: requests, the two load shapes, what comes back,
and the worker processes that share a level.

A level runs as one `Share` per worker. With one worker the share runs in this process; with
several, each runs in its own process (its own event loop, connection pool and core: httpx
spends most of a millisecond of CPU per request, so one process tops out near a thousand
requests/s). Every worker opens its connections first, waits at a barrier for the others, then
sends; their records merge into one level, timed from the first start to the last answer.

An answer counts as a success when it is a 200 holding one vector per input. Every answer's
vectors are counted by its `"index":` keys (a C-speed byte count; nothing else in an OpenAI
embeddings answer has that key, and floats and base64 hold no quotes); the first and every
64th successful answer is parsed in full: `data` holds one numeric (or base64 float32) vector
per input, all of one dimension.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import math
import multiprocessing
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from qiao.bench.embeddings import EmbeddingsBenchConfig

VERIFY_EVERY = 64


class LevelRecorder:
    """What one level's requests came back with. The event loop is single-threaded, so plain
    appends are safe."""

    def __init__(self, expected_vectors: int) -> None:
        self.expected_vectors = expected_vectors
        self.latencies: list[float] = []  # seconds, successful requests only
        self.errors: Counter[str] = Counter()  # kind ("HTTP 503", "timeout", ...) -> count
        self.first_error: str | None = None
        self.send_lags: list[float] = []  # open loop: seconds each request left after its time
        self.dimensions: int | None = None
        self.num_verified = 0

    @property
    def num_requests(self) -> int:
        return len(self.latencies) + self.errors.total()

    def fail(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if self.first_error is None:
            self.first_error = f"{kind}: {detail[:300]}"

    def answer(self, content: bytes, latency: float) -> None:
        """Record a 200 answer: a success if it holds one vector per input."""
        problem = self._check(content)
        if problem is None:
            self.latencies.append(latency)
        else:
            self.fail("bad response", problem)

    def _check(self, content: bytes) -> str | None:
        count = content.count(b'"index":')
        if count != self.expected_vectors:
            return f"expected {self.expected_vectors} vectors, found {count}"
        if len(self.latencies) % VERIFY_EVERY == 0:
            return self._verify(content)
        return None

    def _verify(self, content: bytes) -> str | None:
        try:
            data = json.loads(content)["data"]
            dims = {_vector_dim(item["embedding"]) for item in data}
        except (ValueError, KeyError, TypeError) as e:
            return f"unreadable answer ({type(e).__name__}: {e})"
        if len(data) != self.expected_vectors:
            return f"expected {self.expected_vectors} vectors in data, got {len(data)}"
        if self.dimensions is not None:
            dims.add(self.dimensions)
        if len(dims) != 1 or 0 in dims:
            return f"vectors of differing or zero dimensions {sorted(dims)}"
        self.dimensions = dims.pop()
        self.num_verified += 1
        return None

    @classmethod
    def merged(cls, recorders: list[LevelRecorder]) -> LevelRecorder:
        """One record of several workers' (the first error is the first worker's that had one)."""
        total = cls(recorders[0].expected_vectors)
        for rec in recorders:
            total.latencies += rec.latencies
            total.errors += rec.errors
            total.first_error = total.first_error or rec.first_error
            total.send_lags += rec.send_lags
            total.dimensions = total.dimensions or rec.dimensions
            total.num_verified += rec.num_verified
        return total


def _vector_dim(embedding: Any) -> int:
    if isinstance(embedding, str):  # base64 of little-endian float32
        raw = base64.b64decode(embedding, validate=True)
        if len(raw) % 4:
            raise ValueError(f"base64 vector of {len(raw)} bytes is not float32")
        return len(raw) // 4
    if not all(isinstance(x, int | float) for x in embedding):
        raise TypeError("embedding holds a non-number")
    return len(embedding)


async def send(
    client: httpx.AsyncClient, url: str, body: bytes, rec: LevelRecorder, timeout: float
) -> None:
    """One request; whatever the server or the network does to it is recorded, never raised.
    The latency runs from just before sending to the last byte of the answer."""
    begin = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            response = await client.post(url, content=body)
    except (TimeoutError, httpx.TimeoutException):
        rec.fail("timeout", f"no answer within {timeout:g} s")
        return
    except httpx.HTTPError as e:  # refused, reset, protocol errors
        rec.fail(type(e).__name__, str(e) or repr(e))
        return
    latency = time.perf_counter() - begin
    if response.status_code != 200:
        rec.fail(f"HTTP {response.status_code}", response.text)
    else:
        rec.answer(response.content, latency)


def _nothing() -> None:
    pass


async def closed_loop(
    client: httpx.AsyncClient,
    url: str,
    bodies: list[bytes],
    concurrency: int,
    stop: Callable[[int], bool],
    rec: LevelRecorder,
    timeout: float,
    on_done: Callable[[], object] = _nothing,
) -> None:
    """`concurrency` clients, each sending its next body as soon as its last answer is in,
    until `stop(number of requests issued)` says so."""
    issued = 0

    async def one_client() -> None:
        nonlocal issued
        while not stop(issued):
            body = bodies[issued % len(bodies)]
            issued += 1
            await send(client, url, body, rec, timeout)
            on_done()

    await asyncio.gather(*(one_client() for _ in range(concurrency)))


async def open_loop(
    client: httpx.AsyncClient,
    url: str,
    bodies: list[bytes],
    arrivals: list[float],
    rec: LevelRecorder,
    timeout: float,
    on_done: Callable[[], object] = _nothing,
) -> None:
    """Send body i at `arrivals[i]` seconds after the start, however many are in flight."""

    async def fire(body: bytes) -> None:
        await send(client, url, body, rec, timeout)
        on_done()

    start = time.perf_counter()
    tasks = []
    for index, arrival in enumerate(arrivals):
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec.send_lags.append(time.perf_counter() - start - arrival)
        tasks.append(asyncio.create_task(fire(bodies[index % len(bodies)])))
    await asyncio.gather(*tasks)


def stop_rule(num_requests: int | None, deadline: float) -> Callable[[int], bool]:
    """Stop after `num_requests`, or (None) once `deadline` (perf_counter time) has passed."""
    if num_requests is not None:
        return lambda issued: issued >= num_requests
    return lambda issued: time.perf_counter() >= deadline


def make_client(cfg: EmbeddingsBenchConfig, max_connections: int | None) -> httpx.AsyncClient:
    """A keep-alive pool of `max_connections` (None: no cap; an open loop must not queue in
    the client, which would hide the server's own queueing)."""
    headers = {"Content-Type": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    timeout = httpx.Timeout(cfg.request_timeout, connect=min(10.0, cfg.request_timeout))
    keepalive = 1024 if max_connections is None else max_connections
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=keepalive)
    return httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits)


# --- one worker's part of a level -------------------------------------------------------------


@dataclass(frozen=True)
class Share:
    """One worker's part of one level against one server; it crosses process boundaries."""

    url: str
    bodies: list[bytes]
    concurrency: int  # closed loop: clients (0: this worker sits the level out)
    num_requests: int | None  # closed loop: this worker's requests (None: until duration)
    arrivals: list[float] | None  # open loop: this worker's arrival times
    cfg: EmbeddingsBenchConfig

    @property
    def is_idle(self) -> bool:
        if self.arrivals is not None:
            return not self.arrivals
        return self.concurrency == 0 or self.num_requests == 0


@dataclass
class ShareResult:
    rec: LevelRecorder
    start: float  # perf_counter: CLOCK_MONOTONIC, one clock for every process of the machine
    end: float
    cpu_seconds: float  # this process's CPU time while sending


async def run_share(
    share: Share, on_done: Callable[[], object], barrier_wait: Callable[[], object] | None
) -> ShareResult | None:
    """Open the share's connections (closed loop: one request per client, unrecorded), wait for
    the other workers, then send; None for an idle share."""
    cfg = share.cfg
    rec = LevelRecorder(cfg.inputs_per_request)
    closed = share.arrivals is None
    async with make_client(cfg, share.concurrency if closed else None) as client:
        if closed and not share.is_idle:
            await closed_loop(
                client,
                share.url,
                share.bodies,
                share.concurrency,
                stop_rule(share.concurrency, math.inf),
                LevelRecorder(cfg.inputs_per_request),
                cfg.request_timeout,
            )
        if barrier_wait is not None:
            await asyncio.to_thread(barrier_wait)
        if share.is_idle:
            return None
        cpu_start, start = time.process_time(), time.perf_counter()
        if share.arrivals is not None:
            await open_loop(
                client, share.url, share.bodies, share.arrivals, rec, cfg.request_timeout, on_done
            )
        else:
            stop = stop_rule(share.num_requests, start + cfg.duration)
            await closed_loop(
                client,
                share.url,
                share.bodies,
                share.concurrency,
                stop,
                rec,
                cfg.request_timeout,
                on_done,
            )
        return ShareResult(rec, start, time.perf_counter(), time.process_time() - cpu_start)


# --- worker processes -------------------------------------------------------------------------

# In a worker process: the requests-done counter and the level barrier, shared with the parent.
_worker_progress: Any = None
_worker_barrier: Any = None


def _init_worker(progress: Any, barrier: Any) -> None:
    global _worker_progress, _worker_barrier
    _worker_progress, _worker_barrier = progress, barrier


def _tick() -> None:
    with _worker_progress.get_lock():
        _worker_progress.value += 1


def _run_in_worker(share: Share) -> ShareResult | None:
    return asyncio.run(run_share(share, _tick, _worker_barrier.wait))


class LoadWorkers:
    """`num_workers` processes that run one level's shares at a time (none for one worker:
    its share runs in this process)."""

    def __init__(self, num_workers: int, barrier_timeout: float) -> None:
        self.num_workers = num_workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        if num_workers > 1:
            # spawn, not fork: the parent may hold threads (progress bars, the pool's own).
            ctx = multiprocessing.get_context("spawn")
            self._progress = ctx.Value("q", 0)
            barrier = ctx.Barrier(num_workers, timeout=barrier_timeout)
            self._pool = concurrent.futures.ProcessPoolExecutor(
                num_workers,
                mp_context=ctx,
                initializer=_init_worker,
                initargs=(self._progress, barrier),
            )

    def __enter__(self) -> LoadWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def run(self, shares: list[Share], on_done: Callable[[int], object]) -> list[ShareResult]:
        """Run one share per worker (exactly `num_workers` of them, idle ones included: every
        worker must reach the barrier); `on_done(n)` reports n more requests answered."""
        assert len(shares) == self.num_workers
        if self._pool is None:
            result = asyncio.run(run_share(shares[0], lambda: on_done(1), None))
            return [] if result is None else [result]
        with self._progress.get_lock():
            self._progress.value = 0
        futures = [self._pool.submit(_run_in_worker, share) for share in shares]
        seen, pending = 0, futures
        while pending:
            _, pending = concurrent.futures.wait(pending, timeout=0.1)
            now = self._progress.value
            on_done(now - seen)
            seen = now
        return [r for r in (f.result() for f in futures) if r is not None]
