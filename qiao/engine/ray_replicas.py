"""Engine replicas as Ray Serve deployments behind qiao's own API (`qiao serve --ray`).

qiao keeps the front: HTTP, validation, tokenization, limits, metrics, the model repository. Each
served LLM version becomes one Ray Serve application of `replicas` engine replicas
(`EngineReplica`, an `AsyncEngine` inside a Ray actor, its tokens detokenized there); the API
process reaches them through `RayEngine`, an `EngineClient` over a streaming `DeploymentHandle`.
Ray does what a cluster needs and qiao does not re-invent: placement on the cluster's nodes,
replacing a replica whose actor died (its health check is the engine's), autoscaling on ongoing
requests per replica (`autoscaling_config`, set from qiao's flags), and backpressure.

Routing (`PrefixAffinityRouter`, a Ray Serve request router run in the API process): a prompt
of at least `affinity_tokens` tokens goes to the replica its first tokens hash to (rendezvous
hashing over the replica ids, so a replica joining or leaving moves only its share), unless that
replica holds `load_slack` more requests than the least loaded one; other prompts go to the
least loaded replica. A replica that dies fails its streams at once: a request that had no
output yet is sent again to another replica (`retry`), any other ends with 503
`engine_restarted` (a stream with `finish_reason: "error"`), never a hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from qiao import errors
from qiao.config import EngineConfig
from qiao.engine import wire
from qiao.engine.async_engine import (
    AdmissionLimits,
    EngineClient,
    EngineHealth,
    GenerateRequest,
    RequestStream,
    check_group,
    completed_normally,
)
from qiao.engine.breaker import BreakerConfig, CircuitBreaker
from qiao.engine.replicas import merge_replica_stats
from qiao.errors import (
    ConfigError,
    EngineRestartedError,
    EngineUnavailableError,
    ModelLoadError,
    QiaoError,
    QueueFullError,
)
from qiao.outputs import CompletionOutput, RequestOutput
from qiao.tokenizer import load_tokenizer

logger = logging.getLogger("qiao.ray")

INSTALL_HINT = "pip install 'qiao[ray]' (Ray Serve 2.52 or later)"
# Refusals a replica answers before running a request: another replica may take it.
_PASSING = ("QueueFullError", "EngineUnavailableError", "EngineRestartedError", "CircuitOpenError")


def require_ray() -> tuple[Any, Any]:
    """(ray, ray.serve), or a ConfigError that says how to install them."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError(
            f"--ray needs Ray Serve, which is not installed: {INSTALL_HINT}"
        ) from None
    return ray, serve


@dataclass(frozen=True)
class RayOptions:
    """How `qiao serve --ray` runs its replicas (the `ray_*` serve settings)."""

    # "local": Ray's own rule (RAY_ADDRESS, else a running local cluster, else a new one on
    # 127.0.0.1); anything else is an address for `ray.init` ("auto", "HOST:6379", "ray://...").
    address: str = "local"
    replicas: int = 1
    # Autoscaling when max_replicas is set: between min and max, aiming at this many API
    # requests in flight per replica, after these delays (seconds) of sustained need.
    min_replicas: int = 1
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0
    upscale_delay: float = 30.0
    downscale_delay: float = 600.0
    max_ongoing_requests: int = 256  # API requests one replica runs or queues; more wait in Ray
    max_queued_requests: int = 1024  # waiting in the API process for a replica; more get 503
    replica_cpus: float = 1.0  # Ray CPUs per replica (and its torch threads, rounded)
    replica_gpus: float = 0.0
    retry: bool = True  # a request with no output yet goes to another replica when one dies
    health_check_period: float = 2.0
    affinity_tokens: int = 64
    load_slack: int = 8
    namespace: str = "qiao"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError("replicas must be at least 1")
        if self.max_replicas is not None and not 1 <= self.min_replicas <= self.max_replicas:
            raise ConfigError(
                f"ray_min_replicas {self.min_replicas} and ray_max_replicas {self.max_replicas}: "
                "need 1 <= min <= max"
            )

    def deployment_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "health_check_period_s": self.health_check_period,
            "health_check_timeout_s": max(10.0, 3 * self.health_check_period),
            "graceful_shutdown_timeout_s": 5.0,
            "ray_actor_options": {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus},
        }
        if self.max_replicas is None:
            options["num_replicas"] = self.replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "initial_replicas": max(self.min_replicas, min(self.replicas, self.max_replicas)),
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay,
                "downscale_delay_s": self.downscale_delay,
                "metrics_interval_s": min(1.0, self.upscale_delay),
                "look_back_period_s": max(1.0, min(10.0, self.upscale_delay)),
            }
        return options


