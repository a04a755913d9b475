"""The HTTP app: `create_app(settings, engine)` wires routes, middleware, errors and metrics.

All state lives on `app.state`: settings, the engine client, the served model name, metrics and
the draining flag. Nothing here is global, so tests can run several apps in one process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from qiao.api.errors import error_body, install_error_handlers
from qiao.api.metrics import ServerMetrics
from qiao.api.middleware import APIKeyMiddleware, BodyLimitMiddleware, StatusCountMiddleware
from qiao.api.openai_routes import router as openai_router
from qiao.api.settings import ServeSettings
from qiao.engine.async_engine import AsyncEngine
from qiao.version import __version__


def create_app(settings: ServeSettings, engine: AsyncEngine) -> FastAPI:
    metrics = ServerMetrics(settings.model_name, engine.stats)
    engine.add_output_listener(metrics.observe_outputs)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="qiao", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.model_name = settings.model_name
    app.state.metrics = metrics
    app.state.draining = False
    install_error_handlers(app)
    app.include_router(openai_router)
    _add_health_routes(app)

    app.add_middleware(
        StatusCountMiddleware,
        count=lambda route, status: metrics.http_requests.labels(
            settings.model_name, route, str(status)
        ).inc(),
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    keys = settings.api_keys()
    if keys:
        # Added last, so it runs first: nothing else sees an unauthenticated request.
        app.add_middleware(APIKeyMiddleware, api_keys=keys)
    return app


def _add_health_routes(app: FastAPI) -> None:
    @app.get("/health/live")
    async def live() -> dict[str, str]:
        """The process is up and serving HTTP."""
        return {"status": "ok"}

    @app.get("/health/ready", response_model=None)
    async def ready(request: Request) -> JSONResponse | dict[str, str]:
        """The model is loaded and the engine is making progress (and not draining)."""
        health = request.app.state.engine.health()
        if request.app.state.draining:
            return JSONResponse(error_body(503, "draining"), status_code=503)
        if not health.is_ready:
            return JSONResponse(error_body(503, health.reason), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text format."""
        body = request.app.state.metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
