"""Exact-match caching of whole responses whose answer is determined by the request.

Off by default (`--response-cache` turns it on; a model's `response_cache:` in its config.yaml
turns it on or off for that model). What is cached: completions and chat that are greedy
(`temperature: 0`) or seeded, embeddings, and KServe infers (every served backend answers them
deterministically: encoders, onnx, and LLMs greedily), over HTTP and gRPC (`cache_for` finds
the cache of the app serving the gRPC service's model manager). Only whole successful answers are stored
(every choice ended by stop, length or a tool call); errors, timeouts and streams that missed
are not. A request with `cache: false` (KServe: `parameters.cache: false`) neither reads nor
writes. Every answer of a route the cache covers says what happened in `X-Qiao-Cache`: `hit`,
`miss` or `skip`.

The key (`cache_key`) is the sha256 of a canonical JSON (sorted keys) of: the route, the model
and the version that serves the request (chosen first, so a canary split never mixes
versions), that version's build tag (the fingerprint of its files and config: another build of
the same version number never matches), the scope (the digest of the API key's secret, or `*` with
`--response-cache-scope shared`), and the request body as its pydantic model reads it
(defaults filled in) without the fields that do not change the answer: `stream`,
`stream_options`, `user`, `priority`, `timeout`, `cache`. A hit returns the stored bytes, `id`
and `created` included; a streamed request is answered from the stored non-streamed body,
replayed as the SSE chunks the server streams (`replay_stream`).

Invalidation: a reload of a version drops that version's entries (and its new build tag keys
differently anyway); an unload drops them from memory; a traffic change needs nothing, as keys
name the version that answered. Backends in `cache_backends.py`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from qiao.api.cache_backends import CacheBackend, CachedResponse, Group, MemoryBackend, RedisBackend
from qiao.api.errors import APIError
from qiao.api.keys import key_of
from qiao.api.serving import sse

logger = logging.getLogger(__name__)

CACHE_HEADER = "X-Qiao-Cache"
# Request fields that change how an answer is delivered or scheduled, not what it says.
NOT_IN_KEY = frozenset({"stream", "stream_options", "user", "priority", "timeout", "cache"})
# KServe parameters of the same kind.
KSERVE_NOT_IN_KEY = frozenset({"priority", "timeout", "user", "cache"})
# A choice ended by one of these is a whole answer; others (timeout, abort, error) never stored.
COMPLETE_FINISH_REASONS = frozenset({"stop", "length", "tool_calls"})

Status = Literal["hit", "miss", "skip"]


@dataclass(frozen=True)
class CacheSettings:
    """What `ServeSettings` says about the cache (the `--response-cache*` flags)."""

    enabled: bool = False
    max_bytes: int = 256 << 20
    max_entries: int = 100_000
    ttl: float = 600.0
    backend: str = "memory"
    scope: Literal["key", "shared"] = "key"
    namespace: str = "qiao"

    @classmethod
    def from_serve(cls, settings: Any) -> CacheSettings:
        return cls(
            enabled=settings.response_cache,
            max_bytes=settings.response_cache_max_bytes,
            max_entries=settings.response_cache_max_entries,
            ttl=settings.response_cache_ttl,
            backend=settings.response_cache_backend,
            scope=settings.response_cache_scope,
            namespace=settings.response_cache_namespace,
        )


@dataclass(frozen=True)
class ModelPolicy:
    """A model's `response_cache:` block: on or off for it (None: the server's flag) and its
    own TTL."""

    enabled: bool | None = None
    ttl: float | None = None


def cache_key(
    route: str, model: str, version: str, tag: str, scope: str, fields: dict[str, Any]
) -> str:
    """The hex sha256 of the canonical JSON of everything that determines the answer."""
    canonical = json.dumps(
        {
            "route": route,
            "model": model,
            "version": version,
            "tag": tag,
            "scope": scope,
            "body": fields,
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def body_fields(body: Any) -> dict[str, Any]:
    """A request model's fields as they determine the answer: defaults filled, delivery-only
    fields left out."""
    return body.model_dump(mode="json", exclude=set(NOT_IN_KEY))


def adapter_identity(engine: Any, adapter: str | None) -> list[Any] | None:
    """What identifies the LoRA adapter a request names, for its key: its folder and each of
    its files' name, size and modification time (so an adapter loaded again under the same
    name, from another folder or with new files, never matches); None without an adapter."""
    if adapter is None:
        return None
    path = engine.lora_adapters().get(adapter)
    if path is None:
        return [adapter]
    try:
        files = sorted(
            (entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
            for entry in os.scandir(path)
            if entry.is_file()
        )
    except OSError:
        files = []
    return [adapter, str(path), files]


def kserve_fields(payload: dict[str, Any], binary: bytes) -> dict[str, Any]:
    """A KServe infer request's JSON (its scheduling parameters left out) and the digest of the
    binary tensor data after it."""
    parameters = payload.get("parameters") or {}
    fields = {k: v for k, v in payload.items() if k != "parameters"}
    fields["parameters"] = {k: v for k, v in parameters.items() if k not in KSERVE_NOT_IN_KEY}
    fields["binary_sha256"] = hashlib.sha256(binary).hexdigest()
    return fields


def is_deterministic(body: Any) -> bool:
    """A completions or chat request whose answer is fixed by its input: greedy or seeded."""
    return body.temperature == 0 or body.seed is not None


async def skip_requested(request: Request) -> bool:
    """`cache: false` in the JSON body (400 unless true or false)."""
    try:
        raw = await request.json()
    except ValueError:
        return False
    return _skip_flag(raw.get("cache") if isinstance(raw, dict) else None, "cache")


def _skip_flag(value: Any, param: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{param}: must be true or false", param=param)
    return not value


def kserve_skip_requested(payload: dict[str, Any]) -> bool:
    parameters = payload.get("parameters")
    value = parameters.get("cache") if isinstance(parameters, dict) else None
    if value is not None and not isinstance(value, bool):
        from qiao.errors import ConfigError

        raise ConfigError("parameters.cache must be true or false")
    return value is False


async def lookup(
    request: Request,
    served: Any,
    route: str,
    fields: dict[str, Any] | Callable[[], dict[str, Any]],
    *,
    cacheable: bool = True,
    skip: bool | None = None,
) -> Lookup:
    """The app's `ResponseCache.lookup`; no cache on the app: `Lookup(None)`."""
    cache: ResponseCache | None = getattr(request.app.state, "response_cache", None)
    if cache is None:
        return Lookup(None)
    return await cache.lookup(request, served, route, fields, cacheable=cacheable, skip=skip)


