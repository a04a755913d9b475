"""KServe v2 over gRPC (`qiao.api.kserve_grpc`), driven by the official tritonclient.grpc client.

The servers run on one asyncio loop in a thread, over the fake router and served versions of
test_kserve.py; results are compared with the same computations done here. The wire format is
also checked directly: our message definitions against tritonclient's own, and typed `contents`
requests (which tritonclient never sends) through our generated stub.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.service_pb2 as triton_pb
from google.protobuf.descriptor import Descriptor
from tritonclient.utils import InferenceServerException

from qiao.api.kserve_grpc import build_grpc_server
from qiao.api.proto import inference_pb2 as pb
from qiao.api.proto import inference_pb2_grpc as pb_grpc
from qiao.errors import ConfigError
from qiao.version import __version__

from .test_kserve import (
    API_KEY,
    EMBEDDING_DIM,
    FakeRouter,
    bytes_array,
    embed_reference,
    fake_router,
)

MAX_MESSAGE_BYTES = 1 << 20


class GrpcLoop:
    """An asyncio loop in a daemon thread that hosts this module's gRPC servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._servers: list[grpc.aio.Server] = []

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30.0)

    def start(self, router: FakeRouter, port: int = 0, **kwargs: Any) -> int:
        async def start() -> int:
            server, bound = build_grpc_server(
                lambda: router,
                host="127.0.0.1",
                port=port,
                max_message_bytes=MAX_MESSAGE_BYTES,
                **kwargs,
            )
            await server.start()
            self._servers.append(server)
            return bound

        return self.run(start())

    def close(self) -> None:
        for server in self._servers:
            self.run(server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        self.loop.close()


@pytest.fixture(scope="module")
def grpc_loop() -> Iterator[GrpcLoop]:
    hosting = GrpcLoop()
    yield hosting
    hosting.close()


@pytest.fixture(scope="module")
def router() -> FakeRouter:
    return fake_router()


@pytest.fixture(scope="module")
def port(grpc_loop: GrpcLoop, router: FakeRouter) -> int:
    return grpc_loop.start(router)


@pytest.fixture(scope="module")
def keyed_port(grpc_loop: GrpcLoop, router: FakeRouter) -> int:
    return grpc_loop.start(router, api_keys=["another-key", API_KEY])


@pytest.fixture
def client(port: int) -> Iterator[grpcclient.InferenceServerClient]:
    triton = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")
    yield triton
    triton.close()


@pytest.fixture
def stub(port: int) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def infer_input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def grpc_error(call: Any, *args: Any, **kwargs: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call(*args, **kwargs)
    return caught.value


# --- wire compatibility -------------------------------------------------------------------------


def _fields(message: Descriptor) -> dict[str, tuple[int, int, str | None]]:
    return {
        f.name: (f.number, f.type, f.message_type.full_name if f.message_type else None)
        for f in message.fields
    }


def _messages(message: Descriptor) -> Iterator[Descriptor]:
    yield message
    for nested in message.nested_types:
        yield from _messages(nested)


def test_messages_and_service_match_tritonclient() -> None:
    """Every message, field number and type, and the service's methods, as tritonclient has them
    (the names on the wire are the service path and field numbers; the rest must match too).
    A message may declare only the fields qiao fills (ModelConfig's), never a field of its own."""
    theirs = triton_pb.DESCRIPTOR
    checked = 0
    for top in pb.DESCRIPTOR.message_types_by_name.values():
        for message in _messages(top):
            counterpart = theirs.pool.FindMessageTypeByName(message.full_name)
            ours, full = _fields(message), _fields(counterpart)
            assert ours == {name: full.get(name) for name in ours}, message.full_name
            assert {o.name for o in message.oneofs} <= {o.name for o in counterpart.oneofs}
            checked += 1
    assert checked >= 30
    for enum in pb.DESCRIPTOR.enum_types_by_name.values():
        counterpart = theirs.pool.FindEnumTypeByName(enum.full_name)
        assert [(v.name, v.number) for v in enum.values] == [
            (v.name, v.number) for v in counterpart.values
        ]
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    service = theirs.services_by_name["GRPCInferenceService"]
    assert ours.full_name == service.full_name == "inference.GRPCInferenceService"
    for method in ours.methods:
        other = service.methods_by_name[method.name]
        assert method.input_type.full_name == other.input_type.full_name
        assert method.output_type.full_name == other.output_type.full_name


# --- health and metadata ------------------------------------------------------------------------


def test_server_health_and_metadata(
    client: grpcclient.InferenceServerClient, router: FakeRouter
) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    router.ready = False
    try:
        assert not client.is_server_ready()
    finally:
        router.ready = True
    metadata = client.get_server_metadata(as_json=True)
    assert metadata["name"] == "qiao"
    assert metadata["version"] == __version__
    assert "binary_tensor_data" in metadata["extensions"]


def test_model_ready_and_metadata(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_model_ready("embedder")
    assert client.is_model_ready("scale", "1")
    assert not client.is_model_ready("scale", "2")
    assert not client.is_model_ready("nope")
    assert not client.is_model_ready("warming")
    metadata = client.get_model_metadata("scale", as_json=True)
    assert metadata["versions"] == ["1", "3"]
    assert metadata["platform"] == "onnxruntime_onnx"
    assert metadata["inputs"] == [{"name": "x", "datatype": "INT64", "shape": ["-1"]}]
    pinned = client.get_model_metadata("embedder", "1")
    assert pinned.outputs[0].name == "embedding"
    assert list(pinned.outputs[0].shape) == [-1, EMBEDDING_DIM]
    error = grpc_error(client.get_model_metadata, "nope")
    assert error.status() == "StatusCode.NOT_FOUND"
    assert "'nope'" in error.message()


# --- infer --------------------------------------------------------------------------------------


def test_infer_fp32(client: grpcclient.InferenceServerClient) -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 4)).astype(np.float32)
    b = rng.standard_normal((5, 4)).astype(np.float32)
    result = client.infer(
        "add_sub",
        [infer_input("INPUT0", a, "FP32"), infer_input("INPUT1", b, "FP32")],
        request_id="grpc-9",
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == ("grpc-9", "add_sub", "1")
    only = client.infer(
        "add_sub",
        [infer_input("INPUT0", a, "FP32"), infer_input("INPUT1", b, "FP32")],
        outputs=[grpcclient.InferRequestedOutput("OUTPUT1")],
    )
    np.testing.assert_array_equal(only.as_numpy("OUTPUT1"), a - b)
    assert only.as_numpy("OUTPUT0") is None


def test_infer_int64_with_and_without_version(client: grpcclient.InferenceServerClient) -> None:
    x = np.array([7, -1, 2**41], dtype=np.int64)
    for version, factor in (("1", 1), ("3", 3), ("", 3)):
        result = client.infer("scale", [infer_input("x", x, "INT64")], model_version=version)
        np.testing.assert_array_equal(result.as_numpy("y"), x * factor)
        assert result.get_response().model_version == (version or "3")


def test_infer_bytes(client: grpcclient.InferenceServerClient) -> None:
    texts = [b"hello world", b"", "h\u00e9llo".encode(), b"\xff\x00raw\x80"]
    result = client.infer("upper", [infer_input("text", bytes_array(texts), "BYTES")])
    assert list(result.as_numpy("upper")) == [t.upper() for t in texts]
    np.testing.assert_array_equal(result.as_numpy("length"), [len(t) for t in texts])


def test_infer_embedder(client: grpcclient.InferenceServerClient) -> None:
    texts = [b"hello world", b"the quick brown fox"]
    result = client.infer("embedder", [infer_input("text", bytes_array(texts), "BYTES")])
    expected = np.stack([embed_reference(t) for t in texts])
    np.testing.assert_array_equal(result.as_numpy("embedding"), expected)


def test_infer_passes_priority_timeout_and_user(
    client: grpcclient.InferenceServerClient, router: FakeRouter
) -> None:
    x = np.array([2], dtype=np.int64)
    client.infer(
        "scale",
        [infer_input("x", x, "INT64")],
        model_version="1",
        priority=3,
        timeout=7000,
        parameters={"user": "bob"},
    )
    assert router.version("scale", "1").calls[-1][1:] == (3, 7000)
    assert router.users[-1] == "bob"


def _typed_request(model: str, *tensors: tuple[str, str, list[int], dict[str, Any]]) -> Any:
    request = pb.ModelInferRequest(model_name=model)
    for name, datatype, shape, contents in tensors:
        request.inputs.add(
            name=name, datatype=datatype, shape=shape, contents=pb.InferTensorContents(**contents)
        )
    return request


def _raw_outputs(response: Any) -> dict[str, np.ndarray]:
    dtypes = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32}
    return {
        out.name: np.frombuffer(raw, dtypes[out.datatype]).reshape(list(out.shape))
        for out, raw in zip(response.outputs, response.raw_output_contents, strict=True)
        if out.datatype in dtypes
    }


def test_infer_typed_contents(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    a = [0.5 * i for i in range(8)]
    b = [1.25] * 8
    response = stub.ModelInfer(
        _typed_request(
            "add_sub",
            ("INPUT0", "FP32", [2, 4], {"fp32_contents": a}),
            ("INPUT1", "FP32", [2, 4], {"fp32_contents": b}),
        )
    )
    outputs = _raw_outputs(response)
    expected = np.array(a, np.float32).reshape(2, 4) + np.array(b, np.float32).reshape(2, 4)
    np.testing.assert_array_equal(outputs["OUTPUT0"], expected)

    response = stub.ModelInfer(
        _typed_request("scale", ("x", "INT64", [3], {"int64_contents": [4, -5, 2**50]}))
    )
    np.testing.assert_array_equal(_raw_outputs(response)["y"], [12, -15, 3 * 2**50])

    texts = [b"abc", b"\xffz"]
    response = stub.ModelInfer(
        _typed_request("upper", ("text", "BYTES", [2], {"bytes_contents": texts}))
    )
    assert response.outputs[0].name == "upper"
    assert response.raw_output_contents[0] == b"".join(
        len(t).to_bytes(4, "little") + t.upper() for t in texts
    )


def _invalid(stub: pb_grpc.GRPCInferenceServiceStub, request: Any, *fragments: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for fragment in fragments:
        assert fragment in caught.value.details(), caught.value.details()


def test_bad_typed_requests(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    _invalid(
        stub,
        _typed_request("scale", ("x", "INT64", [2], {"fp32_contents": [1.0, 2.0]})),
        "'x'",
        "int64_contents",
    )
    _invalid(
        stub, _typed_request("scale", ("x", "INT64", [3], {"int64_contents": [1]})), "'x'", "3"
    )
    both = _typed_request("scale", ("x", "INT64", [1], {"int64_contents": [1]}))
    both.raw_input_contents.append(np.array([1], np.int64).tobytes())
    _invalid(stub, both, "'x'", "not both")
    extra = pb.ModelInferRequest(model_name="scale", raw_input_contents=[b"", b""])
    extra.inputs.add(name="x", datatype="INT64", shape=[0])
    _invalid(stub, extra, "raw_input_contents has 2 entries for 1 inputs")
    _invalid(stub, pb.ModelInferRequest(model_name="scale"), "inputs")


# --- errors -------------------------------------------------------------------------------------


def test_errors_map_to_status_codes(client: grpcclient.InferenceServerClient) -> None:
    x = np.array([1], dtype=np.int64)
    error = grpc_error(client.infer, "nope", [infer_input("x", x, "INT64")])
    assert error.status() == "StatusCode.NOT_FOUND"
    assert "'nope'" in error.message()
    error = grpc_error(client.infer, "scale", [infer_input("x", x, "INT64")], model_version="2")
    assert error.status() == "StatusCode.NOT_FOUND"

    bad = np.zeros((2, 3), dtype=np.float32)
    error = grpc_error(
        client.infer,
        "add_sub",
        [infer_input("INPUT0", bad, "FP32"), infer_input("INPUT1", bad, "FP32")],
    )
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "'INPUT0'" in error.message() and "[2, 3]" in error.message()

    value = np.ones(1, dtype=np.float32)
    error = grpc_error(client.infer, "busy", [infer_input("value", value, "FP32")])
    assert error.status() == "StatusCode.UNAVAILABLE"
    assert "full" in error.message()
    error = grpc_error(client.infer, "warming", [infer_input("value", value, "FP32")])
    assert error.status() == "StatusCode.UNAVAILABLE"


@pytest.mark.logs_errors
def test_unexpected_error_is_internal_and_says_nothing(
    client: grpcclient.InferenceServerClient,
) -> None:
    value = np.ones(1, dtype=np.float32)
    error = grpc_error(client.infer, "broken", [infer_input("value", value, "FP32")])
    assert error.status() == "StatusCode.INTERNAL"
    assert "10.0.0.7" not in error.message() and "/work/" not in error.message()


def test_message_size_limit(client: grpcclient.InferenceServerClient) -> None:
    big = np.zeros((MAX_MESSAGE_BYTES // 16 + 1, 4), dtype=np.float32)
    error = grpc_error(
        client.infer,
        "add_sub",
        [infer_input("INPUT0", big, "FP32"), infer_input("INPUT1", big, "FP32")],
    )
    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED"


def test_port_in_use_is_a_config_error(grpc_loop: GrpcLoop, port: int, router: FakeRouter) -> None:
    with pytest.raises(ConfigError, match="grpc_port"):
        grpc_loop.start(router, port=port)


# --- auth ---------------------------------------------------------------------------------------


def test_api_key_is_required_except_for_health(keyed_port: int) -> None:
    triton = grpcclient.InferenceServerClient(url=f"127.0.0.1:{keyed_port}")
    x = np.array([3], dtype=np.int64)
    try:
        assert triton.is_server_live()
        assert triton.is_server_ready()
        for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
            error = grpc_error(
                triton.infer, "scale", [infer_input("x", x, "INT64")], headers=headers
            )
            assert error.status() == "StatusCode.UNAUTHENTICATED"
            assert "Bearer" in error.message()
        error = grpc_error(triton.get_model_metadata, "scale")
        assert error.status() == "StatusCode.UNAUTHENTICATED"
        assert grpc_error(triton.is_model_ready, "scale").status() == "StatusCode.UNAUTHENTICATED"

        headers = {"authorization": f"Bearer {API_KEY}"}
        result = triton.infer("scale", [infer_input("x", x, "INT64")], headers=headers)
        np.testing.assert_array_equal(result.as_numpy("y"), x * 3)
        assert triton.is_model_ready("scale", headers=headers)
    finally:
        triton.close()


def test_a_keys_file_key_authenticates_over_grpc(
    grpc_loop: GrpcLoop, router: FakeRouter, tmp_path: Path
) -> None:
    import hashlib

    named = "sk-grpc-named-0123456789ab"
    keys_file = tmp_path / "keys.yaml"
    digest = hashlib.sha256(named.encode()).hexdigest()
    keys_file.write_text(f"keys:\n  - name: grpc-team\n    key_sha256: {digest}\n")
    port = grpc_loop.start(router, keys_file=keys_file)
    triton = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")
    x = np.array([2], dtype=np.int64)
    try:
        headers = {"authorization": f"Bearer {named}"}
        result = triton.infer("scale", [infer_input("x", x, "INT64")], headers=headers)
        np.testing.assert_array_equal(result.as_numpy("y"), x * 3)
        wrong = {"authorization": "Bearer sk-grpc-other-0123456789ab"}
        error = grpc_error(triton.infer, "scale", [infer_input("x", x, "INT64")], headers=wrong)
        assert error.status() == "StatusCode.UNAUTHENTICATED"
    finally:
        triton.close()


def test_a_keys_file_keys_models_and_limits_apply_over_grpc(
    grpc_loop: GrpcLoop, router: FakeRouter, tmp_path: Path
) -> None:
    """The HTTP routes' rules for a keys-file key hold on gRPC too: a model outside its list is
    PERMISSION_DENIED; past its requests per minute, RESOURCE_EXHAUSTED with retry-after and the
    x-ratelimit-* values as trailing metadata; another key is unaffected; and with the HTTP app's
    limiter, HTTP and gRPC calls count against one window."""
    import hashlib

    from qiao.api.keys import KeyLimiter, KeyRing

    limited, other = "sk-grpc-limited-0123456789", "sk-grpc-free-0123456789ab"
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(
        "keys:\n"
        f"  - name: limited\n    key_sha256: {hashlib.sha256(limited.encode()).hexdigest()}\n"
        "    requests_per_minute: 3\n    models: [scale]\n"
        f"  - name: free\n    key_sha256: {hashlib.sha256(other.encode()).hexdigest()}\n"
    )
    keyring, limiter = KeyRing([], keys_file), KeyLimiter()
    outcomes: list[tuple[str, str]] = []
    port = grpc_loop.start(
        router,
        keyring=keyring,
        limiter=limiter,
        on_key_outcome=lambda name, outcome: outcomes.append((name, outcome)),
    )
    x = np.array([2], dtype=np.int64)
    auth = {"authorization": f"Bearer {limited}"}
    triton = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")
    try:
        error = grpc_error(triton.infer, "upper", [infer_input("x", x, "INT64")], headers=auth)
        assert error.status() == "StatusCode.PERMISSION_DENIED"
        assert "may not use model 'upper'" in error.message()
        # One request counted as if it came over HTTP (the server shares this limiter).
        key = keyring.match(limited.encode())
        assert key is not None and limiter.admit(key)[0] is None
        limiter.release(key)
        for _ in range(2):
            result = triton.infer("scale", [infer_input("x", x, "INT64")], headers=auth)
            np.testing.assert_array_equal(result.as_numpy("y"), x * 3)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            request = _typed_request("scale", ("x", "INT64", [1], {"int64_contents": [2]}))
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(request, metadata=list(auth.items()))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "requests per minute" in caught.value.details()
        trailing = dict(caught.value.trailing_metadata())
        assert int(trailing["retry-after"]) >= 1
        assert trailing["x-ratelimit-limit-requests"] == "3"
        assert trailing["x-ratelimit-remaining-requests"] == "0"
        free = {"authorization": f"Bearer {other}"}
        result = triton.infer("scale", [infer_input("x", x, "INT64")], headers=free)
        np.testing.assert_array_equal(result.as_numpy("y"), x * 3)
    finally:
        triton.close()
    assert ("limited", "model_not_allowed") in outcomes
    assert outcomes.count(("limited", "admitted")) == 2
    assert ("limited", "limited_requests") in outcomes
