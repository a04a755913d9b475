"""KServe v2 over HTTP (`qiao.api.kserve`), driven by the official tritonclient.http client.

A real uvicorn server on 127.0.0.1 serves a minimal app (the `/v2` router, the app's error
handlers, body limit and, for the auth tests, API-key middleware) over a `FakeRouter` whose
served versions compute something checkable: sums and differences, scaled integers, upper-cased
bytes, hash-derived embedding vectors. Each result is compared with the same computation done
here on the client's own inputs. The fakes are shared with test_kserve_grpc.py.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
import uvicorn
from fastapi import FastAPI
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from qiao.api import kserve
from qiao.api.errors import install_error_handlers
from qiao.api.keys import KeyRing
from qiao.api.kserve_tensors import TensorHeader, from_json, from_raw, to_raw
from qiao.api.middleware import APIKeyMiddleware, BodyLimitMiddleware
from qiao.errors import (
    ConfigError,
    EngineUnavailableError,
    ModelNotFoundError,
    QueueFullError,
)
from qiao.repository.types import TensorSpec
from qiao.version import __version__

from .conftest import STOP_TIMEOUT_S, find_leaks, http_client, wait_until

API_KEY = "sk-kserve-test-5b2e91"
MAX_REQUEST_BYTES = 1 << 20
EMBEDDING_DIM = 8  # a SHA-256 digest is eight uint32 words

# --- fakes --------------------------------------------------------------------------------------


def embed_reference(text: bytes) -> np.ndarray:
    """The expected embedding of one text: its SHA-256 words, scaled into [0, 1)."""
    words = struct.unpack("<8I", hashlib.sha256(text).digest())
    return np.array([w / 2**32 for w in words], dtype=np.float32)


class FakeVersion:
    """A served version whose `infer` is a plain function of its inputs; it records each call."""

    def __init__(
        self,
        model: str,
        version: str,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        compute: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    ) -> None:
        self.model = model
        self.version = version
        self.backend = "onnx"
        self.platform = "onnxruntime_onnx"
        self.inputs = inputs
        self.outputs = outputs
        self.compute = compute
        self.calls: list[tuple[dict[str, np.ndarray], int | None, int | None]] = []

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        *,
        priority: int | None = None,
        timeout_us: int | None = None,
    ) -> dict[str, np.ndarray]:
        self.calls.append((inputs, priority, timeout_us))
        for spec in self.inputs:
            if spec.name not in inputs:
                raise ConfigError(f"input {spec.name!r} is required")
        return self.compute(inputs)


def _add_sub(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    a, b = inputs["INPUT0"], inputs["INPUT1"]
    return {"OUTPUT0": a + b, "OUTPUT1": a - b}


def _scale(factor: int) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    return lambda inputs: {"y": inputs["x"] * factor}


def _upper(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    texts = inputs["text"].reshape(-1)
    upper = np.empty(len(texts), dtype=object)
    upper[:] = [t.upper() for t in texts]
    lengths = np.array([len(t) for t in texts], dtype=np.int32)
    return {"upper": upper, "length": lengths}


def _embed(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    vectors = [np.frombuffer(hashlib.sha256(t).digest(), "<u4") for t in inputs["text"]]
    return {"embedding": (np.stack(vectors) / np.float64(2**32)).astype(np.float32)}


def _queue_full(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    raise QueueFullError("the queue of model 'busy' is full (8 waiting)", retry_after=2)


def _crash(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    raise RuntimeError('worker at 10.0.0.7:4711 crashed in File "/work/main/secret.py"')


def _fp32_pair(name: str) -> tuple[TensorSpec, ...]:
    return (TensorSpec(f"{name}0", "FP32", (-1, 4)), TensorSpec(f"{name}1", "FP32", (-1, 4)))


def fake_versions() -> list[FakeVersion]:
    x_spec = (TensorSpec("x", "INT64", (-1,)),)
    y_spec = (TensorSpec("y", "INT64", (-1,)),)
    text_spec = (TensorSpec("text", "BYTES", (-1,)),)
    upper_out = (TensorSpec("upper", "BYTES", (-1,)), TensorSpec("length", "INT32", (-1,)))
    embedding = (TensorSpec("embedding", "FP32", (-1, EMBEDDING_DIM)),)
    value = (TensorSpec("value", "FP32", (-1,)),)
    return [
        FakeVersion("add_sub", "1", _fp32_pair("INPUT"), _fp32_pair("OUTPUT"), _add_sub),
        FakeVersion("scale", "1", x_spec, y_spec, _scale(1)),
        FakeVersion("scale", "3", x_spec, y_spec, _scale(3)),
        FakeVersion("upper", "1", text_spec, upper_out, _upper),
        FakeVersion("embedder", "1", text_spec, embedding, _embed),
        FakeVersion("busy", "1", value, value, _queue_full),
        FakeVersion("broken", "1", value, value, _crash),
    ]


class FakeRouter:
    """Routes to the latest version unless one is pinned; `loading` models have none ready."""

    def __init__(self, versions: list[FakeVersion], loading: tuple[str, ...] = ()) -> None:
        self.models: dict[str, dict[str, FakeVersion]] = {}
        for served in versions:
            self.models.setdefault(served.model, {})[served.version] = served
        self.loading = set(loading)
        self.ready = True
        self.users: list[str | None] = []

    def is_ready(self) -> bool:
        return self.ready

    def model_names(self) -> list[str]:
        return sorted(self.models)

    def ready_versions(self, model: str) -> list[str]:
        return sorted(self.models.get(model, {}), key=int)

    def get(self, model: str, version: str | None = None, *, user: str | None = None) -> Any:
        self.users.append(user)
        if model in self.loading:
            raise EngineUnavailableError(f"model {model!r} has no ready version")
        versions = self.models.get(model)
        if versions is None:
            raise ModelNotFoundError(f"model {model!r} is not served")
        if version is None:
            return versions[self.ready_versions(model)[-1]]
        if version not in versions:
            raise ModelNotFoundError(f"model {model!r} has no version {version!r}")
        return versions[version]

    def version(self, model: str, version: str) -> FakeVersion:
        return self.models[model][version]


def fake_router() -> FakeRouter:
    return FakeRouter(fake_versions(), loading=("warming",))


# --- server -------------------------------------------------------------------------------------


def kserve_app(router: FakeRouter, api_keys: list[str] | None = None) -> FastAPI:
    app = FastAPI()
    app.state.router = router
    install_error_handlers(app)
    app.include_router(kserve.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_REQUEST_BYTES)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keyring=KeyRing(api_keys, None))
    return app


class UvicornThread:
    """`app` under uvicorn on 127.0.0.1 and a free port, in a daemon thread."""

    def __init__(self, app: FastAPI) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        # log_config=None: errors reach the root logger, where conftest checks for them.
        config = uvicorn.Config(app, log_config=None, access_log=False)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._thread.start()
        wait_until(lambda: self.server.started or not self._thread.is_alive(), 30.0, "uvicorn")
        assert self.server.started, "uvicorn did not start"

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(STOP_TIMEOUT_S)
        self._socket.close()
        assert not self._thread.is_alive(), "uvicorn did not stop"


@pytest.fixture(scope="module")
def router() -> FakeRouter:
    return fake_router()


@pytest.fixture(scope="module")
def server(router: FakeRouter) -> Iterator[UvicornThread]:
    running = UvicornThread(kserve_app(router))
    yield running
    running.stop()


@pytest.fixture
def client(server: UvicornThread) -> Iterator[httpclient.InferenceServerClient]:
    triton = httpclient.InferenceServerClient(url=server.url)
    yield triton
    triton.close()


@pytest.fixture
def raw(server: UvicornThread) -> Iterator[httpx.Client]:
    with http_client(f"http://{server.url}", timeout=10.0) as http:
        yield http


def infer_input(
    name: str, array: np.ndarray, datatype: str, binary: bool = True
) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def bytes_array(items: list[bytes]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


def assert_kserve_error(response: httpx.Response, status: int, *fragments: str) -> str:
    """The body is exactly `{"error": "<message>"}`, names every fragment and leaks nothing."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    for fragment in fragments:
        assert fragment in body["error"], body["error"]
    assert not find_leaks(response.content), response.content
    return body["error"]


