"""KServe v2 over gRPC (`inference.GRPCInferenceService`, as tritonclient.grpc speaks it).

`build_grpc_server` returns a `grpc.aio` server, not started, serving ServerLive, ServerReady,
ModelReady, ServerMetadata, ModelMetadata, ModelInfer, ModelConfig and ModelStatistics against
the `ModelRouter` that `router_provider` returns at each call, and RepositoryIndex (read-only)
against the `ModelControl` of `control_provider`; any other method answers UNIMPLEMENTED.
ModelConfig and ModelStatistics parse the very dicts the HTTP routes answer
(`kserve_reports`). ModelInfer takes
inputs as typed `contents` or `raw_input_contents` and answers in `raw_output_contents`, as Triton
does (tritonclient's `as_numpy` reads those).

Failures map to status codes: INVALID_ARGUMENT (a bad request or tensor; the message names it),
NOT_FOUND (unknown model or version), UNAVAILABLE (queue full, queue timeout, going away),
UNAUTHENTICATED (API keys set and no valid `authorization: Bearer <key>` metadata; the two health
RPCs stay open), PERMISSION_DENIED (a keys-file key used for a model outside its list),
RESOURCE_EXHAUSTED (past the key's requests per minute, tokens per minute or requests in flight:
the trailing metadata carries `retry-after` and the `x-ratelimit-*` values HTTP sends as
headers), INTERNAL for anything unexpected (logged here; the message says nothing more). A key's
limits are counted together with its HTTP requests when the server shares its `KeyLimiter`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf import json_format

from qiao.api import response_cache
from qiao.api.cache_backends import CachedResponse
from qiao.api.keys import ApiKey, KeyLimiter, KeyRing, limit_message
from qiao.api.kserve_reports import model_config, model_statistics
from qiao.api.kserve_tensors import (
    EXTENSIONS,
    SERVER_NAME,
    TensorHeader,
    bytes_from_items,
    check_inputs,
    check_outputs,
    datatype_of,
    from_array,
    from_raw,
    is_model_ready,
    metadata_version,
    parse_header,
    parse_options,
    select_outputs,
    to_raw,
)
from qiao.api.management import v2_index_rows
from qiao.api.middleware import bearer_token
from qiao.api.proto import inference_pb2 as pb
from qiao.api.proto import inference_pb2_grpc as pb_grpc
from qiao.errors import (
    ConfigError,
    EngineUnavailableError,
    ModelNotFoundError,
    QueueFullError,
    QueueTimeoutError,
)
from qiao.repository.types import ModelControl, ModelRouter
from qiao.version import __version__

logger = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
# Liveness and readiness stay open so orchestrators can probe without credentials.
PUBLIC_METHODS = frozenset({f"/{SERVICE}/ServerLive", f"/{SERVICE}/ServerReady"})

# The typed `contents` field each datatype uses, and that field's element dtype. FP16 has none.
_CONTENTS_FIELDS: dict[str, tuple[str, type]] = {
    "BOOL": ("bool_contents", np.bool_),
    "INT8": ("int_contents", np.int32),
    "INT16": ("int_contents", np.int32),
    "INT32": ("int_contents", np.int32),
    "INT64": ("int64_contents", np.int64),
    "UINT8": ("uint_contents", np.uint32),
    "UINT16": ("uint_contents", np.uint32),
    "UINT32": ("uint_contents", np.uint32),
    "UINT64": ("uint64_contents", np.uint64),
    "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
    "BYTES": ("bytes_contents", object),
}


def build_grpc_server(
    router_provider: Callable[[], ModelRouter],
    *,
    host: str,
    port: int,
    api_keys: Sequence[str] = (),
    keys_file: Path | None = None,
    keyring: KeyRing | None = None,
    limiter: KeyLimiter | None = None,
    on_key_outcome: Callable[[str, str], None] | None = None,
    max_message_bytes: int,
    control_provider: Callable[[], ModelControl | None] = lambda: None,
) -> tuple[grpc.aio.Server, int]:
    """The server (not started) and the port it is bound to (`port=0`: any free port).

    Call it on the event loop that will run the server; start with `await server.start()`, stop
    with `await server.stop(grace)`. Raises `ConfigError` when the address cannot be bound (no
    SO_REUSEPORT, so a port in use is an error rather than silently shared).

    `keyring` and `limiter` are the HTTP app's, so a key's limits count both protocols; without
    them, a keyring is built from `api_keys` and `keys_file` (and a limiter in memory when the
    keys file gives limits)."""
    if keyring is None:
        keyring = KeyRing(list(api_keys), keys_file)
        if limiter is None and keys_file is not None:
            limiter = KeyLimiter()
    interceptors = [_BearerAuth(keyring)] if keyring.enabled else []
    keys = _KeyPolicy(keyring, limiter, on_key_outcome) if keyring.enabled else None
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(
        _InferenceServicer(router_provider, control_provider, keys), server
    )
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound_port = server.add_insecure_port(address)
    except RuntimeError:
        bound_port = 0
    if bound_port == 0:
        raise ConfigError(f"grpc_port: cannot listen on {address} (in use or not an address)")
    return server, bound_port


# --- auth ---------------------------------------------------------------------------------------


async def _deny(request: bytes, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or invalid API key: send metadata 'authorization: Bearer <key>'",
    )


class _BearerAuth(grpc.aio.ServerInterceptor):
    """Every RPC but the health probes needs `authorization: Bearer <key>` metadata."""

    def __init__(self, keyring: KeyRing) -> None:
        self._keyring = keyring
        self._deny = grpc.unary_unary_rpc_method_handler(_deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method in PUBLIC_METHODS or self._authorized(details.invocation_metadata):
            return await continuation(details)
        return self._deny

    def _authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        values = [value for key, value in metadata or () if key == "authorization"]
        if len(values) != 1 or not isinstance(values[0], str):
            return False
        return self._keyring.match(bearer_token(values[0].encode())) is not None


class _Refused(Exception):
    """An RPC refused for its key: a status, a message and trailing metadata."""

    def __init__(
        self, code: grpc.StatusCode, message: str, metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.metadata = tuple(metadata)


class _KeyPolicy:
    """A keys-file key's model list, priority ceiling and limits, as the HTTP routes apply them."""

    def __init__(
        self,
        keyring: KeyRing,
        limiter: KeyLimiter | None,
        on_outcome: Callable[[str, str], None] | None,
    ) -> None:
        self._keyring = keyring
        self._limiter = limiter
        self._on_outcome = on_outcome or (lambda name, outcome: None)

    def key_of(self, context: grpc.aio.ServicerContext) -> ApiKey | None:
        values = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
        if len(values) != 1 or not isinstance(values[0], str):
            return None
        return self._keyring.match(bearer_token(values[0].encode()))

    @contextlib.contextmanager
    def admitted(self, key: ApiKey | None, model: str) -> Iterator[None]:
        """Refuse a model outside the key's list or a call past its limits; count the call."""
        if key is None:
            yield
            return
        if not key.may_use(model):
            self._on_outcome(key.name, "model_not_allowed")
            raise _Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"model: this API key may not use model {model!r}",
            )
        if self._limiter is None or not key.is_limited:
            self._on_outcome(key.name, "admitted")
            yield
            return
        exceeded, headers = self._limiter.admit(key)
        metadata = [(name.lower(), value) for name, value in headers.items()]
        if exceeded is not None:
            self._on_outcome(key.name, f"limited_{exceeded}")
            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, limit_message(exceeded), metadata)
        self._on_outcome(key.name, "admitted")
        try:
            yield
        finally:
            self._limiter.release(key)


