"""`qiao batch run --ray ADDRESS`: a batch file's lines sharded over engine actors on Ray.

The driver (this process) keeps everything durable: the SQLite state of finished lines, the
progress bar and, at the end, the output files in input order (cli.py, as without Ray). The
pending lines are cut into one contiguous shard per actor; each actor (`ShardWorker`, one
engine of the model, `--ray-actor-cpus` CPUs) runs its shard in chunks of `--ray-chunk-lines`
through the same `OfflineBatch` as a single-process run, and the driver records each chunk's
lines as it returns. When an actor dies mid-shard, a new actor takes that shard over from its
first line the state does not hold: no line is lost, none is recorded twice, and the files
equal the single-process run's (greedy sampling). The number of actors follows the cluster
(its CPUs over `--ray-actor-cpus`) unless `--ray-actors` says.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any

from qiao.batch.lines import BatchLine
from qiao.errors import ConfigError

logger = logging.getLogger(__name__)

# (line number, custom_id, answered?, output or error record)
Result = tuple[int, str, bool, dict[str, Any]]


class ShardWorker:
    """One engine (and encoder, if lines need it) in a Ray actor, running chunks of lines."""

    def __init__(
        self,
        job_id: str,
        model: str,
        engine_kwargs: dict[str, Any],
        embedding_model: str | None,
        num_threads: int,
    ) -> None:
        import torch

        torch.set_num_threads(num_threads)
        self.job_id = job_id
        self.model = model
        self.engine_kwargs = engine_kwargs
        self.embedding_model = embedding_model
        self._batch: Any = None

    def pid(self) -> int:
        return os.getpid()

    def run(self, lines: list[BatchLine], needs_llm: bool, needs_encoder: bool) -> list[Result]:
        if self._batch is None:
            from qiao.batch.cli import _encoder
            from qiao.batch.offline import OfflineBatch
            from qiao.entrypoints.llm import LLM

            engine = LLM(self.model, **self.engine_kwargs).engine if needs_llm else None
            encoder = _encoder(self.embedding_model) if needs_encoder else None
            self._batch = OfflineBatch(self.job_id, engine, encoder)
        results: list[Result] = []
        self._batch.run(
            lines,
            lambda line, ok, record: results.append((line.number, line.custom_id, ok, record)),
        )
        return results


def num_actors(ray: Any, requested: int, actor_cpus: float, lines: int) -> int:
    """`requested`, or (0) as many as the cluster's CPUs hold; never more than lines."""
    if requested <= 0:
        requested = max(1, int(ray.cluster_resources().get("CPU", 1) // actor_cpus))
    return max(1, min(requested, lines))


def run_on_ray(
    args: Any,
    engine_kwargs: dict[str, Any],
    job_id: str,
    pending: list[BatchLine],
    record: Callable[[BatchLine, bool, dict[str, Any]], None],
    is_done: Callable[[int], bool],
) -> None:
    """Run `pending` over actors; `record` each finished line (in the driver, once)."""
    from qiao.batch.cli import LLM_URLS
    from qiao.engine.ray_replicas import RayOptions, connect, require_ray

    connect(RayOptions(address=args.ray))
    ray, _ = require_ray()
    from ray.exceptions import ActorUnavailableError, RayActorError

    if args.ray_chunk_lines < 1:
        raise ConfigError("--ray-chunk-lines must be at least 1")
    runnable = [line for line in pending if line.error is None]
    needs_llm = any(line.url in LLM_URLS for line in runnable)
    needs_encoder = any(line.url == "/v1/embeddings" for line in runnable)
    by_number = {line.number: line for line in pending}
    count = num_actors(ray, args.ray_actors, args.ray_actor_cpus, len(pending))
    size = -(-len(pending) // count)
    shards = [deque(pending[i : i + size]) for i in range(0, len(pending), size)]
    remote = ray.remote(num_cpus=args.ray_actor_cpus)(ShardWorker)
    threads = max(1, round(args.ray_actor_cpus))
    embedding = args.embedding_model

    def new_actor() -> Any:
        return remote.remote(job_id, str(args.model), engine_kwargs, embedding, threads)

    actors = [new_actor() for _ in shards]
    restarts = [0] * len(shards)
    in_flight: dict[Any, tuple[int, list[BatchLine]]] = {}

    def submit(shard: int) -> None:
        queue = shards[shard]
        chunk: list[BatchLine] = []
        while queue and len(chunk) < args.ray_chunk_lines:
            line = queue.popleft()
            if not is_done(line.number):
                chunk.append(line)
        if chunk:
            ref = actors[shard].run.remote(chunk, needs_llm, needs_encoder)
            in_flight[ref] = (shard, chunk)

    print(f"qiao batch: {len(pending)} lines over {len(shards)} Ray actors", flush=True)
    for shard in range(len(shards)):
        submit(shard)
    try:
        while in_flight:
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            ref = ready[0]
            shard, chunk = in_flight.pop(ref)
            try:
                results = ray.get(ref)
            except (RayActorError, ActorUnavailableError) as exc:
                restarts[shard] += 1
                if restarts[shard] > args.ray_max_restarts:
                    raise ConfigError(
                        f"shard {shard} lost its actor {restarts[shard]} times (last: "
                        f"{type(exc).__name__}); the finished lines are saved: run the same "
                        "command again to continue"
                    ) from None
                logger.warning(
                    "shard %d: its actor died (%s); a new one takes the shard over", shard, exc
                )
                print(f"qiao batch: shard {shard}: actor lost, resuming with a new one", flush=True)
                shards[shard].extendleft(reversed(chunk))  # what the state does not hold
                actors[shard] = new_actor()
                submit(shard)
                continue
            for number, _custom_id, ok, output in results:
                if not is_done(number):
                    record(by_number[number], ok, output)
            submit(shard)
    finally:
        for ref in in_flight:
            ray.cancel(ref, force=True)
        for actor in actors:
            ray.kill(actor)