# --- health and metadata ------------------------------------------------------------------------


def test_server_health_and_metadata(
    client: httpclient.InferenceServerClient, router: FakeRouter, raw: httpx.Client
) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata["name"] == "qiao"
    assert metadata["version"] == __version__
    assert "binary_tensor_data" in metadata["extensions"]

    router.ready = False
    try:
        assert not client.is_server_ready()
        assert raw.get("/v2/health/ready").status_code == 400
        assert client.is_server_live()
    finally:
        router.ready = True
    assert raw.get("/v2/health/ready").json() == {"ready": True}


def test_model_ready(client: httpclient.InferenceServerClient, raw: httpx.Client) -> None:
    assert client.is_model_ready("embedder")
    assert client.is_model_ready("scale", "1")
    assert client.is_model_ready("scale", "3")
    assert not client.is_model_ready("scale", "2")
    assert not client.is_model_ready("nope")
    assert not client.is_model_ready("warming")
    assert raw.get("/v2/models/warming/ready").status_code == 400
    assert_kserve_error(raw.get("/v2/models/nope/ready"), 404, "'nope'")
    assert_kserve_error(raw.get("/v2/models/scale/versions/2/ready"), 404, "'scale'", "'2'")


def test_model_metadata(client: httpclient.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("scale")
    assert metadata == {
        "name": "scale",
        "versions": ["1", "3"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": "x", "datatype": "INT64", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "INT64", "shape": [-1]}],
    }
    pinned = client.get_model_metadata("embedder", "1")
    assert pinned["outputs"] == [
        {"name": "embedding", "datatype": "FP32", "shape": [-1, EMBEDDING_DIM]}
    ]
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("nope")
    assert caught.value.status() == "404"
    assert "'nope'" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("warming")
    assert caught.value.status() == "503"


# --- infer --------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_fp32(client: httpclient.InferenceServerClient, binary: bool) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((3, 4)).astype(np.float32)
    outputs = [
        httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")
    ]
    result = client.infer(
        "add_sub",
        [infer_input("INPUT0", a, "FP32", binary), infer_input("INPUT1", b, "FP32", binary)],
        outputs=outputs,
        request_id="req-7",
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert response["id"] == "req-7"
    assert (response["model_name"], response["model_version"]) == ("add_sub", "1")
    for output in response["outputs"]:
        assert output["datatype"] == "FP32" and output["shape"] == [3, 4]
        assert ("data" in output) is not binary


def test_infer_selects_outputs(client: httpclient.InferenceServerClient) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 0.5, dtype=np.float32)
    result = client.infer(
        "add_sub",
        [infer_input("INPUT0", a, "FP32"), infer_input("INPUT1", b, "FP32")],
        outputs=[httpclient.InferRequestedOutput("OUTPUT1")],
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0") is None


def test_infer_int64_with_and_without_version(client: httpclient.InferenceServerClient) -> None:
    x = np.array([1, -2, 2**40 + 3, 0], dtype=np.int64)
    for version, factor in (("1", 1), ("3", 3), ("", 3)):
        result = client.infer("scale", [infer_input("x", x, "INT64")], model_version=version)
        y = result.as_numpy("y")
        assert y.dtype == np.int64
        np.testing.assert_array_equal(y, x * factor)
        assert result.get_response()["model_version"] == (version or "3")


def test_infer_bytes_binary(client: httpclient.InferenceServerClient) -> None:
    texts = [b"hello world", b"", "h\u00e9llo".encode(), b"\xff\x00raw bytes\x80"]
    result = client.infer("upper", [infer_input("text", bytes_array(texts), "BYTES")])
    assert list(result.as_numpy("upper")) == [t.upper() for t in texts]
    np.testing.assert_array_equal(result.as_numpy("length"), [len(t) for t in texts])


def test_infer_bytes_json(client: httpclient.InferenceServerClient) -> None:
    texts = ["hello world", "", "h\u00e9llo \u4e16\u754c"]
    array = bytes_array([t.encode() for t in texts])
    outputs = [httpclient.InferRequestedOutput(n, binary_data=False) for n in ("upper", "length")]
    result = client.infer("upper", [infer_input("text", array, "BYTES", False)], outputs=outputs)
    assert [output.get("data") for output in result.get_response()["outputs"]] == [
        [t.encode().upper().decode() for t in texts],
        [len(t.encode()) for t in texts],
    ]


def test_infer_embedder(client: httpclient.InferenceServerClient) -> None:
    texts = [b"hello world", b"the quick brown fox", b"hello world!"]
    result = client.infer("embedder", [infer_input("text", bytes_array(texts), "BYTES")])
    vectors = result.as_numpy("embedding")
    assert vectors.shape == (3, EMBEDDING_DIM)
    np.testing.assert_array_equal(vectors, np.stack([embed_reference(t) for t in texts]))


def test_infer_passes_priority_timeout_and_user(
    client: httpclient.InferenceServerClient, router: FakeRouter
) -> None:
    x = np.array([5], dtype=np.int64)
    scale = router.version("scale", "1")
    client.infer("scale", [infer_input("x", x, "INT64")], model_version="1")
    assert scale.calls[-1][1:] == (None, None)
    client.infer(
        "scale",
        [infer_input("x", x, "INT64")],
        model_version="1",
        priority=2,
        timeout=5000,
        parameters={"user": "alice"},
    )
    assert scale.calls[-1][1:] == (2, 5000)
    assert router.users[-1] == "alice"


def test_infer_nested_json_data(raw: httpx.Client) -> None:
    body = {
        "inputs": [
            {
                "name": "INPUT0",
                "datatype": "FP32",
                "shape": [2, 4],
                "data": [[1, 2, 3, 4], [5, 6, 7, 8]],
            },
            {"name": "INPUT1", "datatype": "FP32", "shape": [2, 4], "data": [1.5] * 8},
        ]
    }
    response = raw.post("/v2/models/add_sub/infer", json=body)
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    assert outputs["OUTPUT0"]["data"] == [x + 1.5 for x in range(1, 9)]
    assert outputs["OUTPUT1"]["shape"] == [2, 4]


# --- errors -------------------------------------------------------------------------------------


def test_unknown_model_and_version(client: httpclient.InferenceServerClient) -> None:
    x = np.array([1], dtype=np.int64)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("nope", [infer_input("x", x, "INT64")])
    assert caught.value.status() == "404"
    assert "'nope'" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.infer("scale", [infer_input("x", x, "INT64")], model_version="2")
    assert caught.value.status() == "404"
    assert "'2'" in caught.value.message()


def test_bad_shape_and_datatype(client: httpclient.InferenceServerClient) -> None:
    a = np.zeros((2, 3), dtype=np.float32)
    with pytest.raises(InferenceServerException) as caught:
        client.infer(
            "add_sub", [infer_input("INPUT0", a, "FP32"), infer_input("INPUT1", a, "FP32")]
        )
    assert caught.value.status() == "400"
    assert "'INPUT0'" in caught.value.message() and "[2, 3]" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.infer("scale", [infer_input("x", np.array([1], dtype=np.int32), "INT32")])
    assert caught.value.status() == "400"
    assert "'x' is INT64, not INT32" in caught.value.message()


def test_overload_and_unavailable(
    client: httpclient.InferenceServerClient, raw: httpx.Client
) -> None:
    value = np.array([1.0], dtype=np.float32)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("busy", [infer_input("value", value, "FP32")])
    assert caught.value.status() == "503"
    assert "full" in caught.value.message()
    body = {"inputs": [{"name": "value", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    response = raw.post("/v2/models/busy/infer", json=body)
    assert_kserve_error(response, 503, "full")
    assert response.headers["retry-after"] == "2"
    assert_kserve_error(raw.post("/v2/models/warming/infer", json=body), 503, "'warming'")


def _tensor(name: str, datatype: str, shape: list[int], **fields: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, **fields}


def test_bad_json_tensors_answer_400_naming_the_input(raw: httpx.Client) -> None:
    def infer(*inputs: dict[str, Any], model: str = "scale") -> httpx.Response:
        return raw.post(f"/v2/models/{model}/infer", json={"inputs": list(inputs)})

    assert_kserve_error(infer(_tensor("x", "INT64", [3], data=[1, 2])), 400, "'x'", "3 elements")
    assert_kserve_error(infer(_tensor("x", "INT64", [2], data=[1, 2.5])), 400, "'x'", "integers")
    assert_kserve_error(infer(_tensor("x", "INT64", [2], data=["1", "2"])), 400, "'x'")
    assert_kserve_error(infer(_tensor("x", "INT64", [-2], data=[1, 2])), 400, "'x'", ">= 0")
    assert_kserve_error(infer(_tensor("x", "INT128", [1], data=[1])), 400, "'x'", "INT128")
    assert_kserve_error(infer(_tensor("x", "INT64", [1])), 400, "'x'", "neither 'data'")
    assert_kserve_error(infer(_tensor("z", "INT64", [1], data=[1])), 400, "no input 'z'")
    assert_kserve_error(
        infer(_tensor("x", "INT64", [1], data=[1]), _tensor("x", "INT64", [1], data=[2])),
        400,
        "'x' is given twice",
    )
    assert_kserve_error(infer(_tensor("x", "INT64", [1 << 25], data=[])), 400, "'x'", "limit")
    ragged = _tensor("INPUT0", "FP32", [2, 4], data=[[1, 2, 3, 4], [5]])
    ones = _tensor("INPUT1", "FP32", [2, 4], data=[1] * 8)
    assert_kserve_error(infer(ragged, ones, model="add_sub"), 400, "'INPUT0'")
    assert_kserve_error(infer(_tensor("x", "UINT8", [1], data=[3])), 400, "'x' is INT64, not UINT8")
    response = raw.post(
        "/v2/models/scale/infer",
        json={"inputs": [_tensor("x", "INT64", [1], data=[1])], "outputs": [{"name": "w"}]},
    )
    assert_kserve_error(response, 400, "no output 'w'")
    assert_kserve_error(raw.post("/v2/models/scale/infer", content=b"{not json"), 400, "JSON")
    assert_kserve_error(raw.post("/v2/models/scale/infer", json={"inputs": []}), 400, "inputs")


def _binary_request(
    header: dict[str, Any], payload: bytes, header_length: int | None = None
) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    length = len(head) if header_length is None else header_length
    return head + payload, {"Inference-Header-Content-Length": str(length)}


def test_binary_tensor_data_errors(raw: httpx.Client) -> None:
    def post(model: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
        return raw.post(f"/v2/models/{model}/infer", content=content, headers=headers)

    x = np.array([1, 2], dtype=np.int64).tobytes()
    header = {"inputs": [_tensor("x", "INT64", [2], parameters={"binary_data_size": 16})]}
    content, headers = _binary_request(header, x)
    assert post("scale", content, headers).json()["outputs"][0]["data"] == [3, 6]
    assert_kserve_error(post("scale", *_binary_request(header, x[:8])), 400, "'x'", "runs past")
    assert_kserve_error(post("scale", *_binary_request(header, x + b"!")), 400, "binary data")
    assert_kserve_error(
        post("scale", *_binary_request(header, x, header_length=10**6)),
        400,
        "Inference-Header-Content-Length",
    )
    short = {"inputs": [_tensor("x", "INT64", [2], parameters={"binary_data_size": 8})]}
    assert_kserve_error(post("scale", *_binary_request(short, x[:8])), 400, "'x'", "16 bytes")

    texts = serialize_byte_tensor(bytes_array([b"abc", b"de"])).item()
    good = {"inputs": [_tensor("text", "BYTES", [2], parameters={"binary_data_size": len(texts)})]}
    outputs = post("upper", *_binary_request(good, texts)).json()["outputs"]
    assert [o["data"] for o in outputs] == [["ABC", "DE"], [3, 2]]
    cut = {
        "inputs": [_tensor("text", "BYTES", [2], parameters={"binary_data_size": len(texts) - 1})]
    }
    assert_kserve_error(post("upper", *_binary_request(cut, texts[:-1])), 400, "'text'", "BYTES")
    one = {"inputs": [_tensor("text", "BYTES", [1], parameters={"binary_data_size": len(texts)})]}
    assert_kserve_error(post("upper", *_binary_request(one, texts)), 400, "'text'", "elements")

    gzip_headers = {**headers, "Content-Encoding": "gzip"}
    assert_kserve_error(post("scale", content, gzip_headers), 415, "Content-Encoding")


def test_non_utf8_bytes_output_needs_binary(raw: httpx.Client) -> None:
    texts = serialize_byte_tensor(bytes_array([b"\xff\xfe"])).item()
    header = {
        "inputs": [_tensor("text", "BYTES", [1], parameters={"binary_data_size": len(texts)})],
        "outputs": [{"name": "upper", "parameters": {"binary_data": False}}],
    }
    content, headers = _binary_request(header, texts)
    response = raw.post("/v2/models/upper/infer", content=content, headers=headers)
    assert_kserve_error(response, 400, "'upper'", "UTF-8")


def test_streamed_body_over_the_limit_is_413(raw: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": ['
        for _ in range(MAX_REQUEST_BYTES // 4096 + 1):
            yield b" " * 4096
        yield b"1]}]}"

    assert_kserve_error(raw.post("/v2/models/scale/infer", content=chunks()), 413, "limit")


@pytest.mark.logs_errors
def test_unexpected_error_is_a_generic_500(
    client: httpclient.InferenceServerClient, raw: httpx.Client
) -> None:
    body = {"inputs": [_tensor("value", "FP32", [1], data=[1.0])]}
    message = assert_kserve_error(raw.post("/v2/models/broken/infer", json=body), 500)
    assert "10.0.0.7" not in message and "secret" not in message
    with pytest.raises(InferenceServerException) as caught:
        client.infer("broken", [infer_input("value", np.ones(1, np.float32), "FP32")])
    assert caught.value.status() == "500"


# --- auth ---------------------------------------------------------------------------------------


def test_api_key_is_required_when_set(router: FakeRouter) -> None:
    keyed = UvicornThread(kserve_app(router, api_keys=[API_KEY]))
    triton = httpclient.InferenceServerClient(url=keyed.url)
    try:
        x = np.array([4], dtype=np.int64)
        with pytest.raises(InferenceServerException) as caught:
            triton.infer("scale", [infer_input("x", x, "INT64")])
        assert caught.value.status() == "401"
        with pytest.raises(InferenceServerException) as caught:
            triton.infer(
                "scale", [infer_input("x", x, "INT64")], headers={"Authorization": "Bearer wrong"}
            )
        assert caught.value.status() == "401"
        result = triton.infer(
            "scale", [infer_input("x", x, "INT64")], headers={"Authorization": f"Bearer {API_KEY}"}
        )
        np.testing.assert_array_equal(result.as_numpy("y"), x * 3)
    finally:
        triton.close()
        keyed.stop()


# --- tensor conversion ----------------------------------------------------------------------------


def test_json_values_are_cast_only_when_lossless() -> None:
    header = TensorHeader("v", "UINT8", (2,))
    np.testing.assert_array_equal(from_json(header, [0, 255]), np.array([0, 255], np.uint8))
    with pytest.raises(ConfigError, match=r"'v': values 0\.\.300 do not fit UINT8"):
        from_json(header, [0, 300])
    with pytest.raises(ConfigError, match="booleans"):
        from_json(TensorHeader("b", "BOOL", (1,)), [1])
    half = from_json(TensorHeader("h", "FP16", (1, 2)), [[1, 0.5]])
    assert half.dtype == np.float16 and half.tolist() == [[1.0, 0.5]]
    nested = from_json(TensorHeader("t", "BYTES", (2, 2)), [["a", "b"], ["c", "\u00e9"]])
    assert nested.tolist() == [[b"a", b"b"], [b"c", "\u00e9".encode()]]
    with pytest.raises(ConfigError, match="nested too deeply"):
        deep: list[Any] = ["x"]
        for _ in range(100):
            deep = [deep]
        from_json(TensorHeader("t", "BYTES", (1,)), deep)


def test_raw_round_trip_is_little_endian() -> None:
    array = np.array([[1, -2], [3, 2**62]], dtype=">i8")  # big-endian in memory
    raw = to_raw("a", array)
    assert raw == np.array([[1, -2], [3, 2**62]], dtype="<i8").tobytes()
    np.testing.assert_array_equal(from_raw(TensorHeader("a", "INT64", (2, 2)), raw), array)
    flags = from_raw(TensorHeader("f", "BOOL", (3,)), b"\x00\x01\x07")
    assert flags.tolist() == [False, True, True]
    texts = bytes_array([b"", b"ab", "\u00e9".encode()])
    assert to_raw("t", texts) == serialize_byte_tensor(texts).item()
