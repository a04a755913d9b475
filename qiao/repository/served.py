"""Served model versions: what one loaded version of a model runs requests on.

- `LLMVersion`: an `EngineClient` (continuous batching, in its own process or a thread). OpenAI routes use its engine directly;
  KServe `infer` takes `text_input` (BYTES, one prompt per row) and optional `max_tokens`.
- `EncoderVersion`: an encoder (PyTorch or ONNX Runtime) behind a `DynamicBatcher`, in its own
  supervised process (`ProcessEncoder`) or in the batcher's thread. Requests carry texts (or
  token ids), tokenized here; a batch is every queued request's rows run as one `embed` call,
  and each request gets exactly its own rows back.

Both count the requests they hold, so a version being unloaded can finish them first, and keep
Triton's inference statistics (`statistics.InferStatistics`: KServe infers, and an encoder's
OpenAI embeddings too; the batcher adds each batch's queue and compute times).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from qiao.engine.async_engine import GenerateRequest
from qiao.engine.batcher import BatchStats, DynamicBatcher
from qiao.engine.breaker import BreakerConfig, CircuitBreaker
from qiao.engine.encoder_process import ProcessEncoder
from qiao.errors import ConfigError, EngineRestartedError
from qiao.repository.statistics import InferStatistics
from qiao.repository.types import Batching, TensorSpec
from qiao.sampling_params import SamplingParams

if TYPE_CHECKING:
    from qiao.engine.async_engine import EngineClient, RequestStream
    from qiao.engine.batcher import BatcherConfig
    from qiao.runner.encoder import Encoder

_LATEST_ONE = {"latest": {"num_versions": 1}}  # Triton's default version policy
# Most tokens an LLM `infer` may ask for when the request names no `max_tokens`.
DEFAULT_INFER_MAX_TOKENS = 16


def _texts(inputs: dict[str, np.ndarray], name: str) -> list[str]:
    if name not in inputs:
        raise ConfigError(f"input {name!r} is required (BYTES, one text per row)")
    array = inputs[name]
    if array.dtype != object or array.ndim not in (1, 2) or array.size == 0:
        raise ConfigError(f"input {name!r} must be a non-empty BYTES tensor of shape [N] or [N, 1]")
    texts = []
    for value in array.reshape(-1):
        if isinstance(value, bytes | bytearray):
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"input {name!r} holds bytes that are not UTF-8") from None
        if not isinstance(value, str):
            raise ConfigError(f"input {name!r} must hold UTF-8 text")
        texts.append(value)
    return texts


class LLMVersion:
    backend = "llm"
    platform = "qiao_llm"
    inputs = (
        TensorSpec("text_input", "BYTES", (-1,)),
        TensorSpec("max_tokens", "INT32", (1,)),
    )
    outputs = (TensorSpec("text_output", "BYTES", (-1,)),)

    def __init__(
        self,
        model: str,
        version: str,
        engine: EngineClient,
        *,
        version_policy: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.version = version
        self.engine = engine
        # Continuous batching in the engine, no batch dimension in the tensors: Triton's
        # max_batch_size 0 (one infer's prompts are its rows of `text_input`).
        self.batching = Batching(version_policy=version_policy or _LATEST_ONE)
        self.statistics = InferStatistics()

    @property
    def breaker(self) -> CircuitBreaker:
        return self.engine.breaker

    def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)

    def num_unfinished(self) -> int:
        return self.engine.num_unfinished()

    def is_healthy(self) -> tuple[bool, str]:
        health = self.engine.health()
        return health.is_ready, health.reason

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        *,
        priority: int | None = None,
        timeout_us: int | None = None,
    ) -> dict[str, np.ndarray]:
        rows = inputs["text_input"].size if "text_input" in inputs else 0
        with self.statistics.request(rows):
            start = time.perf_counter_ns()
            results = await self._infer(inputs, priority, timeout_us)
            self.statistics.record_execution(rows, time.perf_counter_ns() - start)
            return results

    async def _infer(
        self, inputs: dict[str, np.ndarray], priority: int | None, timeout_us: int | None
    ) -> dict[str, np.ndarray]:
        prompts = _texts(inputs, "text_input")
        max_tokens = DEFAULT_INFER_MAX_TOKENS
        if "max_tokens" in inputs:
            values = np.asarray(inputs["max_tokens"]).reshape(-1)
            if values.size != 1 or values.dtype.kind not in "iu" or int(values[0]) < 1:
                raise ConfigError("input 'max_tokens' must be one positive integer")
            max_tokens = int(values[0])
        tokenizer = self.engine.tokenizer
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        deadline = time.monotonic() + timeout_us / 1e6 if timeout_us else None
        ids = [tokenizer.encode(p) for p in prompts]
        for prompt in ids:
            if len(prompt) + max_tokens > self.engine.max_model_len:
                raise ConfigError(
                    f"prompt of {len(prompt)} tokens plus max_tokens {max_tokens} exceeds the "
                    f"context of {self.engine.max_model_len} tokens"
                )
        requests = [
            GenerateRequest(
                f"infer-{uuid.uuid4().hex}", prompt, params, priority or 0, deadline=deadline
            )
            for prompt in ids
        ]
        streams = self.engine.generate_all(requests)  # every prompt admitted, or none
        try:
            texts = await asyncio.gather(*(_final_text(s) for s in streams))
        finally:
            # Whatever ended this call early (an error, the client going away) frees the rest.
            for stream in streams:
                await stream.aclose()
        out = np.empty(len(texts), dtype=object)
        out[:] = [t.encode("utf-8") for t in texts]
        return {"text_output": out}


async def _final_text(stream: RequestStream) -> str:
    parts: list[str] = []
    async for output in stream:
        parts.append(output.outputs[0].text)
    return "".join(parts)


class EncoderVersion:
    """An encoder behind a dynamic batcher. Items are token-id lists; one row per text.

    `encoder` is a `ProcessEncoder` (the model in its own supervised process) or an encoder
    run in the batcher's thread."""

    def __init__(
        self,
        model: str,
        version: str,
        encoder: Encoder,
        batcher_config: BatcherConfig,
        *,
        backend: str,
        on_batch: Callable[[BatchStats], None] | None = None,
        breaker: BreakerConfig | None = None,
        version_policy: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        # Opened by batches that fail in the encoder (not by refused or invalid requests).
        self.breaker = CircuitBreaker(breaker or BreakerConfig(), "this model version")
        self.version = version
        self.backend = backend
        self.platform = "onnxruntime_onnx" if backend == "onnx" else "pytorch_libtorch"
        self.encoder = encoder
        self._process = encoder if isinstance(encoder, ProcessEncoder) else None
        self._unwatch: Callable[[Callable[[], dict[str, Any]] | None], None] | None = None
        self.inputs = (TensorSpec("text", "BYTES", (-1, 1), reshape=(-1,)),)
        self.outputs = (TensorSpec("embedding", "FP32", (-1, encoder.dim)),)
        self.batching = Batching(
            max_batch_size=batcher_config.max_batch_size,
            preferred_batch_sizes=batcher_config.preferred_batch_sizes,
            max_queue_delay_us=batcher_config.max_queue_delay_us,
            version_policy=version_policy or _LATEST_ONE,
        )
        self.statistics = InferStatistics()
        self.batcher: DynamicBatcher[list[list[int]], np.ndarray] = DynamicBatcher(
            self._run_batch,
            batcher_config,
            name=f"{model}/{version}",
            on_batch=on_batch,
            record_batch=self.statistics.record_batch,
        )

    def _run_batch(self, items: list[list[list[int]]]) -> list[np.ndarray]:
        # E.g. items of 2, 1 and 3 rows -> one embed call of 6 rows, split back 2 / 1 / 3.
        flat = [ids for item in items for ids in item]
        try:
            vectors = self.encoder.embed(flat)
        except EngineRestartedError:
            raise  # the supervisor records one failure per death, not one per batch it took
        except Exception:
            self.breaker.record_failure()
            raise
        self.breaker.record_success()
        bounds = np.cumsum([len(item) for item in items])[:-1]
        return list(np.split(vectors, bounds))

    def start(self) -> None:
        self.batcher.start()
        if self._process is not None:
            self._process.start(on_lost=self.breaker.record_failure)
        # The app hooks its metrics into the batcher (`on_batch`) as the version becomes ready,
        # in this same turn of the event loop; hand them the engine figures right after.
        asyncio.get_running_loop().call_soon(self._share_stats)

    async def stop(self) -> None:
        await self.batcher.close(drain=True)
        if self._unwatch is not None:
            self._unwatch(None)
        if self._process is not None:
            await asyncio.to_thread(self._process.shutdown)

    def _share_stats(self) -> None:
        """Hand `stats` to the metrics' batch observer, when the app gave the batcher one: it
        exports them at scrape time, as an LLM version's (until `stop` takes them back)."""
        watch = getattr(self.batcher.on_batch, "watch_engine", None)
        if watch is not None:
            watch(self.stats)
            self._unwatch = watch

    def num_unfinished(self) -> int:
        return self.batcher.queue_size + self.batcher.in_flight

    def is_healthy(self) -> tuple[bool, str]:
        if self._process is not None:
            return self._process.health()
        return True, "ok"

    def stats(self) -> dict[str, Any]:
        """Engine figures as an LLM version's: up, restarts, breaker (and the process's RSS)."""
        engine = (
            self._process.stats()
            if self._process is not None
            else {"engine_up": 1, "engine_restarts": 0}
        )
        return {
            **engine,
            "breaker_state": int(self.breaker.state),
            "breaker_opened": self.breaker.num_opened,
        }

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encoder.tokenize(texts)

    async def embed_ids(
        self,
        token_ids: list[list[int]],
        *,
        priority: int | None = None,
        timeout_us: int | None = None,
    ) -> np.ndarray:
        """Embeddings of `token_ids` ([N, dim] float32) through the batcher."""
        with self.statistics.request(len(token_ids)):
            return await self._embed_ids(token_ids, priority, timeout_us)

    async def _embed_ids(
        self, token_ids: list[list[int]], priority: int | None, timeout_us: int | None
    ) -> np.ndarray:
        if not token_ids:
            raise ConfigError("input must hold at least one text")
        self.breaker.allow()
        if self._process is not None:
            self._process.check_up()  # 503 at once while it restarts; nothing queues
        for ids in token_ids:
            if len(ids) > self.encoder.max_length:
                raise ConfigError(
                    f"input of {len(ids)} tokens exceeds the model's {self.encoder.max_length}"
                )
        return await self.batcher.submit(
            token_ids, rows=len(token_ids), priority=priority, timeout_us=timeout_us
        )

    async def embed(
        self, texts: list[str], *, priority: int | None = None, timeout_us: int | None = None
    ) -> np.ndarray:
        return await self.embed_ids(self.tokenize(texts), priority=priority, timeout_us=timeout_us)

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        *,
        priority: int | None = None,
        timeout_us: int | None = None,
    ) -> dict[str, np.ndarray]:
        rows = inputs["text"].size if "text" in inputs else 0
        with self.statistics.request(rows):  # a refused input counts as a failure too
            token_ids = self.tokenize(_texts(inputs, "text"))
            vectors = await self._embed_ids(token_ids, priority, timeout_us)
        return {"embedding": vectors.astype(np.float32, copy=False)}