# --- errors -------------------------------------------------------------------------------------


def _status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ConfigError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ModelNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, QueueFullError | QueueTimeoutError | EngineUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    logger.error("unexpected error in a KServe gRPC call", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal server error; the server log has the details"


Request = TypeVar("Request")
Reply = TypeVar("Reply")
Method = Callable[[Any, Request, grpc.aio.ServicerContext], Awaitable[Reply]]


def _rpc(method: Method[Request, Reply]) -> Method[Request, Reply]:
    """Ends the call with the status the exception maps to."""

    @functools.wraps(method)
    async def call(self: Any, request: Request, context: grpc.aio.ServicerContext) -> Reply:
        try:
            return await method(self, request, context)
        except _Refused as refused:
            code, message = refused.code, str(refused)
            if refused.metadata:
                context.set_trailing_metadata(refused.metadata)
        except Exception as exc:
            code, message = _status_of(exc)
        await context.abort(code, message)  # raises

    return call


# --- service ------------------------------------------------------------------------------------


class _InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        router_provider: Callable[[], ModelRouter],
        control_provider: Callable[[], ModelControl | None],
        keys: _KeyPolicy | None,
    ) -> None:
        self._router = router_provider
        self._control = control_provider
        self._keys = keys

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    @_rpc
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self._router().is_ready())

    @_rpc
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> Any:
        try:
            ready = is_model_ready(self._router(), request.name, request.version or None)
        except ModelNotFoundError:
            ready = False
        return pb.ModelReadyResponse(ready=ready)

    @_rpc
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> Any:
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=__version__, extensions=EXTENSIONS
        )

    @_rpc
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> Any:
        served, versions = metadata_version(self._router(), request.name, request.version or None)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=request.name,
            versions=versions,
            platform=served.platform,
            inputs=[tensor(name=s.name, datatype=s.datatype, shape=s.shape) for s in served.inputs],
            outputs=[
                tensor(name=s.name, datatype=s.datatype, shape=s.shape) for s in served.outputs
            ],
        )

    @_rpc
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> Any:
        config = model_config(self._router(), request.name, request.version or None)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))

    @_rpc
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> Any:
        stats = model_statistics(self._router(), request.name or None, request.version or None)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    @_rpc
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> Any:
        control = self._control()
        if control is None:
            raise ModelNotFoundError("this server has no model repository")
        index = pb.RepositoryIndexResponse.ModelIndex
        rows = v2_index_rows(control, ready=request.ready)
        return pb.RepositoryIndexResponse(
            models=[
                index(name=r["name"], version=r["version"], state=r["state"], reason=r["reason"])
                for r in rows
            ]
        )

    @_rpc
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        if self._keys is None:
            return await self._infer(request, None, context)
        key = self._keys.key_of(context)
        with self._keys.admitted(key, request.model_name):
            return await self._infer(request, key, context)

    async def _infer(self, request: pb.ModelInferRequest, key: ApiKey | None, context: Any) -> Any:
        parameters = _parameters(request.parameters)
        options = parse_options(parameters)
        router = self._router()
        served = router.get(request.model_name, request.model_version or None, user=options.user)
        cache = response_cache.cache_for(router)
        lookup = response_cache.Lookup(None)
        if cache is not None:
            lookup = await cache.lookup(
                None,
                served,
                "kserve.grpc_infer",
                lambda: {"request_sha256": _request_digest(request)},
                skip=response_cache.kserve_skip_requested({"parameters": parameters}),
                api_key=key,
            )
        if lookup.hit is not None:
            await context.send_initial_metadata(((CACHE_METADATA, "hit"),))
            return pb.ModelInferResponse.FromString(lookup.hit.body)
        headers = [parse_header(t.name, t.datatype, list(t.shape)) for t in request.inputs]
        if not headers:
            raise ConfigError("'inputs' must not be empty")
        check_inputs(served, headers)
        requested = check_outputs(served, _requested_outputs(request))
        inputs = _decode_inputs(request, headers)
        priority = options.priority
        if key is not None and key.max_priority is not None:
            priority = max(priority, key.max_priority)  # no more urgent than the key's ceiling
        results = await served.infer(inputs, priority=priority, timeout_us=options.timeout_us)
        response = pb.ModelInferResponse(
            model_name=served.model, model_version=served.version, id=request.id
        )
        for name, array in select_outputs(served, results, requested):
            response.outputs.add(name=name, datatype=datatype_of(name, array), shape=array.shape)
            response.raw_output_contents.append(to_raw(name, array))
        if cache is not None and lookup.status == "miss":
            value = CachedResponse(response.SerializeToString(), "application/grpc+proto")
            await cache.store(lookup.key, lookup.group, served, value, lookup.ttl)
        if lookup.status is not None:
            await context.send_initial_metadata(((CACHE_METADATA, lookup.status),))
        return response