# The cache of the app serving a model manager, for the gRPC service (which holds the manager).
_BY_ROUTER: weakref.WeakKeyDictionary[Any, ResponseCache] = weakref.WeakKeyDictionary()


def register(router: Any, cache: ResponseCache) -> None:
    _BY_ROUTER[router] = cache


def cache_for(router: Any) -> ResponseCache | None:
    """The response cache of the app serving `router`, if any."""
    try:
        return _BY_ROUTER.get(router)
    except TypeError:  # a router that cannot be weakly referenced or hashed has none
        return None


# --- the cache -------------------------------------------------------------------------------


class _UsageCollector(Collector):
    def __init__(self, backend: CacheBackend) -> None:
        self.backend = backend

    def collect(self) -> Iterable[Any]:
        usage = self.backend.usage()
        size = GaugeMetricFamily(
            "qiao:response_cache_bytes", "Bytes held by the response cache.", labels=["model_name"]
        )
        entries = GaugeMetricFamily(
            "qiao:response_cache_entries",
            "Entries held by the response cache.",
            labels=["model_name"],
        )
        for model, (num_bytes, num_entries) in sorted(usage.items()):
            size.add_metric([model], num_bytes)
            entries.add_metric([model], num_entries)
        yield size
        yield entries


class ResponseCache:
    """The server's response cache: settings, backend, build tags and policies of the served
    versions, metrics. `lookup` in a route, then `Lookup.respond` (or the hit's replay)."""

    def __init__(
        self,
        settings: CacheSettings,
        registry: CollectorRegistry | None = None,
        *,
        backend: CacheBackend | None = None,
    ) -> None:
        self.settings = settings
        labels = ["model_name"]
        r = registry if registry is not None else CollectorRegistry()
        self.hits = Counter(
            "qiao:response_cache_hits",
            "Requests answered from the response cache.",
            labels,
            registry=r,
        )
        self.misses = Counter(
            "qiao:response_cache_misses",
            "Cacheable requests the response cache did not hold.",
            labels,
            registry=r,
        )
        self.evictions = Counter(
            "qiao:response_cache_evictions",
            "Entries evicted to keep the response cache's bounds.",
            labels,
            registry=r,
        )
        if backend is None:
            backend = self._backend(settings)
        self.backend = backend
        r.register(_UsageCollector(self.backend))
        self._lock = threading.Lock()
        # Per served version instance: its build tag and the model's policy (weakly held).
        self._tags: weakref.WeakKeyDictionary[Any, tuple[str, ModelPolicy]] = (
            weakref.WeakKeyDictionary()
        )
        self._current: dict[Group, Any] = {}  # (model, version) → the instance serving it
        self._tasks: set[asyncio.Task[Any]] = set()

    def _backend(self, settings: CacheSettings) -> CacheBackend:
        if settings.backend.startswith(("redis://", "rediss://", "unix://")):
            return RedisBackend(settings.backend, settings.namespace, settings.max_bytes)

        def evicted(model: str) -> None:
            self.evictions.labels(model).inc()

        return MemoryBackend(settings.max_bytes, settings.max_entries, on_evict=evicted)

    # --- served versions -------------------------------------------------------------------

    def track_loader(self, loader: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """Wrap a repository `VersionLoader`: each version it builds gets its build tag (the
        fingerprint of its files and its model's config) and its model's policy."""

        def load(entry: Any, vdir: Any) -> Any:
            served = loader(entry, vdir)
            config = entry.config
            digest = hashlib.sha256(vdir.fingerprint.encode())
            if config is not None:
                digest.update(config.model_dump_json().encode())
            section = getattr(config, "response_cache", None)
            policy = (
                ModelPolicy(section.enabled, section.ttl) if section is not None else ModelPolicy()
            )
            self.note_version(served, digest.hexdigest(), policy)
            return served

        return load

    def note_version(self, served: Any, tag: str, policy: ModelPolicy = ModelPolicy()) -> None:
        with self._lock:
            self._tags[served] = (tag, policy)

    def version_ready(self, served: Any) -> None:
        """A version instance takes traffic: the entries of one it replaces go."""
        group = (served.model, served.version)
        with self._lock:
            previous = self._current.get(group)
            self._current[group] = served
        if previous is not None and previous is not served:
            self._drop(group)

    def version_stopped(self, served: Any) -> None:
        """A version instance stopped: if nothing replaced it (an unload), its entries leave
        memory (a shared Redis keeps them for the replicas still serving it, until their TTL)."""
        group = (served.model, served.version)
        with self._lock:
            if self._current.get(group) is not served:
                return
            del self._current[group]
        if isinstance(self.backend, MemoryBackend):
            self._drop(group)

    def _drop(self, group: Group) -> None:
        if isinstance(self.backend, MemoryBackend):
            dropped = self.backend.drop_group_now(group)
            if dropped:
                logger.info("response cache: dropped %d entries of %s@%s", dropped, *group)
            return
        task = asyncio.get_running_loop().create_task(self._drop_now(group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drop_now(self, group: Group) -> None:
        try:
            dropped = await self.backend.drop_group(group)
        except Exception as exc:  # a shared backend gone: its entries still expire by TTL
            logger.warning("response cache: could not drop %s@%s: %s", *group, exc)
            return
        if dropped:
            logger.info("response cache: dropped %d entries of %s@%s", dropped, *group)

    def _tag(self, served: Any) -> tuple[str, ModelPolicy]:
        with self._lock:
            return self._tags.get(served, ("static", ModelPolicy()))

    def enabled_for(self, served: Any) -> bool:
        policy = self._tag(served)[1]
        return self.settings.enabled if policy.enabled is None else policy.enabled

    # --- requests ----------------------------------------------------------------------------

    async def lookup(
        self,
        request: Request | None,
        served: Any,
        route: str,
        fields: dict[str, Any] | Callable[[], dict[str, Any]],
        *,
        cacheable: bool = True,
        skip: bool | None = None,
        api_key: Any = None,
    ) -> Lookup:
        """What the cache holds for this request on `served` (the version chosen for it).
        Without an HTTP `request` (gRPC), `api_key` is the caller's key and `skip` is given."""
        tag, policy = self._tag(served)
        enabled = self.settings.enabled if policy.enabled is None else policy.enabled
        if not enabled:
            return Lookup(None)
        if skip is None:  # read from the JSON body
            skip = request is not None and await skip_requested(request)
        if skip or not cacheable:
            return Lookup("skip")
        if self.settings.scope == "shared":
            scope = "*"
        else:  # the digest of the key's secret: the same on every replica, whatever its name
            key = key_of(request) if request is not None else api_key
            scope = key.digest.hex() if key is not None else ""
        body = fields() if callable(fields) else fields
        digest = cache_key(route, served.model, served.version, tag, scope, body)
        group = (served.model, served.version)
        try:
            hit = await self.backend.get(digest, group)
        except Exception as exc:  # a shared backend down: answer from the engine
            logger.warning("response cache: lookup failed (%s); answering without it", exc)
            return Lookup("skip")
        if hit is not None:
            self.hits.labels(served.model).inc()
            return Lookup("hit", self, digest, group, served, hit=hit)
        self.misses.labels(served.model).inc()
        ttl = policy.ttl if policy.ttl is not None else self.settings.ttl
        return Lookup("miss", self, digest, group, served, ttl=ttl)

    async def store(
        self, key: str, group: Group, served: Any, value: CachedResponse, ttl: float
    ) -> None:
        with self._lock:
            if self._current.get(group, served) is not served:
                return  # made by an instance already replaced: never outlives it
        try:
            await self.backend.put(key, group, value, ttl)
        except Exception as exc:
            logger.warning("response cache: store failed (%s)", exc)

    async def close(self) -> None:
        for task in list(self._tasks):
            await task
        await self.backend.close()


@dataclass
class Lookup:
    """One request's cache outcome: `status` None (no cache for this model), skip, hit (with
    the stored response), or miss (with where to store the answer)."""

    status: Status | None
    cache: ResponseCache | None = None
    key: str = ""
    group: Group = ("", "")
    served: Any = None
    hit: CachedResponse | None = None
    ttl: float = 0.0

    def mark(self, response: Response) -> Response:
        if self.status is not None:
            response.headers[CACHE_HEADER] = self.status
        return response

    def hit_response(self) -> Response:
        assert self.hit is not None
        return Response(
            self.hit.body,
            media_type=self.hit.media_type,
            headers={**self.hit.headers, CACHE_HEADER: "hit"},
        )

    def replay(self, body: Any) -> Response:
        """The hit as this completions or chat request asked it: streamed or whole."""
        if getattr(body, "stream", False):
            assert self.hit is not None
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return replay_stream(self.hit, include_usage=include_usage)
        return self.hit_response()

    async def respond_json(self, content: dict[str, Any]) -> Any:
        """A JSON answer: stored on a miss when it is whole, marked."""
        if self.status is None:
            return content
        response = JSONResponse(content)
        choices = content.get("choices")
        whole = choices is None or all(
            c.get("finish_reason") in COMPLETE_FINISH_REASONS for c in choices
        )
        return await self.respond(response, store=whole)

    async def respond(self, response: Response, *, store: bool = True) -> Response:
        """A finished answer: stored on a miss (a 200 only), marked."""
        if self.status == "miss" and store and response.status_code == 200:
            assert self.cache is not None
            kept = {k: v for k, v in response.headers.items() if k.lower() in _KEPT_HEADERS}
            value = CachedResponse(bytes(response.body), response.media_type or "", kept)
            await self.cache.store(self.key, self.group, self.served, value, self.ttl)
        return self.mark(response)


# Response headers stored with the body (the rest Starlette sets again on a hit).
_KEPT_HEADERS = frozenset({"inference-header-content-length"})


# --- streams from the cache ---------------------------------------------------------------------


def replay_stream(hit: CachedResponse, *, include_usage: bool) -> StreamingResponse:
    """A stored completions or chat body as the SSE stream the server would have sent: chat's
    role chunks first, then per choice one chunk with its whole text (or tool calls) and its
    finish_reason, the usage chunk if asked, then [DONE]."""
    body = json.loads(hit.body)
    return StreamingResponse(
        _replay_events(body, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", CACHE_HEADER: "hit"},
    )


async def _replay_events(body: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    for chunk in replay_chunks(body, include_usage):
        yield sse(chunk)
    yield sse("[DONE]")


def replay_chunks(body: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """The stream chunks of a stored non-streamed completions or chat body."""
    chat = body["object"] == "chat.completion"
    base = {
        "id": body["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": body["created"],
        "model": body["model"],
    }
    chunks: list[dict[str, Any]] = []
    if chat:
        for choice in body["choices"]:
            role = {"role": "assistant", "content": ""}
            chunks.append({**base, "choices": [_chunk_choice(choice["index"], role, None, None)]})
    for choice in body["choices"]:
        if chat:
            message = choice["message"]
            delta: dict[str, Any] = {}
            if message.get("content"):
                delta["content"] = message["content"]
            calls = message.get("tool_calls")
            if calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            out = _chunk_choice(choice["index"], delta, choice.get("logprobs"), None)
        else:
            out = {k: v for k, v in choice.items() if k != "finish_reason"}
        out["finish_reason"] = choice["finish_reason"]
        chunks.append({**base, "choices": [out]})
    if include_usage and "usage" in body:
        chunks.append({**base, "choices": [], "usage": body["usage"]})
    return chunks


def _chunk_choice(
    index: int, delta: dict[str, Any], logprobs: Any, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
