"""The HTTP app: `create_app(settings, ...)` wires routes, middleware, errors and metrics.

All state lives on `app.state`: settings, the model manager (`router`: model → served version),
metrics and the draining flag; with one LLM (`qiao serve --model PATH`) also its engine
(`engine`) and name (`model_name`). Nothing here is global, so tests can run several apps in
one process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from qiao.api import response_cache, triton_metrics
from qiao.api.batches import BatchWorker
from qiao.api.batches import router as batches_router
from qiao.api.console import ConsoleShell
from qiao.api.embeddings import router as embeddings_router
from qiao.api.errors import error_body, install_error_handlers
from qiao.api.files import MULTIPART_SLACK_BYTES
from qiao.api.files import router as files_router
from qiao.api.keys import KeyLimiter, KeyRing
from qiao.api.kserve import router as kserve_router
from qiao.api.metrics import ServerMetrics
from qiao.api.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
    StatusCountMiddleware,
)
from qiao.api.openai_routes import router as openai_router
from qiao.api.openapi import install_openapi
from qiao.api.response_cache import CacheSettings, ResponseCache
from qiao.api.settings import ServeSettings
from qiao.engine.async_engine import EngineClient
from qiao.repository.manager import ModelManager, Served
from qiao.repository.served import EncoderVersion, LLMVersion
from qiao.version import __version__


def llm_versions(manager: ModelManager | None) -> list[LLMVersion]:
    """The manager's started LLM versions (for engine metrics and draining)."""
    if manager is None:
        return []
    return [s for s in manager.served_versions() if isinstance(s, LLMVersion)]


def circuit_breakers(manager: ModelManager) -> dict[str, str]:
    """ "model@version" -> its circuit breaker's state (closed, open, half-open)."""
    return {
        f"{s.model}@{s.version}": s.breaker.state.label
        for s in manager.served_versions()
        if getattr(s, "breaker", None) is not None
    }


def _observe(metrics: ServerMetrics, served: Served) -> None:
    """Hook a newly ready version into the metrics."""
    if isinstance(served, LLMVersion):
        served.engine.add_output_listener(metrics.output_observer(served.model, served.version))
    elif isinstance(served, EncoderVersion):
        served.batcher.on_batch = metrics.batch_observer(served.model, served.version)


def _track_versions(cache: ResponseCache, manager: ModelManager) -> None:
    """Tell the response cache each version's build (through the loader), when a version takes
    traffic and when it stops, so no entry outlives the build that made it."""
    if manager.loader is not None:
        manager.loader = cache.track_loader(manager.loader)
    on_ready, on_stopped = manager.on_ready, manager.on_stopped

    def ready(served: Served) -> None:
        if on_ready is not None:
            on_ready(served)
        cache.version_ready(served)

    def stopped(served: Served) -> None:
        if on_stopped is not None:
            on_stopped(served)
        cache.version_stopped(served)

    manager.on_ready, manager.on_stopped = ready, stopped


def create_app(
    settings: ServeSettings,
    engine: EngineClient | None = None,
    *,
    manager: ModelManager | None = None,
    build_manager: Callable[[ServerMetrics], ModelManager] | None = None,
) -> FastAPI:
    """An app serving one LLM `engine` (as version 1 of `settings.model_name`), or the models
    of a `manager`, or of the manager `build_manager(metrics)` returns (so loaders can hook
    their versions into this app's metrics)."""
    metrics = ServerMetrics(lambda: llm_versions(manager), vllm_names=settings.metrics_vllm_names)
    if engine is not None:
        served = LLMVersion(settings.model_name, "1", engine)
        manager = ModelManager.static([served])
    elif build_manager is not None:
        manager = build_manager(metrics)
    if manager is None:
        raise ValueError("create_app needs an engine or a model manager")
    if manager.on_ready is None:
        manager.on_ready = lambda served: _observe(metrics, served)
    cache = ResponseCache(CacheSettings.from_serve(settings), metrics.registry)
    _track_versions(cache, manager)
    response_cache.register(manager, cache)  # for the gRPC service, which holds the manager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await manager.start()
        await app.state.batch_worker.start()
        try:
            yield
        finally:
            await app.state.batch_worker.stop()
            await manager.shutdown()
            await cache.close()
            store = getattr(app.state, "store", None)
            if store is not None:
                store.close()

    app = FastAPI(title="qiao", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.router = manager
    app.state.control = manager  # read-only here: KServe's /v2/repository/index
    app.state.engine = engine
    app.state.model_name = settings.model_name
    app.state.metrics = metrics
    app.state.draining = False
    app.state.key_limiter = None
    app.state.keyring = None
    app.state.batch_worker = BatchWorker(app.state)
    app.state.response_cache = cache
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(embeddings_router)
    app.include_router(kserve_router)
    app.include_router(files_router)
    app.include_router(batches_router)
    _add_health_routes(app)

    app.add_middleware(
        StatusCountMiddleware,
        count=lambda route, status: metrics.http_requests.labels(route, str(status)).inc(),
    )
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_request_bytes,
        upload_limits={"/v1/files": settings.max_file_bytes + MULTIPART_SLACK_BYTES},
    )
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type"],
        )
    keyring = KeyRing(settings.api_keys(), settings.keys_file)
    install_openapi(app, api_keys=keyring.enabled)
    if keyring.enabled:
        app.state.keyring = keyring
        limiter = KeyLimiter(settings.rate_limit_storage) if settings.keys_file else None
        app.state.key_limiter = limiter
        # Added last, so it runs first: nothing else sees an unauthenticated request.
        app.add_middleware(
            APIKeyMiddleware,
            keyring=keyring,
            limiter=limiter,
            on_outcome=lambda name, outcome: metrics.key_requests.labels(name, outcome).inc(),
        )
    # Before auth: the console's static shell at /ui (no data in it) and `/` redirecting there.
    app.add_middleware(ConsoleShell, listener="main")
    # Outermost: every answer, a 401 or a 413 too, carries the request id and is logged.
    app.add_middleware(RequestIdMiddleware, log=settings.access_log)
    return app


def _readiness(request: Request) -> JSONResponse | dict[str, Any]:
    manager: ModelManager = request.app.state.router
    if request.app.state.draining:
        return JSONResponse(error_body(503, "draining"), status_code=503)
    reason = manager.not_ready_reason()
    if reason is not None:
        return JSONResponse(error_body(503, reason), status_code=503)
    return {"status": "ok", "circuit_breakers": circuit_breakers(manager)}


def _add_health_routes(app: FastAPI) -> None:
    @app.get("/health/live")
    async def live() -> dict[str, str]:
        """The process is up and serving HTTP."""
        return {"status": "ok"}

    @app.get("/health/ready", response_model=None)
    async def ready(request: Request) -> JSONResponse | dict[str, Any]:
        """Models are loaded and their engines are making progress (and not draining)."""
        return _readiness(request)

    @app.get("/health", response_model=None)
    async def health(request: Request) -> JSONResponse | dict[str, Any]:
        """`/health/ready` under the name vLLM and the load tools it serves (guidellm) probe."""
        return _readiness(request)

    @app.get("/ping", response_model=None)
    async def ping(request: Request) -> JSONResponse | dict[str, Any]:
        """`/health/ready` under SageMaker's name (vLLM serves it too)."""
        return _readiness(request)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """The server's version."""
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text format: the server's series, then Triton's `nv_inference_*`."""
        served = request.app.state.router.served_versions()
        body = request.app.state.metrics.render() + triton_metrics.render(served)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