# The response cache's outcome (hit, miss, skip), as the HTTP routes' X-Qiao-Cache header.
CACHE_METADATA = response_cache.CACHE_HEADER.lower()


def _request_digest(request: pb.ModelInferRequest) -> str:
    """The sha256 of the request's deterministic serialization, its scheduling parameters left
    out (the response cache's key)."""
    copy = pb.ModelInferRequest()
    copy.CopyFrom(request)
    for name in response_cache.KSERVE_NOT_IN_KEY:
        if name in copy.parameters:
            del copy.parameters[name]
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).hexdigest()


def _parameters(parameters: Any) -> dict[str, Any]:
    """A protobuf map of InferParameter → plain values."""
    values = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        values[key] = getattr(parameter, choice) if choice else None
    return values


def _requested_outputs(request: pb.ModelInferRequest) -> list[str]:
    for output in request.outputs:
        unsupported = [
            k for k in output.parameters if k == "classification" or k.startswith("shared_memory")
        ]
        if unsupported:
            raise ConfigError(
                f"output {output.name!r}: parameter {unsupported[0]!r} is not supported"
            )
    return [output.name for output in request.outputs]


def _decode_inputs(
    request: pb.ModelInferRequest, headers: list[TensorHeader]
) -> dict[str, np.ndarray]:
    """Every input from `raw_input_contents` (one entry per input) or else its typed contents."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(headers):
        raise ConfigError(
            f"raw_input_contents has {len(raw)} entries for {len(headers)} inputs; send one per "
            "input, or none and typed contents"
        )
    inputs = {}
    for i, (tensor, header) in enumerate(zip(request.inputs, headers, strict=True)):
        if any(key.startswith("shared_memory") for key in tensor.parameters):
            raise ConfigError(f"input {header.name!r}: shared memory is not supported")
        if raw and tensor.contents.ListFields():
            raise ConfigError(
                f"input {header.name!r}: send data in raw_input_contents or contents, not both"
            )
        inputs[header.name] = from_raw(header, raw[i]) if raw else _from_contents(header, tensor)
    return inputs


def _from_contents(header: TensorHeader, tensor: Any) -> np.ndarray:
    if header.datatype not in _CONTENTS_FIELDS:
        raise ConfigError(
            f"input {header.name!r}: {header.datatype} has no typed contents; "
            "send it in raw_input_contents"
        )
    field, dtype = _CONTENTS_FIELDS[header.datatype]
    other = [f.name for f, _ in tensor.contents.ListFields() if f.name != field]
    if other:
        raise ConfigError(
            f"input {header.name!r}: {header.datatype} data goes in contents.{field}, "
            f"not contents.{other[0]}"
        )
    values = getattr(tensor.contents, field)
    if header.datatype == "BYTES":
        return bytes_from_items(header, list(values))
    return from_array(header, np.array(values, dtype=dtype))
