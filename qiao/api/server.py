"""`qiao serve`: load the engine, bind (safely), serve, and drain on SIGTERM.

Shutdown: the first SIGTERM/SIGINT stops admitting work (503, readiness fails), gives in-flight
requests up to `drain_timeout` seconds, aborts what is left (streams end with finish_reason
"abort"), then stops the server and exits 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import uvicorn

from qiao.api.app import create_app
from qiao.api.settings import ServeSettings
from qiao.config import EngineConfig
from qiao.engine.async_engine import AdmissionLimits, AsyncEngine
from qiao.engine.llm_engine import LLMEngine
from qiao.entrypoints.tuning import apply_num_threads, tuned_defaults

logger = logging.getLogger("qiao.server")

# Settings that are `EngineConfig.create` arguments of the same name.
_ENGINE_SETTINGS = (
    "dtype",
    "load_format",
    "quantization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "block_size",
    "kv_cache_memory",
    "num_kv_blocks",
    "seed",
    "device",
)


def engine_config(settings: ServeSettings) -> tuple[EngineConfig, int | None]:
    """The engine config and torch thread count: the settings, with the tuning profile's
    values for the tuned settings not set explicitly (by flag, environment or config file)."""
    kwargs = {name: getattr(settings, name) for name in _ENGINE_SETTINGS}
    explicit = settings.model_fields_set
    given = {name: value for name, value in kwargs.items() if name in explicit}
    # These shape the profile lookup and what of it applies, given or not.
    given.update(
        dtype=settings.dtype,
        quantization=settings.quantization,
        block_size=settings.block_size,
        enable_chunked_prefill=settings.enable_chunked_prefill,
    )
    given["num_threads"] = settings.num_threads
    tuned = tuned_defaults(settings.model_path, given, settings.profile_choice)
    num_threads = tuned.pop("num_threads", settings.num_threads)
    kwargs.update(tuned)
    config = EngineConfig.create(
        settings.model_path,
        **kwargs,
        scheduling_policy=settings.scheduling_policy,
        cuda_graphs=settings.cuda_graphs_choice,
    )
    return config, num_threads


def build_engine(settings: ServeSettings) -> AsyncEngine:
    config, num_threads = engine_config(settings)
    apply_num_threads(num_threads)
    limits = AdmissionLimits(
        max_waiting_seqs=settings.max_waiting_requests,
        max_waiting_tokens=settings.max_waiting_tokens,
        stall_timeout=settings.stall_timeout,
        log_interval=settings.log_interval,
    )
    return AsyncEngine(LLMEngine(config), limits)


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first exit signal drains the engine before the server stops."""

    def __init__(self, config: uvicorn.Config, app: Any, drain_timeout: float) -> None:
        super().__init__(config)
        self.qiao_app = app
        self.drain_timeout = drain_timeout
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_task is not None:  # second signal: stop now
            super().handle_exit(sig, frame)
            return
        loop = asyncio.get_event_loop()
        self._drain_task = loop.create_task(self._drain())

    async def _drain(self) -> None:
        state = self.qiao_app.state
        engine: AsyncEngine = state.engine
        state.draining = True
        engine.draining = True
        logger.info(
            "draining: %d requests in flight, up to %.0f s",
            engine.num_unfinished(),
            self.drain_timeout,
        )
        deadline = time.monotonic() + self.drain_timeout
        while engine.num_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_unfinished():
            logger.info("drain timeout: aborting %d requests", engine.num_unfinished())
            engine.abort_all("abort")
            # Give the aborted streams a moment to send their last event.
            flush_deadline = time.monotonic() + 2.0
            while engine.num_unfinished() and time.monotonic() < flush_deadline:
                await asyncio.sleep(0.05)
        self.should_exit = True


def run_server(settings: ServeSettings) -> None:
    settings.check_security()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    started = time.monotonic()
    engine = build_engine(settings)
    app = create_app(settings, engine)
    logger.info(
        "model %r loaded in %.1f s; serving on http://%s:%d",
        settings.model_name,
        time.monotonic() - started,
        settings.host,
        settings.port,
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
        access_log=False,
    )
    DrainingServer(config, app, settings.drain_timeout).run()