# --- the replica (runs in a Ray actor) -------------------------------------------------------------


class EngineReplica:
    """One engine replica: built in the Ray actor's constructor, started on its first call
    (from the event loop Ray Serve runs the replica's calls on)."""

    def __init__(
        self, config: dict[str, Any], limits: dict[str, Any], num_threads: int | None
    ) -> None:
        from ray import serve

        from qiao.engine.async_engine import AsyncEngine
        from qiao.engine.llm_engine import LLMEngine

        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
        engine_config = EngineConfig.from_dict(config)
        breaker = BreakerConfig(**limits.pop("breaker"))
        admission = AdmissionLimits(**limits, breaker=breaker)
        self.engine = AsyncEngine.build(lambda: LLMEngine(engine_config), admission)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._started = False
        logger.info("replica %s (pid %d) built its engine", self.replica_id, os.getpid())

    def _start(self) -> None:
        if not self._started:
            self.engine.start()
            self._started = True

    async def info(self) -> dict[str, Any]:
        self._start()
        engine = self.engine
        return {
            "replica": self.replica_id,
            "pid": os.getpid(),
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
            "max_sequence_tokens": engine.max_sequence_tokens,
        }

    async def generate(self, requests: list[list[Any]], affinity: str | None = None) -> Any:
        """Stream one API request group: frames {replica, outputs, failed}, or {refused}."""
        del affinity  # the router's; here only so the router can read it
        self._start()
        now = time.monotonic()
        group = [
            GenerateRequest(
                rid,
                prompt,
                wire.params_from_wire(params),
                priority,
                deadline=None if remaining is None else now + remaining,
                arrival_time=now - age,
            )
            for rid, prompt, params, priority, remaining, age in requests
        ]
        try:
            streams = self.engine.generate_all(group)
        except QiaoError as exc:
            yield {"replica": self.replica_id, "refused": [type(exc).__name__, str(exc)]}
            return
        queue: asyncio.Queue[tuple[str, RequestOutput | BaseException]] = asyncio.Queue()

        async def pump(stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((stream.request_id, output))
            except BaseException as exc:
                queue.put_nowait((stream.request_id, exc))

        tasks = [asyncio.ensure_future(pump(s)) for s in streams]
        try:
            remaining = len(streams)
            while remaining:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                outputs, failed = [], []
                for rid, item in items:
                    if isinstance(item, BaseException):
                        failed.append([rid, type(item).__name__, str(item)])
                        remaining -= 1
                    else:
                        outputs.append(wire.output_to_wire(item))
                        remaining -= item.finished
                yield {"replica": self.replica_id, "outputs": outputs, "failed": failed}
        finally:  # the caller went away (Ray cancels this generator) or all finished
            for task in tasks:
                task.cancel()
            for stream in streams:
                await stream.aclose()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop died or stalled is replaced."""
        health = self.engine.health()
        if self._started and not health.is_ready and health.reason != "draining":
            raise RuntimeError(f"replica {self.replica_id}: {health.reason}")

    def record_routing_stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "num_unfinished": self.engine.num_unfinished()}


# --- routing (runs in the API process, inside the handle) ------------------------------------------

# Application name -> its router (ray_router.PrefixAffinityRouter, which registers itself):
# RayEngine reads the replicas and their stats from it.
ROUTERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


# --- the client (runs in the API process) ----------------------------------------------------------

_connect_lock = threading.Lock()


def connect(options: RayOptions) -> None:
    """Join (or start) the Ray cluster once per process, and Serve on it without its proxy."""
    # Ray 2.52+ clusters check a token; a driver given an address uses the one `ray start`
    # saved (or RAY_AUTH_TOKEN) only when told to, before Ray is imported.
    token_file = os.path.expanduser("~/.ray/auth_token")
    if (
        options.address != "local"
        and "RAY_AUTH_MODE" not in os.environ
        and (os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(token_file))
    ):
        os.environ["RAY_AUTH_MODE"] = "token"
    ray, serve = require_ray()
    with _connect_lock:
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {
                "namespace": options.namespace,
                "log_to_driver": False,
                "configure_logging": False,
            }
            if options.address == "local" and not os.environ.get("RAY_ADDRESS"):
                kwargs.update(include_dashboard=False, _node_ip_address="127.0.0.1")
            elif options.address != "local":
                kwargs["address"] = options.address
            try:
                ray.init(**kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ConfigError(
                    f"--ray {options.address}: cannot join the cluster: {exc}"
                ) from None
        serve.start(proxy_location="Disabled")


def _limits_dict(limits: AdmissionLimits) -> dict[str, Any]:
    return {**dataclasses.asdict(limits), "breaker": dataclasses.asdict(limits.breaker)}


def affinity_key(prompt: Sequence[int], tokens: int) -> str | None:
    if tokens <= 0 or len(prompt) < tokens:
        return None
    head = b"".join(t.to_bytes(4, "little", signed=True) for t in prompt[:tokens])
    return hashlib.blake2b(head, digest_size=16).hexdigest()


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    n: int
    queue: asyncio.Queue[RequestOutput | BaseException]
    done: bool = False
    unfinished: set[int] = dataclasses.field(default_factory=set)


@dataclass
class _Group:
    requests: dict[str, _Request]
    task: asyncio.Task[None] | None = None
    response: Any = None  # the DeploymentResponseGenerator in use
    replica: str | None = None  # the replica serving it, once it answered


def _replica_lost(exc: BaseException) -> bool:
    from ray import exceptions as rex

    return isinstance(exc, rex.RayActorError | rex.ActorUnavailableError)


class RayEngine(EngineClient):
    """One LLM version served by a Ray Serve application of engine replicas."""

    def __init__(
        self,
        app_name: str,
        handle: Any,
        info: dict[str, Any],
        tokenizer: Any,
        limits: AdmissionLimits,
        options: RayOptions,
    ) -> None:
        self.app_name = app_name
        self._handle = handle.options(stream=True)
        self._tokenizer = tokenizer
        self.limits = limits
        self.options = options
        self._max_model_len = info["max_model_len"]
        self._vocab_size = info["vocab_size"]
        self._max_sequence_tokens = info["max_sequence_tokens"]
        self._groups: dict[int, _Group] = {}
        self._owner: dict[str, int] = {}  # request id -> its group
        self._seq = 0
        self._listeners: list[Callable[[list[RequestOutput]], None]] = []
        self.breaker = CircuitBreaker(limits.breaker, "this model version")
        self.replicas_lost = 0
        self._lost: set[str] = set()  # ids of the replicas seen dying
        self.retried = 0
        self.draining = False
        self._stopping = False

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        limits: AdmissionLimits | None,
        options: RayOptions,
        *,
        app_name: str,
        num_threads: int | None = None,
    ) -> RayEngine:
        """Deploy `app_name` (replacing one of that name) and return once its replicas run."""
        limits = limits or AdmissionLimits()
        connect(options)  # first: it may set Ray's auth mode, which Ray reads on import
        _, serve = require_ray()
        threads = num_threads or max(1, round(options.replica_cpus))
        deployment = serve.deployment(
            EngineReplica,
            name="engine",
            request_router_config={
                "request_router_class": "qiao.engine.ray_router:PrefixAffinityRouter",
                "request_router_kwargs": {"load_slack": options.load_slack},
                "request_routing_stats_period_s": 1.0,
                "request_routing_stats_timeout_s": 5.0,
            },
            **options.deployment_options(),
        )
        app = deployment.bind(config.to_dict(), _limits_dict(limits), threads)
        logger.info("deploying %s on Ray: %s", app_name, options.deployment_options())
        try:
            handle = serve.run(app, name=app_name, route_prefix=None)
            info = handle.info.remote().result(timeout_s=300)
        except Exception as exc:
            with _quiet():
                serve.delete(app_name)
            raise ModelLoadError(f"Ray Serve could not start {app_name}: {exc}") from None
        mc = config.model
        tokenizer = None if mc.skip_tokenizer_init else load_tokenizer(mc.tokenizer or mc.path)
        return cls(app_name, handle, info, tokenizer, limits, options)

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        pass  # the replicas run already; streams start with their requests

    def shutdown(self) -> None:
        """Delete the application (its replicas stop); the cluster stays."""
        self._stopping = True
        _, serve = require_ray()
        with _quiet():
            serve.delete(self.app_name)

    def add_output_listener(self, listener: Callable[[list[RequestOutput]], None]) -> None:
        self._listeners.append(listener)

    def num_unfinished(self) -> int:
        return len(self._owner)

    def abort_all(self, reason: str = "abort") -> None:
        for request_id in list(self._owner):
            self.abort(request_id, reason)

    # --- EngineClient --------------------------------------------------------------------------

    def generate_all(self, requests: Sequence[GenerateRequest]) -> list[RequestStream]:
        if self.draining or self._stopping:
            raise EngineUnavailableError("the server is shutting down; retry on another replica")
        self.breaker.allow()
        check_group(requests, self.limits)
        in_flight = next((r.request_id for r in requests if r.request_id in self._owner), None)
        if in_flight is not None:
            raise QiaoError(f"request id {in_flight!r} is already in flight")
        capacity = self.options.max_queued_requests + self.options.max_ongoing_requests * max(
            1, len(self._router_replicas())
        )
        if len(self._groups) >= capacity:
            raise QueueFullError(
                f"{len(self._groups)} requests in flight fill every replica and the queue; "
                "retry later"
            )
        self._seq += 1
        group = _Group({})
        streams = []
        for r in requests:
            queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
            group.requests[r.request_id] = _Request(
                r.request_id,
                r.prompt_token_ids,
                r.params.n,
                queue,
                unfinished=set(range(r.params.n)),
            )
            self._owner[r.request_id] = self._seq
            streams.append(RequestStream(self, r.request_id, queue))  # type: ignore[arg-type]
        self._groups[self._seq] = group
        now = time.monotonic()
        payload = [
            [
                r.request_id,
                r.prompt_token_ids,
                wire.params_to_wire(r.params),
                r.priority,
                None if r.deadline is None else max(r.deadline - now, 0.0),
                max(now - r.arrival_time, 0.0),
            ]
            for r in requests
        ]
        key = affinity_key(requests[0].prompt_token_ids, self.options.affinity_tokens)
        group.task = asyncio.get_running_loop().create_task(self._run(self._seq, payload, key))
        return streams

    @property
    def _queues(self) -> dict[str, Any]:
        """RequestStream pops a finished request here: nothing to do, `_finish` did."""
        return {}

    def abort(self, request_id: str, reason: str = "abort") -> None:
        seq = self._owner.get(request_id)
        if seq is None:
            return
        group = self._groups[seq]
        request = group.requests[request_id]
        final = RequestOutput(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=request.prompt,
            outputs=[
                CompletionOutput(index=i, text="", token_ids=[], finish_reason=reason)
                for i in sorted(request.unfinished)
            ],
            finished=True,
        )
        request.queue.put_nowait(final)
        self._finish(seq, request)
        for listener in self._listeners:
            listener([final])

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def max_sequence_tokens(self) -> int:
        return self._max_sequence_tokens

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def health(self) -> EngineHealth:
        if self.draining:
            return EngineHealth(False, "draining")
        replicas = self._router_replicas()
        if replicas is not None and not replicas:
            return EngineHealth(False, "no Ray Serve replica is running (one is being replaced)")
        return EngineHealth(True)

    def stats(self) -> dict[str, Any]:
        router = ROUTERS.get(self.app_name)
        replicas = self._router_replicas() or []
        each = [dict(r.routing_stats or {}) for r in replicas]
        out = merge_replica_stats([s for s in each if s]) if any(each) else {}
        out.update(
            engine_up=int(bool(replicas)),
            engine_restarts=self.replicas_lost,
            breaker_state=int(self.breaker.state),
            breaker_opened=self.breaker.num_opened,
            num_replicas=len(replicas),
        )
        out["replicas"] = [
            {
                "replica": r.replica_id.unique_id,
                "num_unfinished": int(s.get("num_unfinished", 0)),
                "routed": 0 if router is None else router.routed.get(r.replica_id.unique_id, 0),
                "routed_by_affinity": 0
                if router is None
                else router.routed_by_affinity.get(r.replica_id.unique_id, 0),
                "up": 1,
                "engine_restarts": 0,
            }
            for r, s in zip(replicas, each, strict=True)
        ]
        return out

    def _router_replicas(self) -> list[Any] | None:
        """The running replicas as the router knows them; None before its first request."""
        router = ROUTERS.get(self.app_name)
        if router is None:
            return None
        return sorted(router.curr_replicas.values(), key=lambda r: r.replica_id.unique_id)

    # --- streams -------------------------------------------------------------------------------

    async def _run(self, seq: int, payload: list[list[Any]], key: str | None) -> None:
        group = self._groups[seq]
        from ray.serve.exceptions import BackPressureError

        attempts = 0
        while True:
            delivered = False
            response = self._handle.generate.remote(payload, affinity=key)
            group.response = response
            try:
                async for frame in response:
                    if "refused" in frame:
                        group.replica = None
                        kind, message = frame["refused"]
                        if kind in _PASSING and attempts < self._max_attempts():
                            attempts += 1
                            break
                        self._fail_group(
                            seq, getattr(errors, kind, EngineUnavailableError)(message)
                        )
                        return
                    group.replica = frame["replica"]
                    delivered |= bool(frame["outputs"])
                    self._on_frame(seq, frame)
                else:
                    self._fail_group(
                        seq, EngineUnavailableError("the replica ended the stream early")
                    )
                    return
            except asyncio.CancelledError:
                if seq not in self._groups:
                    return  # every request ended here (answered, aborted): the stream was cut
                response.cancel()
                raise
            except BackPressureError as exc:
                self._fail_group(seq, QueueFullError(f"every replica is busy ({exc}); retry later"))
                return
            except Exception as exc:
                if seq not in self._groups:
                    return  # every request ended here (answered, aborted): the stream was cut
                if not _replica_lost(exc):
                    logger.error("replica stream failed", exc_info=exc)
                    self._fail_group(
                        seq,
                        EngineUnavailableError(f"the replica failed ({type(exc).__name__}); retry"),
                    )
                    return
                if group.replica is not None and group.replica not in self._lost:
                    self._lost.add(group.replica)  # one death, however many requests it held
                    self.replicas_lost += 1
                    self.breaker.record_failure()
                if self.options.retry and not delivered and attempts < self._max_attempts():
                    attempts += 1
                    self.retried += 1
                    logger.warning("a replica died before answering; sending the request again")
                    continue
                logger.error("a replica died with %d requests in flight", len(group.requests))
                self._fail_group(
                    seq, EngineRestartedError("the replica serving this request died; retry")
                )
                return
            if seq not in self._groups:
                return

    def _max_attempts(self) -> int:
        return max(2, len(self._router_replicas() or ()))

    def _on_frame(self, seq: int, frame: dict[str, Any]) -> None:
        group = self._groups.get(seq)
        if group is None:
            return
        for rid, kind, message in frame["failed"]:
            request = group.requests.get(rid)
            if request is None:
                continue
            if kind == "RequestFailedError":
                self.breaker.record_failure()
            request.queue.put_nowait(getattr(errors, kind, EngineUnavailableError)(message))
            self._finish(seq, request)
        outputs = []
        for values in frame["outputs"]:
            request = group.requests.get(values[0])
            if request is None:
                continue  # aborted here meanwhile
            output = wire.output_from_wire(values, None, request.prompt)
            for c in output.outputs:
                if c.finish_reason is not None:
                    request.unfinished.discard(c.index)
            outputs.append(output)
            request.queue.put_nowait(output)
            if output.finished:
                if completed_normally(output):
                    self.breaker.record_success()
                self._finish(seq, request)
        for listener in self._listeners:
            listener(outputs)

    def _finish(self, seq: int, request: _Request) -> None:
        group = self._groups.get(seq)
        if group is None:
            return
        group.requests.pop(request.request_id, None)
        self._owner.pop(request.request_id, None)
        if not group.requests:
            del self._groups[seq]
            if group.response is not None:
                group.response.cancel()  # a no-op once the stream ended

    def _fail_group(self, seq: int, error: BaseException) -> None:
        group = self._groups.get(seq)
        if group is None:
            return
        for request in list(group.requests.values()):
            request.queue.put_nowait(error)
            self._finish(seq, request)


class _quiet:
    """Swallow (and log) what a best-effort cleanup raises."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None:
            logger.warning("cleanup: %s", exc)
        return exc is None or isinstance(exc, Exception)
